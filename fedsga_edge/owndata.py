"""The devices' own-data figures in a run's records, each with the round of the model it scored.

A round that evaluates (``--eval-holdout``) records the devices' figures of the model it started from:
round t's ``fed_acc`` is the model after round t-1 (``fed_model_round``), while its ``test_acc`` is the
model after round t. The final evaluation after the last round (coordinator/driver.py) records the
figures of the model the run ended with as the last round's ``fed_final``. Whoever sets an own-data
figure beside a test figure pairs them here, by the model's round, never by the record they sit in
(docs/protocol.md, "Federated evaluation").
"""

from __future__ import annotations

from typing import Any

__all__ = ["FED_KEYS", "fed_evaluations", "own_acc", "device_mean", "own_data_of", "final_own_data"]

# the figures of one evaluation, as a round's record and ``fed_final`` hold them
FED_KEYS = ("fed_acc", "fed_loss", "fed_count", "fed_model_round", "fed_by_device", "fed_acc_median",
            "fed_loss_median", "fed_acc_finetuned", "fed_loss_finetuned")


def fed_evaluations(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every own-data evaluation in ``records``, in the order of the models they scored: each round's (of the
    model it started from) and the final one (``fed_final``), as ``FED_KEYS`` maps with ``fed_model_round``.
    Records from before ``fed_model_round`` was written say nothing of their model: they are left out."""
    out = []
    for r in records:
        for fig in (r, r.get("fed_final")):
            if isinstance(fig, dict) and "fed_acc" in fig and "fed_model_round" in fig:
                out.append({k: fig[k] for k in FED_KEYS if k in fig})
    return out


def own_acc(fig: dict[str, Any]) -> float:
    """The own-data accuracy of an evaluation as the method's paper scores it: FedBABU's after its devices
    fine-tune their copies of the head (``fed_acc_finetuned``), every other method's model as its devices
    use it (``fed_acc``: FedGH's own body under the server's head, FedAS's aligned body and own head)."""
    return float(fig.get("fed_acc_finetuned", fig["fed_acc"]))


def device_mean(fig: dict[str, Any]) -> float:
    """The mean over devices of each one's own-data accuracy (``own_acc``'s figure per device: each device
    counts once, whatever its slice's size); the count-weighted ``own_acc`` where devices are not listed."""
    devices = fig.get("fed_by_device")
    if not devices:
        return own_acc(fig)
    return float(sum(d.get("acc_finetuned", d["acc"]) for d in devices.values()) / len(devices))


def own_data_of(records: list[dict[str, Any]], model_round: int) -> dict[str, Any] | None:
    """The devices' evaluation of the model after round ``model_round`` (the latest, if evaluated twice), or
    None: the figure that may stand beside that round's ``test_acc``."""
    found = [f for f in fed_evaluations(records) if f["fed_model_round"] == model_round]
    return found[-1] if found else None


def final_own_data(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The devices' evaluation of the model the run ended with (the last record's round), or None (a run
    without the final evaluation: recorded before it existed, or without ``--eval-holdout``)."""
    return own_data_of(records, int(records[-1]["round"])) if records else None
