"""Torch-free prefix runtime: onnxruntime sessions and a numpy SGD step through the backward graph.

Nothing here imports torch (a device with only the ``device`` extra runs it; a test makes torch
unimportable and drives it). It reads what ``fedsga-edge export`` wrote: ``manifest.json``, the
forward graphs, and with ``--train`` the train graphs and the initial state.

One training step on the device, with the server in between::

    z = runner.train_forward(x, prompts)        # train-mode BN; running stats updated in runner.state
    ... send z, receive dz = dL/dz ...
    grads = runner.train_step(x, dz, prompts, lr=0.01)   # params updated; grads["prompts"] returned

``forward`` runs the exported eval-mode graph with the weights frozen at export time (BatchNorm
folded into the convolutions); after training use ``train_forward``, whose weights are inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["VARIANTS", "ArtifactError", "PrefixRunner", "load_manifest", "make_session"]

VARIANTS = ("fp32", "fp16", "int8")
_FORMAT = "fedsga-edge-prefixes"  # written by fedsga_edge.export.manifest (the device does not import export)
_FORMAT_VERSION = 1


class ArtifactError(RuntimeError):
    """The artifacts cannot serve the request (no such split, no train graphs, bad manifest)."""


def load_manifest(artifacts: str | Path) -> dict[str, Any]:
    path = Path(artifacts) / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"no manifest.json in {artifacts}: run `fedsga-edge export --out {artifacts}` first")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != _FORMAT or manifest.get("format_version", 0) > _FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: format {manifest.get('format')!r} v{manifest.get('format_version')} is not one this runtime reads"
        )
    return manifest


def make_session(path: str | Path, *, threads: int | None = None, providers: list[str] | None = None):
    """An onnxruntime session with ``threads`` intra-op threads (None: onnxruntime's default)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.inter_op_num_threads = 1
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=providers or ["CPUExecutionProvider"])


@dataclass
class _Sgd:
    """torch.optim.SGD's update rule (dampening 0, no Nesterov), on numpy arrays in place."""

    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        self.buf: dict[str, np.ndarray] = {}

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float) -> None:
        for name, g in grads.items():
            p = params[name]
            d = g + self.weight_decay * p if self.weight_decay else g
            if self.momentum:
                b = self.buf.get(name)
                d = self.buf[name] = d.copy() if b is None else b * self.momentum + d
            p -= (lr * d).astype(p.dtype, copy=False)


