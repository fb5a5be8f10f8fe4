"""Torch <-> wire conversions and batch preparation shared by both roles."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

__all__ = ["to_numpy_state", "from_numpy_state", "to_numpy", "from_numpy", "image_batch", "augment_batch", "probe_mode",
           "round_average_bn"]


def to_numpy(t: Tensor) -> np.ndarray:
    """Zero-copy for contiguous CPU tensors; the codec reads the buffer as is."""
    return t.detach().to("cpu").contiguous().numpy()


def from_numpy(a: np.ndarray, device: torch.device | str = "cpu") -> Tensor:
    """Decoded wire arrays are read-only views of the message buffer; copy only when we must."""
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a).to(device)


def to_numpy_state(state: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
    return {k: to_numpy(v) for k, v in state.items()}


def from_numpy_state(state: Mapping[str, np.ndarray], device: torch.device | str = "cpu") -> dict[str, Tensor]:
    return {k: from_numpy(np.asarray(v), device) for k, v in state.items()}


def image_batch(x: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device | str) -> Tensor:
    """uint8 NHWC -> normalised float NCHW on ``device``."""
    t = torch.from_numpy(np.ascontiguousarray(x)).to(device).permute(0, 3, 1, 2).float().div_(255.0)
    m = torch.tensor(mean, device=t.device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=t.device).view(1, -1, 1, 1)
    return (t - m) / s


def augment_batch(x: Tensor, generator: torch.Generator, pad: int = 4) -> Tensor:
    """Random crop with zero padding and random horizontal flip, per sample (CIFAR standard)."""
    b, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator).tolist()
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator).tolist()
    flip = (torch.rand(b, generator=generator) < 0.5).tolist()
    out = torch.empty_like(x)
    for i in range(b):
        crop = padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
        out[i] = crop.flip(-1) if flip[i] else crop
    return out


@contextmanager
def probe_mode(*modules: torch.nn.Module) -> Iterator[None]:
    """Forward passes that leave no trace: batch-statistics BatchNorm, buffers restored, no grad.

    Calibration probes (docs/method.md, "Calibration") compare two paths on one batch. Eval-mode
    BatchNorm would normalise with running statistics that lag far behind weights trained this
    round (cross-entropy up to ~110 in early rounds); batch statistics are what the layers were
    trained with. Train mode updates the running statistics, so they are saved and put back.
    """
    saved = [(m, m.training, {k: v.clone() for k, v in m.named_buffers()}) for m in modules]
    try:
        for m in modules:
            m.train()
        with torch.no_grad():
            yield
    finally:
        for m, training, buffers in saved:
            m.train(training)
            own = dict(m.named_buffers())
            for k, v in buffers.items():
                own[k].copy_(v)


def round_average_bn(module: torch.nn.Module) -> None:
    """Make ``module``'s BatchNorm running statistics the plain average over the batches it sees next.

    The server's shared blocks take one step per device batch, devices interleaved. With torch's EMA
    (momentum 0.1) their running statistics, which evaluation uses, would be those of the last ~10
    batches of the round: under label skew, a few devices' classes. Reset at round start and averaged
    cumulatively (momentum None), they weigh every batch of the round alike, i.e. each device by its
    data, as FedAvg's data-weighted average of the devices' statistics does (docs/method.md,
    "Server-side BatchNorm statistics"). Training is unchanged: train-mode BatchNorm normalises with
    batch statistics.
    """
    for m in module.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            m.momentum = None
            m.reset_running_stats()
