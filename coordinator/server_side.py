"""How the server side trains on the devices' activations: swappable objects, chosen by name.

* ``shared`` (SplitFed-v2 style): one copy of the server blocks takes every device's steps in
  arrival order.
* ``shared`` with ``server_bn_context`` N > 0: the same copy, but each device's batch is normalised
  in the server's BatchNorm layers together with the latest accepted activations of up to N other
  devices at its split (no loss on their rows; docs/method.md, "Server-side BatchNorm statistics").
* ``per_client`` (SplitFed-v1 style): each device trains its own copy, started from the round's
  snapshot; the copies are averaged by data weight at the end of the round.
* ``steps`` tau > 1 (MU-SplitFed's unbalanced update) on either of the two above: the copy the device
  trains takes tau steps on each accepted activation, the device's gradient coming from the first
  (docs/method.md, "Baselines beyond the paper's own").
* ``branches`` (MultiSFL): one copy per branch model, kept by the strategy across rounds, with
  knowledge replay: rows of helper devices' batches joined to a branch's own batches (the strategy's
  ``server_side`` hook builds it).
* ``merged`` (MergeSFL): the shared copy, one step per merged batch of every training device's
  activation; it holds activations until their step is complete (``MergedServer``).

Each is a ``ServerSide``: the coordinator ``submit``s each accepted activation and gets back what
became of it (stepped now, or nothing yet while held), asks ``release`` after every event that can
complete a held step, tells it when a device is done and when the round ends. A new variant is a
subclass registered in ``SERVER_SIDES`` or built by its strategy's ``server_side`` hook. Every optimizer
step a side takes is counted, with its FLOPs, in its ``work`` (coordinator/server_work.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from fedsga_edge.config import RunConfig
from fedsga_edge.method.aggregation import robust_average
from fedsga_edge.tensors import round_average_bn
from fedsga_edge.wire import RemoteProtocolError

from .influence import clip_updates
from .limits import all_finite
from .server_work import ServerWork, step_flops

__all__ = ["ServerCopy", "ServerSide", "SharedServer", "ContextServer", "PerClientServer",
           "BranchServer", "MergedServer", "SERVER_SIDES", "make_server_side"]


@dataclass
class Activation:
    """An accepted activation, validated whole: its request and what its server step needs."""

    msg: Any  # the request (a Message): its reply answers it
    k: int
    z: Tensor
    y: Tensor
    scale: Any  # the influence bound's scaling (None: unscaled)
    clipped: int
    norms: Any
    extra: Any  # what the strategy's check_activation returned


@dataclass
class Stepped:
    """What became of one activation: stepped (``grad``, ``loss``; ``Z`` for the strategy's after_step),
    ``refused`` (its batch is at fault: a counted refusal) or ``dropped`` (never stepped: the round closed
    or its device left before its merged step)."""

    act: Activation
    grad: Tensor | None = None
    loss: float = 0.0
    Z: Tensor | None = None
    refused: str | None = None
    dropped: str | None = None


class ServerCopy:
    """One trainable copy of the server side (blocks + the strategy's head) with its optimizer."""

    def __init__(self, model: nn.Module, head: nn.Module, cfg: RunConfig, lr_scale: float = 1.0) -> None:
        self.model, self.head = model, head
        tc = cfg.train
        self.base_lr = tc.lr if cfg.server_lr is None else cfg.server_lr
        # a head module may name sub-modules with a base rate of their own (``head.rates``: FedSGA's
        # --harmonizer-lr); every other parameter takes the server's
        rates = {name: r for name, r in getattr(head, "rates", {}).items() if r is not None}
        own = {id(p) for name in rates for p in head.get_submodule(name).parameters()}
        groups = [{"params": list(model.parameters()) + [p for p in head.parameters() if id(p) not in own],
                   "base_lr": self.base_lr}]
        groups += [{"params": list(head.get_submodule(name).parameters()), "base_lr": r} for name, r in rates.items()]
        for g in groups:
            g["lr"] = g["base_lr"] * lr_scale
        self.opt = torch.optim.SGD(groups, lr=self.base_lr * lr_scale, momentum=tc.momentum,
                                   weight_decay=tc.weight_decay)

    def scale_lr(self, factor: float) -> None:
        """This round's rate: each group's base rate times the schedule's factor (--lr-schedule)."""
        for group in self.opt.param_groups:
            group["lr"] = group["base_lr"] * factor


class ServerSide:
    """Base: one shared copy; subclasses change which copy a device trains and what a batch sees."""

    name: ClassVar[str] = ""

    def __init__(self, model: nn.Module, head: nn.Module, cfg: RunConfig, weight: Callable[[str], float]) -> None:
        self.cfg = cfg
        self.model, self.head = model, head
        self.weight = weight  # device -> its weight in the copies' average
        self.shared = ServerCopy(model, head, cfg)
        self.lr_scale = 1.0  # the round's factor of every copy's rate (set_lr_scale)
        # optimizer steps per accepted activation (MU-SplitFed's tau, --server-steps; make_server_side sets it)
        self.steps = 1
        self.work = ServerWork()  # every step this side takes, and its FLOPs (coordinator/server_work.py)

    def set_lr_scale(self, factor: float) -> None:
        """The learning-rate schedule's factor for the round about to start (RunConfig.lr_scale): the shared copy
        now, and every copy made during the round (per device, per branch) from it."""
        self.lr_scale = factor
        self.shared.scale_lr(factor)

    def begin_round(self, snapshot: dict[str, Tensor]) -> None:
        if self.cfg.server_bn == "round":
            round_average_bn(self.model)  # the shared copy's statistics: this round's batches, averaged

    def copy_for(self, device: str) -> ServerCopy:
        """The copy this device's activations train (and its probes are measured on)."""
        return self.shared

    def context(self, device: str, k: int) -> list[Tensor]:
        """Rows that join the device's batch in the BatchNorm statistics only."""
        return []

    def remember(self, device: str, k: int, z: Tensor) -> None:
        """An accepted activation (after its step)."""

    def joined(self, device: str, k: int) -> tuple[Tensor, Tensor] | None:
        """Rows (activations, labels) that join the device's batch and its loss (MultiSFL's replay): none."""
        return None

    def submit(self, act: Activation, strategy: Any) -> list[Stepped]:
        """An accepted activation: stepped now (a side that holds, MergedServer: once its step is complete,
        from ``release``). A non-finite step raises RemoteProtocolError with nothing changed."""
        loss, Z = self.step(act.msg.sender, act.z, act.y, act.k, strategy)
        return [Stepped(act, act.z.grad, float(loss.detach()), Z)]

    def release(self, waiting: set[str], closed: bool, strategy: Any) -> list[Stepped]:
        """Held activations whose fate is decided now that ``waiting`` are the devices still training
        (``closed``: the round is over): none unless this side holds them."""
        return []

    def wait_held(self) -> bool:
        """Wait for a held step that completes outside the coordinator's calls (coordinator/sharding.py: on
        another rank); ``release`` then answers it. False: none can complete that way."""
        return False

    def step(self, device: str, z: Tensor, y: Tensor, k: int, strategy: Any) -> tuple[Tensor, Tensor | None]:
        """``steps`` server steps on the device's activation; fills ``z.grad``. A non-finite loss or gradient
        in any of them raises RemoteProtocolError (the device's batch is at fault) with nothing changed.

        With ``steps`` tau > 1 (MU-SplitFed's unbalanced update) the device's gradient is the first step's:
        the gradient of the loss its forward was matched with, as in SplitFed; the tau - 1 further steps
        reuse the same activation and labels and move only the copy the device trains (the shared one, or
        its own with per-client copies). A failure in any of them puts that copy's weights, statistics and
        optimizer back to what they were before the first step."""
        if self.steps == 1:
            return self._step(device, z, y, k, strategy)
        side = self.copy_for(device)
        saved = ({n: v.detach().clone() for n, v in side.model.state_dict().items()},
                 {n: v.detach().clone() for n, v in side.head.state_dict().items()},
                 copy.deepcopy(side.opt.state_dict()))
        loss, Z = self._step(device, z, y, k, strategy)  # fills z.grad: what the device receives
        try:
            for _ in range(self.steps - 1):
                self._step(device, z.detach().clone(), y, k, strategy)
        except RemoteProtocolError:
            side.model.load_state_dict(saved[0])
            side.head.load_state_dict(saved[1])
            side.opt.load_state_dict(saved[2])
            raise
        return loss, Z

    def _step(self, device: str, z: Tensor, y: Tensor, k: int, strategy: Any) -> tuple[Tensor, Tensor | None]:
        """One server step on the device's activation; fills ``z.grad``. A non-finite loss or gradient
        undoes the forward's BatchNorm statistics and raises RemoteProtocolError: nothing changes."""
        side = self.copy_for(device)
        z.requires_grad_(True)
        side.model.train()
        side.head.train()
        side.opt.zero_grad(set_to_none=True)
        buffers = [b for m in (side.model, side.head) for b in m.buffers()]
        saved = [b.detach().clone() for b in buffers]  # BatchNorm statistics move in forward
        joined = self.joined(device, k)
        if joined is not None:  # rows that join the batch and its loss; the device's gradient is z's slice
            y = torch.cat([y, joined[1]])
        rows = [z, *(joined[:1] if joined is not None else []), *self.context(device, k)]
        logits, Z = strategy.forward(side, torch.cat(rows) if len(rows) > 1 else z, k)
        if len(logits) > len(y):  # the other devices' context rows only shape the batch statistics: no loss
            logits, Z = logits[: len(y)], (Z[: len(y)] if Z is not None else None)
        loss = strategy.loss(logits, Z, y)
        loss.backward()
        params = [p for g in side.opt.param_groups for p in g["params"] if p.grad is not None]
        if not (bool(torch.isfinite(loss)) and all_finite([z.grad, *(p.grad for p in params), *buffers])
                and (Z is None or bool(torch.isfinite(Z).all()))):
            with torch.no_grad():  # undo the forward's statistics; the step never happens
                for b, old in zip(buffers, saved):
                    b.copy_(old)
            side.opt.zero_grad(set_to_none=True)
            raise RemoteProtocolError("the activation gives a non-finite loss or gradient: refused, nothing changed")
        side.opt.step()
        # every row ran forward and backward: the device's, the joined (replayed) ones and the context's
        self.work.add(("step", k), sum(len(r) for r in rows), lambda: step_flops(strategy, side.model, side.head, z, k))
        self.remember(device, k, z)
        return loss, Z

    def finish_device(self, device: str, depth: int) -> None:
        """The device's update was accepted: its training on this side is over for the round."""

    def leave_out(self, devices: set[str]) -> None:
        """Devices whose round the anomaly scores left out (coordinator/anomaly.py): what of theirs this side
        can still take back. A shared copy has taken their steps already; their batches that scored off the
        fleet's were refused before stepping it."""

    def end_round(self, snapshot: dict[str, Tensor]) -> None:
        """Before aggregation: leave the server's result of the round in ``self.model`` / ``self.head``."""

    def state_dict(self) -> dict[str, Any]:
        return {"opt": self.shared.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shared.opt.load_state_dict(state["opt"])


class SharedServer(ServerSide):
    name = "shared"


class ContextServer(SharedServer):
    """The shared copy with other devices' latest activations in each batch's BatchNorm statistics."""

    name = "shared+context"

    def __init__(self, model: nn.Module, head: nn.Module, cfg: RunConfig, weight: Callable[[str], float]) -> None:
        super().__init__(model, head, cfg, weight)
        self.n = cfg.server_bn_context
        # split -> device -> its latest accepted activation, most recent last; kept across rounds
        self.rows: dict[int, dict[str, Tensor]] = {}

    def context(self, device: str, k: int) -> list[Tensor]:
        return [z for d, z in self.rows.get(k, {}).items() if d != device][-self.n:]

    def remember(self, device: str, k: int, z: Tensor) -> None:
        """Keep ``z`` as the device's latest at split k; n + 1 entries per split are all n others need."""
        rows = self.rows.setdefault(k, {})
        rows.pop(device, None)
        rows[device] = z.detach().clone()
        while len(rows) > self.n + 1:
            rows.pop(next(iter(rows)))

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"bn_context": self.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rows = {int(k): dict(rows) for k, rows in state.get("bn_context", {}).items()}


class PerClientServer(ServerSide):
    """Each device trains its own copy from the round's snapshot; copies averaged at the round's end."""

    name = "per_client"

    def __init__(self, model: nn.Module, head: nn.Module, cfg: RunConfig, weight: Callable[[str], float]) -> None:
        super().__init__(model, head, cfg, weight)
        self._snapshot: dict[str, Tensor] = {}
        self._copies: dict[str, ServerCopy] = {}
        self._done: dict[str, tuple[float, dict[str, Tensor]]] = {}  # device -> (weight, its trained state)

    def begin_round(self, snapshot: dict[str, Tensor]) -> None:
        super().begin_round(snapshot)
        self._snapshot = snapshot
        self._copies, self._done = {}, {}

    def copy_for(self, device: str) -> ServerCopy:
        side = self._copies.get(device)
        if side is None:
            model, head = copy.deepcopy(self.model), copy.deepcopy(self.head)
            model.load_state_dict(self._snapshot)
            if self.cfg.server_bn == "round":
                round_average_bn(model)
            side = self._copies[device] = ServerCopy(model, head, self.cfg, self.lr_scale)
        return side

    @torch.no_grad()
    def finish_device(self, device: str, depth: int) -> None:
        """Keep a finished device's trained server state (the blocks it did not run, the head); drop its copy."""
        side = self._copies.pop(device, None)
        if side is None:
            return
        trained = {n: v.clone() for n, v in side.model.state_dict().items() if side.model.unit_of(n) >= depth}
        trained |= {"head:" + n: v.clone() for n, v in side.head.state_dict().items()}
        self._done[device] = (self.weight(device), trained)

    def leave_out(self, devices: set[str]) -> None:
        """Their copies leave the round's average (coordinator/sharding.py tells the rank that holds one)."""
        for d in devices:
            self._done.pop(d, None)

    def _unit(self, name: str) -> int | str:
        return "head" if name.startswith("head:") else self.model.unit_of(name)

    @torch.no_grad()
    def end_round(self, snapshot: dict[str, Tensor]) -> None:
        """The copies, each unit's change bounded like a device's update (coordinator/influence.py),
        averaged by data weight, become the server's copy that enters aggregation (SplitFed-v1 style)."""
        ref = dict(snapshot) | {"head:" + n: v for n, v in self.head.state_dict().items()}

        def by_unit(state: dict[str, Tensor]) -> dict[Any, dict[str, Tensor]]:
            units: dict[Any, dict[str, Tensor]] = {}
            for n, v in state.items():
                units.setdefault(self._unit(n), {})[n] = v
            return units

        clip_updates(by_unit(ref), {d: by_unit(st) for d, (_, st) in self._done.items()}, self.cfg.clip_updates)
        sums: dict[str, Tensor] = {}
        weights: dict[str, float] = {}
        for w, trained in self._done.values():  # in the order devices finished
            for n, v in trained.items():
                sums[n] = sums.get(n, 0) + w * v.double()
                weights[n] = weights.get(n, 0.0) + w

        robust = self._robust(ref, by_unit) if self.cfg.aggregation != "mean" else {}

        def mean(key: str, like: Tensor) -> Tensor:
            if key in robust:
                return robust[key]
            if key not in sums:
                return like
            m = sums[key] / weights[key]
            return m.to(like.dtype) if like.is_floating_point() else m.round().to(like.dtype)

        self.model.load_state_dict({n: mean(n, v) for n, v in snapshot.items()})
        self.head.load_state_dict({n: mean("head:" + n, v) for n, v in self.head.state_dict().items()})
        self._copies.clear()
        self._done.clear()

    def _robust(self, ref: dict[str, Tensor], by_unit: Callable[[dict[str, Tensor]], dict[Any, dict[str, Tensor]]]
                ) -> dict[str, Tensor]:
        """The copies combined unit by unit under ``--aggregation`` (fedsga_edge/method/aggregation.py)."""
        done = [(w, by_unit(trained)) for w, trained in self._done.values()]
        out: dict[str, Tensor] = {}
        for u, r in by_unit(ref).items():
            parts = [(w, units[u]) for w, units in done if u in units and w > 0]
            if parts:
                out.update(robust_average([p for _, p in parts], [w for w, _ in parts], self.cfg.aggregation,
                                          self.cfg.trim_fraction, r))
        return out


class BranchServer(ServerSide):
    """MultiSFL's server side: one copy per branch model, started every round from that branch's state
    (``start(b)``); a device trains the copy of the branch it was dealt (``branch_of``). Knowledge replay
    as the reference code has it: each of a branch's own steps takes ``rows(device)`` extra rows into the
    same batch and loss, drawn from helper devices' latest accepted batches (devices of other branches at
    the same split, in id order) for the classes the branch has seen least: each class's share of the
    rows is its deficit below the mean of the branch's label counts, which decay by half every round
    (docs/method.md, "Baselines beyond the paper's own"). The device's gradient is its own rows' slice;
    replayed rows send no gradient to anyone. At the round's end each branch's trained state is left in
    ``trained`` for the strategy, which builds the branches and the master from it; the shared copy is
    not trained.
    """

    name = "branches"
    decay = 0.5  # the reference's decay of a branch's label counts per round

    def __init__(self, model: nn.Module, head: nn.Module, cfg: RunConfig, weight: Callable[[str], float], *,
                 branch_of: Callable[[str], int], start: Callable[[int], dict[str, Tensor]],
                 rows: Callable[[str], int], num_classes: int) -> None:
        super().__init__(model, head, cfg, weight)
        self.branch_of, self.start, self.rows, self.num_classes = branch_of, start, rows, num_classes
        self.trained: dict[int, dict[str, Tensor]] = {}  # branch -> its copy's state at the last round's end
        self.replayed: list[tuple[int, str, int]] = []  # (branch, helper, rows) of each replay this round
        self.counts: dict[int, Tensor] = {}  # branch -> decayed count of each class its own steps saw
        self._copies: dict[int, ServerCopy] = {}
        self._latest: dict[str, tuple[Tensor, Tensor, int]] = {}  # device -> its latest accepted (z, y, k)
        self._join: tuple[Tensor, Tensor] | None = None  # the rows the step being taken replays
        self._credit: dict[int, Tensor] = {}  # branch -> rows owed per class this round (pick)

    def begin_round(self, snapshot: dict[str, Tensor]) -> None:
        # not the base's: the shared model is the master, which no branch copy trains (--server-bn round
        # applies to each branch's copy as it is made)
        self._copies, self._latest, self.replayed, self._credit = {}, {}, [], {}
        self.counts = {b: c * self.decay for b, c in self.counts.items()}

    def copy_for(self, device: str) -> ServerCopy:
        b = self.branch_of(device)
        side = self._copies.get(b)
        if side is None:
            model, head = copy.deepcopy(self.model), copy.deepcopy(self.head)
            model.load_state_dict(self.start(b))
            if self.cfg.server_bn == "round":
                round_average_bn(model)
            side = self._copies[b] = ServerCopy(model, head, self.cfg, self.lr_scale)
        return side

    def joined(self, device: str, k: int) -> tuple[Tensor, Tensor] | None:
        return self._join

    def step(self, device: str, z: Tensor, y: Tensor, k: int, strategy: Any) -> tuple[Tensor, Tensor | None]:
        b = self.branch_of(device)
        counts = self.counts.get(b, torch.zeros(self.num_classes, dtype=torch.float64))
        self.counts[b] = counts + torch.bincount(y.cpu(), minlength=self.num_classes)[: self.num_classes].double()
        credit = self._credit.get(b)
        picked = self.pick(b, k, self.rows(device))
        self._join = (torch.cat([z for z, _ in picked.values()]), torch.cat([y for _, y in picked.values()])) \
            if picked else None
        try:
            loss, Z = super().step(device, z, y, k, strategy)
        except RemoteProtocolError:
            self.counts[b] = counts  # nothing changed: the label counts and the replay credit as they were
            if credit is None:
                self._credit.pop(b, None)
            else:
                self._credit[b] = credit
            raise
        finally:
            self._join = None
        self._latest[device] = (z.detach().clone(), y.detach().clone(), k)
        self.replayed += [(b, d, len(rows[1])) for d, rows in picked.items()]
        return loss, Z

    def pick(self, b: int, k: int, n: int) -> dict[str, tuple[Tensor, Tensor]]:
        """About ``n`` replay rows for branch b: each step adds n * deficit_c / sum of deficits to class c's
        credit (deficit_c = max(mean count - count_c, 0); a credit is capped at n), the whole part of each
        credit is filled from the helpers in id order, each helper's rows in batch order, and what was taken
        leaves the credit, so a share under one row per step still gets its rows over the steps. Helper ->
        its (activations, labels); empty when none help. Call it once per step: it spends the credit."""
        counts = self.counts.get(b)
        if n <= 0 or counts is None:
            return {}
        deficit = (counts.mean() - counts).clamp(min=0)
        if float(deficit.sum()) <= 0:
            return {}
        credit = (self._credit.get(b, torch.zeros_like(counts)) + n * deficit / deficit.sum()).clamp(max=n)
        quota = credit.floor().long()
        out: dict[str, tuple[Tensor, Tensor]] = {}
        for d in sorted(self._latest):
            z, y, kd = self._latest[d]
            if kd != k or self.branch_of(d) == b:
                continue
            take = []
            for i, c in enumerate(y.tolist()):
                if 0 <= c < len(quota) and quota[c] > 0:
                    quota[c] -= 1
                    take.append(i)
            if take:
                out[d] = (z[take], y[take])
        self._credit[b] = credit - sum((torch.bincount(y, minlength=len(credit))[: len(credit)].double()
                                        for _, y in out.values()), torch.zeros_like(credit))
        return out

    @torch.no_grad()
    def end_round(self, snapshot: dict[str, Tensor]) -> None:
        """Keep each branch's trained copy for the strategy; the shared model stays as it is."""
        self.trained = {b: {n: v.detach().clone() for n, v in side.model.state_dict().items()}
                        for b, side in self._copies.items()}
        self._copies.clear()
        self._latest.clear()

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"label_counts": self.counts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.counts = dict(state.get("label_counts", {}))


class MergedServer(SharedServer):
    """MergeSFL's server step: the activations of every device of one step, concatenated into one batch,
    take ONE step of the shared copy; each device gets its slice of the merged batch's input gradient,
    scaled by (merged size / its size) so that it is the gradient of the mean loss over its own samples
    (as the reference code dispatches it). The batch's BatchNorm statistics are the merged batch's.

    It holds each accepted activation (``submit`` steps nothing) until every device still training has
    sent one; ``release``, which the coordinator calls after every event that can complete or break a
    step, then takes the merged step and hands back every device's result, so each held request is
    answered through the coordinator's ordinary return value. A device that left the round (failed, gave
    up, sent its update) is dropped from the step; a closed round drops every held activation.
    """

    name = "merged"

    def __init__(self, model: nn.Module, head: nn.Module, cfg: RunConfig, weight: Callable[[str], float]) -> None:
        super().__init__(model, head, cfg, weight)
        self._held: dict[str, Activation] = {}  # device -> its activation waiting for the step, in arrival order

    def begin_round(self, snapshot: dict[str, Tensor]) -> None:
        super().begin_round(snapshot)
        self._held = {}

    def submit(self, act: Activation, strategy: Any) -> list[Stepped]:
        self._held[act.msg.sender] = replace(act, z=act.z.detach())  # stepped with the rest of its step
        return []

    def release(self, waiting: set[str], closed: bool, strategy: Any) -> list[Stepped]:
        """The merged step once every device in ``waiting`` holds an activation; activations at different
        splits merge per split. A merged step refused as non-finite falls back to one step per device, so
        one device's batch cannot cost the others their step: a device whose own step is refused gets the
        refusal."""
        out: list[Stepped] = []
        why = "the round closed" if closed else "the device left the round"
        for d in [d for d in self._held if d not in waiting]:
            out.append(Stepped(self._held.pop(d), dropped=f"activation not stepped: {why} before its merged step"))
        if not self._held or any(d not in self._held for d in waiting):
            return out
        held, self._held = self._held, {}
        by_split: dict[int, list[tuple[str, Activation]]] = {}
        for d, a in held.items():  # arrival order within a split
            by_split.setdefault(a.k, []).append((d, a))
        for k, group in sorted(by_split.items()):
            out += self._step_group(group, k, strategy)
        return out

    def _step_group(self, group: list[tuple[str, Activation]], k: int, strategy: Any) -> list[Stepped]:
        """One merged step of ``group``, or one step per device if the merged batch is refused (the
        refusals first, then the stepped, each in arrival order)."""
        try:
            loss, grads = self.step_merged([(d, a.z, a.y) for d, a in group], k, strategy)
            return [Stepped(a, grads[d], float(loss.detach())) for d, a in group]
        except RemoteProtocolError:
            pass
        refused, stepped = [], []
        for d, a in group:
            z = a.z.detach().clone()
            try:
                one, _ = self.step(d, z, a.y, k, strategy)
            except RemoteProtocolError as exc:
                refused.append(Stepped(a, refused=f"bad activation: {exc}"))
                continue
            stepped.append(Stepped(a, z.grad, float(one.detach())))
        return refused + stepped

    def step_merged(self, batches: list[tuple[str, Tensor, Tensor]], k: int,
                    strategy: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """One server step on the concatenation of ``batches`` ((device, z, y), all entering at split k);
        returns the merged loss and each device's gradient. A non-finite loss or gradient undoes the
        forward's BatchNorm statistics and raises RemoteProtocolError: nothing changes."""
        side = self.shared
        z = torch.cat([b[1].detach() for b in batches]).requires_grad_(True)
        y = torch.cat([b[2] for b in batches])
        side.model.train()
        side.head.train()
        side.opt.zero_grad(set_to_none=True)
        buffers = [b for m in (side.model, side.head) for b in m.buffers()]
        saved = [b.detach().clone() for b in buffers]
        logits, Z = strategy.forward(side, z, k)
        loss = strategy.loss(logits, Z, y)
        loss.backward()
        params = [p for g in side.opt.param_groups for p in g["params"] if p.grad is not None]
        if not (bool(torch.isfinite(loss)) and all_finite([z.grad, *(p.grad for p in params), *buffers])):
            with torch.no_grad():
                for b, old in zip(buffers, saved):
                    b.copy_(old)
            side.opt.zero_grad(set_to_none=True)
            raise RemoteProtocolError("the merged batch gives a non-finite loss or gradient: refused, nothing changed")
        side.opt.step()
        self.work.add(("step", k), len(y), lambda: step_flops(strategy, side.model, side.head, z, k))
        out: dict[str, Tensor] = {}
        start, total = 0, len(y)
        for device, zi, _ in batches:
            n = len(zi)
            out[device] = z.grad[start:start + n] * (total / n)
            start += n
        return loss, out


SERVER_SIDES: dict[str, type[ServerSide]] = {"shared": SharedServer, "per_client": PerClientServer}


def make_server_side(model: nn.Module, head: nn.Module, cfg: RunConfig, weight: Callable[[str], float],
                     steps: int = 1) -> ServerSide:
    """The server side ``cfg`` asks for, taking ``steps`` optimizer steps per activation (the strategy's
    ``server_steps``, MU-SplitFed's tau, times ``--server-steps``) on the shared copy or on each device's own."""
    if steps < 1:
        raise ValueError(f"the server takes at least one step per activation, got {steps}")
    if cfg.server_copies == "shared" and cfg.server_bn_context:
        if steps != 1:  # the context rows' statistics would move tau times per batch
            raise ValueError(f"{steps} server steps per activation cannot take --server-bn-context")
        return ContextServer(model, head, cfg, weight)
    if cfg.server_copies not in SERVER_SIDES:
        raise ValueError(f"--server-copies must be one of {', '.join(SERVER_SIDES)} (got {cfg.server_copies!r})")
    side = SERVER_SIDES[cfg.server_copies](model, head, cfg, weight)
    side.steps = steps
    return side
