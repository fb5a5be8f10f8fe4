"""The coordinator role: the server side of the split network, rounds and aggregation.

It sees messages, never a transport, and never waits on a device. Every entry point returns what it
wants sent, one ``Outgoing`` list of ``(device, message)`` (fedsga_edge/wire/messages.py):

* ``begin_round(t, now)`` -> the ``round_start`` messages, one per device (new messages: the
  driver's Peer numbers them);
* ``receive(msg, now)`` for every message from a device, in arrival order -> the reply to it (one
  server step per activation, so the shared server blocks see the devices' batches interleaved),
  and any replies to other devices' held requests that this message released;
* ``tick(now)`` applies the round's deadline, ``fail(device, reason)`` takes a device out of the
  round, ``end_round(now)`` closes it (with the round's record) -> the held requests they released;
  ``round_complete`` says when the round is over.

Every message but ``begin_round``'s answers a request: it carries that request's ``seq``. A server
side that holds activations (MergeSFL's merged step, coordinator/server_side.py) answers nothing at
once; the held request's reply comes out of whichever later call completes or breaks the step.

What differs between methods is the strategy's (coordinator/strategy.py); how the server blocks
train on activations is the server side's (coordinator/server_side.py); which message a device
may send when is the round's table (coordinator/round.py). Every request is checked against its
schema and the round before a handler runs, and validated completely before it touches a weight,
an optimizer or a BatchNorm statistic (coordinator/checks.py). A device's bad message raises
``RemoteProtocolError`` and gets a refusal; any other exception is our bug and propagates.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedsga_edge.config import WIRE_CODECS, RunConfig
from fedsga_edge.method.aggregation import DeviceUpdate, aggregate_round, group_by_unit
from fedsga_edge.models import CostTable, SplitModel
from fedsga_edge.tensors import from_numpy, to_numpy, to_numpy_state
from fedsga_edge.wire import Message, Outgoing, RemoteProtocolError, check_body

from .anomaly import AnomalyScores
from .checks import check_batch, check_blocks, check_split, check_update
from .evaluation import FederatedEvaluation, evaluate, evaluate_models, headline_split
from .fronts import TEST_MODEL, PrivateFronts
from .influence import ActivationBound, clip_updates
from .instructions import Instruction, check_instructions, round_start_body
from .limits import capped_samples
from .round import RoundError, RoundState
from .server_side import Activation, Stepped, make_server_side
from .strategy import Strategy

__all__ = ["Coordinator", "samples_per_epoch", "weighed_samples"]

_MAX_REFUSALS_KEPT = 50  # reasons kept per round in the record; the count goes on


def samples_per_epoch(n: int, batch_size: int, max_batches: int, batching: str = "balanced") -> int:
    """Samples a device with ``n`` samples trains per local epoch: its batches as the device cuts them
    (fedsga_edge/batches.py), at most ``max_batches`` of them (0 = all)."""
    from fedsga_edge.batches import batch_sizes

    sizes = batch_sizes(n, batch_size, batching)
    return sum(sizes[:max_batches] if max_batches else sizes)


def _flops_part(flops: Any, who: str = "client") -> int:
    """The ``who`` count of a strategy's ``{"client": int, "server": int}`` FLOPs field; 0 when it is absent."""
    value = flops.get(who, 0) if isinstance(flops, dict) else 0
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
        self.unverified: set[str] = set()  # devices whose sample count is their own claim (their own data)
        weight = lambda d: strategy.weight(weighed_samples(self, d))
        # the strategy's own server side (MultiSFL's branches), else the one cfg asks for
        own = strategy.server_side(self.model, self.head, cfg, weight)
        if own is not None and cfg.server_steps != 1:
            raise ValueError(f"--server-steps {cfg.server_steps}: {strategy.name} trains its own server side "
                             f"({type(own).__name__}), which does not take steps per activation from it")
        self.server = own or make_server_side(self.model, self.head, cfg, weight,
                                              steps=strategy.server_steps() * cfg.server_steps)
        self.round = RoundState()
        self.bounds = ActivationBound(cfg.clip_activations)  # docs/protocol.md, "Bounded influence"
        self.anomaly = AnomalyScores(cfg.quarantine, cfg.quarantine_rounds)  # the same, round after round
        # split -> samples trained there in the latest round that trained a split (the headline's embedding)
        self.split_samples: dict[int, int] = {}
        self.remote_errors = 0  # requests refused over the whole run
        self._handlers = {"activation": self._on_activation, "fetch": self._on_fetch, "update": self._on_update}
        # --fronts private: each device's own copy of the blocks it may run, out of aggregation (coordinator/fronts.py)
        self.fronts = PrivateFronts(self.model, cfg.fronts == "private")
        self.fed_eval = FederatedEvaluation(self)  # the devices' evaluation on their held-out data
        self._handlers["evaluate"] = self.fed_eval.on_request
        for kind, method in strategy.requests.items():
            handler = getattr(strategy, method)
            self._handlers[kind] = lambda msg, h=handler: h(self, msg)
        self._last_seq: dict[str, int] = {}  # device -> seq of its last accepted request this round
        self.wire_formats: dict[str, str] = {}  # device -> the codec its round's tensors travel in, where not the run's
        self._snapshot: dict[str, Tensor] = {}
        self._stats: dict[str, Any] = {}

    # -- rounds -----------------------------------------------------------------------------------
    def begin_round(self, t: int, now: float | None = None, devices: list[str] | None = None,
                    evaluate_only: bool = False) -> Outgoing:
        """Start round t for ``devices`` (default: all); each device's ``round_start`` message. ``evaluate_only``:
        the final evaluation after the last round (``FederatedEvaluation``): nothing trains or is aggregated."""
        now = time.monotonic() if now is None else now
        devices = list(self.clients) if devices is None else devices
        calibrate = not evaluate_only and self.strategy.calibrates(t)
        instructions = check_instructions(self.strategy.configure_round(t, devices), devices)
        assigned = {cid: i.split for cid, i in instructions.items()}
        # each device's own wire format this round, as its Peer's codec (the driver sends its gradients in it)
        self.wire_formats = {cid: WIRE_CODECS[i.wire_format] for cid, i in instructions.items() if i.wire_format}
        timeout = self.cfg.round_timeout
        self.round.begin(t, assigned, calibrate, now + timeout if timeout > 0 else None)
        self._snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.fed_eval.begin_round(t, evaluate_only)
        self.anomaly.begin_round()
        self.server.work.begin_round()
        if not evaluate_only:
            self.server.set_lr_scale(self.strategy.lr_scale(t))
            self.server.begin_round(self._snapshot)
            self.strategy.begin_round(t, calibrate)
        self._stats = {"server_samples": {}, "remote_errors": [], "refused": 0, "started": now,
                       "clipped": {"activations": {}, "updates": {}}}
        self._last_seq = {}
        # a new message, not a reply: run and seq are the sending Peer's
        return [(cid, Message("round_start", "", t, 0, self.name, self._round_start_body(cid, i)))
                for cid, i in instructions.items()]

    @property
    def round_complete(self) -> bool:
        return self.round.complete or self.round.phase == "closed"

    def tick(self, now: float | None = None) -> Outgoing:
        """Apply the deadline (``round_complete`` then says whether the round is over); a round it closes
        refuses what its server side still held."""
        if self.round.expire(time.monotonic() if now is None else now):
            return self._released()
        return []

    def fail(self, device: str, reason: str) -> Outgoing:
        """A driver saw ``device`` fail (its transport broke, it crashed): it leaves this round, and a
        merged step no longer waits for it."""
        self.round.fail(device, reason)
        return self._released()

    def await_held(self) -> Outgoing:
        """Wait for a held server step that completes elsewhere (per-client copies on other ranks,
        coordinator/sharding.py): the replies it released; nothing when no step is out."""
        return self._released() if self.server.wait_held() else []

    def end_round(self, now: float | None = None) -> tuple[dict[str, Any], Outgoing]:
        """Aggregate what arrived, let the strategy close its round: the round's record, and the
        refusals of whatever was still held (nothing stays held past the round)."""
        now = time.monotonic() if now is None else now
        rs = self.round
        for d in rs.waiting:
            rs.failures[d] = "no update when the round was closed"
        if rs.phase == "training":
            rs.close()
        out = self._released()
        if self.fed_eval.only:  # the final evaluation: the devices' figures, nothing aggregated
            return self.fed_eval.end_final(rs.updates, rs.failures), out
        updates = rs.updates
        screened = screen(self, updates) if updates else None  # before the server's copies are averaged
        self.server.end_round(self._snapshot)
        if screened is not None:
            self._aggregate(*screened)
        record: dict[str, Any] = {
            "round": rs.t,
            "splits": {cid: int(u["split"]) for cid, u in updates.items()},
            "depths": {cid: int(u["depth"]) for cid, u in updates.items()},
            "train_loss": float(np.mean([u["train_loss"] for u in updates.values()])) if updates else float("nan"),
            "failures": dict(rs.failures),
            "round_s": now - self._stats["started"],
        }
        this_round = samples_by_split(updates, self.clients)
        if any(k > 0 for k in this_round):  # a round that trained no split (none came back) keeps the last one's
            self.split_samples = this_round
        self.strategy.end_round(updates, record)
        self.fed_eval.end_round(updates, record)
        record.update(client_costs(self.cfg, self.clients, self.costs, updates, record))
        # the server's steps and FLOPs (coordinator/server_work.py), its calibration probes' forwards included
        record.update(self.server.work.record(_flops_part(record.get("calibration_flops"), "server")))
        clipped = {kind: counts for kind, counts in self._stats["clipped"].items() if counts}
        if clipped:  # samples / units scaled down to the fleet's bound, per device
            record["clipped"] = clipped
        record.update(self.anomaly.record if updates else {})  # anomaly scores, who is quarantined and why
        if self._stats["remote_errors"]:
            record["remote_errors"] = list(self._stats["remote_errors"])  # later refusals must not grow a written record
            record["remote_errors_count"] = self._stats["refused"]
        return record, out

    def _round_start_body(self, cid: str, instruction: Instruction) -> dict[str, Any]:
        k = instruction.split
        full = k == 0
        depth = self.model.num_blocks + 1 if full else self.model.depth_of(k if k is not None else 1)
        names = [n for n in self._snapshot if self.model.unit_of(n) < depth]
        return round_start_body(instruction, to_numpy_state(device_copy(self, cid, names)), self.fed_eval.active,
                                self.fed_eval.only)

    # -- message handling -------------------------------------------------------------------------
    def receive(self, msg: Message, now: float | None = None) -> Outgoing:
        """One device message: its reply (none for a held activation or a one-way ``error``) and the
        replies to held requests it released. A device's mistake is refused and changes nothing."""
        if msg.kind not in self._handlers and msg.kind != "error":
            return [(msg.sender, self._refuse(msg, f"coordinator does not accept {msg.kind!r}"))]
        out: Outgoing = []
        try:
            check_body(msg.kind, msg.body, RemoteProtocolError)
            out += self.tick(now)
            self.round.check_request(msg.sender, msg.round, msg.kind)
            self.fed_eval.check_kind(msg.kind)
            if msg.kind == "error":  # the device gives up on this round
                self.round.fail(msg.sender, f"device reported: {str(msg.body.get('reason', ''))[:200]}")
                return out + self._released()
            # A device's requests are sequential, so their seqs grow: an old one is a replay (e.g. after
            # the Peer's reply cache turned over) and must not step the server twice.
            last = self._last_seq.get(msg.sender)
            if last is not None and msg.seq <= last:
                raise RoundError(f"seq {msg.seq} is not after {last}, {msg.sender}'s last request this round: "
                                 "a replay or a stale message")
            if msg.kind == "activation":
                out += self._on_activation(msg)
            else:
                kind, body = self._handlers[msg.kind](msg)
                out.append((msg.sender, Message(kind, msg.run, msg.round, msg.seq, self.name, body)))
        except RemoteProtocolError as exc:  # the device's fault; anything else is ours and propagates
            return out + [(msg.sender, self._refuse(msg, f"bad {msg.kind}: {exc}"))]
        self.round.advance(msg.sender, msg.kind)
        self._last_seq[msg.sender] = msg.seq
        return out + self._released()  # a held step this completed (an update: its device trains no more)

    def _refuse(self, msg: Message, reason: str) -> Message:
        self.remote_errors += 1
        if self._stats:
            self._stats["refused"] += 1
            if len(self._stats["remote_errors"]) < _MAX_REFUSALS_KEPT:  # a flood must not grow the record
                self._stats["remote_errors"].append(f"{msg.sender}: {reason}"[:300])
        return Message("error", msg.run, msg.round, msg.seq, self.name, {"reason": reason})

    def check_activation(self, body: dict[str, Any], key: str, k: int) -> tuple[Tensor, Tensor]:
        """``body[key]`` and ``body["y"]`` as an activation batch entering at split k (coordinator/checks.py)."""
        return check_batch(self, body, key, k)

    def _on_activation(self, msg: Message) -> Outgoing:
        k = check_split(self, msg.body, msg.sender)
        z, y = self.check_activation(msg.body, "z", k)
        extra = self.strategy.check_activation(msg.body, len(y))
        z, scale, clipped, norms = self.bounds.clip(k, z, msg.sender)
        self.anomaly.check_batch(self.bounds, k, msg.sender, norms)  # --quarantine: off the fleet's, never stepped
        # validated whole: stepped now, or held by a side that merges (its reply comes with its step)
        return self._answers(self.server.submit(Activation(msg, k, z, y, scale, clipped, norms, extra), self.strategy))

    def _released(self) -> Outgoing:
        """The replies to held activations whose step this round's state now decides (MergedServer)."""
        training = self.round.phase == "training"
        return self._answers(self.server.release(set(self.round.waiting) if training else set(), not training,
                                                 self.strategy))

    def _answers(self, results: list[Stepped]) -> Outgoing:
        """Each activation's reply: its gradient after the step's bookkeeping, or its refusal."""
        out: Outgoing = []
        for r in results:
            a, d = r.act, r.act.msg.sender
            if r.dropped is not None:  # not the device's fault: not counted as a refusal
                out.append((d, Message("error", a.msg.run, a.msg.round, a.msg.seq, self.name, {"reason": r.dropped})))
            elif r.refused is not None:
                out.append((d, self._refuse(a.msg, r.refused)))
            else:
                out.append((d, Message("gradient", a.msg.run, a.msg.round, a.msg.seq, self.name, self._stepped(r))))
        return out

    def _stepped(self, r: Stepped) -> dict[str, Any]:
        """After an accepted server step: the bookkeeping, and the gradient reply's body."""
        a, device = r.act, r.act.msg.sender
        self.bounds.accept(device, a.k, a.norms)
        self.anomaly.step_loss(device, r.loss)
        self.strategy.after_step(r.Z, a.y, a.extra)
        self._stats["server_samples"][a.k] = self._stats["server_samples"].get(a.k, 0) + len(a.y)
        if a.clipped:
            counts = self._stats["clipped"]["activations"]
            counts[device] = counts.get(device, 0) + a.clipped
        dz = r.grad if a.scale is None else r.grad * a.scale  # through the scaling, the scale held constant
        return {"dz": to_numpy(dz), "loss": r.loss}

    def _on_fetch(self, msg: Message) -> tuple[str, dict[str, Any]]:
        blocks = check_blocks(msg.body["blocks"], self.model.num_blocks)
        if bool(msg.body.get("head")):
            blocks.add(self.model.num_blocks)
        weights = device_copy(self, msg.sender, [n for n in self._snapshot if self.model.unit_of(n) in blocks])
        return "weights", {"weights": to_numpy_state(weights)}

    def _on_update(self, msg: Message) -> tuple[str, dict[str, Any]]:
        """Validated whole before it may enter aggregation (coordinator/checks.py), then the method's fields."""
        if self.fed_eval.only:  # the final evaluation's update: the device's figures, no weights
            return self.fed_eval.on_final_update(msg)
        k, depth = check_update(self, msg.body, msg.sender)
        self.strategy.check_update(msg.body)  # the method's own fields (device/methods.py), none by default
        self.fed_eval.check_update(msg.sender, msg.body)
        self.server.finish_device(msg.sender, depth)
        self.round.accept_update(msg.sender, dict(msg.body, split=k, depth=depth))
        return "ack", {}

    # -- aggregation ------------------------------------------------------------------------------
    def _aggregate(self, updates: dict[str, dict[str, Any]], states: dict[str, Any],
                   global_units: dict[int, dict[str, Tensor]]) -> None:
        """docs/method.md, "Aggregation": per unit, devices' copies and the server's, weighted by data."""
        unit = self.model.unit_of
        states = self.fronts.keep(states)  # --fronts private: a device's front stays its own, the rest is aggregated
        self._stats["clipped"]["updates"] = clip_updates(global_units, states, self.cfg.clip_updates)
        weight = self.strategy.aggregation_weight  # the strategy's weight(n) unless it weighs otherwise (FedAS)
        n = {cid: self.strategy.weight(weighed_samples(self, cid)) for cid in updates}  # claims capped
        device_updates = [DeviceUpdate(cid, int(u["depth"]), weight(cid, u, n[cid]), states[cid])
                          for cid, u in updates.items()]
        new = aggregate_round(global_units, device_updates, group_by_unit(self.model.state_dict(), unit),
                              rule=self.cfg.aggregation, trim=self.cfg.trim_fraction)
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

        # private fronts: no one global model, each device's own (its front, the shared rest), averaged by data
        own = self.fronts.test_models(self.model.state_dict(), lambda cid: weighed_samples(self, cid))
        models = own or self.strategy.test_models()
        out = evaluate_models(self.model, models, run) if models else run(self.model)
        return out | {"test_model": TEST_MODEL} if own else out

    # -- state ------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything the next round needs to go on as if never stopped (the one checkpoint writer's input)."""
        return checkpoint_state(self)

    def restore(self, state: dict[str, Any]) -> None:
        """Load what ``checkpoint_state`` returned (``resume``)."""
        restore(self, state)

    def state_dict(self) -> dict[str, Any]:
        """The trained server state (checkpoint.pt's "coordinator"): weights, head, the strategy's own."""
        return {"model": self.model.state_dict(), "head": self.head.state_dict(), "strategy": self.strategy.state_dict()}


