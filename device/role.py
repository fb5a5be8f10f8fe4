"""The device role, whatever computes it: the round as a stepped generator over a compute backend.

The role sees messages, never a transport. A ``round_start`` arms the round; each ``step()`` then
computes up to the next request to the coordinator: missing blocks (``fetch`` -> ``weights``), one
per local batch (``activation`` -> ``gradient``), on calibration rounds one ``probe`` after local
training, and finally the ``update`` (-> ``ack``). Everything private (prompts, data, the previous
descriptor and interface mean, r) stays in this object (docs/method.md).

What differs between methods is a method's device side (device/methods.py; FedSGA's observation,
Gamma, split policy, prompt descriptor and probe: device/fedsga.py), called at fixed points of the
round. The prefix's arithmetic comes from a :class:`Backend`: torch autograd
(``device.client.TorchBackend``, simulation and Jetson) or onnxruntime with the exported train graphs
(``device.onnx_backend.OnnxBackend``, a Pi without torch). This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fedsga_edge.batches import cut_batches
from fedsga_edge.config import WIRE_CODECS, TrainConfig, from_wire
from fedsga_edge.method.adaptation import prompt_contributions
from fedsga_edge.method.heads import HeadError
from fedsga_edge.transport import PendingMessage
from fedsga_edge.wire import Message, RemoteProtocolError

from . import fedsga as _fedsga  # noqa: F401  (registers FedSGA's device side)
from .backend import Backend, BackendError, Refused, Steps, expect
from .evaluate import held_out_evaluation
from .methods import DeviceMethod, check_method, device_method
from .seeds import PROBE_SPAWN_KEY, device_rng, stable_hash

__all__ = ["Backend", "BackendError", "Caller", "ClientData", "PrivateState", "SplitClient", "check_round_start",
           "device_rng", "settle_update", "stable_hash"]


class Caller(Protocol):
    """What the device needs of its Peer: requests with replies, and one-way notices.

    A reply the coordinator answers later (MergeSFL's merged step) may come back as a ``PendingMessage``
    on a transport that cannot wait for it (loopback): the device then keeps it, ``waiting`` says so,
    and the next ``step`` takes the reply once it is there (waiting for it if need be). ``tensor_format``
    (given only when the round start names the device's wire format) is the codec its tensors travel in."""

    def call(self, dst: str, kind: str, round: int, body: dict[str, Any],
             **kw: Any) -> Message | PendingMessage: ...

    def send(self, dst: str, kind: str, round: int, body: dict[str, Any]) -> None: ...


@dataclass
class ClientData:
    """The device's private data: an ImageSet and the indices it owns (``indices``: the ones it trains on)."""

    images: Any  # fedsga_edge.data.ImageSet
    indices: np.ndarray
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    # held out for federated evaluation, never trained on (device/evaluate.py); None: no slice
    eval_indices: np.ndarray | None = None
    # held out for the calibration probe on a calibration round, not trained on in that round (docs/method.md,
    # "Calibration"); None: no slice
    probe_indices: np.ndarray | None = None
    _training: np.ndarray | None = field(default=None, repr=False)  # ``indices`` as they were before the slice

    def __len__(self) -> int:
        """The samples the device trains on plus its probe slice (the evaluation slice is apart): what
        ``hello`` and the update declare, and what aggregation weighs by."""
        return len(self.indices) + (0 if self.probe_indices is None else len(self.probe_indices))

    def hold_out_probe(self, fraction: float, seq: np.random.SeedSequence) -> None:
        """Move ``fraction`` of ``indices`` (at least 2, drawn by ``seq``) to ``probe_indices`` until
        ``release_probe``; a second call before it moves nothing.

        Deterministic given ``seq``; a device with fewer than 4 samples keeps them all for training."""
        n = len(self.indices)
        if self.probe_indices is not None or fraction <= 0 or n < 4:
            return
        take = min(max(2, int(round(fraction * n))), n - 2)
        chosen = np.zeros(n, dtype=bool)
        chosen[np.random.default_rng(seq).choice(n, size=take, replace=False)] = True
        self._training = self.indices
        self.probe_indices = self.indices[chosen]
        self.indices = self.indices[~chosen]

    def release_probe(self) -> None:
        """The probe slice back into training, ``indices`` exactly as before it was held out."""
        if self.probe_indices is not None:
            self.indices, self.probe_indices, self._training = self._training, None, None


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


@dataclass
class _Task:
    t: int
    gen: Steps[dict[str, Any]]
    reply: Message | PendingMessage | None = None
    # the round start's own wire format for this round's requests, as the Peer's keyword (none: the run's)
    wire: dict[str, str] = field(default_factory=dict)


@dataclass
class _Plan:
    """What the round start settled before the first request; ``prompts`` and ``report`` change as it runs.

    The method's device side (``DeviceMethod.prepare``) sets ``k`` when the coordinator named no split, and
    what the round trains with beyond the training settings (prompts, h1, the prompts' rate, calibration)."""

    train: TrainConfig
    full: bool  # a full-model round (FedAvg, FedProx): no split, the device trains head and all
    k: int | None  # the split (0 in a full-model round; None until the method picks it)
    have: set[int]  # the units the round start carried
    report: dict[str, Any] = field(default_factory=dict)  # what the update reports beside the weights
    depth: int = 0
    prompts: np.ndarray | None = None
    want_h1: bool = False  # send the pooled p_1 features with each activation (FedSGA's phi_s)
    prompt_lr: float | None = None  # the prompts' own rate (None: the training rate)
    calibrate: bool = False  # probe after training (FedSGA's calibration rounds)


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
        self._probe_seq = np.random.SeedSequence(ss.entropy, spawn_key=(*ss.spawn_key, PROBE_SPAWN_KEY))
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
        fmt = msg.body.get("wire_format")
        wire = {"tensor_format": WIRE_CODECS[fmt]} if fmt is not None else {}
        self._task = _Task(msg.round, self._round(msg.round, msg.body), wire=wire)
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
        except (Refused, BackendError, HeadError) as exc:
            self._give_up(task, str(exc))
            return False
        task.reply = self.peer.call(self.server, kind, task.t, body, **task.wire)
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
    def _round(self, t: int, body: dict[str, Any]) -> Steps[dict[str, Any]]:
        """The round's requests in order (fetch, evaluation, activation per batch, the method's); returns the update
        (the evaluation's figures alone when the round start says ``evaluate_only``: the run's final evaluation)."""
        method = device_method(body)  # a method's device side (device/methods.py), or None
        plan = self._plan(body, method)
        yield from self._fetch(plan)
        if method is not None:
            method.before_train(self, plan)
        if body.get("evaluate"):  # the model this round starts from, on the held-out slice (device/evaluate.py)
            plan.report.update((yield from held_out_evaluation(self, plan, expect)))
            if method is not None:  # a method's own figures (FedBABU: after fine-tuning a copy of the head)
                plan.report.update(method.evaluate(self, plan, t))
        if body.get("evaluate_only"):  # the final evaluation after the last round: the figures, no training
            return {**plan.report, "weights": {}, "num_samples": len(self.data)}
        trained = yield from self._train(plan)
        if method is not None:
            method.after_train(self, plan, trained)
            yield from method.requests(self, plan)
        update = self._update(plan, trained)
        if method is not None:
            fields = method.report(self, plan)
            if fields is not None:
                update["method"] = fields
        return update

    def _plan(self, body: dict[str, Any], method: DeviceMethod | None) -> _Plan:
        """Settings, the round's weights loaded, split and depth (the method's choice where the coordinator
        named none): everything before the first request."""
        be = self.backend
        train = from_wire(TrainConfig, body["train"])
        full = bool(body.get("full"))
        if full and be.name != "torch":
            raise BackendError(f"the {be.name} backend trains a prefix only; a full-model round (FedAvg, FedProx) "
                               "needs --backend torch")
        have = _check_weights(be, body["weights"])
        be.load(body["weights"])
        plan = _Plan(train, full, self._named_split(body, full), have)
        if method is not None:
            method.prepare(self, plan)
        if plan.k is None:
            raise Refused("the round start names no split and its method picks none")
        plan.depth = be.num_blocks if full else be.depth_of(plan.k)
        return plan

    def _named_split(self, body: dict[str, Any], full: bool) -> int | None:
        """0 for a full-model round, the coordinator's split if it names one, else None (the method picks)."""
        if full:
            return 0
        if body.get("split") is None:
            return None
        K = self.backend.num_splits
        k = int(body["split"])
        if not 1 <= k <= K:
            raise Refused(f"split {k} is not a candidate (1..{K})")
        return k

    def _fetch(self, plan: _Plan) -> Steps[None]:
        """Asks for the blocks (and, in a full-model round, the head) the round start did not carry."""
        need = [j for j in range(plan.depth) if j not in plan.have]
        if need or plan.full:
            reply = expect((yield "fetch", {"blocks": need, "head": plan.full}), "weights")
            _check_weights(self.backend, reply.body["weights"])
            self.backend.load(reply.body["weights"])

    def _train(self, plan: _Plan) -> Steps[_Trained]:
        """Local epochs: full-model steps on the device, or one activation -> gradient exchange per batch."""
        be = self.backend
        done = _Trained(np.zeros(len(plan.prompts)) if plan.prompts is not None else None)
        be.train_begin(plan.train, plan.depth, plan.full, plan.prompts, prompt_lr=plan.prompt_lr)
        try:
            for _ in range(plan.train.local_epochs):
                for idx in self._batches(plan.train):
                    x, y = self._inputs(idx, plan.train.augment)
                    if plan.full:
                        done.loss_sum += be.full_step(x, y)
                    else:
                        done.loss_sum += yield from self._exchange(plan.k, x, y, plan.want_h1, done.contrib)
                    done.steps += 1
        finally:
            done.new_prompts = be.train_end()
        return done

    def _exchange(self, k: int, x: Any, y: np.ndarray, want_h1: bool, contrib: np.ndarray | None) -> Steps[float]:
        """One batch through the split: z (and h1) up, dz down, one backward step; returns the server's loss."""
        be = self.backend
        z, h1 = be.forward(x, want_h1)
        req: dict[str, Any] = {"z": z, "y": y, "split": k}
        if h1 is not None:
            req["h1"] = h1
        reply = expect((yield "activation", req), "gradient")
        dz = np.asarray(reply.body["dz"])
        if dz.shape != z.shape or not np.isfinite(dz).all():
            raise Refused(f"gradient of shape {tuple(dz.shape)} for an activation {tuple(z.shape)}, or not finite")
        pg = be.backward(dz)
        if contrib is not None and pg is not None:
            contrib += prompt_contributions(*pg)
        return float(reply.body["loss"])

    def _update(self, plan: _Plan, trained: _Trained) -> dict[str, Any]:
        """The update's body: the report (the observation vector stays private) and the trained weights."""
        report = plan.report
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
        method = check_method(body)  # the device side it arms (device/methods.py), its settings checked
        if not isinstance(body["weights"], dict):
            raise TypeError("weights must be a map of arrays")
        if not isinstance(body.get("evaluate_only", False), bool):
            raise TypeError("evaluate_only must be true or false")
        split = body.get("split")
        if split is not None and (not isinstance(split, int) or isinstance(split, bool)):
            raise TypeError("split must be an integer")
        fmt = body.get("wire_format")
        if fmt is not None and (not isinstance(fmt, str) or fmt not in WIRE_CODECS):
            raise ValueError(f"wire_format {fmt!r:.40} is none of {', '.join(WIRE_CODECS)}")
        if split is None and not body.get("full") and not (method is not None and method.chooses_split):
            raise ValueError("round_start names no split and carries no FedSGA settings to choose one")
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise RemoteProtocolError(f"malformed round_start: {type(exc).__name__}: {exc}") from None


def _check_weights(be: Backend, weights: Any) -> set[int]:
    """The units the coordinator sent, each weight checked against the device's model before ``load``
    allocates a copy: a name the model does not have or a shape that differs means another model (or a
    coordinator declaring sizes the device would have to allocate): refuse the round."""
    if not isinstance(weights, dict):
        raise Refused(f"weights must be a map of arrays, not {type(weights).__name__}")
    units = set()
    for name, value in weights.items():
        try:
            units.add(be.unit_of(name))
            want = be.weight_shape(name)
        except ValueError as exc:
            raise Refused(f"the coordinator sent weights of another model: {exc}") from None
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiub":
            raise Refused(f"weight {name!r:.100} is not a numeric array")
        if want is not None and tuple(value.shape) != tuple(want):
            raise Refused(f"weight {name!r:.100} has shape {tuple(value.shape)!s:.100}; this device's model "
                           f"has {tuple(want)}: weights of another model")
    return units
