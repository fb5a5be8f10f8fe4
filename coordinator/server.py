"""The coordinator role: server-side blocks, harmonizer, prototypes, phi_s, the estimator and rounds.

It sees messages, never a transport, and never waits on a device. A driver calls

* ``begin_round(t, now)`` -> the ``round_start`` bodies to send, one per device;
* ``receive(msg, now)`` for every message from a device, in arrival order -> the reply (one
  server step per activation, so the shared server blocks see the devices' batches interleaved);
* ``tick(now)`` to apply the round's deadline, and ``end_round()`` once ``round_complete``.

The simulation's scheduler and a network transport are two such drivers (docs/method.md, "Rounds").
Every request is checked against the round (sender, round number) and validated completely before
it touches a weight, an optimizer or a BatchNorm statistic.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedsga_edge.config import RunConfig
from fedsga_edge.method import (
    CalibrationBuffer,
    Harmonizer,
    MonotoneEstimator,
    Prototypes,
    ShallowHead,
    alignment_loss,
    fit,
    phi_s_loss,
    reference_index,
    sufficiency_label,
)
from fedsga_edge.method.aggregation import DeviceUpdate, aggregate_round, group_by_unit, unit_of
from fedsga_edge.models import CostTable, SplitModel
from fedsga_edge.tensors import from_numpy, image_batch, probe_mode, round_average_bn, to_numpy, to_numpy_state
from fedsga_edge.wire import Message

from .round import RoundError, RoundState
from .strategy import Strategy

__all__ = ["Coordinator"]

_REQUESTS = ("activation", "probe", "fetch", "update", "error")
# Largest |value| accepted in an activation, h1 or weight. Honest ones are O(1)-O(1e3); anything this
# big means a diverged or hostile device, and would overflow float32 a few layers on.
MAX_ABS_VALUE = 1e6
_MAX_REFUSALS_KEPT = 50  # reasons kept per round in the record; the count goes on
# Per-client numbers an update may report (docs/method.md); copied into metrics.jsonl, so checked here.
_REPORT_FIELDS = ("a", "delta", "q", "r", "r_prev", "k_policy", "L1", "Lref", "s", "descriptor_entropy",
                  "probe_samples", "steps")


def _check_values(arr: np.ndarray, what: str) -> None:
    """Finite and of a sane size, or ValueError naming the problem (one NaN would spread for good)."""
    if arr.size == 0 or arr.dtype.kind not in "fc":
        return
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} holds non-finite values")
    peak = float(np.abs(arr).max())
    if peak > MAX_ABS_VALUE:
        raise ValueError(f"{what} holds |values| up to {peak:.3g}, over the {MAX_ABS_VALUE:g} any honest device sends")


def _all_finite(tensors: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


class ServerHead(nn.Module):
    """What follows the pooled features on the server: harmonizer + G, or the plain head."""

    def __init__(self, model: SplitModel, num_classes: int, harmonizer: bool, dim: int) -> None:
        super().__init__()
        self.harmonizer = Harmonizer(model.feature_dim, model.num_splits, dim=dim) if harmonizer else None
        self.G = nn.Linear(dim, num_classes) if harmonizer else None


class _ServerSide:
    """One trainable copy of the server side (blocks + head) with its optimizer."""

    def __init__(self, model: SplitModel, head: ServerHead, cfg: RunConfig) -> None:
        self.model, self.head = model, head
        tc = cfg.train
        params = list(model.parameters()) + list(head.parameters())
        lr = tc.lr if cfg.server_lr is None else cfg.server_lr
        self.opt = torch.optim.SGD(params, lr=lr, momentum=tc.momentum, weight_decay=tc.weight_decay)


class Coordinator:
    def __init__(
        self,
        model: SplitModel,
        cfg: RunConfig,
        clients: dict[str, int],
        num_classes: int,
        strategy: Strategy,
        costs: CostTable,
        *,
        device: str | torch.device = "cpu",
        name: str = "coordinator",
    ) -> None:
        self.cfg = cfg
        self.clients = dict(clients)  # id -> |D_i|
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.strategy = strategy
        self.costs = costs
        self.name = name
        self.num_classes = num_classes
        self.fedsga = cfg.strategy == "fedsga"
        fed = cfg.fedsga
        use_harm = self.fedsga and fed.harmonizer
        self.head = ServerHead(model, num_classes, use_harm, fed.proto_dim).to(self.device)
        proto_dim = fed.proto_dim if use_harm else model.feature_dim
        self.proto_dim = proto_dim
        self.prototypes = Prototypes(num_classes, proto_dim, fed.mu_proto).to(self.device)
        d1 = model.depth_of(1)
        c1 = model.interface_shape(d1)[0] if model.family == "cnn" else model.prompt_dim
        self.phi_s = ShallowHead(c1, proto_dim).to(self.device)
        num_obs = 3 if fed.adapt else 2
        self.estimator = MonotoneEstimator(num_obs=num_obs)
        self.cal_buffer = CalibrationBuffer(num_obs=num_obs)
        self.shared = _ServerSide(self.model, self.head, cfg)
        self.phi_opt = torch.optim.SGD(self.phi_s.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum)
        self.round = RoundState()
        self.split_samples: dict[int, int] = {}  # split -> samples trained there so far (headline eval)
        self.remote_errors = 0  # requests refused over the whole run
        self._last_seq: dict[str, int] = {}  # device -> seq of its last accepted request this round
        self._snapshot: dict[str, Tensor] = {}
        self._stats: dict[str, Any] = {}
        self._copies: dict[str, _ServerSide] = {}
        self._copy_sums: dict[str, Tensor] = {}
        self._copy_weights: dict[str, float] = {}
        # --server-bn-context: split -> device -> its latest accepted activation, most recent last
        # (docs/method.md, "Server-side BatchNorm statistics"); kept across rounds, checkpointed by the service
        self.bn_context: dict[int, dict[str, Tensor]] = {}

    # -- server-side computation ----------------------------------------------------------------
    def server_forward(self, z: Tensor, k: int, side: _ServerSide | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits (and harmonized Z) for an activation that entered at split index k."""
        side = side or self.shared
        feats = side.model.suffix(z, side.model.depth_of(k))
        if side.head.harmonizer is None:
            return side.model.head(feats), (feats if self.fedsga else None)
        Z = side.head.harmonizer(feats, k)
        return side.head.G(Z), Z

    def _loss(self, logits: Tensor, Z: Tensor | None, y: Tensor) -> Tensor:
        loss = F.cross_entropy(logits, y)
        if Z is not None and self.head.harmonizer is not None:
            fed = self.cfg.fedsga
            loss = loss + fed.lambda_align * alignment_loss(Z, y, self.prototypes.protos, fed.tau_a)
        return loss

    # -- rounds -----------------------------------------------------------------------------------
    def begin_round(self, t: int, now: float | None = None, devices: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Start round t for ``devices`` (default: all); returns each device's ``round_start`` body."""
        now = time.monotonic() if now is None else now
        fed = self.cfg.fedsga
        devices = list(self.clients) if devices is None else devices
        calibrate = self.fedsga and fed.estimator and (t == 1 or t % max(fed.cal_every, 1) == 0)
        assigned = self.strategy.assign(t, devices)
        timeout = self.cfg.round_timeout
        self.round.begin(t, assigned, calibrate, now + timeout if timeout > 0 else None)
        self._snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.cfg.server_bn == "round":
            round_average_bn(self.model)  # the shared copy's statistics: this round's batches, averaged
        self._stats = {"server_samples": {}, "calibration": [], "cal_flops_server": 0, "remote_errors": [],
                       "refused": 0, "started": now}
        self._last_seq = {}
        self._copies, self._copy_sums, self._copy_weights = {}, {}, {}
        return {cid: self._round_start_body(k, calibrate) for cid, k in assigned.items()}

    @property
    def round_complete(self) -> bool:
        return self.round.complete or self.round.phase == "closed"

    def tick(self, now: float | None = None) -> bool:
        """Apply the deadline; True when the round is over (complete, or closed by the deadline)."""
        self.round.expire(time.monotonic() if now is None else now)
        return self.round_complete

    def fail(self, device: str, reason: str) -> None:
        """A driver saw ``device`` fail (its transport broke, it crashed): it leaves this round."""
        self.round.fail(device, reason)

    def end_round(self, now: float | None = None) -> dict[str, Any]:
        """Aggregate what arrived, refit the estimator on calibration rounds; the round's record."""
        now = time.monotonic() if now is None else now
        rs = self.round
        for d in rs.waiting:
            rs.failures[d] = "no update when the round was closed"
        if rs.phase == "training":
            rs.close()
        updates = rs.updates
        if self.cfg.server_copies == "per_client":
            self._finish_copies()
        if updates:
            self._aggregate(updates)
        if self.fedsga:
            self.prototypes.commit()
        record: dict[str, Any] = {
            "round": rs.t,
            "splits": {cid: int(u["split"]) for cid, u in updates.items()},
            "depths": {cid: int(u["depth"]) for cid, u in updates.items()},
            "train_loss": float(np.mean([u["train_loss"] for u in updates.values()])) if updates else float("nan"),
            "failures": dict(rs.failures),
            "round_s": now - self._stats["started"],
        }
        for cid, u in updates.items():
            k = int(u["split"])
            self.split_samples[k] = self.split_samples.get(k, 0) + self.clients[cid]
        # docs/method.md, "Costs": training FLOPs per sample at each device's split, weighted by |D_i|
        total = sum(self.clients[c] for c in updates)
        record["client_flops_per_sample"] = (sum(self.clients[c] * self.costs.train(int(u["split"]))
                                                 for c, u in updates.items()) / total if total else 0.0)
        record["client_params"] = (float(np.mean([self.costs.params[int(u["split"])] for u in updates.values()]))
                                   if updates else 0.0)
        if self.fedsga:
            keys = ("a", "delta", "q", "r", "r_prev", "k_policy", "L1", "Lref", "s", "descriptor_entropy")
            record["clients"] = {cid: {k: u[k] for k in keys if k in u} for cid, u in updates.items()}
            cal = self._stats["calibration"]
            if cal:  # Alg. 1: refit Gamma once per calibration round, on all pairs; used from round t+1
                fit_stats = fit(self.estimator, self.cal_buffer)
                record["calibration"] = {
                    "pairs": len(self.cal_buffer),
                    "accuracy": fit_stats["accuracy"],
                    "brier": fit_stats["brier"],
                    "bce": fit_stats["loss"],
                    "positive_rate": float(np.mean([c["s"] for c in cal])),
                }
            K = self.model.num_splits
            client_cal = sum(self.costs.prefix_fwd(reference_index(K)) * int(u.get("probe_samples", 0))
                             for u in updates.values())
            record["calibration_flops"] = {"client": int(client_cal), "server": int(self._stats["cal_flops_server"])}
        if self._stats["remote_errors"]:
            record["remote_errors"] = self._stats["remote_errors"]
            record["remote_errors_count"] = self._stats["refused"]
        return record

    def _round_start_body(self, k: int | None, calibrate: bool) -> dict[str, Any]:
        cfg = self.cfg
        full = k == 0
        if full:
            names = [n for n in self._snapshot if n.startswith(("blocks.", "head."))]
        else:
            depth = self.model.depth_of(k if k is not None else 1)
            names = [n for n in self._snapshot if n.startswith("blocks.") and int(n.split(".", 2)[1]) < depth]
        body: dict[str, Any] = {
            "split": None if full else k,
            "full": full,
            "train": vars(self.strategy.device_train(cfg.train)),
            "weights": to_numpy_state({n: self._snapshot[n] for n in names}),
            "fedsga": vars(cfg.fedsga) if self.fedsga else None,
        }
        if self.fedsga and k is None:
            body.update(
                calibrate=calibrate,
                estimator=to_numpy_state(self.estimator.state_dict()),
                phi_s=to_numpy_state(self.phi_s.state_dict()),
                prototypes=to_numpy(self.prototypes.protos),
                proto_dim=self.proto_dim,
            )
        return body

    # -- message handling -------------------------------------------------------------------------
    def receive(self, msg: Message, now: float | None = None) -> Message | None:
        """Answer one device message; a device's mistake gets an error reply and changes nothing."""
        if msg.kind not in _REQUESTS:
            return self._refuse(msg, f"coordinator does not accept {msg.kind!r}")
        try:
            self.tick(now)
            self.round.check_request(msg.sender, msg.round)
            if msg.kind == "error":  # the device gives up on this round
                self.round.fail(msg.sender, f"device reported: {str(msg.body.get('reason', ''))[:200]}")
                return None
            # A device's requests are sequential, so their seqs grow: an old one is a replay (e.g. after
            # the Peer's reply cache turned over) and must not step the server twice.
            last = self._last_seq.get(msg.sender)
            if last is not None and msg.seq <= last:
                raise RoundError(f"seq {msg.seq} is not after {last}, {msg.sender}'s last request this round: "
                                 "a replay or a stale message")
            kind, body = getattr(self, f"_on_{msg.kind}")(msg)
        except (RoundError, KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            return self._refuse(msg, f"bad {msg.kind}: {exc}")
        self._last_seq[msg.sender] = msg.seq
        return Message(kind, msg.run, msg.round, msg.seq, self.name, body)

    handle = receive  # Peer.register wants a handler

    def _refuse(self, msg: Message, reason: str) -> Message:
        self.remote_errors += 1
        if self._stats:
            self._stats["refused"] += 1
            if len(self._stats["remote_errors"]) < _MAX_REFUSALS_KEPT:  # a flood must not grow the record
                self._stats["remote_errors"].append(f"{msg.sender}: {reason}"[:300])
        return Message("error", msg.run, msg.round, msg.seq, self.name, {"reason": reason})

    def _side(self, device: str) -> _ServerSide:
        """The server-side copy this device's activations train (shared, or its own)."""
        if self.cfg.server_copies != "per_client":
            return self.shared
        side = self._copies.get(device)
        if side is None:
            model, head = copy.deepcopy(self.model), copy.deepcopy(self.head)
            model.load_state_dict(self._snapshot)
            if self.cfg.server_bn == "round":
                round_average_bn(model)
            side = self._copies[device] = _ServerSide(model, head, self.cfg)
        return side

    def _check_activation(self, body: dict[str, Any], key: str, k: int) -> tuple[Tensor, Tensor]:
        z, y = body[key], body["y"]
        if not isinstance(z, np.ndarray) or not isinstance(y, np.ndarray):
            raise TypeError(f"{key} and y must be arrays")
        if z.dtype.kind != "f":
            raise TypeError(f"{key} must be floating point, got {z.dtype}")
        if y.dtype.kind not in "iu":
            raise TypeError(f"labels must be integers, got {y.dtype}")
        expected = self.model.interface_shape(self.model.depth_of(k), self._prompt_tokens())
        if z.ndim != len(expected) + 1 or tuple(z.shape[1:]) != expected or y.shape != z.shape[:1] or len(y) < 2:
            raise ValueError(f"{key} {z.shape} / labels {y.shape} do not fit split {k} (expected (B>=2, *{expected}))")
        most = self.cfg.train.batch_size + 1  # a device folds a last batch of one into the one before
        if len(y) > most:
            raise ValueError(f"{key} holds {len(y)} samples, more than a batch ({most})")
        _check_values(z, key)
        if y.min() < 0 or y.max() >= self.num_classes:
            raise ValueError(f"labels outside 0..{self.num_classes - 1}")
        return from_numpy(z, self.device).float(), from_numpy(y, self.device).long()

    def _split_of(self, body: dict[str, Any], device: str) -> int:
        k = body["split"]
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.model.num_splits:
            raise ValueError(f"split {k!r} out of range 1..{self.model.num_splits}")
        fixed = self.round.assigned.get(device)
        if fixed is not None and fixed != k and not (self.round.calibrate and k >= fixed):
            raise ValueError(f"split {k} but this round assigned {fixed}")
        return k

    def _on_activation(self, msg: Message) -> tuple[str, dict[str, Any]]:
        k = self._split_of(msg.body, msg.sender)
        z, y = self._check_activation(msg.body, "z", k)
        h1 = None
        if self.fedsga and "h1" in msg.body:
            h1 = msg.body["h1"]
            if not isinstance(h1, np.ndarray) or h1.shape != (len(y), self.phi_s.net[0].in_features):
                raise ValueError("h1 must be pooled p_1 features, one row per sample")
            _check_values(h1, "h1")
        side = self._side(msg.sender)
        z.requires_grad_(True)
        side.model.train()
        side.head.train()
        side.opt.zero_grad(set_to_none=True)
        buffers = [b for m in (side.model, side.head) for b in m.buffers()]
        saved = [b.detach().clone() for b in buffers]  # BatchNorm statistics move in forward
        context = self._context_rows(msg.sender, k) if side is self.shared else []
        logits, Z = self.server_forward(torch.cat([z, *context]) if context else z, k, side)
        if context:  # the other devices' rows only shape the batch statistics: no loss, no step of theirs
            logits, Z = logits[: len(y)], (Z[: len(y)] if Z is not None else None)
        loss = self._loss(logits, Z, y)
        loss.backward()
        params = [p for g in side.opt.param_groups for p in g["params"] if p.grad is not None]
        if not (bool(torch.isfinite(loss)) and _all_finite([z.grad, *(p.grad for p in params), *buffers])
                and (Z is None or bool(torch.isfinite(Z).all()))):
            with torch.no_grad():  # undo the forward's statistics; the step never happens
                for b, old in zip(buffers, saved):
                    b.copy_(old)
            side.opt.zero_grad(set_to_none=True)
            raise ValueError("the activation gives a non-finite loss or gradient: refused, nothing changed")
        side.opt.step()
        if side is self.shared:
            self._remember(msg.sender, k, z)
        if Z is not None:
            self.prototypes.accumulate(Z.detach(), y)
        if h1 is not None:
            self._train_phi_s(from_numpy(h1, self.device).float(), y)
        samples = self._stats["server_samples"]
        samples[k] = samples.get(k, 0) + len(y)
        return "gradient", {"dz": to_numpy(z.grad), "loss": float(loss.detach())}

    def _context_rows(self, device: str, k: int) -> list[Tensor]:
        """The latest accepted activations of up to ``server_bn_context`` other devices at split k."""
        n = self.cfg.server_bn_context
        if not n:
            return []
        return [z for d, z in self.bn_context.get(k, {}).items() if d != device][-n:]

    def _remember(self, device: str, k: int, z: Tensor) -> None:
        """Keep ``z`` as the device's latest at split k; n + 1 entries per split are all n others need."""
        if not self.cfg.server_bn_context:
            return
        rows = self.bn_context.setdefault(k, {})
        rows.pop(device, None)
        rows[device] = z.detach().clone()
        while len(rows) > self.cfg.server_bn_context + 1:
            rows.pop(next(iter(rows)))

    @staticmethod
    def _check_report(body: dict[str, Any]) -> None:
        """The update's own numbers go into metrics.jsonl and end_round's sums: finite numbers only."""
        loss = body.get("train_loss")
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise TypeError("train_loss must be a finite number")
        for key in _REPORT_FIELDS:
            v = body.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or abs(v) > MAX_ABS_VALUE):
                raise TypeError(f"{key} must be a finite number, got {type(v).__name__}")
        if body.get("probe_samples") is not None and (not isinstance(body["probe_samples"], int) or body["probe_samples"] < 0):
            raise TypeError("probe_samples must be a non-negative integer")

    def _prompt_tokens(self) -> int:
        fed = self.cfg.fedsga
        return fed.prompts if self.model.family == "vit" and self.fedsga and fed.adapt else 0

    def _train_phi_s(self, h1: Tensor, y: Tensor) -> None:
        """phi_s learns to map pooled p_1 features onto the prototypes (our reading of Eq. 3's head)."""
        if not bool(self.prototypes.initialized.any()):
            return
        self.phi_opt.zero_grad(set_to_none=True)
        phi_s_loss(self.phi_s(h1), y, self.prototypes.protos, self.cfg.fedsga.tau_a).backward()
        self.phi_opt.step()

    def _on_probe(self, msg: Message) -> tuple[str, dict[str, Any]]:
        """Calibration (docs/method.md): L1 through the server's blocks from p_1, Lref through the
        device's own blocks up to p_ref; nothing is updated. The pair is stored for the refit."""
        if not (self.fedsga and self.round.calibrate):
            raise ValueError("this round does not calibrate")
        if any(c["client"] == msg.sender for c in self._stats["calibration"]):
            raise ValueError("this device already probed this round")
        fed = self.cfg.fedsga
        k_ref = reference_index(self.model.num_splits)
        body = msg.body
        z1, y = self._check_activation(body, "z1", 1)
        zref, y2 = self._check_activation(body, "zref", k_ref)
        if not torch.equal(y, y2):
            raise ValueError("z1 and zref must come from the same batch")
        o = np.asarray(body["o"], dtype=np.float64)
        r_prev = float(body["r_prev"])
        if o.shape != (self.cal_buffer.num_obs,) or not np.isfinite(o).all() or not 0.0 <= r_prev <= 1.0:
            raise ValueError(f"o must be {self.cal_buffer.num_obs} finite values and r_prev in [0, 1]")
        # o = (a, delta[, q]) (docs/method.md): a is a mean cosine, delta and q are norms of changes.
        if not (-1.0001 <= o[0] <= 1.0001 and (o[1:] >= 0).all() and (o[1:] <= MAX_ABS_VALUE).all()):
            raise ValueError(f"o = {o.tolist()} is out of range: a in [-1, 1], the rest in [0, {MAX_ABS_VALUE:g}]")
        side = self._side(msg.sender)
        with probe_mode(side.model, side.head):
            L1 = float(self._loss(*self.server_forward(z1, 1, side), y))
            Lref = float(self._loss(*self.server_forward(zref, k_ref, side), y))
        if not (math.isfinite(L1) and math.isfinite(Lref)):
            raise ValueError("probe losses are not finite")
        s = sufficiency_label(L1, Lref, fed.beta)
        self.cal_buffer.append(o.tolist(), r_prev, s)
        self._stats["calibration"].append({"client": msg.sender, "L1": L1, "Lref": Lref, "s": s})
        n = len(y)
        self._stats["cal_flops_server"] += n * (self.costs.suffix_fwd(1) + self.costs.suffix_fwd(k_ref))
        return "probe_result", {"L1": L1, "Lref": Lref, "s": s}

    def _on_fetch(self, msg: Message) -> tuple[str, dict[str, Any]]:
        raw = msg.body["blocks"]
        if not all(isinstance(j, int) and not isinstance(j, bool) for j in raw):
            raise TypeError("blocks must be integers")
        blocks = set(raw)
        if any(not 0 <= j < self.model.num_blocks for j in blocks):
            raise ValueError(f"block indices {sorted(blocks)} out of range 0..{self.model.num_blocks - 1}")
        head = bool(msg.body.get("head"))
        weights = {
            n: v
            for n, v in self._snapshot.items()
            if (n.startswith("blocks.") and int(n.split(".", 2)[1]) in blocks) or (head and n.startswith("head."))
        }
        return "weights", {"weights": to_numpy_state(weights)}

    def _on_update(self, msg: Message) -> tuple[str, dict[str, Any]]:
        """Validated whole before it may enter aggregation: names, shapes, dtypes, finite values."""
        body = msg.body
        L = self.model.num_blocks
        assigned = self.round.assigned[msg.sender]
        full = assigned == 0
        k = 0 if full else self._split_of(body, msg.sender)
        depth = L if full else self.model.depth_of(k)  # blocks trained on the device
        if body.get("depth") != depth:
            raise ValueError(f"depth {body.get('depth')!r} does not match split {k} (expected {depth})")
        if full:
            depth = L + 1  # the head (unit L) too
        expected = {n for n in self._snapshot if unit_of(n, L) < depth}
        weights = body["weights"]
        if set(weights) != expected:
            extra, missing = sorted(set(weights) - expected)[:3], sorted(expected - set(weights))[:3]
            raise ValueError(f"update weights do not match depth {depth}: extra {extra}, missing {missing}")
        for n, arr in weights.items():
            ref = self._snapshot[n]
            if not isinstance(arr, np.ndarray) or tuple(arr.shape) != tuple(ref.shape):
                raise ValueError(f"weight {n} has shape {getattr(arr, 'shape', None)}, expected {tuple(ref.shape)}")
            if ref.is_floating_point():
                if arr.dtype.kind != "f":
                    raise ValueError(f"weight {n} must be floating point, got {arr.dtype}")
                _check_values(arr, f"weight {n}")
            elif arr.dtype.kind not in "iu" or (arr.size and (arr.min() < 0 or arr.max() > 2**62)):
                raise ValueError(f"weight {n} must be a non-negative integer counter")
        if body.get("num_samples") != self.clients[msg.sender]:
            raise ValueError(f"num_samples {body.get('num_samples')!r:.40} is not this device's "
                             f"{self.clients[msg.sender]}")
        self._check_report(body)
        if self.cfg.server_copies == "per_client" and msg.sender in self._copies:
            self._fold_copy(msg.sender, depth)
        self.round.accept_update(msg.sender, dict(body, split=k, depth=depth))
        return "ack", {}

    # -- per-client server copies ---------------------------------------------------------------
    @torch.no_grad()
    def _fold_copy(self, device: str, depth: int) -> None:
        """Add a finished device's server copy to the data-weighted running sums, then drop it."""
        side = self._copies.pop(device)
        w = self.strategy.weight(self.clients[device])
        L = self.model.num_blocks
        trained = [(n, v) for n, v in side.model.state_dict().items() if unit_of(n, L) >= depth]
        trained += [("head:" + n, v) for n, v in side.head.state_dict().items()]
        for n, v in trained:
            self._copy_sums[n] = self._copy_sums.get(n, 0) + w * v.double()
            self._copy_weights[n] = self._copy_weights.get(n, 0.0) + w

    @torch.no_grad()
    def _finish_copies(self) -> None:
        """The averaged copies become the server's copy that enters aggregation (SplitFed-v1 style)."""
        def mean(key: str, like: Tensor) -> Tensor:
            if key not in self._copy_sums:
                return like
            m = self._copy_sums[key] / self._copy_weights[key]
            return m.to(like.dtype) if like.is_floating_point() else m.round().to(like.dtype)

        self.model.load_state_dict({n: mean(n, v) for n, v in self._snapshot.items()})
        self.head.load_state_dict({n: mean("head:" + n, v) for n, v in self.head.state_dict().items()})
        self._copies.clear()

    # -- aggregation ------------------------------------------------------------------------------
    def _aggregate(self, updates: dict[str, dict[str, Any]]) -> None:
        """docs/method.md, "Aggregation": per unit, devices' copies and the server's, weighted by data."""
        L = self.model.num_blocks
        device_updates = [
            DeviceUpdate(cid, int(u["depth"]), self.strategy.weight(self.clients[cid]),
                         group_by_unit({n: from_numpy(a, self.device) for n, a in u["weights"].items()}, L))
            for cid, u in updates.items()
        ]
        new = aggregate_round(group_by_unit(self._snapshot, L), device_updates, group_by_unit(self.model.state_dict(), L))
        self.model.load_state_dict({n: v for unit in new.values() for n, v in unit.items()})

    # -- evaluation -------------------------------------------------------------------------------
    def headline_split(self) -> int:
        """The depth embedding the headline accuracy uses: the split most trained so far (by samples),
        ties to the shallower; p_ref before any split training (docs/method.md, "Evaluation")."""
        if not self.split_samples or set(self.split_samples) == {0}:
            return reference_index(self.model.num_splits)
        split = {k: n for k, n in self.split_samples.items() if k > 0}
        return min(split, key=lambda k: (-split[k], k)) if split else reference_index(self.model.num_splits)

    @torch.no_grad()
    def evaluate(self, images: Any, mean: tuple, std: tuple, batch_size: int = 256) -> dict[str, Any]:
        """Accuracy and loss of the global model under every depth embedding (no prompts: private).

        Prefix + suffix is the whole backbone for any split, so the pooled features are computed
        once; only the harmonizer's depth embedding e(k) differs between splits."""
        self.model.eval()
        self.head.eval()
        K = self.model.num_splits
        ks = list(range(1, K + 1)) if self.head.harmonizer is not None else [0]
        correct = dict.fromkeys(ks, 0)
        loss_sum = dict.fromkeys(ks, 0.0)
        head = self.headline_split() if ks != [0] else 0
        # how often the headline model predicts each class: a collapse onto few classes shows here first
        predicted = torch.zeros(self.num_classes, dtype=torch.long)
        n = len(images)
        for start in range(0, n, batch_size):
            idx = np.arange(start, min(n, start + batch_size))
            x = image_batch(images.get_batch(idx), mean, std, self.device)
            y = torch.from_numpy(np.asarray(images.labels[idx], dtype=np.int64)).to(self.device)
            feats = self.model.features(x)
            for k in ks:
                logits = self.model.head(feats) if k == 0 else self.head.G(self.head.harmonizer(feats, k))
                loss_sum[k] += float(F.cross_entropy(logits, y, reduction="sum"))
                pred = logits.argmax(1)
                correct[k] += int((pred == y).sum())
                if k == head:
                    predicted += torch.bincount(pred.cpu(), minlength=self.num_classes)
        acc = {k: correct[k] / max(n, 1) for k in ks}
        loss = {k: loss_sum[k] / max(n, 1) for k in ks}
        by_split = {str(k): acc[k] for k in ks} if ks != [0] else {str(k): acc[0] for k in range(1, K + 1)}
        share = [round(int(c) / max(n, 1), 4) for c in predicted]
        return {"test_acc": acc[head], "test_loss": loss[head], "test_acc_by_split": by_split,
                "eval_split": head if head else None, "test_pred_share": share}

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything the next round needs to go on as if never stopped (the one checkpoint writer's input)."""
        return {"coordinator": self.state_dict(), "opt": self.shared.opt.state_dict(),
                "phi_opt": self.phi_opt.state_dict(), "split_samples": dict(self.split_samples),
                "remote_errors": self.remote_errors, "bn_context": self.bn_context,
                "strategy_rngs": {name: g.bit_generator.state for name, g in vars(self.strategy).items()
                                  if isinstance(g, np.random.Generator)}}

    def restore(self, state: dict[str, Any]) -> None:
        """Load what ``checkpoint_state`` returned (``resume``)."""
        c = state["coordinator"]
        self.model.load_state_dict(c["model"])
        self.head.load_state_dict(c["head"])
        self.prototypes.load_state_dict(c["prototypes"])
        self.phi_s.load_state_dict(c["phi_s"])
        self.estimator.load_state_dict(c["estimator"])
        self.cal_buffer.load_state_dict(c["cal_buffer"])
        self.shared.opt.load_state_dict(state["opt"])
        self.phi_opt.load_state_dict(state["phi_opt"])
        self.split_samples = {int(k): int(v) for k, v in state["split_samples"].items()}
        self.remote_errors = int(state["remote_errors"])
        self.bn_context = {int(k): dict(rows) for k, rows in state.get("bn_context", {}).items()}
        for name, rng_state in state["strategy_rngs"].items():
            getattr(self.strategy, name).bit_generator.state = rng_state

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "head": self.head.state_dict(),
            "prototypes": self.prototypes.state_dict(),
            "phi_s": self.phi_s.state_dict(),
            "estimator": self.estimator.state_dict(),
            "cal_buffer": self.cal_buffer.state_dict(),
        }

