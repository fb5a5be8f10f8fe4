"""The device role with the torch backend: local prefix training, observations and its own split.

The role sees messages, never a transport. A ``round_start`` arms the round; each ``step()`` then
computes up to the next request to the coordinator: missing blocks (``fetch`` -> ``weights``), one
per local batch (``activation`` -> ``gradient``), on calibration rounds one ``probe`` after local
training, and finally the ``update`` (-> ``ack``). Everything private (prompts, data, the previous
descriptor and interface mean) stays in this object (docs/method.md).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedsga_edge.config import FedSGAConfig, TrainConfig, from_wire
from fedsga_edge.method.adaptation import descriptor, descriptor_weights, prompt_contributions, weight_entropy
from fedsga_edge.method.estimator import MonotoneEstimator
from fedsga_edge.method.observation import Observation, ShallowHead, alignment, drift, prompt_variation
from fedsga_edge.method.policy import reference_index, split_index
from fedsga_edge.models import SplitModel
from fedsga_edge.tensors import (
    augment_batch,
    from_numpy,
    from_numpy_state,
    image_batch,
    probe_mode,
    to_numpy,
    to_numpy_state,
)
from fedsga_edge.wire import Message, RemoteProtocolError

__all__ = ["ClientData", "TorchClient"]


class Caller(Protocol):
    """What the device needs of its Peer: requests with replies, and one-way notices."""

    def call(self, dst: str, kind: str, round: int, body: dict[str, Any]) -> Message: ...

    def send(self, dst: str, kind: str, round: int, body: dict[str, Any]) -> None: ...


@dataclass
class ClientData:
    """The device's private data: an ImageSet and the indices it owns."""

    images: Any  # fedsga_edge.data.ImageSet
    indices: np.ndarray
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class _PrivateState:
    prompts: Tensor | None = None
    r_prev: float = 0.0  # conservative start: no evidence yet that the shallow split suffices
    m_prev: Tensor | None = None  # descriptor before the last one
    m_last: Tensor | None = None  # descriptor from the last local training
    H_prev: Tensor | None = None  # batch-mean pooled p_1 features at the last observation
    rounds: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class _Refused(Exception):
    """The coordinator refused a request (or answered nonsense): this round cannot go on."""


@dataclass
class _Task:
    t: int
    gen: Generator[tuple[str, dict[str, Any]], Message | None, dict[str, Any]]
    reply: Message | None = None


def _expect(reply: Message | None, kind: str) -> Message:
    if reply is None or reply.kind != kind:
        reason = reply.body.get("reason") if reply is not None and reply.kind == "error" else None
        got = reply.kind if reply is not None else "nothing"
        raise _Refused(f"coordinator answered {got}" + (f": {reason}" if reason else f" where {kind} was expected"))
    return reply


