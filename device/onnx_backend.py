"""The torch-free backend of the device role: onnxruntime + numpy on ``export --train`` artifacts.

A Raspberry Pi runs FedSGA with ``pip install "fedsga-edge[device]"`` and nothing heavier: the
prefix's forward and backward are the exported ONNX train graphs (``device.runtime.PrefixRunner``),
the SGD step is numpy, and the method's device side (observation, phi_s, Gamma, split policy,
prompt descriptor) is the same numpy code the torch device runs (``device.role``).

One numpy state holds the device's block weights and BatchNorm statistics under the model's
state-dict keys; one runner per candidate split reads the keys its graphs need from it. What the
torch device asks the model (which unit a weight belongs to, how p_1 pools, whether prompts are
tokens) this backend reads from the manifest the export wrote (``export.pipeline``). What the
graphs cannot do is refused with a clear error: a full-model round (FedAvg/FedProx train the head
locally), or artifacts exported for another model than the run's.

Approximation, stated: the torch backend's augmentation (random crop + flip) is re-implemented in
numpy with the device's own generator, so the two backends draw different crops for the same seed.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

from fedsga_edge.config import TrainConfig

from .backend import BackendError
from .role import ClientData
from .runtime import ArtifactError, PrefixRunner, _Sgd, load_manifest

__all__ = ["OnnxBackend", "check_artifacts"]

# What the export records of the model's contract, so this device never branches on a model family.
_CONTRACT = ("units", "interface_pool_axes", "prompts_as_tokens", "prompt_std")


def check_artifacts(manifest: dict[str, Any], *, model: str, width: float | None, num_classes: int,
                    img_size: int | None, prompts_m: int) -> None:
    """The artifacts must be the run's model: say which field differs, before any round starts."""
    m = manifest.get("model", {})
    wrong = []
    absent = [k for k in _CONTRACT if k not in m]
    if absent:
        wrong.append(f"the manifest records no {', '.join(absent)} (exported by an older fedsga-edge): export again")
    if m.get("arch") != model:
        wrong.append(f"model {m.get('arch')!r} != {model!r}")
    if width is not None and m.get("width") is not None and abs(float(m["width"]) - float(width)) > 1e-9:
        wrong.append(f"width {m.get('width')} != {width}")
    if m.get("num_classes") != num_classes:
        wrong.append(f"num_classes {m.get('num_classes')} != {num_classes}")
    if img_size and m.get("img_size") not in (None, img_size):
        wrong.append(f"img_size {m.get('img_size')} != {img_size}")
    have_m = int(m.get("prompts_m") or 0)
    if prompts_m and have_m != prompts_m:
        wrong.append(f"prompts {have_m} != {prompts_m} (export with --prompts {prompts_m})")
    if not prompts_m and have_m and m.get("prompts_as_tokens"):
        wrong.append(f"the run uses no prompts but the prefix was exported with {have_m} prompt tokens, "
                     "which are positions of its activation")
    missing = [p["split"] for p in manifest.get("prefixes", []) if not p.get("train")]
    if missing:
        wrong.append(f"splits {missing} have no train graphs (export with --train)")
    if wrong:
        raise ArtifactError("artifacts do not match the run: " + "; ".join(wrong))


