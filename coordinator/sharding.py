"""Per-client server copies sharded across processes with torch.distributed (docs/scale.md, "The server
side across processes").

With per-client copies a device's server steps touch only its own copy, started from the round's snapshot,
so the copies of different devices can train in different processes at once. ``ShardedServer`` is the
coordinator's (rank 0's) server side: a device's copy lives on the rank ``deal`` gives it (by its expected
work); rank 0 sends the others' activations to their rank without waiting (the request is held, as MergeSFL's
are, and answered by whichever later call finds the step back) and steps its own as ``PerClientServer`` does,
once the next activation has gone to another rank. Each other
rank runs ``serve_shard`` around a ``PerClientServer`` of its own. At the round's end every rank bounds its
devices' changes against the norms of all devices (``influence.change_norms``, gathered), sums its copies
by data weight, and one ``all_reduce`` adds the ranks' sums: the average is one process's, to float
rounding.

The shared copy stays on one rank: it takes the devices' steps one after another in arrival order, each
step starting from the previous one's weights, so there is nothing to run side by side.

Messages between ranks go over the gloo group as a small pickled header (the message with each tensor
replaced by its dtype and shape: a length on one tag, the bytes on the next) followed by the tensors
themselves, sent as they are, on a third tag; nothing copies or pickles the activations and gradients.
Rank 0 -> rank r ``begin`` (the snapshot, the head, the rate), ``step``, ``finish``,
``end``, ``stop``; rank r -> rank 0 the step's result. The average's ``all_reduce`` runs on the NCCL group
when the copies live on a GPU.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fedsga_edge.config import RunConfig
from fedsga_edge.wire import RemoteProtocolError

from .influence import change_norms, clip_updates
from .server_side import Activation, PerClientServer, Stepped

__all__ = ["RankFailed", "ShardedServer", "serve_shard", "check_sharding", "deal", "expected_work"]

_TO_RANK = (1, 2, 5)  # rank 0 -> rank r: header length, header, tensors
_TO_ZERO = (3, 4, 6)  # rank r -> rank 0


def deal(work: dict[str, float], world: int) -> dict[str, int]:
    """Each device's rank, by the server work it is expected to bring (``expected_work``): the devices in
    decreasing work, each to the rank with the least so far (ties: the lower rank). Devices of equal work
    are dealt round-robin in the run's order; uneven partitions (Dirichlet) come out even by work, not by
    count, so no rank waits for a busier one at the round's end."""
    load = [0.0] * world
    ranks: dict[str, int] = {}
    for d in sorted(work, key=lambda d: -work[d]):  # stable: equal work keeps the run's order
        r = min(range(world), key=lambda r: load[r])
        ranks[d] = r
        load[r] += work[d]
    return ranks


def expected_work(samples: dict[str, int], cfg: RunConfig) -> dict[str, float]:
    """The samples each device's server steps take in a round: its data, at most ``--max-batches`` batches."""
    cap = cfg.train.max_batches * cfg.train.batch_size
    return {d: float(min(n, cap) if cap else n) for d, n in samples.items()}


def check_sharding(cfg: RunConfig, strategy: type) -> None:
    """A ValueError naming why this run (its config, its strategy's class) cannot shard its server side."""
    from .strategy import Strategy

    if cfg.server_copies != "per_client":
        raise ValueError("only per-client server copies shard across ranks (--server-copies per-client): the "
                         "shared copy takes the devices' steps in arrival order, one after another")
    if cfg.aggregation != "mean":
        raise ValueError(f"--aggregation {cfg.aggregation} combines every copy coordinate by coordinate in one "
                         "process; across ranks the copies are averaged (mean)")
    hooks = [h for h in ("forward", "loss", "after_step", "server_side", "requests")
             if getattr(strategy, h) is not getattr(Strategy, h)]
    if hooks:
        raise ValueError(f"strategy {cfg.strategy!r} has its own server-side {', '.join(hooks)}: its server state "
                         "lives in the coordinator's process, so it runs on one rank")


class RankFailed(RuntimeError):
    """Another rank of the server side stopped answering (it crashed, or its connection broke): the run fails."""


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a message header: it follows the header on the tensor tag."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _pack(obj: Any, tensors: list[Tensor]) -> Any:
    """``obj`` with every tensor (in dicts, lists, tuples) replaced by its ``_Slot``, the tensors appended."""
    if isinstance(obj, Tensor):
        tensors.append(obj.detach().cpu().contiguous())
        return _Slot(len(tensors) - 1, obj.dtype, tuple(obj.shape))
    if isinstance(obj, dict):
        return {k: _pack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pack(v, tensors) for v in obj)
    return obj