def screen(co: Coordinator, updates: dict[str, dict[str, Any]]
           ) -> tuple[dict[str, dict[str, Any]], dict[str, Any], dict[int, dict[str, Tensor]]]:
    """The round's anomaly scores (coordinator/anomaly.py): the updates, their states by unit and the
    round's global units that enter aggregation; a device left out leaves the server's copies too."""
    unit = co.model.unit_of
    states = {cid: group_by_unit({n: from_numpy(a, co.device) for n, a in u["weights"].items()}, unit)
              for cid, u in updates.items()}
    global_units = group_by_unit(co._snapshot, unit)
    kept, states = co.anomaly.score(co.round.t, co.bounds, updates, global_units, states)
    co.server.leave_out(set(updates) - set(kept))
    return kept, states, global_units


def checkpoint_state(co: Coordinator) -> dict[str, Any]:
    """Everything the next round needs to go on as if never stopped (the one checkpoint writer's input)."""
    # the server side's whole state ("opt", and "bn_context" with context): a new ServerSide's too
    return {"coordinator": co.state_dict(), **co.server.state_dict(),
            "strategy_opt": co.strategy.optimizer_state(), "split_samples": dict(co.split_samples),
            "remote_errors": co.remote_errors, "activation_norms": co.bounds.state_dict(),
            "anomaly": co.anomaly.state_dict(),
            "fronts": co.fronts.state_dict(),
            "strategy_rngs": {name: g.bit_generator.state for name, g in vars(co.strategy).items()
                              if isinstance(g, np.random.Generator)}}


