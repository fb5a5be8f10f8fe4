"""``--train``: ONNX graphs that let a device train its prefix with onnxruntime and numpy only.

Per prefix, two graphs whose weights are *inputs* (named by the model's state-dict keys, so the
coordinator's block weights map onto them one to one) and a state file:

* ``prefix_kK.train_fwd.onnx``: (x, prompts, *params, *bn_stats) -> (z, *new_bn_stats).
  The forward in training mode: BatchNorm normalises with batch statistics and returns the
  updated running mean / var (momentum update, unbiased variance, as torch does).
* ``prefix_kK.train_bwd.onnx``: (x, dz, prompts, *params) -> (grad.prompts, *grad.params).
  Gradients of ``sum(prefix(x, prompts) * dz)``, i.e. of the server's loss once the server sends
  ``dz = dL/dz``. It recomputes the forward instead of taking saved activations (activation
  checkpointing: about a third more arithmetic, much less memory held between the two calls).
* ``prefix_kK.state.npz``: the initial parameters and BatchNorm buffers, as numpy arrays.

How (torch 2.14; taking ``torch.func.vjp`` or ``autograd.grad`` through the exporter fails):
``torch.export`` the surrogate loss with the prompts made a parameter, build the joint graph with
``torch.export.experimental._export_forward_backward``, wrap that functional graph in a module
whose inputs are (x, dz, prompts, *params), export it again with a dynamic batch, and run two
decompositions before handing it to torch.onnx:

* ``aten.convolution_backward`` has no ONNX translation: it becomes a transposed convolution
  (input gradient) and a convolution over the batch axis (weight gradient), see
  :func:`convolution_backward`;
* train-mode BatchNorm (``_native_batch_norm_legit_functional``) is otherwise exported as an
  inference BatchNormalization (gradients 79% wrong, silently): torch's own decomposition into
  var_mean / rsqrt / mul is applied first;
* timm's fused attention gives wrong gradients in the joint graph and has no ONNX op: it is off
  while exporting (:func:`~.onnx_prefix.export_friendly`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.export.graph_signature import InputKind, OutputKind

from fedsga_edge.models import SplitModel

from .manifest import sha256_file
from .onnx_prefix import PrefixModule, export_friendly, export_onnx, ort_session
from .report import Check

__all__ = ["BN_STATS", "TrainGraphs", "check_train_graphs", "convolution_backward", "export_train_graphs"]

aten = torch.ops.aten
BN_STATS = ("running_mean", "running_var")


def convolution_backward(
    grad_out: Tensor,
    inp: Tensor,
    weight: Tensor,
    bias_sizes: Any,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
    output_mask: list[bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """aten.convolution_backward for plain 2-D convolutions (groups 1), from ops ONNX has."""
    if transposed or groups != 1 or inp.dim() != 4:
        raise NotImplementedError(
            f"convolution_backward decomposition covers 2-D, groups=1, non-transposed convs "
            f"(got transposed={transposed}, groups={groups}, {inp.dim() - 2}-D)"
        )
    grad_in = grad_w = grad_b = None
    if output_mask[0]:
        # The transposed convolution maps the output grid back; output_padding restores the rows
        # and columns a strided forward convolution dropped.
        extra = [
            inp.shape[2 + i]
            - ((grad_out.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (weight.shape[2 + i] - 1) + 1)
            for i in range(2)
        ]
        grad_in = aten.convolution.default(grad_out, weight, None, stride, padding, dilation, True, extra, 1)
    if output_mask[1]:
        # dW[o, i] = sum_n corr(x[n, i], dy[n, o]): a convolution with the batch as the channel
        # axis, the forward's stride as dilation and its dilation as stride; cropped to the kernel
        # (a strided forward that dropped trailing pixels leaves extra taps here).
        g = aten.convolution.default(
            inp.transpose(0, 1), grad_out.transpose(0, 1), None, dilation, padding, stride, False, [0, 0], 1
        )
        grad_w = g.transpose(0, 1)[:, :, : weight.shape[2], : weight.shape[3]]
    if output_mask[2]:
        grad_b = grad_out.sum(dim=(0, 2, 3))
    return grad_in, grad_w, grad_b


def _decompositions() -> dict:
    from torch._decomp import decomposition_table

    bn = aten._native_batch_norm_legit_functional.default
    return {aten.convolution_backward.default: convolution_backward, bn: decomposition_table[bn]}


class _Lifted(nn.Module):
    """Calls a functional graph of an ExportedProgram with chosen parameters/buffers as inputs.

    ``plan`` gives, for each of the graph's inputs in signature order, where it comes from:
    ("arg", i) the i-th argument of forward, or ("const", name) a registered buffer.
    """

    def __init__(self, gm: nn.Module, plan: list[tuple[str, Any]], consts: dict[str, Tensor], outputs: list[int]):
        super().__init__()
        self.gm = gm
        self.plan = plan
        self.outputs = outputs
        self.const_names = {}
        for i, (name, value) in enumerate(consts.items()):
            self.register_buffer(f"const{i}", value.detach().clone())
            self.const_names[name] = f"const{i}"

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        feed = [args[ref] if kind == "arg" else getattr(self, self.const_names[ref]) for kind, ref in self.plan]
        out = self.gm(*feed)
        return tuple(out[i] for i in self.outputs)


def _lift(
    ep: torch.export.ExportedProgram,
    state: dict[str, Tensor],
    args: list[str],
    outputs: list[tuple[OutputKind, str | None]],
) -> tuple[_Lifted, list[str]]:
    """Wraps ``ep``'s graph so that the user inputs and the state entries named in ``args`` are
    forward arguments (in that order), every other parameter/buffer a constant, and the outputs
    are those of ``outputs`` (kind, target-or-None) in that order. Returns the output names too."""
    sig = ep.graph_signature
    plan: list[tuple[str, Any]] = []
    consts: dict[str, Tensor] = {}
    for spec in sig.input_specs:
        key = spec.arg.name if spec.kind == InputKind.USER_INPUT else spec.target
        if key in args:
            plan.append(("arg", args.index(key)))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            consts[key] = state[key]
            plan.append(("const", key))
        else:
            raise RuntimeError(f"unexpected graph input {spec.kind} {key}")
    specs = sig.output_specs
    picked: list[int] = []
    for kind, target in outputs:
        idx = [i for i, s in enumerate(specs) if s.kind == kind and (target is None or s.target == target)]
        if len(idx) != 1:
            raise RuntimeError(f"graph has {len(idx)} outputs of kind {kind} for {target}")
        picked.append(idx[0])
    return _Lifted(ep.graph_module, plan, consts, picked), [str(t) for _, t in outputs]


class _Surrogate(nn.Module):
    """sum(prefix(x, prompts) * dz) with the prompts as a parameter, so the joint graph differentiates them."""

    def __init__(self, model: SplitModel, depth: int, prompts: Tensor) -> None:
        super().__init__()
        self.prompts = nn.Parameter(prompts.detach().clone())
        self.prefix = PrefixModule(model, depth)

    def forward(self, x: Tensor, dz: Tensor) -> tuple[Tensor]:
        return ((self.prefix(x, self.prompts) * dz).sum(),)


def _state_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """Trainable parameter names and BatchNorm running-stat names of a PrefixModule (state-dict keys)."""
    params = [n for n, p in module.named_parameters() if p.requires_grad]
    stats = [n for n, _ in module.named_buffers() if n.rsplit(".", 1)[-1] in BN_STATS]
    return params, stats


def _key(name: str) -> str:
    """PrefixModule names (``blocks.0.conv1.weight``) are the model's state-dict keys already."""
    return name


