"""The device role with the torch backend: local prefix training, observations and its own split.

The role sees messages, never a transport: it answers ``round_start`` with ``update`` and, while
handling it, asks the coordinator for gradients (``activation`` -> ``gradient``), for missing
blocks (``fetch`` -> ``weights``) and, on calibration rounds, for probe losses. Everything private
(prompts, data, the previous descriptor and interface mean) stays in this object.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedsga_edge.config import FedSGAConfig, TrainConfig, from_wire
from fedsga_edge.method.adaptation import descriptor, prompt_contributions
from fedsga_edge.method.estimator import MonotoneEstimator
from fedsga_edge.method.observation import Observation, ShallowHead, alignment, drift, prompt_variation
from fedsga_edge.method.policy import split_index
from fedsga_edge.models import SplitModel
from fedsga_edge.tensors import augment_batch, from_numpy, from_numpy_state, image_batch, to_numpy, to_numpy_state
from fedsga_edge.wire import Message, RemoteProtocolError

__all__ = ["ClientData", "TorchClient"]


class Caller(Protocol):
    def call(self, dst: str, kind: str, round: int, body: dict[str, Any]) -> Message: ...


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


class TorchClient:
    """A device that trains its prefix with torch autograd (simulation, Jetson)."""

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
        self._have: dict[int, set[int]] = {}  # round -> blocks already received this round
        self.rng = np.random.default_rng([seed, _stable_hash(cid)])
        self.gen = torch.Generator().manual_seed(int(self.rng.integers(2**31)))

    # -- message entry point --------------------------------------------------------------------
    def handle(self, msg: Message) -> Message | None:
        """A coordinator that sends nonsense gets an error reply (via Peer); our own bugs still raise."""
        if msg.kind != "round_start":
            raise RemoteProtocolError(f"client {self.cid} does not accept {msg.kind!r}")
        _check_round_start(msg.body)
        body = self.run_round(msg.round, msg.body)
        return Message("update", msg.run, msg.round, 0, self.cid, body)

    # -- one round --------------------------------------------------------------------------------
    def run_round(self, t: int, body: dict[str, Any]) -> dict[str, Any]:
        model = self._model()
        self._have = {}
        train = from_wire(TrainConfig, body["train"])
        fed = from_wire(FedSGAConfig, body["fedsga"]) if body.get("fedsga") else None
        self._load(model, body["weights"])
        use_prompts = fed is not None and fed.adapt and fed.prompts > 0
        if use_prompts and self.state.prompts is None:
            self.state.prompts = model.init_prompts(fed.prompts, self.gen).to(self.device)
        prompts = self.state.prompts if use_prompts else None

        report: dict[str, Any] = {}
        full = bool(body.get("full"))
        if full:
            k = 0
        elif body.get("split") is not None:
            k = int(body["split"])
        else:  # FedSGA: observe, maybe calibrate, estimate r, pick the split (DESIGN §1.2-1.5)
            assert fed is not None  # _check_round_start guarantees it
            k, report = self._choose_split(t, model, body, fed, prompts)
        depth = model.num_blocks if full else model.depth_of(k)
        self._fetch_missing(t, model, body, depth, full)

        loss_sum, steps, contrib = self._train(t, model, train, depth, k, full, prompts, fedsga_h1=fed is not None)
        if prompts is not None and fed is not None and contrib is not None:
            self.state.m_prev = self.state.m_last
            self.state.m_last = descriptor(prompts.detach(), contrib / max(steps, 1), fed.tau_m)
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

    def _fetch_missing(self, t: int, model: SplitModel, body: dict[str, Any], depth: int, full: bool) -> None:
        """Download this round's blocks that neither the round start nor an earlier fetch brought."""
        have = self._have.setdefault(t, {_block_index(n) for n in body["weights"]})
        need = [j for j in range(depth) if j not in have]
        if need or (full and (1 << 30) not in have):
            reply = self._call(t, "fetch", {"blocks": need, "head": full})
            self._load(model, reply.body["weights"])
            have.update(_block_index(n) for n in reply.body["weights"])

    def _call(self, t: int, kind: str, body: dict[str, Any]) -> Message:
        reply = self.peer.call(self.server, kind, t, body)
        if reply.kind == "error":
            raise RuntimeError(f"coordinator refused {kind}: {reply.body.get('reason')}")
        return reply

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
        t: int,
        model: SplitModel,
        cfg: TrainConfig,
        depth: int,
        k: int,
        full: bool,
        prompts: Tensor | None,
        fedsga_h1: bool = False,
    ) -> tuple[float, int, Tensor | None]:
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
        for _ in range(cfg.local_epochs):
            for idx in self._batches(cfg.batch_size, cfg.max_batches):
                x, y = self._inputs(idx, cfg.augment)
                opt.zero_grad(set_to_none=True)
                if fedsga_h1 and not full:  # phi_s trains on pooled p_1 features (README: "phi_s")
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
                    reply = self._call(t, "activation", body)
                    z.backward(from_numpy(reply.body["dz"], self.device))
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
        if prompts is not None:
            prompts.requires_grad_(False)
            prompts.grad = None
        return loss_sum, steps, contrib

    @torch.no_grad()
    def _choose_split(
        self, t: int, model: SplitModel, body: dict[str, Any], fed: FedSGAConfig, prompts: Tensor | None
    ) -> tuple[int, dict[str, Any]]:
        K = model.num_splits
        d1 = model.depth_of(1)
        k_ref = math.ceil(K / 2)
        calibrate = bool(body.get("calibrate"))
        idx = self._batches(body["train"]["batch_size"], 1)[0]
        x, y = self._inputs(idx, augment=False)
        model.eval()
        if calibrate:  # one forward to p_ref yields both interfaces (Alg. 1)
            self._fetch_missing(t, model, body, model.depth_of(k_ref), False)
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
        report: dict[str, Any] = {"a": obs.a, "delta": obs.delta, "q": obs.q, "r_prev": self.state.r_prev}
        estimator_state = body["estimator"]
        if calibrate:
            href = model.run_blocks(h1, d1, model.depth_of(k_ref))
            probe = {"z1": to_numpy(h1), "zref": to_numpy(href), "y": to_numpy(y), "o": o.tolist(), "r_prev": self.state.r_prev}
            res = self._call(t, "probe", probe).body
            report.update(L1=res["L1"], Lref=res["Lref"], s=res["s"], probe_samples=len(idx))
            estimator_state = res["estimator"]
        gamma = MonotoneEstimator(num_obs=len(o))
        gamma.load_state_dict(from_numpy_state(estimator_state))
        r = float(gamma(o.unsqueeze(0), torch.tensor([self.state.r_prev])))
        k = split_index(r, K, fed.rho)
        self.state.r_prev = r
        report.update(r=r)
        return k, report


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
