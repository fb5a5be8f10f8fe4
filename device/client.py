"""The torch backend of the device role: autograd on the prefix (simulation, Jetson, any torch device).

``TorchClient`` is the role (``device.role.SplitClient``) with this backend; its round logic, the
observation, Gamma and the split policy are shared with the torch-free ONNX backend.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedsga_edge.config import TrainConfig
from fedsga_edge.models import SplitModel
from fedsga_edge.tensors import augment_batch, from_numpy_state, image_batch, probe_mode, to_numpy, to_numpy_state

from .role import Caller, ClientData, SplitClient
from .seeds import device_rng

__all__ = ["ClientData", "TorchBackend", "TorchClient"]


@contextmanager
def _batch_statistics(model: torch.nn.Module) -> Iterator[None]:
    """Forward passes on batch statistics (BatchNorm as in training) that leave no trace in the running
    statistics: ``probe_mode`` with gradients allowed. Eval-mode BatchNorm lags far behind weights trained
    this round in early rounds (tensors.probe_mode says by how much), which would swamp a Fisher estimate."""
    was = model.training
    saved = {k: v.clone() for k, v in model.named_buffers()}
    model.train()
    try:
        yield
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(saved[k])
        model.train(was)


class TorchBackend:
    """The prefix in torch: a whole ``SplitModel`` (blocks beyond the split stay unused)."""

    name = "torch"

    def __init__(self, model_factory: Callable[[], SplitModel], data: ClientData, gen: torch.Generator,
                 device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._factory = model_factory
        self._model: SplitModel | None = None
        self.data = data
        self.gen = gen
        self._opt: torch.optim.Optimizer | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None  # the model's weight shapes, for weight_shape

    @property
    def model(self) -> SplitModel:
        """Built on first use, as before: a simulation's devices do not draw from the global torch RNG early."""
        if self._model is None:
            self._model = self._factory().to(self.device)
        return self._model

    @property
    def num_splits(self) -> int:
        return self.model.num_splits

    @property
    def num_blocks(self) -> int:
        return self.model.num_blocks

    def depth_of(self, k: int) -> int:
        return self.model.depth_of(k)

    def unit_of(self, name: str) -> int:
        return self.model.unit_of(name)

    def weight_shape(self, name: str) -> tuple[int, ...] | None:
        self.model.unit_of(name)  # ValueError for a weight of another model
        if self._shapes is None:
            self._shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        return self._shapes.get(name)

    def init_prompts(self, m: int) -> np.ndarray:
        return self.model.init_prompts(m, self.gen).numpy()

    def inputs(self, images: np.ndarray, augment: bool) -> Tensor:
        x = image_batch(images, self.data.mean, self.data.std, self.device)
        return augment_batch(x, self.gen) if augment else x

    def load(self, weights: dict[str, np.ndarray]) -> None:
        if weights:
            self.model.load_state_dict(from_numpy_state(weights, self.device), strict=False)

    def _prompts(self, prompts: np.ndarray | None) -> Tensor | None:
        return None if prompts is None else torch.from_numpy(np.array(prompts, dtype=np.float32)).to(self.device)

    @torch.no_grad()
    def observe(self, x: Tensor, prompts: np.ndarray | None) -> np.ndarray:
        self.model.eval()
        h1 = self.model.prefix(x, self.model.depth_of(1), self._prompts(prompts))
        return to_numpy(self.model.interface_pool(h1)).astype(np.float64)

    def train_begin(self, cfg: TrainConfig, depth: int, full: bool, prompts: np.ndarray | None,
                    prompt_lr: float | None = None) -> None:
        model = self.model
        model.train()
        self._params = [p for j in range(depth) for p in model.blocks[j].parameters()]
        if full and not cfg.freeze_head:  # FedBABU: the head stays as received (no step, no weight decay)
            self._params += list(model.head.parameters())
        self._anchor = [p.detach().clone() for p in self._params] if cfg.mu > 0 else None
        self._mu = cfg.mu
        self._p = self._prompts(prompts)
        if self._p is not None:
            self._p.requires_grad_(True)
        groups: list[dict[str, Any]] = [{"params": self._params}]
        if self._p is not None:  # the prompts at their own rate (docs/method.md, "Adaptation channel")
            groups.append({"params": [self._p], "lr": cfg.lr if prompt_lr is None else prompt_lr})
        self._opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self._depth = depth

    def forward(self, x: Tensor, want_h1: bool) -> tuple[np.ndarray, np.ndarray | None]:
        assert self._opt is not None
        self._opt.zero_grad(set_to_none=True)
        if want_h1:
            d1 = self.model.depth_of(1)
            h1 = self.model.prefix(x, d1, self._p)
            self._z = self.model.run_blocks(h1, d1, self._depth)
            return to_numpy(self._z), to_numpy(self.model.interface_pool(h1.detach()))
        self._z = self.model.prefix(x, self._depth, self._p)
        return to_numpy(self._z), None

    def backward(self, dz: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        self._z.backward(torch.from_numpy(np.array(dz, dtype=np.float32)).to(self.device))
        self._z = None
        return self._step()

    def full_step(self, x: Tensor, y: np.ndarray) -> float:
        assert self._opt is not None
        self._opt.zero_grad(set_to_none=True)
        model = self.model
        loss = F.cross_entropy(model.head(model.pool(model.prefix(x, self._depth, self._p))),
                               torch.from_numpy(y).to(self.device))
        loss.backward()
        self._step()
        return float(loss.detach())

    def _step(self) -> tuple[np.ndarray, np.ndarray] | None:
        assert self._opt is not None
        if self._anchor is not None:  # FedProx: grad of mu/2 ||w - w_global||^2
            for p, a in zip(self._params, self._anchor):
                if p.grad is not None:
                    p.grad.add_(p.detach() - a, alpha=self._mu)
        pg = None
        if self._p is not None and self._p.grad is not None:
            pg = (to_numpy(self._p.grad).copy(), to_numpy(self._p).copy())
        self._opt.step()
        return pg

    def train_end(self) -> np.ndarray | None:
        p = self._p
        self._opt, self._p, self._anchor, self._z = None, None, None, None
        return None if p is None else to_numpy(p).copy()

    def probe(self, x: Tensor, prompts: np.ndarray | None, d1: int, dref: int) -> tuple[np.ndarray, np.ndarray]:
        with probe_mode(self.model):
            h1 = self.model.prefix(x, d1, self._prompts(prompts))
            href = self.model.run_blocks(h1, d1, dref)
        return to_numpy(h1), to_numpy(href)

    # -- what a method's device side needs (device/methods.py) -----------------------------------------
    @torch.no_grad()
    def features(self, x: Tensor) -> np.ndarray:
        """The whole body's pooled features (the head's input) on batch statistics, running statistics
        untouched: FedGH's and FedAS's class means."""
        with _batch_statistics(self.model):
            return to_numpy(self.model.pool(self.model.prefix(x, self.model.num_blocks))).astype(np.float32)

    def fisher_trace(self, x: Tensor, y: np.ndarray) -> float:
        """FedAS's Fisher information of one batch: sum over every parameter of the squared gradient of the
        batch's mean negative log-likelihood, on batch statistics (the weights, their gradients and the running
        statistics are left as they were)."""
        model = self.model
        params = [p for p in model.parameters() if p.requires_grad]
        with _batch_statistics(model):
            logits = model.head(model.pool(model.prefix(x, model.num_blocks)))
            nll = F.cross_entropy(logits, torch.from_numpy(np.asarray(y, dtype=np.int64)).to(self.device))
            grads = torch.autograd.grad(nll, params, allow_unused=True)
        return float(sum(float((g.double() ** 2).sum()) for g in grads if g is not None))

    def align_step(self, x: Tensor, y: np.ndarray, classes: np.ndarray, means: np.ndarray, lr: float) -> float:
        """FedAS's parameter alignment, one plain SGD step of the body (train mode): for each class of the
        batch that ``classes`` holds, the mean squared distance of its samples' features to that class's
        ``means`` row, summed over classes. Returns the loss (0 and no step when no class matches)."""
        model = self.model
        body = [p for j in range(model.num_blocks) for p in model.blocks[j].parameters()]
        was = model.training
        model.train()
        try:
            f = model.pool(model.prefix(x, model.num_blocks))
            target = torch.from_numpy(np.asarray(means, dtype=np.float32)).to(self.device)
            row = {int(c): i for i, c in enumerate(np.asarray(classes))}
            yy = np.asarray(y)
            terms = [((f[torch.from_numpy(yy == c).to(self.device)] - target[row[int(c)]]) ** 2).mean()
                     for c in np.unique(yy) if int(c) in row]
            if not terms:
                return 0.0
            loss = torch.stack(terms).sum()
            grads = torch.autograd.grad(loss, body, allow_unused=True)
            with torch.no_grad():
                for p, g in zip(body, grads):
                    if g is not None:
                        p.add_(g, alpha=-lr)
            return float(loss.detach())
        finally:
            model.train(was)

    def weights(self, depth: int, full: bool) -> dict[str, np.ndarray]:
        sd, model = self.model.state_dict(), self.model
        keys = [n for n in sd if model.unit_of(n) < depth or (full and model.unit_of(n) == model.num_blocks)]
        return to_numpy_state({n: sd[n] for n in keys})

    def capabilities(self) -> dict[str, Any]:
        caps: dict[str, Any] = {"machine": platform.machine(), "system": platform.system(), "cpus": os.cpu_count() or 0,
                                "torch": torch.__version__, "device": str(self.device),
                                "threads": torch.get_num_threads()}
        if self.device.type == "cuda":
            caps["gpu"] = torch.cuda.get_device_name(self.device)
        return caps

    def rng_state(self) -> np.ndarray:
        return self.gen.get_state().numpy().copy()

    def set_rng_state(self, state: Any) -> None:
        self.gen.set_state(torch.from_numpy(np.asarray(state, dtype=np.uint8).copy()))


class TorchClient(SplitClient):
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
        rng, backend_seed = device_rng(seed, cid)
        gen = torch.Generator().manual_seed(backend_seed)
        super().__init__(cid, data, TorchBackend(model_factory, data, gen, device), peer, rng=rng, server=server)

    @property
    def model(self) -> SplitModel:
        return self.backend.model  # type: ignore[attr-defined]

    @property
    def device(self) -> torch.device:
        return self.backend.device  # type: ignore[attr-defined]