def restore(co: Coordinator, state: dict[str, Any]) -> None:
    """Load what ``checkpoint_state`` returned (``resume``)."""
    c = state["coordinator"]
    co.model.load_state_dict(c["model"])
    co.head.load_state_dict(c["head"])
    co.strategy.load_state_dict(c["strategy"])
    co.server.load_state_dict(state)
    co.strategy.load_optimizer_state(state["strategy_opt"])
    co.split_samples = {int(k): int(v) for k, v in state["split_samples"].items()}
    co.remote_errors = int(state["remote_errors"])
    co.bounds.load_state_dict(state.get("activation_norms", {}))
    co.anomaly.load_state_dict(state.get("anomaly", {}))
    co.fronts.load_state_dict(state.get("fronts", {}))
    for name, rng_state in state["strategy_rngs"].items():
        getattr(co.strategy, name).bit_generator.state = rng_state


def samples_by_split(updates: dict[str, dict[str, Any]], clients: dict[str, int]) -> dict[int, int]:
    """The round's training samples per split (the headline split follows where most samples trained)."""
    out: dict[int, int] = {}
    for cid, u in updates.items():
        out[int(u["split"])] = out.get(int(u["split"]), 0) + clients[cid]
    return out


def device_copy(co: Coordinator, cid: str, names: Any) -> dict[str, Tensor]:
    """The round snapshot's ``names`` as ``cid`` receives them: its own front under ``--fronts private``, then
    the strategy's copy (FedMut's mutation; the snapshot itself by default), except in the final evaluation
    (the model as the run ended)."""
    weights = co.fronts.own(cid, {n: co._snapshot[n] for n in names}, co._snapshot)  # --fronts private
    return weights if co.fed_eval.only else co.strategy.device_weights(cid, co.round.t, weights)