class TorchClient:
    """A device that trains its prefix with torch autograd (simulation, Jetson).

    A round is a generator (``_round``) that yields its requests to the coordinator and is sent
    the replies: ``step()`` advances it by one request, so a scheduler can interleave many devices
    one local batch at a time, and an agent process simply calls ``step()`` until it returns False.
    """

    def __init__(
        self,
        cid: str,
        data: ClientData,
        model_factory: Callable[[], SplitModel],
        peer: Caller,
        *,
        server: str = "coordinator",
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        self.cid = cid
        self.data = data
        self.peer = peer
        self.server = server
        self.device = torch.device(device)
        self._factory = model_factory
        self.model: SplitModel | None = None
        self.state = _PrivateState()
        self.rng = np.random.default_rng([seed, _stable_hash(cid)])
        self.gen = torch.Generator().manual_seed(int(self.rng.integers(2**31)))
        self._task: _Task | None = None
        self.last_error: str | None = None

    # -- message entry point --------------------------------------------------------------------
    def handle(self, msg: Message) -> Message | None:
        """A round start arms this round's task; a coordinator that sends nonsense gets an error reply."""
        if msg.kind != "round_start":
            raise RemoteProtocolError(f"client {self.cid} does not accept {msg.kind!r}")
        _check_round_start(msg.body)
        self._task = _Task(msg.round, self._round(msg.round, msg.body))
        self.last_error = None
        return None

    @property
    def busy(self) -> bool:
        return self._task is not None

    def step(self) -> bool:
        """Compute up to the next request, send it and keep the reply; False once the round is done.

        A round the coordinator refuses (an error reply) ends here: the device tells the
        coordinator it gives up (so the round need not wait for its deadline) and keeps its state.
        """
        task = self._task
        if task is None:
            return False
        try:
            kind, body = task.gen.send(task.reply)
        except StopIteration as done:
            self._task = None
            reply = self.peer.call(self.server, "update", task.t, done.value)
            if reply.kind == "error":
                self.last_error = f"update refused: {reply.body.get('reason')}"
            return False
        except _Refused as exc:
            self._give_up(task, str(exc))
            return False
        task.reply = self.peer.call(self.server, kind, task.t, body)
        return True

    def abort(self) -> None:
        """Drop the running round (its deadline passed); the device keeps its private state."""
        if self._task is not None:
            self._task.gen.close()
            self._task = None

    def _give_up(self, task: "_Task", reason: str) -> None:
        self._task = None
        self.last_error = reason
        self.peer.send(self.server, "error", task.t, {"reason": reason})

    # -- one round --------------------------------------------------------------------------------
    def _round(self, t: int, body: dict[str, Any]) -> Generator[tuple[str, dict[str, Any]], Message | None, dict[str, Any]]:
        model = self._model()
        train = from_wire(TrainConfig, body["train"])
        fed = from_wire(FedSGAConfig, body["fedsga"]) if body.get("fedsga") else None
        self._load(model, body["weights"])
        have = {_block_index(n) for n in body["weights"]}
        use_prompts = fed is not None and fed.adapt and fed.prompts > 0
        if use_prompts and self.state.prompts is None:
            self.state.prompts = model.init_prompts(fed.prompts, self.gen).to(self.device)
        prompts = self.state.prompts if use_prompts else None

        report: dict[str, Any] = {}
        full = bool(body.get("full"))
        calibrate = bool(body.get("calibrate"))
        K = model.num_splits
        k_ref = reference_index(K)
        if full:
            k = 0
        elif body.get("split") is not None:
            k = int(body["split"])
        else:  # FedSGA: observe, estimate r, pick the split (docs/method.md)
            assert fed is not None  # _check_round_start guarantees it
            k, report = self._choose_split(model, body, fed, prompts)
            if calibrate:  # the probe compares the device's own trained blocks up to p_ref
                k = max(k, k_ref)
        depth = model.num_blocks if full else model.depth_of(k)
        need = [j for j in range(depth) if j not in have]
        if need or full:
            reply = yield "fetch", {"blocks": need, "head": full}
            _expect(reply, "weights")
            self._load(model, reply.body["weights"])

        loss_sum, steps, contrib = 0.0, 0, None
        gen = self._train(model, train, depth, k, full, prompts, fedsga_h1=fed is not None)
        reply = None
        while True:
            try:
                request = gen.send(reply)
            except StopIteration as done:
                loss_sum, steps, contrib = done.value
                break
            reply = yield request
            _expect(reply, "gradient")
        if prompts is not None and fed is not None and contrib is not None:
            alpha = descriptor_weights(contrib / max(steps, 1), fed.tau_m)
            self.state.m_prev = self.state.m_last
            self.state.m_last = descriptor(prompts.detach(), contrib / max(steps, 1), fed.tau_m)
            report["descriptor_entropy"] = weight_entropy(alpha)
        if calibrate and "r" in report:  # after local training, before aggregation (docs/method.md)
            probe = self._probe(model, body, prompts, report["o"], report["r_prev"])
            reply = yield "probe", probe
            _expect(reply, "probe_result")
            report.update(L1=float(reply.body["L1"]), Lref=float(reply.body["Lref"]), s=int(reply.body["s"]),
                          probe_samples=len(probe["y"]))
        report.pop("o", None)
        self.state.rounds += 1
        keys = [n for n in model.state_dict() if _block_index(n) < depth or (full and n.startswith("head."))]
        sd = model.state_dict()
        report.update(
            weights=to_numpy_state({n: sd[n] for n in keys}),
            num_samples=len(self.data),
            split=None if full else k,
            depth=depth,
            train_loss=loss_sum / max(steps, 1),
            steps=steps,
        )
        return report

    # -- pieces -----------------------------------------------------------------------------------
    def _model(self) -> SplitModel:
        if self.model is None:
            self.model = self._factory().to(self.device)
        return self.model

    def _load(self, model: SplitModel, weights: dict[str, np.ndarray]) -> None:
        if weights:
            model.load_state_dict(from_numpy_state(weights, self.device), strict=False)

    def _batches(self, batch_size: int, max_batches: int) -> list[np.ndarray]:
        order = self.data.indices[self.rng.permutation(len(self.data.indices))]
        out = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        if len(out) > 1 and len(out[-1]) < 2:  # BatchNorm cannot train on a batch of one
            out[-2] = np.concatenate([out[-2], out.pop()])
        return out[:max_batches] if max_batches else out

    def _inputs(self, idx: np.ndarray, augment: bool) -> tuple[Tensor, Tensor]:
        x = image_batch(self.data.images.get_batch(idx), self.data.mean, self.data.std, self.device)
        if augment:
            x = augment_batch(x, self.gen)
        y = torch.from_numpy(np.asarray(self.data.images.labels[idx], dtype=np.int64)).to(self.device)
        return x, y

    def _train(
        self,
        model: SplitModel,
        cfg: TrainConfig,
        depth: int,
        k: int,
        full: bool,
        prompts: Tensor | None,
        fedsga_h1: bool = False,
    ) -> Generator[tuple[str, dict[str, Any]], Message | None, tuple[float, int, Tensor | None]]:
        """Local epochs; each split-training batch yields one ``activation`` request."""
        model.train()
        params = [p for j in range(depth) for p in model.blocks[j].parameters()]
        if full:
            params += list(model.head.parameters())
        anchor = [p.detach().clone() for p in params] if cfg.mu > 0 else None
        if prompts is not None:
            prompts.requires_grad_(True)
        opt = torch.optim.SGD(
            params + ([prompts] if prompts is not None else []),
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
        )
        contrib = torch.zeros(prompts.shape[0], device=self.device) if prompts is not None else None
        d1 = model.depth_of(1)
        loss_sum, steps = 0.0, 0
        try:
            for _ in range(cfg.local_epochs):
                for idx in self._batches(cfg.batch_size, cfg.max_batches):
                    x, y = self._inputs(idx, cfg.augment)
                    opt.zero_grad(set_to_none=True)
                    if fedsga_h1 and not full:  # phi_s trains on pooled p_1 features (docs/method.md)
                        h1 = model.prefix(x, d1, prompts)
                        z = model.run_blocks(h1, d1, depth)
                    else:
                        z = model.prefix(x, depth, prompts)
                    if full:
                        loss = F.cross_entropy(model.head(model.pool(z)), y)
                        loss.backward()
                        loss_value = float(loss.detach())
                    else:
                        body: dict[str, Any] = {"z": to_numpy(z), "y": to_numpy(y), "split": k}
                        if fedsga_h1:
                            body["h1"] = to_numpy(model.interface_pool(h1.detach()))
                        reply = yield "activation", body
                        assert reply is not None
                        dz = from_numpy(reply.body["dz"], self.device)
                        if dz.shape != z.shape or not bool(torch.isfinite(dz).all()):
                            raise _Refused(f"gradient of shape {tuple(dz.shape)} for an activation {tuple(z.shape)}, or not finite")
                        z.backward(dz)
                        loss_value = float(reply.body["loss"])
                    if anchor is not None:  # FedProx: grad of mu/2 ||w - w_global||^2
                        for p, a in zip(params, anchor):
                            if p.grad is not None:
                                p.grad.add_(p.detach() - a, alpha=cfg.mu)
                    if contrib is not None and prompts is not None and prompts.grad is not None:
                        contrib += prompt_contributions(prompts.grad, prompts.detach())
                    opt.step()
                    loss_sum += loss_value
                    steps += 1
        finally:
            if prompts is not None:
                prompts.requires_grad_(False)
                prompts.grad = None
        return loss_sum, steps, contrib

    @torch.no_grad()
    def _choose_split(
        self, model: SplitModel, body: dict[str, Any], fed: FedSGAConfig, prompts: Tensor | None
    ) -> tuple[int, dict[str, Any]]:
        """Observation at round start (the round's global blocks, eval mode) -> r -> split (Eq. 8)."""
        K = model.num_splits
        d1 = model.depth_of(1)
        idx = self._batches(body["train"]["batch_size"], 1)[0]
        x, y = self._inputs(idx, augment=False)
        model.eval()
        h1 = model.prefix(x, d1, prompts)
        hbar = model.interface_pool(h1)
        phi_s = ShallowHead(hbar.shape[1], int(body["proto_dim"]))
        phi_s.load_state_dict(from_numpy_state(body["phi_s"]))
        protos = from_numpy(body["prototypes"], "cpu")
        H = hbar.mean(dim=0).cpu()
        obs = Observation(
            a=alignment(phi_s(hbar.cpu()), protos, y.cpu()),
            delta=drift(H, self.state.H_prev),
            q=prompt_variation(self.state.m_last, self.state.m_prev) if self.state.m_last is not None else 0.0,
        )
        self.state.H_prev = H
        o = obs.as_tensor(adapt=fed.adapt)
        gamma = MonotoneEstimator(num_obs=len(o))
        gamma.load_state_dict(from_numpy_state(body["estimator"]))
        r_prev = self.state.r_prev
        r = float(gamma(o.unsqueeze(0), torch.tensor([r_prev])))
        k = split_index(r, K, fed.rho)
        self.state.r_prev = r
        report = {"a": obs.a, "delta": obs.delta, "q": obs.q, "r_prev": r_prev, "r": r, "k_policy": k, "o": o.tolist()}
        return k, report

    def _probe(
        self, model: SplitModel, body: dict[str, Any], prompts: Tensor | None, o: list[float], r_prev: float
    ) -> dict[str, Any]:
        """One batch through the device's own (locally trained) blocks to p_1 and on to p_ref."""
        K = model.num_splits
        d1, dref = model.depth_of(1), model.depth_of(reference_index(K))
        idx = self._batches(body["train"]["batch_size"], 1)[0]
        x, y = self._inputs(idx, augment=False)
        with probe_mode(model):
            h1 = model.prefix(x, d1, prompts)
            href = model.run_blocks(h1, d1, dref)
        return {"z1": to_numpy(h1), "zref": to_numpy(href), "y": to_numpy(y), "o": o, "r_prev": r_prev}


def _check_round_start(body: dict[str, Any]) -> None:
    """Reject a malformed round start before any local state changes."""
    try:
        from_wire(TrainConfig, body["train"])
        if body.get("fedsga"):
            from_wire(FedSGAConfig, body["fedsga"])
        if not isinstance(body["weights"], dict):
            raise TypeError("weights must be a map of arrays")
        split = body.get("split")
        if split is not None and not isinstance(split, int):
            raise TypeError("split must be an integer")
        if split is None and not body.get("full") and not body.get("fedsga"):
            raise ValueError("round_start names no split and carries no FedSGA settings to choose one")
        if split is None and body.get("fedsga") and not body.get("full"):
            for key in ("estimator", "phi_s", "prototypes", "proto_dim"):
                body[key]
    except (KeyError, TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"malformed round_start: {type(exc).__name__}: {exc}") from None


def _block_index(name: str) -> int:
    """``blocks.3.layer...`` -> 3; anything outside the blocks (the head) sorts after them."""
    if name.startswith("blocks."):
        return int(name.split(".", 2)[1])
    return 1 << 30


def _stable_hash(text: str) -> int:
    h = 2166136261
    for ch in text.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h
