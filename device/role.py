"""The device role, whatever computes it: the round as a stepped generator over a compute backend.

The role sees messages, never a transport. A ``round_start`` arms the round; each ``step()`` then
computes up to the next request to the coordinator: missing blocks (``fetch`` -> ``weights``), one
per local batch (``activation`` -> ``gradient``), on calibration rounds one ``probe`` after local
training, and finally the ``update`` (-> ``ack``). Everything private (prompts, data, the previous
descriptor and interface mean, r) stays in this object (docs/method.md).

The method's device side (observation, Gamma, the split policy, the prompt descriptor) is numpy
(``fedsga_edge.method``), so it runs the same on every device; only the prefix's arithmetic comes
from a :class:`Backend`: torch autograd (``device.client.TorchBackend``, simulation and Jetson) or
onnxruntime with the exported train graphs (``device.onnx_backend.OnnxBackend``, a Pi without
torch). This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from fedsga_edge.batches import cut_batches
from fedsga_edge.config import FedSGAConfig, TrainConfig, from_wire
from fedsga_edge.method.adaptation import descriptor, descriptor_weights, prompt_contributions, weight_entropy
from fedsga_edge.method.heads import HeadError, estimate, shallow_head
from fedsga_edge.method.observation import Observation, alignment, drift, prompt_variation
from fedsga_edge.method.policy import deadline_split, reference_index, split_index
from fedsga_edge.transport import PendingMessage
from fedsga_edge.wire import Message, RemoteProtocolError

from .evaluate import held_out_evaluation
from .methods import check_method, device_method

__all__ = ["Backend", "BackendError", "Caller", "ClientData", "PrivateState", "SplitClient", "check_round_start", "settle_update"]


class Caller(Protocol):
    """What the device needs of its Peer: requests with replies, and one-way notices.

    A reply the coordinator answers later (MergeSFL's merged step) may come back as a ``PendingMessage``
    on a transport that cannot wait for it (loopback): the device then keeps it, ``waiting`` says so,
    and the next ``step`` takes the reply once it is there (waiting for it if need be)."""

    def call(self, dst: str, kind: str, round: int, body: dict[str, Any]) -> Message | PendingMessage: ...

    def send(self, dst: str, kind: str, round: int, body: dict[str, Any]) -> None: ...


class BackendError(RuntimeError):
    """The backend cannot do what the round asks (e.g. a FedAvg round on the ONNX backend)."""


class Backend(Protocol):
    """The prefix's arithmetic. Arrays in and out are numpy; the backend keeps the block weights.

    One training step is ``forward`` (returns z and, when asked, the pooled p_1 features h1),
    then, once the server's dz is back, ``backward`` (one SGD step of the prefix and the prompts;
    returns the prompts' gradient and their value before the step, for Eq. 2).
    """

    name: str
    num_splits: int
    num_blocks: int

    def depth_of(self, k: int) -> int: ...

    def unit_of(self, name: str) -> int:
        """The model's aggregation unit of a weight (``SplitModel.unit_of``); ValueError if unknown."""
        ...

    def weight_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape ``load`` needs for a weight (None: the backend does not keep it); ValueError if unknown.

        The role checks every weight the coordinator sends against it before ``load`` allocates anything."""
        ...

    def init_prompts(self, m: int) -> np.ndarray: ...

    def inputs(self, images: np.ndarray, augment: bool) -> Any: ...

    def load(self, weights: dict[str, np.ndarray]) -> None: ...

    def observe(self, x: Any, prompts: np.ndarray | None) -> np.ndarray: ...

    def train_begin(self, cfg: TrainConfig, depth: int, full: bool, prompts: np.ndarray | None,
                    prompt_lr: float | None = None) -> None:
        """Start local training; the prompts (if any) step at ``prompt_lr`` (None: ``cfg.lr``)."""
        ...

    def forward(self, x: Any, want_h1: bool) -> tuple[np.ndarray, np.ndarray | None]: ...

    def backward(self, dz: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None: ...

    def full_step(self, x: Any, y: np.ndarray) -> float: ...

    def train_end(self) -> np.ndarray | None: ...

    def probe(self, x: Any, prompts: np.ndarray | None, d1: int, dref: int) -> tuple[np.ndarray, np.ndarray]: ...

    def weights(self, depth: int, full: bool) -> dict[str, np.ndarray]: ...

    def capabilities(self) -> dict[str, Any]: ...

    def rng_state(self) -> Any: ...

    def set_rng_state(self, state: Any) -> None: ...


@dataclass
class ClientData:
    """The device's private data: an ImageSet and the indices it owns (``indices``: the ones it trains on)."""

    images: Any  # fedsga_edge.data.ImageSet
    indices: np.ndarray
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    # held out for federated evaluation, never trained on (device/evaluate.py); None: no slice
    eval_indices: np.ndarray | None = None
    # held out for the calibration probe, never trained on (docs/method.md, "Calibration"); None: no slice
    probe_indices: np.ndarray | None = None

    def __len__(self) -> int:
        """The samples the device trains on plus its probe slice (the evaluation slice is apart): what
        ``hello`` and the update declare, and what aggregation weighs by."""
        return len(self.indices) + (0 if self.probe_indices is None else len(self.probe_indices))

    def hold_out_probe(self, fraction: float, seq: np.random.SeedSequence) -> None:
        """Move ``fraction`` of ``indices`` (at least 2, drawn by ``seq``) to ``probe_indices``, once.

        Deterministic given ``seq``; a device with fewer than 4 samples keeps them all for training."""
        n = len(self.indices)
        if self.probe_indices is not None or fraction <= 0 or n < 4:
            return
        take = min(max(2, int(round(fraction * n))), n - 2)
        chosen = np.zeros(n, dtype=bool)
        chosen[np.random.default_rng(seq).choice(n, size=take, replace=False)] = True
        self.probe_indices = self.indices[chosen]
        self.indices = self.indices[~chosen]


@dataclass
class PrivateState:
    """What a device keeps between rounds and never sends (numpy, so any backend can persist it)."""

    prompts: np.ndarray | None = None
    r_prev: float = 0.0  # conservative start: no evidence yet that the shallow split suffices
    m_prev: np.ndarray | None = None  # descriptor before the last one
    m_last: np.ndarray | None = None  # descriptor from the last local training
    H_prev: np.ndarray | None = None  # batch-mean pooled p_1 features at the last observation
    # extra["q"]: the prompts' weighted movement in the last local training (Eq. 5 as docs/method.md states it)
    rounds: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class _Refused(Exception):
    """The coordinator refused a request (or answered nonsense): this round cannot go on."""


_R = TypeVar("_R")
# A part of the round: yields (kind, body) requests, is sent each reply, returns its result.
_Steps = Generator[tuple[str, dict[str, Any]], Message | None, _R]


@dataclass
class _Task:
    t: int
    gen: _Steps[dict[str, Any]]
    reply: Message | PendingMessage | None = None


@dataclass
class _Plan:
    """What the round start settled before the first request; ``prompts`` and ``report`` change as it runs."""

    train: TrainConfig
    fed: FedSGAConfig | None
    full: bool  # a full-model round (FedAvg, FedProx): no split, the device trains head and all
    calibrate: bool
    prompts: np.ndarray | None
    k: int  # the split (0 in a full-model round)
    depth: int
    have: set[int]  # the units the round start carried
    report: dict[str, Any]  # what the update reports beside the weights


@dataclass
class _Trained:
    """What local training leaves for the descriptor and the update."""

    contrib: np.ndarray | None  # summed per-prompt contributions (Eq. 2), None without prompts
    loss_sum: float = 0.0
    steps: int = 0
    new_prompts: np.ndarray | None = None


def _now(reply: Message | PendingMessage) -> Message:
    """The reply itself: a pending one waited for."""
    return reply.result() if isinstance(reply, PendingMessage) else reply


def _expect(reply: Message | None, kind: str) -> Message:
    if reply is None or reply.kind != kind:
        reason = reply.body.get("reason") if reply is not None and reply.kind == "error" else None
        got = reply.kind if reply is not None else "nothing"
        raise _Refused(f"coordinator answered {got}" + (f": {reason}" if reason else f" where {kind} was expected"))
    return reply


class SplitClient:
    """A device: its data, private state and backend, driven one request at a time.

    A round is a generator (``_round``) that yields its requests to the coordinator and is sent
    the replies: ``step()`` advances it by one request, so a scheduler can interleave many devices
    one local batch at a time, and an agent process simply calls ``step()`` until it returns False.
    """

    def __init__(
        self,
        cid: str,
        data: ClientData,
        backend: Backend,
        peer: Caller,
        *,
        rng: np.random.Generator,
        server: str = "coordinator",
    ) -> None:
        self.cid = cid
        self.data = data
        self.backend = backend
        self.peer = peer
        self.server = server
        self.rng = rng
        # The probe slice's own seed: a child of the device generator's seed (the seed and the device id),
        # so holding it out draws nothing from the batch order's stream.
        ss = getattr(rng.bit_generator, "seed_seq", None)
        if ss is None:
            ss = np.random.SeedSequence(stable_hash(cid))
        self._probe_seq = np.random.SeedSequence(ss.entropy, spawn_key=(*ss.spawn_key, _PROBE_SPAWN_KEY))
        self.state = PrivateState()
        self.method_state: dict[str, Any] = {}  # a method's private state between rounds (device/methods.py)
        self._task: _Task | None = None
        self.last_error: str | None = None
        # The newest round the coordinator answered a request of (not with an error): proof that the
        # round exists, unlike a one-way round_start that anyone on an open broker can publish.
        self.confirmed_round = 0

    # -- message entry point --------------------------------------------------------------------
    def handle(self, msg: Message) -> Message | None:
        """A round start arms this round's task; a coordinator that sends nonsense gets an error reply."""
        if msg.kind != "round_start":
            raise RemoteProtocolError(f"client {self.cid} does not accept {msg.kind!r}")
        check_round_start(msg.body)
        self._task = _Task(msg.round, self._round(msg.round, msg.body))
        self.last_error = None
        return None

    @property
    def busy(self) -> bool:
        return self._task is not None

    @property
    def waiting(self) -> bool:
        """Its last request's reply is still held by the coordinator (a merged step): ``step`` would wait."""
        task = self._task
        return task is not None and isinstance(task.reply, PendingMessage) and not task.reply.ready

    def step(self) -> bool:
        """Compute up to the next request, send it and keep the reply; False once the round is done.

        A round the coordinator refuses (an error reply), or one this backend cannot run, ends
        here: the device tells the coordinator it gives up (so the round need not wait for its
        deadline) and keeps its state.
        """
        task = self._task
        if task is None:
            return False
        if isinstance(task.reply, PendingMessage):  # a reply the coordinator held: here, or waited for now
            task.reply = task.reply.result()
            if task.reply.kind != "error":
                self._confirm(task.t)
        try:
            kind, body = task.gen.send(task.reply)
        except StopIteration as done:
            self._task = None
            settle_update(self, task.t, _now(self.peer.call(self.server, "update", task.t, done.value)))
            return False
        except (_Refused, BackendError, HeadError) as exc:
            self._give_up(task, str(exc))
            return False
        task.reply = self.peer.call(self.server, kind, task.t, body)
        if isinstance(task.reply, Message) and task.reply.kind != "error":
            self._confirm(task.t)
        return True

    def _confirm(self, t: int) -> None:
        self.confirmed_round = max(self.confirmed_round, t)

    def abort(self) -> None:
        """Drop the running round (its deadline passed); the device keeps its private state."""
        if self._task is not None:
            self._task.gen.close()
            self._task = None

    def _give_up(self, task: _Task, reason: str) -> None:
        self._task = None
        self.last_error = reason
        self.peer.send(self.server, "error", task.t, {"reason": reason})

    # -- one round --------------------------------------------------------------------------------
    def _round(self, t: int, body: dict[str, Any]) -> _Steps[dict[str, Any]]:
        """The round's requests in order (fetch, activation per batch, probe); returns the update."""
        plan = self._plan(body)
        yield from self._fetch(plan)
        method = device_method(body.get("method"))  # a method's device side (device/methods.py), or None
        if method is not None:
            method.before_train(self, plan)
        if body.get("evaluate"):  # the model this round starts from, on the held-out slice (device/evaluate.py)
            plan.report.update((yield from held_out_evaluation(self, plan, _expect)))
            if method is not None:  # a method's own figures (FedBABU: after fine-tuning a copy of the head)
                plan.report.update(method.evaluate(self, plan, t))
        trained = yield from self._train(plan)
        self._learn_prompts(plan, trained)
        yield from self._calibrate(body, plan)
        update = self._update(plan, trained)
        if method is not None:
            update["method"] = method.report(self, plan)
        return update

    def _plan(self, body: dict[str, Any]) -> _Plan:
        """Settings, the round's weights loaded, prompts, split and depth: everything before the first request."""
        be = self.backend
        train = from_wire(TrainConfig, body["train"])
        fed = from_wire(FedSGAConfig, body["fedsga"]) if body.get("fedsga") else None
        full = bool(body.get("full"))
        if full and be.name != "torch":
            raise BackendError(f"the {be.name} backend trains a prefix only; a full-model round (FedAvg, FedProx) "
                               "needs --backend torch")
        have = _check_weights(be, body["weights"])
        be.load(body["weights"])
        if fed is not None and fed.estimator and not full:  # the strategy calibrates: probe on unseen data
            self.data.hold_out_probe(fed.probe_holdout, self._probe_seq)
        use_prompts = fed is not None and fed.adapt and fed.prompts > 0
        if use_prompts and self.state.prompts is None:
            self.state.prompts = be.init_prompts(fed.prompts)
        prompts = self.state.prompts if use_prompts else None
        calibrate = bool(body.get("calibrate"))
        k, report = self._split(body, fed, full, calibrate, prompts)
        if calibrate and k < reference_index(be.num_splits):  # the deadline kept it shallower than p_ref: no probe
            calibrate = False
        depth = be.num_blocks if full else be.depth_of(k)
        return _Plan(train, fed, full, calibrate, prompts, k, depth, have, report)

    def _split(self, body: dict[str, Any], fed: FedSGAConfig | None, full: bool, calibrate: bool,
               prompts: np.ndarray | None) -> tuple[int, dict[str, Any]]:
        """None for a full-model round (0), the coordinator's if it names one, else FedSGA's choice."""
        K = self.backend.num_splits
        if full:
            return 0, {}
        if body.get("split") is not None:
            k = int(body["split"])
            if not 1 <= k <= K:
                raise _Refused(f"split {k} is not a candidate (1..{K})")
            return k, {}
        assert fed is not None  # check_round_start guarantees it
        k, report = self._choose_split(body, fed, prompts)  # observe, estimate r, pick (docs/method.md)
        floor = reference_index(K) if calibrate else 1
        k = max(k, floor)  # a calibration round's probe compares the device's own trained blocks up to p_ref
        deadline = body.get("deadline")
        if deadline is not None:  # --deadline-aware (docs/fleet.md): never a split predicted to miss the deadline
            if len(deadline["split_s"]) != K:
                raise _Refused(f"the deadline's predictions cover {len(deadline['split_s'])} splits, not {K}")
            k = deadline_split(k, list(deadline["split_s"]), deadline["s"], floor)
        return k, report

    def _fetch(self, plan: _Plan) -> _Steps[None]:
        """Asks for the blocks (and, in a full-model round, the head) the round start did not carry."""
        need = [j for j in range(plan.depth) if j not in plan.have]
        if need or plan.full:
            reply = _expect((yield "fetch", {"blocks": need, "head": plan.full}), "weights")
            _check_weights(self.backend, reply.body["weights"])
            self.backend.load(reply.body["weights"])

    def _train(self, plan: _Plan) -> _Steps[_Trained]:
        """Local epochs: full-model steps on the device, or one activation -> gradient exchange per batch."""
        be = self.backend
        done = _Trained(np.zeros(len(plan.prompts)) if plan.prompts is not None else None)
        want_h1 = plan.fed is not None and not plan.full  # phi_s trains on pooled p_1 features (docs/method.md)
        # the prompts' own rate (docs/method.md, "Adaptation channel")
        be.train_begin(plan.train, plan.depth, plan.full, plan.prompts,
                       prompt_lr=plan.fed.prompt_lr if plan.fed is not None and plan.prompts is not None else None)
        try:
            for _ in range(plan.train.local_epochs):
                for idx in self._batches(plan.train):
                    x, y = self._inputs(idx, plan.train.augment)
                    if plan.full:
                        done.loss_sum += be.full_step(x, y)
                    else:
                        done.loss_sum += yield from self._exchange(plan.k, x, y, want_h1, done.contrib)
                    done.steps += 1
        finally:
            done.new_prompts = be.train_end()
        return done

    def _exchange(self, k: int, x: Any, y: np.ndarray, want_h1: bool, contrib: np.ndarray | None) -> _Steps[float]:
        """One batch through the split: z (and h1) up, dz down, one backward step; returns the server's loss."""
        be = self.backend
        z, h1 = be.forward(x, want_h1)
        req: dict[str, Any] = {"z": z, "y": y, "split": k}
        if h1 is not None:
            req["h1"] = h1
        reply = _expect((yield "activation", req), "gradient")
        dz = np.asarray(reply.body["dz"])
        if dz.shape != z.shape or not np.isfinite(dz).all():
            raise _Refused(f"gradient of shape {tuple(dz.shape)} for an activation {tuple(z.shape)}, or not finite")
        pg = be.backward(dz)
        if contrib is not None and pg is not None:
            contrib += prompt_contributions(*pg)
        return float(reply.body["loss"])

    def _learn_prompts(self, plan: _Plan, trained: _Trained) -> None:
        """Keeps the trained prompts, their descriptor (Eq. 2) and how far they moved (q, Eq. 5) for the
        next round's observation.

        q = ||sum_k alpha_k (e_k after - e_k before)|| with this round's weights alpha on both sides
        (docs/method.md, "Observation"): it follows the prompts' movement, not which token alpha favours.
        """
        before, fed = plan.prompts, plan.fed
        prompts = before
        if before is not None and trained.new_prompts is not None:
            self.state.prompts = plan.prompts = prompts = trained.new_prompts
        if prompts is not None and fed is not None and trained.contrib is not None:
            mean_c = trained.contrib / max(trained.steps, 1)
            alpha = descriptor_weights(mean_c, fed.tau_m)
            self.state.m_prev = self.state.m_last
            self.state.m_last = descriptor(prompts, mean_c, fed.tau_m)
            self.state.extra["q"] = prompt_variation(prompts, before, alpha)
            plan.report["descriptor_entropy"] = weight_entropy(alpha)

    def _calibrate(self, body: dict[str, Any], plan: _Plan) -> _Steps[None]:
        """On a calibration round: the probe, after local training and before aggregation (docs/method.md)."""
        report = plan.report
        if plan.calibrate and "r" in report:
            probe = self._probe(body, plan.prompts, report["o"], report["r_prev"])
            reply = _expect((yield "probe", probe), "probe_result")
            report.update(L1=float(reply.body["L1"]), Lref=float(reply.body["Lref"]), s=int(reply.body["s"]),
                          probe_samples=len(probe["y"]))

    def _update(self, plan: _Plan, trained: _Trained) -> dict[str, Any]:
        """The update's body: the report (the observation vector stays private) and the trained weights."""
        report = plan.report
        report.pop("o", None)
        self.state.rounds += 1
        report.update(
            weights=self.backend.weights(plan.depth, plan.full),
            num_samples=len(self.data),
            split=None if plan.full else plan.k,
            depth=plan.depth,
            train_loss=trained.loss_sum / max(trained.steps, 1),
            steps=trained.steps,
        )
        return report

    # -- pieces -----------------------------------------------------------------------------------
    def _probe_batch(self, batch_size: int) -> np.ndarray:
        """Up to one batch of the probe slice (a batch of the training data when there is no slice)."""
        held = self.data.probe_indices
        if held is None:
            return self._one_batch(batch_size)
        return held[self.rng.permutation(len(held))][:batch_size]

    def _one_batch(self, batch_size: int) -> np.ndarray:
        """The first ``batch_size`` samples of a fresh permutation of the training data (observation, probe)."""
        return self.data.indices[self.rng.permutation(len(self.data.indices))][:batch_size]

    def _batches(self, train: TrainConfig) -> list[np.ndarray]:
        """One epoch's batches: a fresh permutation cut as ``train.batching`` says (fedsga_edge/batches.py)."""
        out = cut_batches(self.data.indices[self.rng.permutation(len(self.data.indices))], train.batch_size,
                          train.batching)
        return out[:train.max_batches] if train.max_batches else out

    def _inputs(self, idx: np.ndarray, augment: bool) -> tuple[Any, np.ndarray]:
        x = self.backend.inputs(self.data.images.get_batch(idx), augment)
        return x, np.asarray(self.data.images.labels[idx], dtype=np.int64)

    def _choose_split(self, body: dict[str, Any], fed: FedSGAConfig, prompts: np.ndarray | None) -> tuple[int, dict[str, Any]]:
        """Observation at round start (the round's global blocks, eval mode) -> r -> split (Eq. 8)."""
        K = self.backend.num_splits
        idx = self._one_batch(body["train"]["batch_size"])
        x, y = self._inputs(idx, augment=False)
        hbar = self.backend.observe(x, prompts)  # (B, C) pooled p_1 features
        H = hbar.mean(axis=0)
        obs = Observation(
            a=alignment(shallow_head(body["phi_s"], hbar), body["prototypes"], y),
            delta=drift(H, self.state.H_prev),
            q=float(self.state.extra.get("q", 0.0)),  # 0 before the prompts have trained once
        )
        self.state.H_prev = H
        o = obs.values(adapt=fed.adapt)
        if "margin" in body:  # --label-memory: the margin the server kept from this device's last probe
            o.append(float(body["margin"]))
        r_prev = self.state.r_prev
        r = estimate(body["estimator"], o, r_prev)
        k = split_index(r, K, fed.rho)
        self.state.r_prev = r
        report = {"a": obs.a, "delta": obs.delta, "q": obs.q, "r_prev": r_prev, "r": r, "k_policy": k, "o": o,
                  "obs_samples": len(y)}  # the observation forward is client compute too (docs/method.md, "Costs")
        if "margin" in body:
            report["margin"] = o[-1]
        return k, report

    def _probe(self, body: dict[str, Any], prompts: np.ndarray | None, o: list[float], r_prev: float) -> dict[str, Any]:
        """One batch through the device's own (locally trained) blocks to p_1 and on to p_ref, from the
        held-out probe slice when there is one (docs/method.md, "Calibration")."""
        be = self.backend
        d1, dref = be.depth_of(1), be.depth_of(reference_index(be.num_splits))
        idx = self._probe_batch(body["train"]["batch_size"])
        x, y = self._inputs(idx, augment=False)
        z1, zref = be.probe(x, prompts, d1, dref)
        return {"z1": z1, "zref": zref, "y": y, "o": o, "r_prev": r_prev}


def settle_update(client: SplitClient, t: int, reply: Message) -> None:
    """What the update's reply means to ``client``: only an ack completes the round (and lets the agent save it)."""
    if reply.kind == "error":
        client.last_error = f"update refused: {reply.body.get('reason')}"
    elif reply.kind != "ack":
        client.last_error = f"update refused: the coordinator answered {reply.kind!r:.40}, not 'ack'"
    else:
        client._confirm(t)


def check_round_start(body: dict[str, Any]) -> None:
    """Reject a malformed round start before any local state changes."""
    try:
        from_wire(TrainConfig, body["train"])
        if body.get("fedsga"):
            from_wire(FedSGAConfig, body["fedsga"])
        if body.get("method") is not None:
            check_method(body["method"])
        if not isinstance(body["weights"], dict):
            raise TypeError("weights must be a map of arrays")
        split = body.get("split")
        if split is not None and (not isinstance(split, int) or isinstance(split, bool)):
            raise TypeError("split must be an integer")
        if split is None and not body.get("full") and not body.get("fedsga"):
            raise ValueError("round_start names no split and carries no FedSGA settings to choose one")
        if split is None and body.get("fedsga") and not body.get("full"):
            for key in ("estimator", "phi_s", "prototypes", "proto_dim"):
                body[key]
        margin = body.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                   or not math.isfinite(margin) or abs(margin) > 1e6):
            raise ValueError(f"margin must be a finite number, not {margin!r:.40}")
        deadline = body.get("deadline")
        if deadline is not None:  # the deadline-aware policy's predictions: checked before anything trains
            if not isinstance(deadline, dict) or not isinstance(deadline.get("split_s"), (list, tuple)):
                raise TypeError("deadline must be a map with a split_s list")
            deadline_split(1, list(deadline["split_s"]), deadline.get("s"))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise RemoteProtocolError(f"malformed round_start: {type(exc).__name__}: {exc}") from None


