"""How the coordinator measures the global model: test accuracy under the strategy's heads, and the devices'
federated evaluation on their own held-out data (``FederatedEvaluation``)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsga_edge.method import reference_index
from fedsga_edge.tensors import image_batch
from fedsga_edge.wire import RemoteProtocolError

__all__ = ["FederatedEvaluation", "headline_split", "evaluate", "evaluate_models"]


def headline_split(split_samples: dict[int, int], num_splits: int) -> int:
    """The depth embedding the headline accuracy uses: the split most trained (by samples) in the samples
    given, the coordinator's latest round; ties to the shallower; p_ref before any split training
    (docs/method.md, "Evaluation")."""
    if not split_samples or set(split_samples) == {0}:
        return reference_index(num_splits)
    split = {k: n for k, n in split_samples.items() if k > 0}
    return min(split, key=lambda k: (-split[k], k)) if split else reference_index(num_splits)


@torch.no_grad()
def evaluate(model: Any, head: nn.Module, strategy: Any, headline: int, num_classes: int, images: Any,
             mean: tuple, std: tuple, device: torch.device, batch_size: int = 256) -> dict[str, Any]:
    """Accuracy and loss of the global model under every depth embedding the strategy evaluates
    (no prompts: they are private). Prefix + suffix is the whole backbone for any split, so the
    pooled features are computed once; only the strategy's per-depth head can differ. A strategy
    with one head for every split (key 0) is reported under every split.

    With several depth heads (FedSGA's harmonizer: one depth embedding each) ``test_acc_depth_mean`` is
    the accuracy of their softmaxes averaged with equal weights: one global model's figure that does not
    hang on which embedding the latest round trained most (under label skew the embeddings' figures lay
    ~8 points apart at cifar-v1; benchmarks/RESULTS.md, "The harmonizer's depth heads"). Reported beside
    the headline, not as it."""
    model.eval()
    head.eval()
    K = model.num_splits
    correct: dict[int, int] = {}
    loss_sum: dict[int, float] = {}
    shown: int | None = None
    # how often the headline model predicts each class: a collapse onto few classes shows here first
    predicted = torch.zeros(num_classes, dtype=torch.long)
    mean_correct = 0
    n = len(images)
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(n, start + batch_size))
        x = image_batch(images.get_batch(idx), mean, std, device)
        y = torch.from_numpy(np.asarray(images.labels[idx], dtype=np.int64)).to(device)
        by_k = strategy.eval_logits(model, model.features(x))
        if shown is None:
            shown = 0 if 0 in by_k else headline
        for k, logits in by_k.items():
            loss_sum[k] = loss_sum.get(k, 0.0) + float(F.cross_entropy(logits, y, reduction="sum"))
            pred = logits.argmax(1)
            correct[k] = correct.get(k, 0) + int((pred == y).sum())
            if k == shown:
                predicted += torch.bincount(pred.cpu(), minlength=num_classes)
        if len(by_k) > 1:
            probs = torch.stack([F.softmax(logits, dim=1) for logits in by_k.values()]).mean(0)
            mean_correct += int((probs.argmax(1) == y).sum())
    if shown is None:
        raise ValueError("evaluate needs at least one test image")
    ks = sorted(correct)
    acc = {k: correct[k] / n for k in ks}
    loss = {k: loss_sum[k] / n for k in ks}
    by_split = {str(k): acc[k] for k in ks} if ks != [0] else {str(k): acc[0] for k in range(1, K + 1)}
    share = [round(int(c) / n, 4) for c in predicted]
    out = {"test_acc": acc[shown], "test_loss": loss[shown], "test_acc_by_split": by_split,
           "eval_split": shown if shown else None, "test_pred_share": share}
    if len(ks) > 1:
        out["test_acc_depth_mean"] = mean_correct / n
    return out


def evaluate_models(model: Any, models: list[tuple[float, dict[str, torch.Tensor]]],
                    run: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """The test figures of a method without one global model (FedGH: each device's own body under the
    server's head): ``run`` (``evaluate`` on a model) on a copy of ``model`` loaded with each state,
    the figures averaged by the states' weights. ``test_acc_devices`` keeps each one, ``test_acc_global``
    the global model's figure (FedGH's average of bodies that never train together) for comparison."""
    twin = copy.deepcopy(model)
    recs = []
    for _, state in models:
        twin.load_state_dict(state)
        recs.append(run(twin))
    w = np.array([float(wt) for wt, _ in models], dtype=np.float64)
    w = w / w.sum()

    def mean(key: str) -> float:
        return float(sum(wi * r[key] for wi, r in zip(w, recs)))

    acc = mean("test_acc")
    share = np.sum([wi * np.asarray(r["test_pred_share"]) for wi, r in zip(w, recs)], axis=0)
    return {"test_acc": acc, "test_loss": mean("test_loss"),
            "test_acc_by_split": {k: acc for k in recs[0]["test_acc_by_split"]},
            "eval_split": recs[0]["eval_split"], "test_pred_share": [round(float(x), 4) for x in share],
            "test_acc_devices": [r["test_acc"] for r in recs], "test_acc_global": run(model)["test_acc"]}


class FederatedEvaluation:
    """The coordinator's side of federated evaluation (docs/protocol.md, "Federated evaluation").

    With ``--eval-holdout`` above 0, round 1 and every round after an evaluation round tell the devices
    to evaluate (``round_start`` field ``evaluate``) the model the round starts from: the global model
    after the previous round's aggregation (``fed_model_round`` in the record), the one the coordinator's
    own test figure of that round measured. A split device's ``evaluate`` request (eval-mode activations
    of a held-out batch at its split, with labels) runs through a copy of the suffix and of the strategy's
    head taken at round start, so the devices' training in the same round does not leak into the figure;
    a whole-model device reports ``eval_count``, ``eval_loss`` and ``eval_acc`` in its update. The round's
    record gets the count-weighted ``fed_acc`` and ``fed_loss``, ``fed_count`` and ``fed_by_device``, and
    ``fed_acc_median`` and ``fed_loss_median``: the median over devices, which one device forging its figure
    cannot move (these figures are device-claimed; the coordinator's own is ``test_acc``).

    After the last round the final evaluation (``begin_round(t, only=True)``, ``t`` the last round + 1) has
    every device evaluate the model the run ended with and nothing else: the round start says
    ``evaluate_only``, ``check_kind`` refuses training requests, ``on_final_update`` takes the figures without
    weights and ``end_final`` gives them with ``fed_model_round`` the last round (the driver's ``fed_final``).

    Under a strategy with ``finetuned_eval`` (FedBABU) a whole-model device's figures come with the fine-tuned
    model's ``eval_loss_finetuned`` and ``eval_acc_finetuned`` (the same slice, so the same count): required
    there and refused elsewhere; the record gets ``fed_acc_finetuned`` and ``fed_loss_finetuned`` (weighted by
    the same counts) and each device's ``acc_finetuned`` and ``loss_finetuned`` in ``fed_by_device``.
    """

    MAX_COUNT = 10**9
    FINETUNED = ("eval_loss_finetuned", "eval_acc_finetuned")  # a ``finetuned_eval`` strategy's second figure

    # what a device may send in the final evaluation: its weights, its held-out batches, its figures
    FINAL_KINDS = ("fetch", "evaluate", "update", "error")

    def __init__(self, co: Any) -> None:
        self.co = co
        self.active = False
        self.only = False  # the final evaluation after the last round runs: nothing trains
        self.t = 0
        self.expected: dict[str, int] = {}  # device -> its held-out slice's size, where known (hello, simulate)
        self._model: Any = None
        self._head_state: dict[str, Any] | None = None
        self.tally: dict[str, list[float]] = {}  # device -> [count, summed loss, correct]
        self.finetuned = bool(getattr(co.strategy, "finetuned_eval", False))  # FedBABU: a second figure per device

    def evaluates(self, t: int) -> bool:
        cfg = self.co.cfg
        return cfg.eval_holdout > 0 and (t - 1) % max(int(cfg.eval_every), 1) == 0

    def begin_round(self, t: int, only: bool = False) -> None:
        """Call when the round's snapshot is taken: the model and head as the round starts are kept. ``only``:
        the final evaluation (``t`` the last round + 1): the model as the run ends, evaluated and nothing else."""
        self.t, self.tally, self.only = t, {}, only
        self.active = only or self.evaluates(t)
        self._model = copy.deepcopy(self.co.model).eval() if self.active else None
        self._head_state = ({k: v.detach().clone() for k, v in self.co.head.state_dict().items()}
                            if self.active else None)

    def check_kind(self, kind: str) -> None:
        """The final evaluation trains nothing: a device's activation or probe there is refused."""
        if self.only and kind not in self.FINAL_KINDS:
            raise RemoteProtocolError(f"round {self.t} is the final evaluation: no {kind!r}, only "
                                      f"{', '.join(self.FINAL_KINDS)}")

    def on_final_update(self, msg: Any) -> tuple[str, dict[str, Any]]:
        """A device's update in the final evaluation: its figures checked as in a round's update; any weights it
        carries are not read (nothing is aggregated), so the round's record gets the figures alone."""
        self.check_update(msg.sender, msg.body)
        self.co.round.accept_update(msg.sender, {k: v for k, v in msg.body.items() if k.startswith("eval_")})
        return "ack", {}

    def end_final(self, updates: dict[str, dict[str, Any]], failures: dict[str, str]) -> dict[str, Any]:
        """The final evaluation's figures (``fed_*`` as in a round's record, ``fed_model_round`` the last round),
        with the devices that did not report and why (``failures``)."""
        record: dict[str, Any] = {"failures": dict(failures)}
        self.end_round(updates, record)
        self.only = False
        return record

    def on_request(self, msg: Any) -> tuple[str, dict[str, Any]]:
        """An ``evaluate`` request: checked like an activation, run through the round-start copy."""
        co = self.co
        if not self.active:
            raise RemoteProtocolError(f"round {co.round.t} is not an evaluation round")
        k = msg.body.get("split")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= co.model.num_splits:
            raise RemoteProtocolError(f"split {k!r:.40} out of range 1..{co.model.num_splits}")
        z, y = co.check_activation(msg.body, "z", k)
        have = self.tally.get(msg.sender, [0, 0.0, 0])
        limit = self.expected.get(msg.sender)
        if limit is not None and have[0] + len(y) > limit:
            raise RemoteProtocolError(f"{have[0] + len(y)} evaluation samples this round, more than the {limit} "
                             f"{msg.sender} holds out")
        loss, correct = self._score(z, y, k)
        if not math.isfinite(loss):
            raise RemoteProtocolError("the evaluation loss is not finite")
        self.tally[msg.sender] = [have[0] + len(y), have[1] + loss, have[2] + correct]
        return "eval_result", {"loss": loss, "correct": correct, "count": int(len(y))}

    @torch.no_grad()
    def _score(self, z: torch.Tensor, y: torch.Tensor, k: int) -> tuple[float, int]:
        co, model = self.co, self._model
        feats = model.suffix(z, model.depth_of(k))
        head = co.head
        live = {n: v.detach().clone() for n, v in head.state_dict().items()} if self._head_state else None
        was = head.training
        try:
            if live is not None:
                head.load_state_dict(self._head_state)
            head.eval()
            by_k = co.strategy.eval_logits(model, feats)
        finally:
            if live is not None:
                head.load_state_dict(live)
            head.train(was)
        logits = by_k[0] if 0 in by_k else by_k[co.headline_split()]
        loss = float(F.cross_entropy(logits, y, reduction="sum"))
        return loss, int((logits.argmax(1) == y).sum())

    def check_update(self, device: str, body: dict[str, Any]) -> None:
        """A whole-model device's own figures, checked before the update is accepted (RemoteProtocolError)."""
        tuned = [k for k in self.FINETUNED if k in body]
        if "eval_count" not in body:
            if tuned:
                raise RemoteProtocolError(f"{tuned[0]} without eval_count")
            return
        n = body.get("eval_count")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.MAX_COUNT:
            raise RemoteProtocolError(f"eval_count must be an integer in 1..{self.MAX_COUNT}")
        limit = self.expected.get(device)
        if limit is not None and n != limit:
            raise RemoteProtocolError(f"eval_count {n} is not the {limit} samples {device} holds out")
        if self.finetuned and len(tuned) != len(self.FINETUNED):
            raise RemoteProtocolError(f"{self.co.strategy.name} evaluates a fine-tuned model too: the update must "
                                      "carry "
                             f"{' and '.join(self.FINETUNED)}")
        if tuned and not self.finetuned:
            raise RemoteProtocolError(f"{tuned[0]}: {self.co.strategy.name} fine-tunes nothing for evaluation")
        for name in ("eval_loss", "eval_acc", *tuned):
            v, top = body.get(name), 1.0 if name.startswith("eval_acc") else 1e6
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= top:
                raise RemoteProtocolError(f"{name} must be a finite number in [0, {top:g}]")
        if not self.active:
            raise RemoteProtocolError(f"round {self.t} is not an evaluation round")

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        """The round's federated figures into its record: weighted by each device's count."""
        tally = dict(self.tally)
        tuned: dict[str, list[float]] = {}  # device -> [count, summed loss, correct] of its fine-tuned model
        for cid, u in updates.items():
            if "eval_count" in u and cid not in tally:
                n = int(u["eval_count"])
                tally[cid] = [n, float(u["eval_loss"]) * n, float(u["eval_acc"]) * n]
                if "eval_acc_finetuned" in u:
                    tuned[cid] = [n, float(u["eval_loss_finetuned"]) * n, float(u["eval_acc_finetuned"]) * n]
        self._model, self._head_state, self.tally = None, None, {}
        if not tally:
            return
        count = sum(v[0] for v in tally.values())
        record["fed_acc"] = sum(v[2] for v in tally.values()) / count
        record["fed_loss"] = sum(v[1] for v in tally.values()) / count
        record["fed_count"] = int(count)
        record["fed_model_round"] = self.t - 1
        record["fed_by_device"] = {cid: {"acc": v[2] / v[0], "loss": v[1] / v[0], "count": int(v[0])}
                                   for cid, v in sorted(tally.items())}
        # what devices claim, which one device can forge: its median over devices is what one liar cannot move
        record["fed_acc_median"] = float(np.median([v[2] / v[0] for v in tally.values()]))
        record["fed_loss_median"] = float(np.median([v[1] / v[0] for v in tally.values()]))
        if tuned:  # every device that reported a global figure here (check_update requires the pair)
            n_tuned = sum(v[0] for v in tuned.values())
            record["fed_acc_finetuned"] = sum(v[2] for v in tuned.values()) / n_tuned
            record["fed_loss_finetuned"] = sum(v[1] for v in tuned.values()) / n_tuned
            for cid, v in tuned.items():
                record["fed_by_device"][cid].update(acc_finetuned=v[2] / v[0], loss_finetuned=v[1] / v[0])