def _unpack(obj: Any, tensors: list[Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v, tensors) for v in obj)
    return obj


def _slots(obj: Any) -> list[_Slot]:
    if isinstance(obj, _Slot):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sorted((s for v in items for s in _slots(v)), key=lambda s: s.index)


class _Link:
    """Messages to and from one peer rank, sent without waiting (their buffers kept until ``flush``).
    ``listen``: a thread reads the peer's messages into a queue as they come (gloo completes a posted
    receive only inside ``wait``, so a receive cannot be polled); the peer's ``None`` ends it."""

    def __init__(self, peer: int, send_tags: tuple[int, int, int], recv_tags: tuple[int, int, int], *,
                 listen: bool = False) -> None:
        self.peer, self.send_tags, self.recv_tags = peer, send_tags, recv_tags
        self._sending: list[tuple[Any, Tensor]] = []
        self._inbox: queue.Queue[Any] | None = None
        if listen:
            self._inbox = queue.Queue()
            threading.Thread(target=self._listen, name=f"rank-{peer}-results", daemon=True).start()

    def send(self, obj: Any) -> None:
        """``obj`` (None, or a dict of plain values and tensors) to the peer: its header, then its tensors."""
        tensors: list[Tensor] = []
        header = torch.frombuffer(bytearray(pickle.dumps(_pack(obj, tensors))), dtype=torch.uint8)
        size = torch.tensor([header.numel()], dtype=torch.int64)
        length, head, body = self.send_tags
        parts = [(size, length), (header, head)] + [(t, body) for t in tensors if t.numel()]
        self._sending += [(dist.isend(t, self.peer, tag=tag), t) for t, tag in parts]

    def flush(self) -> None:
        """Wait until the peer has taken every message sent (a gloo send completes only when waited for, so
        their buffers are let go here, at the round's end, when the peer has read them all)."""
        for w, _ in self._sending:
            w.wait()
        self._sending = []

    def recv(self) -> Any:
        """The peer's next message, waiting for it."""
        length, head, body = self.recv_tags
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, self.peer, tag=length)
        header = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.recv(header, self.peer, tag=head)
        skeleton = pickle.loads(header.numpy().tobytes())
        tensors = []
        for slot in _slots(skeleton):
            t = torch.empty(slot.shape, dtype=slot.dtype)
            if t.numel():
                dist.recv(t, self.peer, tag=body)
            tensors.append(t)
        return _unpack(skeleton, tensors)

    def _listen(self) -> None:
        assert self._inbox is not None
        while True:
            try:
                msg = self.recv()
            except Exception as exc:  # the rank died: whoever waits on it hears so
                self._inbox.put(RankFailed(f"server rank {self.peer} is gone: {type(exc).__name__}: {exc}"[:500]))
                return
            self._inbox.put(msg)
            if msg is None:
                return

    def poll(self, timeout: float | None = 0.0) -> Any:
        """A message the listening thread read (``timeout`` seconds to wait for one, None: forever), else None."""
        assert self._inbox is not None
        try:
            msg = self._inbox.get(block=timeout != 0.0, timeout=timeout or None)
        except queue.Empty:
            return None
        if isinstance(msg, RankFailed):
            self._inbox.put(msg)  # every later wait fails the same way
            raise msg
        return msg