@dataclass
class TrainGraphs:
    forward_file: str
    backward_file: str
    state_file: str
    params: list[str]
    buffers: list[str]
    seconds: float

    def to_dict(self, out_dir: Path) -> dict[str, Any]:
        files = {k: getattr(self, k) for k in ("forward_file", "backward_file", "state_file")}
        return {
            **files,
            "sha256": {k: sha256_file(out_dir / v) for k, v in files.items()},
            "params": self.params,
            "buffers": self.buffers,
            "forward_outputs": ["z", *(f"new.{b}" for b in self.buffers)],
            "backward_inputs": ["x", "dz", "prompts", *self.params],
            "backward_outputs": ["grad.prompts", *(f"grad.{p}" for p in self.params)],
            "bn_momentum": _bn_momentum(self.buffers),
            "export_seconds": round(self.seconds, 2),
        }


def _bn_momentum(buffers: list[str]) -> float | None:
    return 0.1 if buffers else None  # torch's default, the only one the models use (checked at export)


def export_train_graphs(
    model: SplitModel,
    depth: int,
    out_dir: Path,
    stem: str,
    *,
    prompts_m: int,
    opset: int,
    example_batch: int = 2,
) -> TrainGraphs:
    """Writes ``{stem}.train_fwd.onnx``, ``{stem}.train_bwd.onnx`` and ``{stem}.state.npz``."""
    if example_batch < 2:
        raise ValueError("example_batch must be >= 2: a batch-1 example bakes batch 1 into the graph")
    start = time.perf_counter()
    model = copy.deepcopy(model).train()  # exports trace train mode; the caller's model stays as it is
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum != 0.1:
            raise NotImplementedError(f"BatchNorm momentum {m.momentum}: the train graphs assume torch's 0.1")
    prefix = PrefixModule(model, depth).train()
    params, stats = _state_names(prefix)
    state = dict(prefix.state_dict(keep_vars=True))
    state = {k: v.detach() for k, v in state.items()}
    x = torch.randn(example_batch, 3, model.input_size, model.input_size)
    prompts = model.init_prompts(prompts_m)
    dz = torch.randn(example_batch, *model.interface_shape(depth, prompts_m))
    batch = torch.export.Dim("batch", min=1)
    decomp = _decompositions()
    out_dir = Path(out_dir)

    with export_friendly(model):
        # 1. Training-mode forward, running statistics as inputs and outputs.
        ep = torch.export.export(prefix, (x, prompts), dynamic_shapes={"x": {0: batch}, "prompts": None})
        ep = ep.run_decompositions({})  # functionalise: in-place running-stat updates become outputs
        outs: list[tuple[OutputKind, str | None]] = [(OutputKind.USER_OUTPUT, None)]
        outs += [(OutputKind.BUFFER_MUTATION, b) for b in stats]
        fwd, _ = _lift(ep, state, ["x", "prompts", *params, *stats], outs)
        fwd_args = (x, prompts, *(state[n] for n in params), *(state[n] for n in stats))
        ds = {"args": ({0: batch}, None, *([None] * (len(params) + len(stats))))}
        ep_fwd = torch.export.export(fwd, fwd_args, dynamic_shapes=ds).run_decompositions(decomp)
        export_onnx(
            ep_fwd,
            fwd_args,
            out_dir / f"{stem}.train_fwd.onnx",
            input_names=["x", "prompts", *params, *stats],
            output_names=["z", *(f"new.{b}" for b in stats)],
            opset=opset,
        )

        # 2. Joint forward-backward of the surrogate loss.
        from torch.export.experimental import _export_forward_backward

        sur = _Surrogate(model, depth, prompts).train()
        sur_state = {k: v.detach() for k, v in sur.state_dict(keep_vars=True).items()}
        ep = torch.export.export(sur, (x, dz), dynamic_shapes={"x": {0: batch}, "dz": {0: batch}})
        joint = _export_forward_backward(ep)
        sur_params = ["prompts", *(f"prefix.{p}" for p in params)]
        outs = [(OutputKind.GRADIENT_TO_PARAMETER, p) for p in sur_params]
        bwd, _ = _lift(joint, sur_state, ["x", "dz", *sur_params], outs)
        bwd_args = (x, dz, prompts, *(state[n] for n in params))
        ds = {"args": ({0: batch}, {0: batch}, *([None] * (1 + len(params))))}
        ep_bwd = torch.export.export(bwd, bwd_args, dynamic_shapes=ds).run_decompositions(decomp)
        export_onnx(
            ep_bwd,
            bwd_args,
            out_dir / f"{stem}.train_bwd.onnx",
            input_names=["x", "dz", "prompts", *params],
            output_names=["grad.prompts", *(f"grad.{p}" for p in params)],
            opset=opset,
        )

    arrays = {k: v.cpu().numpy() for k, v in prefix.state_dict().items()}
    np.savez(out_dir / f"{stem}.state.npz", **arrays)
    return TrainGraphs(
        f"{stem}.train_fwd.onnx",
        f"{stem}.train_bwd.onnx",
        f"{stem}.state.npz",
        params,
        stats,
        time.perf_counter() - start,
    )


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


