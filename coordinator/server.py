"""The coordinator role: the server side of the split network, rounds and aggregation.

It sees messages, never a transport, and never waits on a device. A driver calls

* ``begin_round(t, now)`` -> the ``round_start`` bodies to send, one per device;
* ``receive(msg, now)`` for every message from a device, in arrival order -> the reply (one
  server step per activation, so the shared server blocks see the devices' batches interleaved;
  with a server side that ``merges`` (MergeSFL) None for an activation held until its step's last
  device has sent, the other devices' replies then coming from ``take_replies``);
* ``tick(now)`` to apply the round's deadline, and ``end_round()`` once ``round_complete``.

What differs between methods is the strategy's (coordinator/strategy.py); how the server blocks
train on activations is the server side's (coordinator/server_side.py); which message a device
may send when is the round's table (coordinator/round.py). Every request is checked against its
schema and the round before a handler runs, and validated completely before it touches a weight,
an optimizer or a BatchNorm statistic. A device's bad message is a ``RemoteProtocolError`` (or a
ValueError from validation) and gets a refusal; any other exception is our bug and propagates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedsga_edge.config import RunConfig
from fedsga_edge.method.aggregation import DeviceUpdate, aggregate_round, group_by_unit
from fedsga_edge.models import CostTable, SplitModel
from fedsga_edge.tensors import from_numpy, to_numpy, to_numpy_state
from fedsga_edge.wire import Message, RemoteProtocolError, check_body

from .evaluation import FederatedEvaluation, evaluate, evaluate_models, headline_split
from .influence import ActivationBound, clip_updates
from .instructions import Instruction, check_instructions, round_start_body
from .limits import check_report, check_values
from .round import RoundError, RoundState
from .server_side import make_server_side
from .strategy import Strategy

__all__ = ["Coordinator", "samples_per_epoch"]

_MAX_REFUSALS_KEPT = 50  # reasons kept per round in the record; the count goes on
_HELD = "held"  # a handler's reply kind for a request answered later (a merged step, MergeSFL)


@dataclass
class _Held:
    """An accepted activation waiting for its merged step: its request and what its step needs."""

    msg: Message
    k: int
    z: Tensor
    y: Tensor
    scale: Any
    clipped: int
    norms: Any
    extra: Any


def samples_per_epoch(n: int, batch_size: int, max_batches: int, batching: str = "balanced") -> int:
    """Samples a device with ``n`` samples trains per local epoch: its batches as the device cuts them
    (fedsga_edge/batches.py), at most ``max_batches`` of them (0 = all)."""
    from fedsga_edge.batches import batch_sizes

    sizes = batch_sizes(n, batch_size, batching)
    return sum(sizes[:max_batches] if max_batches else sizes)


def _client_part(flops: Any) -> int:
    """The "client" count of a strategy's ``{"client": int, ...}`` FLOPs field; 0 when it is absent."""
    value = flops.get("client", 0) if isinstance(flops, dict) else 0
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


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
        strategy.attach(self)
        self.head = strategy.server_head().to(self.device)
        weight = lambda d: strategy.weight(self.clients[d])
        # the strategy's own server side (MultiSFL's branches), else the one cfg asks for
        self.server = strategy.server_side(self.model, self.head, cfg, weight) or make_server_side(
            self.model, self.head, cfg, weight, steps=strategy.server_steps())
        self.round = RoundState()
        self.bounds = ActivationBound(cfg.clip_activations)  # docs/protocol.md, "Bounded influence"
        # split -> samples trained there in the latest round that trained a split (the headline's embedding)
        self.split_samples: dict[int, int] = {}
        self.remote_errors = 0  # requests refused over the whole run
        self._handlers = {"activation": self._on_activation, "fetch": self._on_fetch, "update": self._on_update}
        self.fed_eval = FederatedEvaluation(self)  # the devices' evaluation on their held-out data (issue 18)
        self._handlers["evaluate"] = self.fed_eval.on_request
        for kind, method in strategy.requests.items():
            handler = getattr(strategy, method)
            self._handlers[kind] = lambda msg, h=handler: h(self, msg)
        self._last_seq: dict[str, int] = {}  # device -> seq of its last accepted request this round
        self._snapshot: dict[str, Tensor] = {}
        self._stats: dict[str, Any] = {}
        # A server side that merges (MergeSFL) holds each activation until every training device of the
        # step has sent; the replies released for devices other than the sender wait in the outbox.
        self._held: dict[str, _Held] = {}
        self._outbox: list[tuple[str, Message]] = []

    # -- rounds -----------------------------------------------------------------------------------
    def begin_round(self, t: int, now: float | None = None, devices: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Start round t for ``devices`` (default: all); returns each device's ``round_start`` body."""
        now = time.monotonic() if now is None else now
        devices = list(self.clients) if devices is None else devices
        calibrate = self.strategy.calibrates(t)
        instructions = check_instructions(self.strategy.configure_round(t, devices), devices)
        assigned = {cid: i.split for cid, i in instructions.items()}
        timeout = self.cfg.round_timeout
        self.round.begin(t, assigned, calibrate, now + timeout if timeout > 0 else None)
        self._snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.fed_eval.begin_round(t)
        self.server.set_lr_scale(self.strategy.lr_scale(t))
        self.server.begin_round(self._snapshot)
        self.strategy.begin_round(t, calibrate)
        self._stats = {"server_samples": {}, "remote_errors": [], "refused": 0, "started": now,
                       "clipped": {"activations": {}, "updates": {}}}
        self._last_seq = {}
        self._held, self._outbox = {}, []
        return {cid: self._round_start_body(cid, i) for cid, i in instructions.items()}

    @property
    def round_complete(self) -> bool:
        return self.round.complete or self.round.phase == "closed"

    def tick(self, now: float | None = None) -> bool:
        """Apply the deadline; True when the round is over (complete, or closed by the deadline)."""
        if self.round.expire(time.monotonic() if now is None else now):
            self._release()  # held requests of a closed round are refused, not left waiting
        return self.round_complete

    def fail(self, device: str, reason: str) -> None:
        """A driver saw ``device`` fail (its transport broke, it crashed): it leaves this round."""
        self.round.fail(device, reason)
        self._release()  # a merged step no longer waits for it

    def holds(self, device: str) -> bool:
        """Whether ``device``'s last activation is held for a merged step (its reply comes from
        ``take_replies``): the driver tells the transport to answer it later."""
        return device in self._held

    def take_replies(self) -> list[tuple[str, Message]]:
        """Replies to held requests released since the last call, (device, reply) in release order: the
        driver sends them (a merged step answers every device of the step at once)."""
        out, self._outbox = self._outbox, []
        return out

    def end_round(self, now: float | None = None) -> dict[str, Any]:
        """Aggregate what arrived, let the strategy close its round; the round's record."""
        now = time.monotonic() if now is None else now
        rs = self.round
        for d in rs.waiting:
            rs.failures[d] = "no update when the round was closed"
        if rs.phase == "training":
            rs.close()
        self._release()  # nothing stays held past the round
        updates = rs.updates
        self.server.end_round(self._snapshot)
        if updates:
            self._aggregate(updates)
        record: dict[str, Any] = {
            "round": rs.t,
            "splits": {cid: int(u["split"]) for cid, u in updates.items()},
            "depths": {cid: int(u["depth"]) for cid, u in updates.items()},
            "train_loss": float(np.mean([u["train_loss"] for u in updates.values()])) if updates else float("nan"),
            "failures": dict(rs.failures),
            "round_s": now - self._stats["started"],
        }
        this_round: dict[int, int] = {}
        for cid, u in updates.items():
            k = int(u["split"])
            this_round[k] = this_round.get(k, 0) + self.clients[cid]
        if any(k > 0 for k in this_round):  # a round that trained no split (none came back) keeps the last one's
            self.split_samples = this_round
        self.strategy.end_round(updates, record)
        self.fed_eval.end_round(updates, record)
        record.update(self._client_costs(updates, record))
        clipped = {kind: counts for kind, counts in self._stats["clipped"].items() if counts}
        if clipped:  # samples / units scaled down to the fleet's bound, per device
            record["clipped"] = clipped
        if self._stats["remote_errors"]:
            record["remote_errors"] = list(self._stats["remote_errors"])  # later refusals must not grow a written record
            record["remote_errors_count"] = self._stats["refused"]
        return record

    def _client_costs(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> dict[str, Any]:
        """docs/method.md, "Costs": what the round's devices computed per sample they trained.

        Training FLOPs at each device's split plus what the method adds on the device (FedSGA's
        observation forward and calibration probes: the strategy's ``observation_flops`` and
        ``calibration_flops`` "client" totals, absent for other strategies), over the samples trained;
        each device weighs by the samples it trained (|D_i| x local epochs), ``client_params`` too.
        """
        tc = self.cfg.train
        seen = {c: tc.local_epochs * samples_per_epoch(self.clients[c], tc.batch_size, tc.max_batches, tc.batching)
                for c in updates}
        total = sum(seen.values())
        if not total:
            return {"client_flops_per_sample": 0.0, "client_train_flops_per_sample": 0.0,
                    "client_method_flops_per_sample": 0.0, "client_params": 0.0, "client_samples": 0}
        train = sum(seen[c] * self.costs.train(int(u["split"])) for c, u in updates.items())
        method = sum(_client_part(record.get(key)) for key in ("observation_flops", "calibration_flops"))
        params = sum(seen[c] * self.costs.params[int(u["split"])] for c, u in updates.items())
        return {"client_flops_per_sample": (train + method) / total, "client_train_flops_per_sample": train / total,
                "client_method_flops_per_sample": method / total, "client_params": params / total,
                "client_samples": int(total)}

    def _round_start_body(self, cid: str, instruction: Instruction) -> dict[str, Any]:
        k = instruction.split
        full = k == 0
        depth = self.model.num_blocks + 1 if full else self.model.depth_of(k if k is not None else 1)
        names = [n for n in self._snapshot if self.model.unit_of(n) < depth]
        # the strategy's copy for this device (FedMut's mutation; the snapshot itself by default)
        weights = to_numpy_state(self.strategy.device_weights(cid, self.round.t, {n: self._snapshot[n] for n in names}))
        return round_start_body(instruction, weights, self.fed_eval.active)

    # -- message handling -------------------------------------------------------------------------
    def receive(self, msg: Message, now: float | None = None) -> Message | None:
        """Answer one device message; a device's mistake gets an error reply and changes nothing."""
        if msg.kind not in self._handlers and msg.kind != "error":
            return self._refuse(msg, f"coordinator does not accept {msg.kind!r}")
        try:
            check_body(msg.kind, msg.body, RemoteProtocolError)
            self.tick(now)
            self.round.check_request(msg.sender, msg.round, msg.kind)
            if msg.kind == "error":  # the device gives up on this round
                self.round.fail(msg.sender, f"device reported: {str(msg.body.get('reason', ''))[:200]}")
                self._release()
                return None
            # A device's requests are sequential, so their seqs grow: an old one is a replay (e.g. after
            # the Peer's reply cache turned over) and must not step the server twice.
            last = self._last_seq.get(msg.sender)
            if last is not None and msg.seq <= last:
                raise RoundError(f"seq {msg.seq} is not after {last}, {msg.sender}'s last request this round: "
                                 "a replay or a stale message")
            kind, body = self._handlers[msg.kind](msg)
        except (RemoteProtocolError, ValueError) as exc:  # the device's fault; anything else is ours
            return self._refuse(msg, f"bad {msg.kind}: {exc}")
        self.round.advance(msg.sender, msg.kind)
        self._last_seq[msg.sender] = msg.seq
        if kind == _HELD or self._held:  # a held activation, or a device that no longer trains (update)
            self._release()
            if kind == _HELD:  # answered now only if the sender was the step's last device
                return self._take_reply(msg.sender)
        return Message(kind, msg.run, msg.round, msg.seq, self.name, body)

    def _refuse(self, msg: Message, reason: str) -> Message:
        self.remote_errors += 1
        if self._stats:
            self._stats["refused"] += 1
            if len(self._stats["remote_errors"]) < _MAX_REFUSALS_KEPT:  # a flood must not grow the record
                self._stats["remote_errors"].append(f"{msg.sender}: {reason}"[:300])
        return Message("error", msg.run, msg.round, msg.seq, self.name, {"reason": reason})

    def check_activation(self, body: dict[str, Any], key: str, k: int) -> tuple[Tensor, Tensor]:
        """``body[key]`` and ``body["y"]`` as an activation batch entering at split k, or ValueError."""
        z, y = body[key], body["y"]
        if not isinstance(z, np.ndarray) or not isinstance(y, np.ndarray):
            raise ValueError(f"{key} and y must be arrays")
        if z.dtype.kind != "f":
            raise ValueError(f"{key} must be floating point, got {z.dtype}")
        if y.dtype.kind not in "iu":
            raise ValueError(f"labels must be integers, got {y.dtype}")
        m = self.model.prompt_positions(self.strategy.prompt_tokens(self.cfg))
        expected = self.model.interface_shape(self.model.depth_of(k), m)
        if z.ndim != len(expected) + 1 or tuple(z.shape[1:]) != expected or y.shape != z.shape[:1] or len(y) < 2:
            raise ValueError(f"{key} {z.shape} / labels {y.shape} do not fit split {k} (expected (B>=2, *{expected}))")
        most = self.cfg.train.batch_size + 1  # a device folds a last batch of one into the one before
        if len(y) > most:
            raise ValueError(f"{key} holds {len(y)} samples, more than a batch ({most})")
        check_values(z, key)
        if y.min() < 0 or y.max() >= self.num_classes:
            raise ValueError(f"labels outside 0..{self.num_classes - 1}")
        return from_numpy(z, self.device).float(), from_numpy(y, self.device).long()

    def _split_of(self, body: dict[str, Any], device: str) -> int:
        k = body.get("split")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.model.num_splits:
            raise ValueError(f"split {k!r} out of range 1..{self.model.num_splits}")
        fixed = self.round.assigned.get(device)
        if not self.strategy.accepts_split(fixed, k, self.round.calibrate):
            raise ValueError(f"split {k} but this round assigned {fixed}")
        return k

    def _on_activation(self, msg: Message) -> tuple[str, dict[str, Any]]:
        k = self._split_of(msg.body, msg.sender)
        z, y = self.check_activation(msg.body, "z", k)
        extra = self.strategy.check_activation(msg.body, len(y))
        z, scale, clipped, norms = self.bounds.clip(k, z, fleet=len(self.round.assigned))
        if self.server.merges:  # validated whole; stepped with the rest of its step (``_release``)
            self._held[msg.sender] = _Held(msg, k, z.detach(), y, scale, clipped, norms, extra)
            return _HELD, {}
        loss, Z = self.server.step(msg.sender, z, y, k, self.strategy)
        return "gradient", self._stepped(msg.sender, k, y, Z, extra, z.grad, float(loss.detach()), scale, clipped,
                                         norms)

    def _stepped(self, device: str, k: int, y: Tensor, Z: Tensor | None, extra: Any, grad: Tensor, loss: float,
                 scale: Any, clipped: int, norms: Any) -> dict[str, Any]:
        """After an accepted server step: the bookkeeping, and the gradient reply's body."""
        self.bounds.accept(device, k, norms)
        self.strategy.after_step(Z, y, extra)
        samples = self._stats["server_samples"]
        samples[k] = samples.get(k, 0) + len(y)
        if clipped:
            counts = self._stats["clipped"]["activations"]
            counts[device] = counts.get(device, 0) + clipped
        dz = grad if scale is None else grad * scale  # through the scaling, the scale held constant
        return {"dz": to_numpy(dz), "loss": loss}

    # -- merged steps (a server side that ``merges``: MergeSFL) ---------------------------------------
    def _release(self) -> None:
        """Take the merged step once every device still training this round holds an activation.

        A held device that left the round (failed, gave up, or sent its update) is answered with a
        refusal and leaves the step; a round that is over refuses every held request. Activations at
        different splits merge per split. A merged step refused as non-finite falls back to one step per
        device, so one device's batch cannot cost the others their step: a device whose own step is
        refused gets the refusal."""
        if not self._held:
            return
        waiting = set(self.round.waiting) if self.round.phase == "training" else set()
        for d in [d for d in self._held if d not in waiting]:
            h = self._held.pop(d)
            why = "the round closed" if self.round.phase != "training" else "the device left the round"
            self._outbox.append((d, Message("error", h.msg.run, h.msg.round, h.msg.seq, self.name,
                                             {"reason": f"activation not stepped: {why} before its merged step"})))
        if not self._held or any(d not in self._held for d in waiting):
            return
        held, self._held = self._held, {}
        by_split: dict[int, list[tuple[str, _Held]]] = {}
        for d, h in held.items():  # arrival order within a split
            by_split.setdefault(h.k, []).append((d, h))
        for k, group in sorted(by_split.items()):
            try:
                loss, grads = self.server.step_merged([(d, h.z, h.y) for d, h in group], k, self.strategy)
                results = {d: (grads[d], float(loss.detach())) for d, _ in group}
            except ValueError:
                results = {}
                for d, h in group:
                    z = h.z.detach().clone()
                    try:
                        one, _ = self.server.step(d, z, h.y, k, self.strategy)
                    except ValueError as exc:
                        self._outbox.append((d, self._refuse(h.msg, f"bad activation: {exc}")))
                        continue
                    results[d] = (z.grad, float(one.detach()))
            for d, h in group:
                if d in results:
                    grad, value = results[d]
                    body = self._stepped(d, k, h.y, None, h.extra, grad, value, h.scale, h.clipped, h.norms)
                    self._outbox.append((d, Message("gradient", h.msg.run, h.msg.round, h.msg.seq, self.name, body)))

    def _take_reply(self, device: str) -> Message | None:
        """The sender's own released reply, out of the outbox (None: its request is still held)."""
        for i, (d, reply) in enumerate(self._outbox):
            if d == device:
                del self._outbox[i]
                return reply
        return None

    def _on_fetch(self, msg: Message) -> tuple[str, dict[str, Any]]:
        raw = msg.body["blocks"]
        if not all(isinstance(j, int) and not isinstance(j, bool) for j in raw):
            raise ValueError("blocks must be integers")
        blocks = set(raw)
        L = self.model.num_blocks
        if any(not 0 <= j < L for j in blocks):
            raise ValueError(f"block indices {sorted(blocks)} out of range 0..{L - 1}")
        if bool(msg.body.get("head")):
            blocks.add(L)
        weights = self.strategy.device_weights(
            msg.sender, self.round.t, {n: v for n, v in self._snapshot.items() if self.model.unit_of(n) in blocks})
        return "weights", {"weights": to_numpy_state(weights)}

    def _on_update(self, msg: Message) -> tuple[str, dict[str, Any]]:
        """Validated whole before it may enter aggregation: names, shapes, dtypes, finite values."""
        body = msg.body
        L = self.model.num_blocks
        full = self.round.assigned[msg.sender] == 0
        k = 0 if full else self._split_of(body, msg.sender)
        depth = L if full else self.model.depth_of(k)  # blocks trained on the device
        if body.get("depth") != depth:
            raise ValueError(f"depth {body.get('depth')!r} does not match split {k} (expected {depth})")
        if full:
            depth = L + 1  # the head (unit L) too
        self._check_weights(body["weights"], depth)
        if body.get("num_samples") != self.clients[msg.sender]:
            raise ValueError(f"num_samples {body.get('num_samples')!r:.40} is not this device's "
                             f"{self.clients[msg.sender]}")
        check_report(body)
        self.strategy.check_update(body)  # the method's own fields (device/methods.py), none by default
        self.fed_eval.check_update(msg.sender, body)
        self.server.finish_device(msg.sender, depth)
        self.round.accept_update(msg.sender, dict(body, split=k, depth=depth))
        return "ack", {}

    def _check_weights(self, weights: dict[str, Any], depth: int) -> None:
        expected = {n for n in self._snapshot if self.model.unit_of(n) < depth}
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
                check_values(arr, f"weight {n}")
            elif arr.dtype.kind not in "iu" or (arr.size and (arr.min() < 0 or arr.max() > 2**62)):
                raise ValueError(f"weight {n} must be a non-negative integer counter")

    # -- aggregation ------------------------------------------------------------------------------
    def _aggregate(self, updates: dict[str, dict[str, Any]]) -> None:
        """docs/method.md, "Aggregation": per unit, devices' copies and the server's, weighted by data."""
        unit = self.model.unit_of
        states = {cid: group_by_unit({n: from_numpy(a, self.device) for n, a in u["weights"].items()}, unit)
                  for cid, u in updates.items()}
        global_units = group_by_unit(self._snapshot, unit)
        self._stats["clipped"]["updates"] = clip_updates(global_units, states, self.cfg.clip_updates)
        weight = self.strategy.aggregation_weight  # the strategy's weight(n) unless it weighs otherwise (FedAS)
        device_updates = [DeviceUpdate(cid, int(u["depth"]), weight(cid, u, self.strategy.weight(self.clients[cid])),
                                       states[cid]) for cid, u in updates.items()]
        new = aggregate_round(global_units, device_updates,
                              group_by_unit(self.model.state_dict(), unit))
        self.model.load_state_dict({n: v for u in new.values() for n, v in u.items()})

    # -- evaluation -------------------------------------------------------------------------------
    def headline_split(self) -> int:
        return headline_split(self.split_samples, self.model.num_splits)

    def evaluate(self, images: Any, mean: tuple, std: tuple, batch_size: int = 256) -> dict[str, Any]:
        """Test accuracy of the global model, or of the devices' own models where the strategy keeps
        them (``test_models``; coordinator/evaluation.py)."""
        def run(model: Any) -> dict[str, Any]:
            return evaluate(model, self.head, self.strategy, self.headline_split(), self.num_classes,
                            images, mean, std, self.device, batch_size)

        models = self.strategy.test_models()
        return evaluate_models(self.model, models, run) if models else run(self.model)

    # -- state ------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything the next round needs to go on as if never stopped (the one checkpoint writer's input)."""
        # the server side's whole state ("opt", and "bn_context" with context): a new ServerSide's too
        return {"coordinator": self.state_dict(), **self.server.state_dict(),
                "strategy_opt": self.strategy.optimizer_state(), "split_samples": dict(self.split_samples),
                "remote_errors": self.remote_errors, "activation_norms": self.bounds.state_dict(),
                "strategy_rngs": {name: g.bit_generator.state for name, g in vars(self.strategy).items()
                                  if isinstance(g, np.random.Generator)}}

    def restore(self, state: dict[str, Any]) -> None:
        """Load what ``checkpoint_state`` returned (``resume``)."""
        c = state["coordinator"]
        self.model.load_state_dict(c["model"])
        self.head.load_state_dict(c["head"])
        self.strategy.load_state_dict(c["strategy"])
        self.server.load_state_dict(state)
        self.strategy.load_optimizer_state(state["strategy_opt"])
        self.split_samples = {int(k): int(v) for k, v in state["split_samples"].items()}
        self.remote_errors = int(state["remote_errors"])
        self.bounds.load_state_dict(state.get("activation_norms", {}))
        for name, rng_state in state["strategy_rngs"].items():
            getattr(self.strategy, name).bit_generator.state = rng_state

    def state_dict(self) -> dict[str, Any]:
        """The trained server state (checkpoint.pt's "coordinator"): weights, head, the strategy's own."""
        return {"model": self.model.state_dict(), "head": self.head.state_dict(), "strategy": self.strategy.state_dict()}