class PrefixRunner:
    """Runs split ``k`` of an export; holds the prefix state (params + BN stats) as numpy arrays."""

    def __init__(
        self,
        artifacts: str | Path,
        split: int,
        *,
        variant: str = "fp32",
        threads: int | None = None,
        providers: list[str] | None = None,
    ) -> None:
        self.dir = Path(artifacts)
        self.manifest = load_manifest(self.dir)
        entries = {p["split"]: p for p in self.manifest["prefixes"]}
        if split not in entries:
            raise ArtifactError(f"split {split} not exported in {self.dir} (have {sorted(entries)})")
        if variant not in VARIANTS:
            raise ArtifactError(f"variant {variant!r}: choose one of {VARIANTS}")
        self.entry = entries[split]
        self.split, self.depth = split, self.entry["depth"]
        self.variant, self.threads, self.providers = variant, threads, providers
        self.prompts_shape = tuple(self.entry["inputs"]["prompts"])
        self.activation_shape = tuple(self.entry["activation"]["shape"])
        file = self.entry["file"] if variant == "fp32" else (self.entry.get(variant) or {}).get("file")
        if file is None:
            raise ArtifactError(f"split {split} has no {variant} file (export with --{variant})")
        self.file = file
        self._fwd = None
        self._train = self.entry.get("train")
        self._train_fwd = self._train_bwd = None
        self.state: dict[str, np.ndarray] = {}
        if self._train:
            with np.load(self.dir / self._train["state_file"]) as npz:
                self.state = {k: np.array(npz[k]) for k in npz.files}
        self._sgd = _Sgd()

    # -- sessions (created on first use, so session-create time can be measured on its own) ----
    def session(self):
        if self._fwd is None:
            self._fwd = make_session(self.dir / self.file, threads=self.threads, providers=self.providers)
        return self._fwd

    @property
    def trainable(self) -> bool:
        return self._train is not None

    def train_sessions(self):
        if not self._train:
            raise ArtifactError(f"split {self.split} has no train graphs: export with --train")
        if self._train_fwd is None:
            self._train_fwd = make_session(
                self.dir / self._train["forward_file"], threads=self.threads, providers=self.providers
            )
            self._train_bwd = make_session(
                self.dir / self._train["backward_file"], threads=self.threads, providers=self.providers
            )
        return self._train_fwd, self._train_bwd

    # -- inference -----------------------------------------------------------------------------
    def _check(self, x: np.ndarray, prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        prompts = np.ascontiguousarray(prompts, dtype=np.float32)
        if prompts.shape != self.prompts_shape:
            raise ArtifactError(f"prompts must have shape {self.prompts_shape} (fixed at export), got {prompts.shape}")
        want = tuple(self.manifest["input"]["shape"][1:])
        if x.ndim != 4 or x.shape[1:] != want:
            raise ArtifactError(f"x must have shape (batch, {', '.join(map(str, want))}), got {x.shape}")
        return x, prompts

    def forward(self, x: np.ndarray, prompts: np.ndarray) -> np.ndarray:
        """Eval-mode prefix with the exported (frozen) weights: z of shape (batch, *activation_shape)."""
        x, prompts = self._check(x, prompts)
        return self.session().run(["z"], {"x": x, "prompts": prompts})[0]

    # -- training ------------------------------------------------------------------------------
    def _feeds(self, sess, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Unused inputs may be pruned from a graph: feed only what the session declares.
        return {i.name: base[i.name] if i.name in base else self.state[i.name] for i in sess.get_inputs()}

    def train_forward(self, x: np.ndarray, prompts: np.ndarray, *, update_stats: bool = True) -> np.ndarray:
        """Train-mode prefix with the current state; updates the BN running statistics."""
        x, prompts = self._check(x, prompts)
        fwd, _ = self.train_sessions()
        out = fwd.run(None, self._feeds(fwd, {"x": x, "prompts": prompts}))
        if update_stats:
            for name, value in zip(self._train["buffers"], out[1:]):
                self.state[name] = value
                counter = name.rsplit(".", 1)[0] + ".num_batches_tracked"
                if name.endswith("running_mean") and counter in self.state:
                    self.state[counter] = self.state[counter] + 1
        return out[0]

    def gradients(self, x: np.ndarray, dz: np.ndarray, prompts: np.ndarray) -> dict[str, np.ndarray]:
        """d sum(z * dz) / d(prompts, params), with z the train-mode prefix output."""
        x, prompts = self._check(x, prompts)
        dz = np.ascontiguousarray(dz, dtype=np.float32)
        if dz.shape != (x.shape[0], *self.activation_shape):
            raise ArtifactError(f"dz must have shape {(x.shape[0], *self.activation_shape)}, got {dz.shape}")
        _, bwd = self.train_sessions()
        out = bwd.run(None, self._feeds(bwd, {"x": x, "dz": dz, "prompts": prompts}))
        names = [o.name.removeprefix("grad.") for o in bwd.get_outputs()]
        return dict(zip(names, out))

    def set_optimizer(self, *, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self._sgd = _Sgd(momentum, weight_decay)

    def train_step(self, x: np.ndarray, dz: np.ndarray, prompts: np.ndarray, lr: float) -> dict[str, np.ndarray]:
        """One SGD step of the prefix parameters (not the prompts: their gradient is returned)."""
        grads = self.gradients(x, dz, prompts)
        self._sgd.step(self.state, {k: v for k, v in grads.items() if k != "prompts"}, lr)
        return grads

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Prefix params and BN buffers under the model's state-dict keys (copies)."""
        return {k: v.copy() for k, v in self.state.items()}

    def load_state(self, arrays: dict[str, np.ndarray], *, strict: bool = True) -> None:
        """Sets params / buffers (e.g. the aggregated blocks from the coordinator)."""
        unknown = set(arrays) - set(self.state)
        if strict and unknown:
            raise ArtifactError(f"not in this prefix's state: {sorted(unknown)[:5]}")
        for k, v in arrays.items():
            if k in self.state:
                if tuple(np.shape(v)) != self.state[k].shape:
                    raise ArtifactError(f"{k}: shape {np.shape(v)} != {self.state[k].shape}")
                self.state[k] = np.array(v, dtype=self.state[k].dtype)