def weighed_samples(co: Coordinator, device: str) -> float:
    """``device``'s sample count as aggregation weighs it: a count it claimed (its own data, which the
    coordinator cannot see) at most ``--sample-cap`` x the fleet's median count (docs/protocol.md, "Claims")."""
    return capped_samples(co.clients, device, co.cfg.sample_cap if device in co.unverified else 0.0)


def client_costs(cfg: RunConfig, clients: dict[str, int], costs: CostTable, updates: dict[str, dict[str, Any]],
                 record: dict[str, Any]) -> dict[str, Any]:
    """docs/method.md, "Costs": what the round's devices computed per sample they trained.

    Training FLOPs at each device's split plus what the method adds on the device (FedSGA's
    observation forward and calibration probes, FedAS's alignment and Fisher passes, FedGH's class means:
    the strategy's ``observation_flops``, ``calibration_flops`` and ``method_flops`` "client" totals,
    absent for other strategies), over the samples trained;
    each device weighs by the samples it trained (|D_i| x local epochs), ``client_params`` too.
    """
    tc = cfg.train
    seen = {c: tc.local_epochs * samples_per_epoch(clients[c], tc.batch_size, tc.max_batches, tc.batching)
            for c in updates}
    total = sum(seen.values())
    if not total:
        return {"client_flops_per_sample": 0.0, "client_train_flops_per_sample": 0.0,
                "client_method_flops_per_sample": 0.0, "client_params": 0.0, "client_samples": 0}
    train = sum(seen[c] * costs.train(int(u["split"])) for c, u in updates.items())
    method = sum(_flops_part(record.get(key)) for key in ("observation_flops", "calibration_flops", "method_flops"))
    params = sum(seen[c] * costs.params[int(u["split"])] for c, u in updates.items())
    return {"client_flops_per_sample": (train + method) / total, "client_train_flops_per_sample": train / total,
            "client_method_flops_per_sample": method / total, "client_params": params / total,
            "client_samples": int(total)}