def _check_weights(be: Backend, weights: Any) -> set[int]:
    """The units the coordinator sent, each weight checked against the device's model before ``load``
    allocates a copy: a name the model does not have or a shape that differs means another model (or a
    coordinator declaring sizes the device would have to allocate): refuse the round."""
    if not isinstance(weights, dict):
        raise _Refused(f"weights must be a map of arrays, not {type(weights).__name__}")
    units = set()
    for name, value in weights.items():
        try:
            units.add(be.unit_of(name))
            want = be.weight_shape(name)
        except ValueError as exc:
            raise _Refused(f"the coordinator sent weights of another model: {exc}") from None
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiub":
            raise _Refused(f"weight {name!r:.100} is not a numeric array")
        if want is not None and tuple(value.shape) != tuple(want):
            raise _Refused(f"weight {name!r:.100} has shape {tuple(value.shape)!s:.100}; this device's model "
                           f"has {tuple(want)}: weights of another model")
    return units


_PROBE_SPAWN_KEY = 0x9B0BE  # the probe slice's branch of a device's seed sequence


def stable_hash(text: str) -> int:
    """FNV-1a: the same per-device seed on every machine and Python (unlike ``hash``)."""
    h = 2166136261
    for ch in text.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h


def device_rng(seed: int, cid: str) -> tuple[np.random.Generator, int]:
    """The device's own generator (batch order) and the seed of its backend's (augmentation, prompts).

    Both backends draw the backend seed the same way, so for one seed they see the same batches.
    """
    rng = np.random.default_rng([seed, stable_hash(cid)])
    return rng, int(rng.integers(2**31))