def _cpu(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().cpu()


class ShardedServer(PerClientServer):
    """Rank 0's per-client server side, its devices' copies on the ranks ``owners`` gives (``deal``; a device
    not dealt stays on rank 0)."""

    name = "per_client"

    def __init__(self, model: nn.Module, head: nn.Module, cfg: RunConfig, weight: Callable[[str], float], *,
                 owners: dict[str, int], world: int, reduce_group: Any = None) -> None:
        super().__init__(model, head, cfg, weight)
        self.owners, self.world, self.reduce_group = dict(owners), world, reduce_group
        self.links = {r: _Link(r, _TO_RANK, _TO_ZERO, listen=True) for r in range(1, world)}
        self._flight: dict[int, Activation] = {}  # step id -> its held activation
        self._dropped: set[int] = set()  # steps still coming back from a closed round: read and ignored
        self._ready: list[Stepped] = []  # steps back, not yet handed to the coordinator
        self._own: list[Activation] = []  # rank 0's devices' activations, stepped once the others have work
        self._strategy: Any = None
        self._next = 0

    def begin_round(self, snapshot: dict[str, Tensor]) -> None:
        super().begin_round(snapshot)
        self._flight, self._own = {}, []
        # copies: a send reads its buffer until the round's flush, and the weights may move before that
        msg = {"op": "begin", "snapshot": {n: v.detach().cpu().clone() for n, v in snapshot.items()},
               "head": {n: v.detach().cpu().clone() for n, v in self.head.state_dict().items()},
               "lr_scale": self.lr_scale}
        for link in self.links.values():
            link.send(msg)

    def submit(self, act: Activation, strategy: Any) -> list[Stepped]:
        """Another rank's activation goes to it at once, then rank 0 steps its own held ones; its own is held
        until then (or until the scheduler waits, ``wait_held``). So a rank never idles while rank 0 steps:
        stepped at arrival, rank 0's activation would hold back the next one another rank is waiting for.
        The copies are the devices' own, so only each device's order counts, and that is kept."""
        self._strategy = strategy
        r = self.owners.get(act.msg.sender, 0)
        if r == 0:
            self._own.append(act)
            return []
        self._next += 1
        self._flight[self._next] = act
        self.links[r].send({"op": "step", "id": self._next, "device": act.msg.sender, "z": _cpu(act.z),
                            "y": _cpu(act.y), "k": act.k})
        return self._step_own()

    def _step_own(self) -> list[Stepped]:
        own, self._own = self._own, []
        out: list[Stepped] = []
        for act in own:
            try:
                out += super().submit(act, self._strategy)
            except RemoteProtocolError as exc:  # the device's batch is at fault: its refusal, the others go on
                out.append(Stepped(act, refused=f"bad activation: {exc}"))
        return out

    def release(self, waiting: set[str], closed: bool, strategy: Any) -> list[Stepped]:
        """The steps back from the other ranks; with the round closed, those still out are dropped."""
        self._read(block=False)
        out, self._ready = self._ready, []
        if closed:
            out += [Stepped(a, dropped="activation not stepped: the round closed before its step") for a in self._own]
            self._own = []
            for i, act in self._flight.items():
                self._dropped.add(i)
                out.append(Stepped(act, dropped="activation not stepped: the round closed before its step came back"))
            self._flight = {}
        return out

    def wait_held(self) -> bool:
        """Step rank 0's held activations, else wait until a step sent to another rank is back (``release``
        then answers either); False: none is held or out."""
        if self._own:
            self._ready += self._step_own()
            return True
        if not self._flight and not self._ready:
            return False
        while not self._ready:
            self._read(block=True)
        return True

    def _read(self, block: bool) -> None:
        """Every result the other ranks sent so far (``block``: at least one) into ``_ready``."""
        while True:
            got = False
            for link in self.links.values():
                while (msg := link.poll()) is not None:
                    got = True
                    self._result(msg)
            if got or not block:
                return
            if len(self.links) == 1:
                self._result(next(iter(self.links.values())).poll(timeout=None))
                return
            threading.Event().wait(0.0002)

    def _result(self, msg: dict[str, Any]) -> None:
        i = msg["id"]
        if i in self._dropped:
            self._dropped.discard(i)
            return
        act = self._flight.pop(i)
        if msg.get("refused") is not None:
            self._ready.append(Stepped(act, refused=msg["refused"]))
        else:
            self._ready.append(Stepped(act, msg["grad"].to(act.z.device), msg["loss"]))

    def finish_device(self, device: str, depth: int) -> None:
        r = self.owners.get(device, 0)
        if r == 0:
            super().finish_device(device, depth)
        else:
            self.links[r].send({"op": "finish", "device": device, "depth": depth, "weight": self.weight(device)})

    def leave_out(self, devices: set[str]) -> None:
        """Their copies leave the round's average on whichever rank holds them."""
        super().leave_out({d for d in devices if self.owners.get(d, 0) == 0})
        for d in devices:
            if (r := self.owners.get(d, 0)) != 0:
                self.links[r].send({"op": "leave_out", "device": d})

    def end_round(self, snapshot: dict[str, Tensor]) -> None:
        while self._flight or self._dropped:  # every step out must be back before the copies are averaged
            self._read(block=True)
        self._ready, self._own = [], []
        for link in self.links.values():
            link.flush()
            link.send({"op": "end"})
        means = reduce_copies(self, snapshot, self.reduce_group)
        self._done = {"": (1.0, means)}
        super().end_round(snapshot)

    def close(self) -> None:
        """Tell the other ranks to stop serving."""
        for link in self.links.values():
            try:
                link.send({"op": "stop"})
                link.send(None)  # ends the rank's listening thread
                while link.poll(timeout=None) is not None:  # the rank's last word: None
                    pass
                link.flush()
            except RuntimeError:  # that rank is gone already (RankFailed, or gloo's own error)
                continue


def _by_unit(side: PerClientServer, state: dict[str, Tensor]) -> dict[Any, dict[str, Tensor]]:
    units: dict[Any, dict[str, Tensor]] = {}
    for n, v in state.items():
        units.setdefault(side._unit(n), {})[n] = v
    return units


@torch.no_grad()
def reduce_copies(side: PerClientServer, snapshot: dict[str, Tensor], group: Any = None) -> dict[str, Tensor]:
    """Every rank's part of the round's average (all ranks call it together): this rank's finished copies,
    each unit's change bounded against every rank's devices (``clip_updates``), summed by data weight; the
    ranks' sums added by ``all_reduce``. Returns the weighted mean of every entry some device trained."""
    ref = dict(snapshot) | {"head:" + n: v for n, v in side.head.state_dict().items()}
    ref_units = _by_unit(side, ref)
    local = {d: _by_unit(side, st) for d, (_, st) in side._done.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, change_norms(ref_units, local))
    elsewhere: dict[Any, dict[str, float]] = {}
    for norms in gathered:
        for u, by_device in norms.items():
            elsewhere.setdefault(u, {}).update({d: v for d, v in by_device.items() if d not in local})
    clip_updates(ref_units, local, side.cfg.clip_updates, elsewhere)
    names = sorted(ref)
    sizes = [ref[n].numel() for n in names]
    flat = torch.zeros(sum(sizes) + len(names), dtype=torch.float64, device=next(iter(ref.values())).device)
    sums, weights = flat[:sum(sizes)].split(sizes), flat[sum(sizes):]
    for w, trained in side._done.values():  # in the order this rank's devices finished
        for i, n in enumerate(names):
            if n in trained:
                sums[i].add_(w * trained[n].double().flatten())
                weights[i] += w
    dist.all_reduce(flat, group=group)
    return {n: (sums[i] / weights[i]).view_as(ref[n]) for i, n in enumerate(names) if weights[i] > 0}


def serve_shard(server: PerClientServer, strategy: Any, reduce_group: Any = None) -> None:
    """Rank r > 0: train the copies of the devices rank 0 sends steps for, round after round, until ``stop``
    (``reduce_group``: the group of the average's ``all_reduce``, the one rank 0's ``ShardedServer`` has)."""
    link = _Link(0, _TO_ZERO, _TO_RANK, listen=True)  # a receive always posted: the next step's bytes land at once
    weights: dict[str, float] = {}
    server.weight = weights.__getitem__
    snapshot: dict[str, Tensor] = {}
    where = next(server.model.parameters()).device
    while True:
        msg = link.poll(timeout=None)
        op = msg["op"]
        if op == "begin":
            snapshot = {n: v.to(where) for n, v in msg["snapshot"].items()}
            server.model.load_state_dict(snapshot)
            server.head.load_state_dict(msg["head"])
            server.set_lr_scale(msg["lr_scale"])
            server.begin_round(snapshot)
            weights.clear()
        elif op == "step":
            z, y = msg["z"].to(where), msg["y"].to(where)
            try:
                loss, _ = server.step(msg["device"], z, y, msg["k"], strategy)
                link.send({"id": msg["id"], "grad": z.grad.cpu(), "loss": float(loss.detach())})
            except RemoteProtocolError as exc:
                link.send({"id": msg["id"], "refused": f"bad activation: {exc}"})
        elif op == "finish":
            weights[msg["device"]] = msg["weight"]
            server.finish_device(msg["device"], msg["depth"])
        elif op == "leave_out":
            server.leave_out({msg["device"]})
        elif op == "end":
            link.flush()
            reduce_copies(server, snapshot, reduce_group)
            server._copies.clear()
            server._done.clear()
        elif op == "stop":
            link.send(None)
            link.flush()
            while link.poll(timeout=None) is not None:  # rank 0's None: the listening thread is out of gloo
                pass
            return
