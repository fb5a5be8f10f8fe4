"""Torch-free prefix runtime: onnxruntime sessions and a numpy SGD step through the backward graph.

Nothing here imports torch (a device with only the ``device`` extra runs it; a test makes torch
unimportable and drives it). It reads what ``fedsga-edge export`` wrote: ``manifest.json``, the
forward graphs, and with ``--train`` the train graphs and the initial state.

One training step on the device, with the server in between::

    z, h1 = runner.train_forward(x, prompts, return_h1=True)  # train-mode BN; stats updated in runner.state
    ... send z (and h1), receive dz = dL/dz ...
    grads = runner.train_step(x, dz, prompts, lr=0.01)   # params updated; grads["prompts"] returned

or, to change the gradients first (e.g. a FedProx term), ``grads = runner.gradients(x, dz, prompts)``,
edit ``grads``, then ``runner.sgd_step(grads, lr)``.

``forward`` runs the exported eval-mode graph with the weights frozen at export time (BatchNorm
folded into the convolutions); ``eval_forward`` runs the eval-mode graph whose weights and
BatchNorm running statistics are inputs (``runner.state``), e.g. for the round-start observation
with the round's global blocks (docs/method.md "Observation").

One device has one set of block weights however many splits it may train at: give every runner
the same dict (``PrefixRunner(art, k, state=shared)``). Each runner reads and writes only its own
prefix's keys; BN statistics are written into the dict, SGD updates the arrays in place.
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
        state: dict[str, np.ndarray] | None = None,
    ) -> None:
        """``state``: a dict shared with the device's other runners; keys it lacks are filled from
        this split's initial state file, keys it has are kept (they are the device's weights)."""
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
        self._train_fwd = self._train_bwd = self._eval = None
        self.state: dict[str, np.ndarray] = {} if state is None else state
        self.keys: list[str] = []  # this prefix's state-dict keys (params, BN buffers, counters)
        if self._train:
            with np.load(self.dir / self._train["state_file"]) as npz:
                self.keys = list(npz.files)
                for k in self.keys:
                    if k not in self.state:
                        self.state[k] = np.array(npz[k])
                    elif self.state[k].shape != npz[k].shape:
                        raise ArtifactError(f"shared state {k}: shape {self.state[k].shape} != {npz[k].shape}")
        self._sgd = _Sgd()
        self._kept: tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]] | None = None
        self._input_names: dict[int, list[str]] = {}
        self._out_names: dict[int, list[str]] = {}

    # -- sessions (created on first use, so session-create time can be measured on its own) ----
    def session(self):
        if self._fwd is None:
            self._fwd = make_session(self.dir / self.file, threads=self.threads, providers=self.providers)
        return self._fwd

    @property
    def trainable(self) -> bool:
        return self._train is not None

    def _need_train(self) -> dict[str, Any]:
        if not self._train:
            raise ArtifactError(f"split {self.split} has no train graphs: export with --train")
        return self._train

    def train_sessions(self):
        t = self._need_train()
        if self._train_fwd is None:
            self._train_fwd = make_session(self.dir / t["forward_file"], threads=self.threads, providers=self.providers)
            self._train_bwd = make_session(
                self.dir / t["backward_file"], threads=self.threads, providers=self.providers
            )
        return self._train_fwd, self._train_bwd

    def eval_session(self):
        t = self._need_train()
        if not t.get("eval_file"):
            raise ArtifactError(f"split {self.split} has no eval graph with weights as inputs: re-export with --train")
        if self._eval is None:
            self._eval = make_session(self.dir / t["eval_file"], threads=self.threads, providers=self.providers)
        return self._eval

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

    def eval_forward(
        self, x: np.ndarray, prompts: np.ndarray, *, return_h1: bool = False
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Eval-mode prefix (BN with the running stats) with the weights in ``self.state``: z, or (z, h1)."""
        x, prompts = self._check(x, prompts)
        sess = self.eval_session()
        z, h1 = sess.run(["z", "h1"], self._feeds(sess, {"x": x, "prompts": prompts}))
        return (z, h1) if return_h1 else z

    # -- training ------------------------------------------------------------------------------
    def _feeds(self, sess, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Unused inputs may be pruned from a graph: feed only what the session declares.
        return {n: base[n] if n in base else self.state[n] for n in self._inputs(sess)}

    def _inputs(self, sess) -> list[str]:
        names = self._input_names.get(id(sess))
        if names is None:
            names = self._input_names[id(sess)] = [i.name for i in sess.get_inputs()]
        return names

    def train_forward(
        self, x: np.ndarray, prompts: np.ndarray, *, update_stats: bool = True, return_h1: bool = False
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Train-mode prefix with the current state: z, or (z, h1) with h1 the model's
        ``interface_pool`` of the p_1 activation (B, C1); updates the BN running statistics.

        Keeps the activations the backward graph needs (``saved.*`` outputs) for the next
        :meth:`gradients` / :meth:`train_step` on the same x and prompts (the weights must not
        change in between: the device sends z and waits for dz)."""
        x, prompts = self._check(x, prompts)
        fwd, _ = self.train_sessions()
        names = self._output_names(fwd)
        if return_h1 and "h1" not in names:
            raise ArtifactError(f"split {self.split}'s train forward has no h1 output: re-export with --train")
        out = dict(zip(names, fwd.run(None, self._feeds(fwd, {"x": x, "prompts": prompts}))))
        self._kept = (x.copy(), prompts.copy(), {k: v for k, v in out.items() if k.startswith("saved.")})
        if update_stats:
            for name in self._train["buffers"]:  # in place, like the SGD step: holders of the arrays see it
                np.copyto(self.state[name], out[f"new.{name}"])
                counter = name.rsplit(".", 1)[0] + ".num_batches_tracked"
                if name.endswith("running_mean") and counter in self.state:
                    np.add(self.state[counter], 1, out=self.state[counter])
        return (out["z"], out["h1"]) if return_h1 else out["z"]

    def _output_names(self, sess) -> list[str]:
        names = self._out_names.get(id(sess))
        if names is None:
            names = self._out_names[id(sess)] = [o.name for o in sess.get_outputs()]
        return names

    def _saved_for(self, x: np.ndarray, prompts: np.ndarray) -> dict[str, np.ndarray]:
        """What the last train_forward kept, if it ran on this x and these prompts; else a fresh
        forward (no BN update) produces it. Used once: the arrays are released for the next batch."""
        kept, self._kept = self._kept, None
        if kept is not None and np.array_equal(kept[0], x) and np.array_equal(kept[1], prompts):
            return kept[2]
        fwd, bwd = self.train_sessions()
        if not any(n.startswith("saved.") for n in self._inputs(bwd)):
            return {}  # an export from before the split: its backward recomputes the forward
        names = self._output_names(fwd)
        out = fwd.run(None, self._feeds(fwd, {"x": x, "prompts": prompts}))
        return {k: v for k, v in zip(names, out) if k.startswith("saved.")}

    def gradients(self, x: np.ndarray, dz: np.ndarray, prompts: np.ndarray) -> dict[str, np.ndarray]:
        """d sum(z * dz) / d(prompts, params), with z the train-mode prefix output (of the last
        :meth:`train_forward` on this x, whose activations the backward graph reuses)."""
        x, prompts = self._check(x, prompts)
        dz = np.ascontiguousarray(dz, dtype=np.float32)
        if dz.shape != (x.shape[0], *self.activation_shape):
            raise ArtifactError(f"dz must have shape {(x.shape[0], *self.activation_shape)}, got {dz.shape}")
        _, bwd = self.train_sessions()
        base = {"x": x, "dz": dz, "prompts": prompts} | self._saved_for(x, prompts)
        out = bwd.run(None, self._feeds(bwd, base))
        names = [n.removeprefix("grad.") for n in self._output_names(bwd)]
        return dict(zip(names, out))

    def set_optimizer(self, *, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        """torch.optim.SGD's rule; a new optimizer (momentum buffers start empty)."""
        self._sgd = _Sgd(momentum, weight_decay)

    def sgd_step(self, grads: dict[str, np.ndarray], lr: float) -> None:
        """SGD on this prefix's parameters in ``self.state`` (in place) from ``grads`` (e.g. from
        :meth:`gradients`, edited by the caller); a ``prompts`` entry is ignored (the caller owns them)."""
        params = self._need_train()["params"]
        grads = {k: v for k, v in grads.items() if k != "prompts"}
        unknown = set(grads) - set(params)
        if unknown:
            raise ArtifactError(f"gradients for names that are not split {self.split}'s params: {sorted(unknown)[:5]}")
        for k, g in grads.items():
            if np.shape(g) != self.state[k].shape:
                raise ArtifactError(f"gradient {k}: shape {np.shape(g)} != {self.state[k].shape}")
        self._sgd.step(self.state, grads, lr)

    def train_step(self, x: np.ndarray, dz: np.ndarray, prompts: np.ndarray, lr: float) -> dict[str, np.ndarray]:
        """One SGD step of the prefix parameters (not the prompts: their gradient is returned)."""
        grads = self.gradients(x, dz, prompts)
        self.sgd_step(grads, lr)
        return grads

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """This prefix's params and BN buffers under the model's state-dict keys (copies)."""
        return {k: self.state[k].copy() for k in self.keys}

    def load_state(self, arrays: dict[str, np.ndarray], *, strict: bool = True) -> None:
        """Sets params / buffers (e.g. the aggregated blocks from the coordinator); with ``strict``,
        every name must be one of this prefix's keys, otherwise names outside it are skipped."""
        own = set(self.keys)
        unknown = set(arrays) - own
        if strict and unknown:
            raise ArtifactError(f"not in this prefix's state: {sorted(unknown)[:5]}")
        for k, v in arrays.items():
            if k in own:
                if tuple(np.shape(v)) != self.state[k].shape:
                    raise ArtifactError(f"{k}: shape {np.shape(v)} != {self.state[k].shape}")
                self.state[k] = np.array(v, dtype=self.state[k].dtype)
