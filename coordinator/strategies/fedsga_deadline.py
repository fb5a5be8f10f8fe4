"""FedSGA's deadline-aware variant (--deadline-aware, docs/fleet.md "Deadline-aware splits"): each device's
predicted round seconds per split, sent in its round start so that it never picks a split predicted to miss
the round's deadline (fedsga_edge/method/policy.py ``deadline_split``)."""

from __future__ import annotations

from typing import Any

from fedsga_edge.config import RunConfig
from fedsga_edge.method.policy import reference_index

__all__ = ["Deadlines", "predict_device", "predicted_split_s", "weight_bytes"]

# Bytes one activation or gradient value takes on the wire per --wire-format (docs/protocol.md, "Messages"): int4
# packs two values a byte plus a float32 scale per 256 values. Weights, labels and probes are counted as fp32/int64.
_VALUE_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 256}
# A message's envelope, keys and small fields, each way, and a margin on the whole: the prediction should err long,
# not short (against the virtual clock it was within 0.5 % either way without the margin: benchmarks/RESULTS.md).
_MESSAGE_BYTES = 256
_MARGIN = 1.01

def _batches(n: int, batch_size: int, max_batches: int) -> int:
    """Batches a device with ``n`` samples cuts per local epoch (a last batch under 2 samples joins the one before:
    coordinator/server.py ``samples_per_epoch``), capped at ``max_batches``."""
    count = max(1, -(-n // batch_size))
    if count > 1 and n - batch_size * (count - 1) < 2:
        count -= 1
    return min(count, max_batches) if max_batches else count


def _probe_slice(n: int, fraction: float) -> int:
    """Samples a device holds out for its probe (device/role.py ``ClientData.hold_out_probe``; all of them
    without a slice)."""
    if fraction <= 0 or n < 4:
        return n
    return min(max(2, int(round(fraction * n))), n - 2)


def predicted_split_s(cls: Any, costs: Any, num_samples: int, cfg: RunConfig, calibrate: bool, h1_dim: int = 0,
                      weight_bytes: dict[int, float] | None = None, extra_down: float = 0.0) -> list[float]:
    """Predicted seconds of one FedSGA device's round at each split k = 1..K on its fleet class ``cls``
    (fedsga_edge/fleet.py ``DeviceClass.round_s``): the time model of docs/fleet.md applied to what the round
    would carry, counted from the cost table rather than measured, so the choice is made before the round.

    Compute: the samples trained (|D_i| less the probe's held-out slice, x local epochs, batches as the device
    cuts them; ``num_samples`` is |D_i| as the device registered it) x the prefix's training
    FLOPs at k, plus the probe's forward to p_ref on a calibration round (a batch of the held-out probe slice).
    Up: per sample its activation at k in --wire-format, its label and its pooled p_1 features (``h1_dim``
    floats), then the update's weights up to p_k (``weight_bytes[k]``, default 4 bytes a parameter). Down: the
    gradients, the weights up to p_k (round start plus fetch) and ``extra_down`` (the round start's method state).
    Each message ``_MESSAGE_BYTES`` more each way (envelope, keys); a round trip per request; then 1 % more
    (``_MARGIN``). Not counted (as on the virtual clock): the observation forward, waiting for the server, held-out
    evaluations; a device's first round adds its class's ``warmup_s`` (``Deadlines.fields``).
    Against the virtual clock it is long by under 1.5 % (tests/test_fleet_bench.py)."""
    from fedsga_edge.coordinator.server import samples_per_epoch

    tc = cfg.train
    # the probe's slice, never trained on (held out only while the estimator calibrates)
    held = _probe_slice(num_samples, cfg.fedsga.probe_holdout) if cfg.fedsga.estimator else num_samples
    n = num_samples - held if held < num_samples else num_samples
    seen = tc.local_epochs * samples_per_epoch(n, tc.batch_size, tc.max_batches, tc.batching)
    requests = tc.local_epochs * _batches(n, tc.batch_size, tc.max_batches)
    value = _VALUE_BYTES[cfg.wire_format]
    K = len(costs.prefix)
    ref = reference_index(K)
    probe = min(tc.batch_size, held) if calibrate else 0
    out = []
    for k in range(1, K + 1):
        elems = costs.prefix[k].activation_elems
        weights = float(weight_bytes[k]) if weight_bytes is not None else 4.0 * costs.params[k]
        flops = seen * costs.train(k) + probe * costs.prefix_fwd(ref)
        messages = requests + 1 + (1 if k > 1 else 0) + (1 if probe else 0)  # batches, update, fetch, probe
        up = seen * (elems * value + 8 + 4 * h1_dim) + weights + messages * _MESSAGE_BYTES
        up += probe * (4 * (costs.prefix[1].activation_elems + costs.prefix[ref].activation_elems) + 8)
        down = seen * elems * value + weights + extra_down + (messages + 1) * _MESSAGE_BYTES  # + the round start
        out.append(_MARGIN * float(cls.round_s(flops, up, down, 0.5 + messages)))  # + half a trip: the round start
    return out


class Deadlines:
    """Each device's fleet class, and the predictions it is sent: its own round seconds per split, a device's
    first round with its class's warm-up too (a resumed coordinator starts the warm-up afresh)."""

    def __init__(self, cfg: RunConfig, clients: list[str]) -> None:
        if not cfg.fleet or cfg.round_timeout <= 0:
            raise ValueError("--deadline-aware needs --fleet FILE (each device's speed and link) and "
                             "--round-timeout SECONDS (the deadline it keeps to)")
        from fedsga_edge.fleet import load_fleet  # torch-free

        self.cfg = cfg
        self.classes: dict[str, Any] = load_fleet(cfg.fleet).assign(list(clients))
        self.predicted: dict[str, list[float]] = {}  # this round's predicted seconds per split, per device
        self._told: set[str] = set()  # devices sent a prediction before, so past their first round's warm-up
        self._weight_bytes: dict[int, float] | None = None  # the weights up to each split, bytes

    def fields(self, strategy: Any, cid: str, calibrate: bool) -> dict[str, Any]:
        """Device ``cid``'s round-start ``deadline``: the round's seconds and its predicted seconds per split
        (none for a device outside the fleet file)."""
        cls = self.classes.get(cid)
        if cls is None:
            return {}
        split_s = self.predict(strategy, cls, cid, calibrate)
        if cid not in self._told:  # its first round: a fresh process's one-time work (the class's warmup_s) too
            split_s = [s + float(cls.warmup_s) for s in split_s]
            self._told.add(cid)
        self.predicted[cid] = split_s
        return {"deadline": {"s": float(self.cfg.round_timeout), "split_s": split_s}}

    def predict(self, strategy: Any, cls: Any, cid: str, calibrate: bool) -> list[float]:
        if self._weight_bytes is None:
            self._weight_bytes = weight_bytes(strategy.co.model, strategy.K)
        return predict_device(strategy, cls, cid, calibrate, self._weight_bytes)


def weight_bytes(model: Any, num_splits: int) -> dict[int, float]:
    """The bytes of the weights (buffers included) a device at each split k = 1..K holds."""
    state = model.state_dict()
    return {k: float(sum(v.numel() * v.element_size() for n, v in state.items()
                         if model.unit_of(n) < model.depth_of(k))) for k in range(1, num_splits + 1)}


def predict_device(strategy: Any, cls: Any, cid: str, calibrate: bool,
                   weights: dict[int, float] | None = None) -> list[float]:
    """``predicted_split_s`` for FedSGA's device ``cid`` on fleet class ``cls`` with this model's real weight bytes
    (``weight_bytes``) and the round start's method state (estimator, phi_s, prototypes)."""
    co = strategy.co
    extra = sum(v.numel() * v.element_size() for module in (strategy.phi_s, strategy.prototypes)
                for v in module.state_dict().values())
    extra += sum(v.numel() * v.element_size() for v in strategy.estimator.state_dict().values() if hasattr(v, "numel"))
    return predicted_split_s(cls, co.costs, co.clients[cid], strategy.cfg, calibrate, h1_dim=strategy._h1_dim,
                             weight_bytes=weights or weight_bytes(co.model, strategy.K), extra_down=float(extra))
