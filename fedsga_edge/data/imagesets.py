"""Image containers shared by every dataset: one protocol, an in-memory kind and a lazy on-disk kind.

Importing needs numpy only: Pillow is imported where pixels are resized or decoded, so a device
with the base install can hold an in-memory split at its stored size.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


class DatasetError(ValueError):
    """A dataset cannot be loaded as asked; the message names the problem and the expected layout."""


@runtime_checkable
class ImageSet(Protocol):
    """One split (train or test) of a dataset.

    Labels (and domains) are arrays up front because partitioning needs them all; pixels come
    per batch so that folder datasets can stay on disk.
    """

    labels: np.ndarray
    domains: np.ndarray | None

    def __len__(self) -> int: ...

    def get_batch(self, indices: np.ndarray) -> np.ndarray:
        """uint8 (B, S, S, 3) NHWC images at the bundle's image_size."""
        ...


def _as_ids(values: object, length: int, what: str) -> np.ndarray:
    """Checks one int id per sample and returns them as int64 (what every consumer indexes with)."""
    ids = np.asarray(values)
    if ids.ndim != 1 or len(ids) != length:
        raise DatasetError(f"{what} must be a 1-D array with one entry per image ({length}), got shape {ids.shape}")
    if length and not np.issubdtype(ids.dtype, np.integer):
        raise DatasetError(f"{what} must be integers, got dtype {ids.dtype}")
    return ids.astype(np.int64)


def resize_rgb(image: np.ndarray, size: int) -> np.ndarray:
    """Resizes one uint8 HxWx3 image to size x size with PIL's bilinear filter.

    PIL widens the filter support when shrinking, so downscaling is antialiased rather than aliased.
    """
    from PIL import Image

    if image.shape[:2] == (size, size):
        return image
    return np.asarray(Image.fromarray(image).resize((size, size), Image.Resampling.BILINEAR))


def channel_stats(images: np.ndarray) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Exact per-channel mean and std on the 0..1 scale of a uint8 NHWC array.

    Goes through one 256-bin histogram per channel, so a 50k-image train set costs no float copy.
    """
    if images.size == 0:
        raise DatasetError("cannot compute normalisation statistics of an empty image set")
    values = np.arange(256, dtype=np.float64) / 255.0
    means, stds = [], []
    for channel in range(3):
        hist = np.bincount(images[..., channel].ravel(), minlength=256)
        prob = hist / hist.sum()
        mean = float(prob @ values)
        means.append(mean)
        stds.append(float(np.sqrt(max(prob @ values**2 - mean * mean, 0.0))))
    return (means[0], means[1], means[2]), (stds[0], stds[1], stds[2])


class ArrayImageSet:
    """Images held in memory as one uint8 NHWC array (digits, CIFAR, npz files).

    When ``image_size`` differs from the stored size, every image is resized once here, with PIL's
    bilinear filter (see :func:`resize_rgb`), so that ``get_batch`` is a plain gather.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        domains: np.ndarray | None = None,
        image_size: int | None = None,
    ) -> None:
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
            raise DatasetError(f"images must be a uint8 (N, H, W, 3) array, got {images.dtype} {images.shape}")
        if image_size is None:
            if images.shape[1] != images.shape[2]:
                raise DatasetError(f"images are {images.shape[1]}x{images.shape[2]}: non-square images need image_size")
            image_size = images.shape[1]
        if images.shape[1:3] != (image_size, image_size):
            resized = np.empty((len(images), image_size, image_size, 3), dtype=np.uint8)
            for row, image in enumerate(images):
                resized[row] = resize_rgb(image, image_size)
            images = resized
        self.images = np.ascontiguousarray(images)
        self.image_size = image_size
        self.labels = _as_ids(labels, len(images), "labels")
        self.domains = None if domains is None else _as_ids(domains, len(images), "domains")

    def __len__(self) -> int:
        return len(self.images)

    def get_batch(self, indices: np.ndarray) -> np.ndarray:
        return self.images[np.asarray(indices, dtype=np.int64)]


class FileImageSet:
    """Images left on disk and decoded per batch (Tiny-ImageNet, DomainNet: too large to hold decoded).

    Each file is opened with PIL, converted to RGB (DomainNet holds greyscale, palette and RGBA
    files) and resized to S x S with the bilinear filter. JPEGs are first decoded in PIL's draft
    mode, which lets libjpeg shrink by a power of two while staying at least S x S: large photos
    decode several times faster, and the bilinear resize that follows sets the final size.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        labels: np.ndarray,
        image_size: int,
        domains: np.ndarray | None = None,
    ) -> None:
        self.paths = [os.fspath(path) for path in paths]
        self.image_size = image_size
        self.labels = _as_ids(labels, len(self.paths), "labels")
        self.domains = None if domains is None else _as_ids(domains, len(self.paths), "domains")

    def __len__(self) -> int:
        return len(self.paths)

    def _load(self, path: str) -> np.ndarray:
        from PIL import Image

        size = self.image_size
        try:
            with Image.open(path) as image:
                image.draft("RGB", (size, size))
                rgb = image.convert("RGB")
        except OSError as exc:
            raise DatasetError(f"cannot read image {path}: {exc}") from exc
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(rgb)

    def get_batch(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        batch = np.empty((len(indices), self.image_size, self.image_size, 3), dtype=np.uint8)
        for row, index in enumerate(indices):
            batch[row] = self._load(self.paths[index])
        return batch