class OnnxBackend:
    """Prefix training and inference with onnxruntime sessions on one shared numpy state."""

    name = "onnx"

    def __init__(self, artifacts: str | Path, data: ClientData, rng: np.random.Generator, *,
                 threads: int | None = None) -> None:
        """``rng``: the backend's own generator (augmentation, fresh prompts), as the torch backend's."""
        self.dir = Path(artifacts)
        self.manifest = load_manifest(self.dir)
        model = self.manifest["model"]
        absent = [k for k in _CONTRACT if k not in model]
        if absent:
            raise ArtifactError(f"{self.dir}: the manifest records no {', '.join(absent)} (exported by an older "
                                "fedsga-edge): export again")
        self._units: dict[str, int] = {str(k): int(v) for k, v in model["units"].items()}
        self._pool_axes = tuple(int(a) for a in model["interface_pool_axes"])
        self.data = data
        self.rng = rng
        self.threads = threads
        self.splits = sorted(p["split"] for p in self.manifest["prefixes"])
        # K is the model's number of candidate splits, not how many were exported: an export of some splits
        # (`export --splits 1,2`) must not move p_ref (the middle candidate) or the policy's choices; a split
        # asked for but not exported is refused where it is used (depth_of, runner).
        self.num_splits = len(model.get("splits") or self.splits)
        self.num_blocks = int(self.manifest["model"]["num_blocks"])
        self._depths = {p["split"]: int(p["depth"]) for p in self.manifest["prefixes"]}
        deepest = self.splits[-1]
        self.state: dict[str, np.ndarray] = {}  # one set of block weights; every split's runner reads it
        first = PrefixRunner(self.dir, deepest, threads=threads, state=self.state)
        if not first.trainable:
            raise ArtifactError(f"{self.dir}: no train graphs; export with --train")
        self._runners: dict[int, PrefixRunner] = {deepest: first}
        self.prompts_shape = first.prompts_shape
        self._mean = np.asarray(data.mean, dtype=np.float32).reshape(1, -1, 1, 1)
        self._std = np.asarray(data.std, dtype=np.float32).reshape(1, -1, 1, 1)
        self._train: dict[str, Any] | None = None

    # -- geometry ---------------------------------------------------------------------------------
    def depth_of(self, k: int) -> int:
        if k not in self._depths:
            raise BackendError(f"split {k} not in the artifacts (have {self.splits})")
        return self._depths[k]

    def runner(self, k: int) -> PrefixRunner:
        if k not in self._runners:
            self._runners[k] = PrefixRunner(self.dir, k, threads=self.threads, state=self.state)
        return self._runners[k]

    def _split_at(self, depth: int) -> int:
        for k, d in self._depths.items():
            if d == depth:
                return k
        raise BackendError(f"no exported prefix ends at depth {depth} (have {sorted(self._depths.values())})")

    # -- inputs -----------------------------------------------------------------------------------
    def init_prompts(self, m: int) -> np.ndarray:
        if m != self.prompts_shape[0]:
            raise BackendError(f"the run asks for {m} prompt tokens; the artifacts take {self.prompts_shape[0]}")
        std = float(self.manifest["model"]["prompt_std"])
        return (std * self.rng.standard_normal(self.prompts_shape)).astype(np.float32)

    def _feed_prompts(self, prompts: np.ndarray | None) -> np.ndarray:
        # No prompts: zero tokens are exactly "no prompts" for the CNN's prompt bias (0.1 * attn @ 0);
        # check_artifacts refuses an export whose prompts are tokens (ViT) for a run without prompts.
        return np.zeros(self.prompts_shape, np.float32) if prompts is None else np.asarray(prompts, np.float32)

    def inputs(self, images: np.ndarray, augment: bool) -> np.ndarray:
        """uint8 NHWC -> normalised float32 NCHW; augmentation: random 4-px crop + flip (numpy)."""
        x = np.ascontiguousarray(images).transpose(0, 3, 1, 2).astype(np.float32) / 255.0
        x = (x - self._mean) / self._std
        if augment:
            b, _, h, w = x.shape
            pad = 4
            padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
            dx = self.rng.integers(0, 2 * pad + 1, b)
            dy = self.rng.integers(0, 2 * pad + 1, b)
            flip = self.rng.random(b) < 0.5
            out = np.empty_like(x)
            for i in range(b):
                crop = padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
                out[i] = crop[:, :, ::-1] if flip[i] else crop
            x = out
        return np.ascontiguousarray(x, dtype=np.float32)

    # -- weights ----------------------------------------------------------------------------------
    def unit_of(self, name: str) -> int:
        """The exported model's unit of a weight, as the manifest records it (no name parsing)."""
        if name not in self._units:
            raise ValueError(f"{name!r} is not a weight of the exported {self.manifest['model'].get('arch')}")
        return self._units[name]

    def weight_shape(self, name: str) -> tuple[int, ...] | None:
        """The export's shape of a weight; None for a block deeper than any export (``load`` skips it)."""
        if name in self.state:
            return tuple(self.state[name].shape)
        if self.unit_of(name) >= max(self._depths.values()):
            return None
        raise ValueError(f"weight {name} is not in the exported prefix: artifacts of another model?")

    def load(self, weights: dict[str, np.ndarray]) -> None:
        """The coordinator's blocks into the shared state (blocks deeper than any export are not kept)."""
        deepest = max(self._depths.values())
        for name, value in weights.items():
            if name in self.state:
                a = np.asarray(value)
                if a.shape != self.state[name].shape:
                    raise BackendError(f"weight {name}: shape {a.shape} != the export's {self.state[name].shape}")
                self.state[name] = np.array(a, dtype=self.state[name].dtype)
            elif name not in self._units or self._units[name] < deepest:  # unknown, or a prefix weight we lack
                raise BackendError(f"weight {name} is not in the exported prefix: artifacts of another model?")

    def weights(self, depth: int, full: bool) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.state.items() if self.unit_of(k) < depth}

    # -- forward passes ---------------------------------------------------------------------------
    def _pool(self, h: np.ndarray) -> np.ndarray:
        return h.mean(axis=self._pool_axes)  # the model's interface_pool_axes

    def observe(self, x: np.ndarray, prompts: np.ndarray | None) -> np.ndarray:
        """Eval-mode p_1 features with the round's weights and running statistics, pooled."""
        h1 = self.runner(1).eval_forward(x, self._feed_prompts(prompts))
        return self._pool(h1).astype(np.float64)

    def probe(self, x: np.ndarray, prompts: np.ndarray | None, d1: int, dref: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch-statistics BatchNorm, running statistics untouched (as ``tensors.probe_mode``)."""
        p = self._feed_prompts(prompts)
        z1 = self.runner(self._split_at(d1)).train_forward(x, p, update_stats=False)
        zref = self.runner(self._split_at(dref)).train_forward(x, p, update_stats=False)
        return z1, zref

    # -- training ---------------------------------------------------------------------------------
    def train_begin(self, cfg: TrainConfig, depth: int, full: bool, prompts: np.ndarray | None,
                    prompt_lr: float | None = None) -> None:
        if full:
            raise BackendError("the onnx backend trains a prefix only; full-model rounds need --backend torch")
        runner = self.runner(self._split_at(depth))
        params = runner.entry["train"]["params"]
        self._train = {
            "runner": runner,
            "cfg": cfg,
            "params": params,
            "anchor": {n: self.state[n].copy() for n in params} if cfg.mu > 0 else None,
            "sgd": _Sgd(cfg.momentum, cfg.weight_decay),
            "prompts": None if prompts is None else {"prompts": np.array(prompts, dtype=np.float32)},
            "prompt_lr": cfg.lr if prompt_lr is None else prompt_lr,  # docs/method.md, "Adaptation channel"
            "x": None,
        }

    def forward(self, x: np.ndarray, want_h1: bool) -> tuple[np.ndarray, np.ndarray | None]:
        tr = self._train
        assert tr is not None
        tr["x"] = x
        p = self._feed_prompts(None if tr["prompts"] is None else tr["prompts"]["prompts"])
        if want_h1:
            z, h1 = tr["runner"].train_forward(x, p, return_h1=True)
            return z, np.asarray(h1, dtype=np.float32)
        return tr["runner"].train_forward(x, p), None

    def backward(self, dz: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        tr = self._train
        assert tr is not None and tr["x"] is not None
        pd = tr["prompts"]
        p = self._feed_prompts(None if pd is None else pd["prompts"])
        grads = tr["runner"].gradients(tr["x"], dz, p)
        tr["x"] = None
        pgrad = grads.pop("prompts", None)
        if tr["anchor"] is not None:  # FedProx: grad of mu/2 ||w - w_global||^2
            mu = tr["cfg"].mu
            for n, a in tr["anchor"].items():
                if n in grads:
                    grads[n] = grads[n] + mu * (self.state[n] - a)
        tr["sgd"].step(self.state, grads, tr["cfg"].lr)
        if pd is None or pgrad is None:
            return None
        before = pd["prompts"].copy()
        tr["sgd"].step(pd, {"prompts": pgrad}, tr["prompt_lr"])
        return pgrad, before

    def full_step(self, x: np.ndarray, y: np.ndarray) -> float:
        raise BackendError("the onnx backend trains a prefix only; full-model rounds need --backend torch")

    def train_end(self) -> np.ndarray | None:
        tr, self._train = self._train, None
        if tr is None or tr["prompts"] is None:
            return None
        return tr["prompts"]["prompts"]

    # -- identity ---------------------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        import onnxruntime as ort

        return {"machine": platform.machine(), "system": platform.system(), "cpus": os.cpu_count() or 0,
                "onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
                "threads": self.threads or 0, "artifacts": str(self.dir)}

    def rng_state(self) -> np.ndarray:
        return np.frombuffer(json.dumps(self.rng.bit_generator.state).encode(), dtype=np.uint8).copy()

    def set_rng_state(self, state: Any) -> None:
        self.rng.bit_generator.state = json.loads(np.asarray(state, dtype=np.uint8).tobytes().decode())