def check_train_graphs(
    model: SplitModel,
    depth: int,
    out_dir: Path,
    graphs: TrainGraphs,
    *,
    prompts_m: int,
    batch: int = 3,
    rtol: float = 1e-4,
) -> tuple[list[Check], float]:
    """Train graphs vs torch autograd at ``batch`` (not the export's), with perturbed weights as inputs.

    Returns the checks and the largest relative error over every gradient (max|diff| / max|ref|).
    """
    gen = torch.Generator().manual_seed(4321)
    ref_model = copy.deepcopy(model).train()
    prefix = PrefixModule(ref_model, depth).train()
    with torch.no_grad():  # weights other than the exported ones: they must act as inputs
        for p in prefix.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    x = torch.randn(batch, 3, model.input_size, model.input_size, generator=gen)
    prompts = model.init_prompts(prompts_m, generator=gen).requires_grad_(True)
    dz = torch.randn(batch, *model.interface_shape(depth, prompts_m), generator=gen)
    state = {k: v.detach().numpy().copy() for k, v in prefix.state_dict().items()}
    with export_friendly(ref_model):
        z = prefix(x, prompts)
        (z * dz).sum().backward()
    checks: list[Check] = []

    fwd = ort_session(out_dir / graphs.forward_file)
    feeds = {"x": x.numpy(), "prompts": prompts.detach().numpy()} | {
        n: state[n] for n in graphs.params + graphs.buffers
    }
    names = {i.name for i in fwd.get_inputs()}
    got = fwd.run(None, {k: v for k, v in feeds.items() if k in names})
    z_err = _rel(got[0], z.detach().numpy())
    checks.append(Check(z_err <= rtol, f"train forward matches torch train mode (batch {batch}, rel {z_err:.1e})"))
    new_stats = prefix.state_dict()
    s_err = max((_rel(g, new_stats[b].numpy()) for g, b in zip(got[1:], graphs.buffers)), default=0.0)
    if graphs.buffers:
        checks.append(Check(s_err <= rtol, f"updated BatchNorm running stats match torch (rel {s_err:.1e})"))

    bwd = ort_session(out_dir / graphs.backward_file)
    feeds |= {"dz": dz.numpy()}
    names = {i.name for i in bwd.get_inputs()}
    grads = bwd.run(None, {k: v for k, v in feeds.items() if k in names})
    named = dict(prefix.named_parameters())
    refs = [prompts.grad.numpy()] + [named[p].grad.numpy() for p in graphs.params]
    worst = max(_rel(g, r) for g, r in zip(grads, refs))
    checks.append(
        Check(
            worst <= rtol, f"gradients of prompts and {len(graphs.params)} params match autograd (max rel {worst:.1e})"
        )
    )
    return checks, max(worst, z_err, s_err)
