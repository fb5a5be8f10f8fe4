"""``simulate --engine ray``: the device roles compute on Ray actors; everything else stays here.

Flower's simulation engine, fitted to this project's round: a pool of actors sized to the cluster's
CPUs (one device worker per actor, ``cpus_per_actor`` each), and each virtual device's private state
kept in the driver and shipped with its round start (``Snapshot`` of device/statefile.py plus its
method state), so an actor that is replaced loses nothing. The coordinator, its scheduler and the
virtual clock stay in the driver process: a device here is a ``RayDevice`` proxy with the in-process
role's ``handle``/``step``/``abort``/``busy``/``waiting``, so ``InProcessScheduler`` and the round
driver run unchanged and the requests reach the coordinator in the same order, over the same loopback
Peer (the wire bytes are counted the same). The same seed gives the same metrics and weights as the
in-process engine.

A device step is split at its request: the actor runs the device's round generator up to its next
request and returns it; the driver sends it and ships the reply back with the next step. A device's
next computation needs only its own reply, so it is started on its actor as soon as the reply is in
(``RayDevice.step`` returns at once): the other devices' turns overlap it, and the actors compute in
parallel while the schedule stays the in-process one. A step that is overtaken by the round's end
is undone on the actor (the snapshot taken before it), as if it had never run.

Device ``i`` lives on actor ``i % actors`` for the run (its model stays built there); a cluster is
joined with ``--ray-address`` (docs/scale.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsga_edge.config import RunConfig
from fedsga_edge.runbuild import COORDINATOR, build_client, plan_run
from fedsga_edge.transport import PendingMessage, Peer
from fedsga_edge.wire import Message

__all__ = ["RayEngine", "RayDevice", "DeviceWorker", "EngineError"]


class EngineError(RuntimeError):
    """The ray engine cannot start (ray missing, no cluster at the address): the message says what to do."""


class _AwaitReply(BaseException):
    """Unwinds a device step that needs its reply now (the update's ack) from inside the actor: the driver
    sends the request and settles the reply with ``DeviceWorker.settle``. Not an ``Exception``, so no
    device handler takes it for a failure."""


class _Relayed(PendingMessage):
    """A request's reply as the device on the actor sees it: it comes with the device's next step."""

    __slots__ = ("reply",)

    def __init__(self) -> None:
        self.reply: Message | None = None

    @property
    def ready(self) -> bool:
        return self.reply is not None

    def result(self, timeout: float | None = None) -> Message:
        if self.reply is None:
            raise _AwaitReply
        return self.reply


class _RelayPeer:
    """The device's Peer on the actor: it notes the request instead of sending it."""

    def __init__(self) -> None:
        self.out: tuple[str, str, int, dict[str, Any] | None] | None = None
        self.pending: _Relayed | None = None

    def call(self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None, **_: Any) -> _Relayed:
        self.out, self.pending = ("call", kind, round, body), _Relayed()
        return self.pending

    def send(self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None) -> None:
        self.out = ("send", kind, round, body)


@dataclass
class Outcome:
    """What one step on the actor returns: its request (how, kind, round, body), whether the round goes
    on, the device's last error, and its private state once its round is over."""

    request: tuple[str, str, int, dict[str, Any] | None] | None
    more: bool
    last_error: str | None
    state: Any = None
    settle: bool = False  # the request is the update: its reply goes to ``settle``


class DeviceWorker:
    """One actor's devices, built by ``setup`` from the run's plan; stateless between rounds but for caches.

    The actor is created before the run's plan exists (while the driver loads and partitions the data and
    builds its model), so its process start and its imports overlap the driver's own setup."""

    def __init__(self, threads: int) -> None:
        import torch

        import fedsga_edge.device.role  # noqa: F401 - the device code's imports, paid here, not in round 1
        import fedsga_edge.device.statefile  # noqa: F401

        torch.set_num_threads(max(1, threads))
        self.plan: Any = None
        self.backend, self.artifacts = "torch", None
        self.clients: dict[int, Any] = {}
        self.before: dict[int, Any] = {}  # each running device's snapshot before its last step

    def setup(self, cfg: RunConfig, bundle: Any, backend: str, artifacts: str | None, devices: list[int]) -> None:
        """The run's plan, and the roles of the devices this actor holds (each built once, for the run)."""
        self.plan = plan_run(cfg, bundle)
        self.backend, self.artifacts = backend, artifacts
        for i in devices:
            self._client(i)

    def _client(self, i: int) -> Any:
        client = self.clients.get(i)
        if client is None:
            client = self.clients[i] = build_client(self.plan, i, _RelayPeer(), backend=self.backend,
                                                    artifacts=self.artifacts)
        return client

    def start(self, i: int, state: Any, msg: Message) -> None:
        """Device ``i``'s round start, on the private state the driver kept for it (None: a fresh device)."""
        client = self._client(i)
        if state is not None:
            _restore(client, state)
        client.handle(msg)

    def step(self, i: int, reply: Message | None) -> Outcome:
        """Hand the device its last request's reply and run it up to its next request."""
        from fedsga_edge.device.statefile import Snapshot

        client, relay = self.clients[i], self.clients[i].peer
        if relay.pending is not None and reply is not None:
            relay.pending.reply = reply
        self.before[i] = Snapshot.take(client)
        relay.out = None
        try:
            more = client.step()
        except _AwaitReply:
            return Outcome(relay.out, False, None, settle=True)
        return Outcome(relay.out, more, client.last_error, None if more else _state(client))

    def settle(self, i: int, t: int, reply: Message) -> Outcome:
        """The update's reply: the round is over for the device."""
        from fedsga_edge.device.role import settle_update

        client = self.clients[i]
        settle_update(client, t, reply)
        return Outcome(None, False, client.last_error, _state(client))

    def abort(self, i: int, undo: bool) -> Any:
        """Drop the device's round; ``undo``: its last step ran ahead of the schedule, put its state back."""
        client = self.clients[i]
        client.abort()
        if undo and i in self.before:
            self.before[i].restore(client)
        return _state(client)


def _state(client: Any) -> tuple[Any, dict[str, Any], int]:
    """What the driver keeps of a device between rounds."""
    from fedsga_edge.device.statefile import Snapshot

    return Snapshot.take(client), client.method_state, client.confirmed_round


def _restore(client: Any, state: tuple[Any, dict[str, Any], int]) -> None:
    snap, client.method_state, client.confirmed_round = state
    snap.restore(client)


class RayDevice:
    """Device ``index`` in the driver: its Peer and private state here, its compute on ``actor``."""

    def __init__(self, cid: str, index: int, peer: Peer, actor: Any, ray: Any, server: str = COORDINATOR) -> None:
        self.cid, self.index, self.peer, self.actor, self.server = cid, index, peer, actor, server
        self._ray = ray
        self.state: Any = None  # shipped with every round start
        self.last_error: str | None = None
        self._busy = False
        self._reply: Message | PendingMessage | None = None
        self._ahead: Any = None  # the next step, started on the actor as soon as its reply was in

    def handle(self, msg: Message) -> None:
        """A round start: the actor arms the device's round (a bad one raises the role's own error)."""
        self._ray.get(self.actor.start.remote(self.index, self.state, msg))
        self._busy, self._reply, self._ahead, self.last_error = True, None, None, None

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def waiting(self) -> bool:
        r = self._reply
        return self._ahead is None and isinstance(r, PendingMessage) and not r.ready

    def step(self) -> bool:
        """The device's next request, sent; its reply starts the step after (False once the round is done)."""
        if not self._busy:
            return False
        future, self._ahead = self._ahead or self._launch(), None
        out: Outcome = self._ray.get(future)
        self._reply = None
        if out.request is not None:
            how, kind, t, body = out.request
            if how == "send":
                self.peer.send(self.server, kind, t, body)
            elif out.settle:
                reply = self.peer.call(self.server, kind, t, body)
                out = self._ray.get(self.actor.settle.remote(self.index, t, _now(reply)))
            else:
                self._reply = self.peer.call(self.server, kind, t, body)
        self._busy, self.last_error = out.more, out.last_error
        if not out.more:
            self.state = out.state
        elif not (isinstance(self._reply, PendingMessage) and not self._reply.ready):
            self._ahead = self._launch()  # its reply is in: compute the next request while others take turns
        return out.more

    def _launch(self) -> Any:
        return self.actor.step.remote(self.index, _now(self._reply) if self._reply is not None else None)

    def abort(self) -> None:
        """The round closed on the device: a step started ahead is undone, its state comes back."""
        if not self._busy:
            return
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            try:
                self._ray.get(ahead)
            except Exception:  # noqa: BLE001 - the step is undone either way
                pass
        self.state = self._ray.get(self.actor.abort.remote(self.index, ahead is not None))
        self._busy = False


def _now(reply: Message | PendingMessage) -> Message:
    return reply.result() if isinstance(reply, PendingMessage) else reply


class RayEngine:
    """The actor pool for one run. Constructing it starts the cluster and the actors on a thread of their own,
    so that they come up while the driver loads the data, partitions it and builds its model; ``client``
    (simulation.DeviceEngine) waits for them on the first device and hands the actors the run's plan.

    The thread lives until ``close``: a local Ray's processes are bound to the thread that started them
    (they end when it ends), so it also ends them."""

    def __init__(self, *, address: str | None = None, actors: int = 0, cpus_per_actor: float = 1.0,
                 threads: int | None = None) -> None:
        """``address``: a running cluster (``ray start --head``; None starts a local Ray on this machine's
        CPUs); ``actors``: the pool size (0: the cluster's CPUs over ``cpus_per_actor``); ``threads``: each
        actor's torch threads (default: this process's, which the bit-identical results need: torch's
        float sums depend on the thread count, in one process as across them)."""
        import threading
        import time

        if actors < 0 or cpus_per_actor <= 0:
            raise ValueError("--ray-actors must be >= 0 and the CPUs per actor > 0")
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        self.address, self.actors, self.cpus_per_actor, self.threads = address, actors, cpus_per_actor, threads
        self.pool: list[Any] = []
        self.init_s = 0.0  # starting (or joining) Ray and its actors, on the starting thread
        self.setup_s = 0.0  # from the start to the actors holding their devices
        self.waited_s = 0.0  # of those, the seconds the driver waited for them
        self.ready = False  # the actors hold the run's devices
        self._ray: Any = None
        self._failure: BaseException | None = None
        self._up, self._closing = threading.Event(), threading.Event()
        self._t0 = time.perf_counter()
        self._holder = threading.Thread(target=self._hold, name="ray-engine", daemon=True)
        self._holder.start()

    def _hold(self) -> None:
        """The starting thread: Ray and the actors up, then held until ``close``, then ended."""
        import time

        started = False
        try:
            ray = _import_ray()
            if not ray.is_initialized():
                try:
                    if self.address:
                        ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
                    else:
                        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a run's own Ray reports nothing
                        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
                except (ConnectionError, RuntimeError, ValueError) as exc:
                    raise EngineError(f"cannot reach the Ray cluster at {self.address!r}: {exc}") from None
                started = True
            cpus = float(ray.cluster_resources().get("CPU", 1.0))
            n = self.actors or max(1, int(cpus // self.cpus_per_actor))
            worker = ray.remote(num_cpus=self.cpus_per_actor)(DeviceWorker)
            self.pool = [worker.remote(self.threads) for _ in range(n)]
            fit = max(1, min(n, int(cpus // self.cpus_per_actor)))  # an actor holds its CPUs: the others wait
            ray.wait([a.__ray_ready__.remote() for a in self.pool], num_returns=fit)
            self._ray = ray
        except BaseException as exc:  # noqa: BLE001 - raised on the driver's thread by ``client``
            self._failure = exc
        self.init_s = time.perf_counter() - self._t0
        self._up.set()
        self._closing.wait()
        if "ray" in locals():
            for a in self.pool:
                ray.kill(a)
            if started:
                ray.shutdown()
        self.pool = []

    def client(self, plan: Any, i: int, peer: Peer, *, backend: str = "torch",
               artifacts: str | Path | None = None) -> RayDevice:
        if not self.ready:
            self._setup(plan, backend, artifacts)
        return RayDevice(plan.client_ids[i], i, peer, self.pool[i % len(self.pool)], self._ray)

    def _setup(self, plan: Any, backend: str, artifacts: str | Path | None) -> None:
        """The actors up (waiting for the starting thread), given the plan; each builds its devices' roles."""
        import time

        started = time.perf_counter()
        self._up.wait()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        ray, devices = self._ray, len(plan.client_ids)
        for a in self.pool[devices:]:  # fewer devices than actors
            ray.kill(a)
        del self.pool[devices:]
        bundle = ray.put(plan.bundle)
        art = str(artifacts) if artifacts else None
        n = len(self.pool)
        ray.get([a.setup.remote(plan.cfg, bundle, backend, art, list(range(j, devices, n)))
                 for j, a in enumerate(self.pool)])
        now = time.perf_counter()
        self.waited_s, self.setup_s, self.ready = now - started, now - self._t0, True

    def close(self) -> None:
        """End the actors (and the local Ray this engine started), once the start is over."""
        self._up.wait()
        self._closing.set()
        self._holder.join()
        self._ray = None


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise EngineError("--engine ray needs Ray: pip install 'fedsga-edge[scale]'") from None
    return ray
