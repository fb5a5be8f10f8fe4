"""A device's own data: an image folder or an npz, read whole and checked before the device registers.

Two layouts (docs/deploy.md, "A device's own data"):

* **an image folder**: ``PATH/<class name>/<image>`` with one sub-folder per class and the common image
  formats Pillow reads (``IMAGE_EXTENSIONS``). Hidden entries (a leading ``.``) are skipped. Samples are
  ordered by file name, then class, so the folders ``fedsga-edge partition`` writes (``000123.png`` = the
  share's 123rd sample) come back in the order the simulation's partition holds them;
* **an npz** in the loaders' format (``fedsga_edge.data.datasets``): uint8 ``x_train`` (N, H, W, 3) and
  integer ``y_train``, with ``classes`` (the names the labels index) when the labels are not already the
  run's class ids. The whole ``train`` part is the device's data; any ``test`` part is not used.

Class names map to the run's class ids, which the coordinator announces (``describe``). Every image is
decoded once, here, converted to RGB and resized to the run's input size with Pillow's bilinear filter
(JPEGs through draft mode first, as ``FileImageSet``), so a corrupt file or a wrong one fails at start,
not in round 3. Numpy and Pillow only: the torch-free device reads its data with this module, and the
torch device reads the same bytes the same way.

Each problem raises ``LocalDataError`` naming the file or folder and what to do about it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .imagesets import ArrayImageSet, DatasetError

__all__ = ["IMAGE_EXTENSIONS", "DESCRIPTION_FILE", "LocalDataError", "RunData", "read_local_data", "scan_local_data",
           "read_run_data", "write_image_folder", "write_npz", "DEFAULT_STATS"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm")
# 8-bit modes that convert to RGB without losing their meaning; 16-bit and float images would be clipped
RGB_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "RGBa", "La", "CMYK", "YCbCr")
DESCRIPTION_FILE = "dataset.json"  # what `fedsga-edge partition` writes beside the device folders
# ImageNet statistics: the normalisation of a run whose class list says nothing about its pixels
DEFAULT_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
MAX_CLASSES = 100_000


class LocalDataError(DatasetError):
    """The device's own data cannot be used as it is; the message names the file and what to do."""


@dataclass
class RunData:
    """What every side of a run agrees on about its data, without holding any of it: the class names (in
    class-id order), the input size and the normalisation. The coordinator announces it (``description``)."""

    classes: list[str]
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def to_wire(self) -> dict[str, Any]:
        return {"classes": list(self.classes), "image_size": int(self.image_size),
                "mean": [float(v) for v in self.mean], "std": [float(v) for v in self.std]}

    @classmethod
    def from_wire(cls, body: Any, where: str = "the coordinator's description") -> "RunData":
        """Checked: it comes from another machine (or a file a person wrote)."""
        if not isinstance(body, dict):
            raise LocalDataError(f"{where} is not a map")
        classes = body.get("classes")
        if (not isinstance(classes, (list, tuple)) or not 1 <= len(classes) <= MAX_CLASSES
                or not all(isinstance(c, str) and 0 < len(c) <= 200 for c in classes)):
            raise LocalDataError(f"{where}: classes must be a list of 1..{MAX_CLASSES} non-empty names")
        if len(set(classes)) != len(classes):
            raise LocalDataError(f"{where}: class names repeat")
        size = body.get("image_size")
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 4096:
            raise LocalDataError(f"{where}: image_size must be an integer in 1..4096")
        stats = []
        for key in ("mean", "std"):
            v = body.get(key)
            if not isinstance(v, (list, tuple)) or len(v) != 3 or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
                raise LocalDataError(f"{where}: {key} must be three finite numbers")
            stats.append(tuple(float(x) for x in v))
        if not all(0 < s <= 10 for s in stats[1]) or not all(-10 <= m <= 10 for m in stats[0]):
            raise LocalDataError(f"{where}: std must be in (0, 10] and mean in [-10, 10]")
        return cls(list(classes), size, stats[0], stats[1])  # type: ignore[arg-type]


def read_run_data(path: str | os.PathLike[str], image_size: int | None = None) -> RunData:
    """The coordinator's ``--classes``: ``dataset.json`` as ``partition`` writes it (classes, image_size, mean,
    std), a JSON list of names, or a text file with one class name per line. ``image_size`` (``--img-size``)
    must agree with the file's when both are given; mean and std default to ImageNet's."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise LocalDataError(f"--classes {p}: cannot read it ({exc.strerror or exc})") from None
    data: Any
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise LocalDataError(f"--classes {p}: not valid JSON ({exc})") from None
    else:
        data = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if isinstance(data, list):
        data = {"classes": data}
    if not isinstance(data, dict):
        raise LocalDataError(f"--classes {p}: expected a map with classes (and image_size, mean, std) or a list")
    given = data.get("image_size")
    if image_size is not None and given is not None and given != image_size:
        raise LocalDataError(f"--classes {p} says image_size {given}, --img-size says {image_size}: make them agree")
    size = image_size if image_size is not None else given
    if size is None:
        raise LocalDataError(f"--classes {p} names no image_size: give --img-size (the model's input size)")
    mean, std = DEFAULT_STATS
    return RunData.from_wire({"classes": data.get("classes"), "image_size": size, "mean": data.get("mean", list(mean)),
                              "std": data.get("std", list(std))}, where=f"--classes {p}")


# -- reading -------------------------------------------------------------------------------------------

def scan_local_data(path: str | os.PathLike[str]) -> list[tuple[str, list[Path]]]:
    """The folder's classes and files, checked without decoding (no run description needed): a missing or
    unreadable path, a file beside the class folders, an empty or unreadable class folder, a nested folder,
    a file that is no image by its name. An npz gives [] (its checks need the run's classes)."""
    p = Path(path)
    if not p.exists():
        raise LocalDataError(f"--data {p}: no such file or folder; give the folder of class sub-folders (or the "
                             ".npz) on this device")
    if p.is_file():
        if p.suffix.lower() != ".npz":
            raise LocalDataError(f"--data {p}: a file that is not an .npz; give a folder with one sub-folder per "
                                 "class, or an .npz with x_train and y_train")
        return []
    entries = _listdir(p, f"--data {p}")
    loose = [e for e in entries if not e.startswith(".") and not (p / e).is_dir()]
    if loose:
        raise LocalDataError(f"--data {p}: {p / loose[0]} is a file beside the class folders; images go into "
                             "one sub-folder per class (PATH/<class>/<image>): move it into its class's folder")
    classes = sorted(e for e in entries if not e.startswith(".") and (p / e).is_dir())
    if not classes:
        raise LocalDataError(f"--data {p}: no class folders; put each class's images into PATH/<class name>/")
    out = []
    for name in classes:
        folder = p / name
        files = []
        for e in _listdir(folder, f"class folder {folder}"):
            if e.startswith("."):
                continue
            f = folder / e
            if f.is_dir():
                raise LocalDataError(f"{f} is a folder inside a class folder; each class folder holds its images "
                                     "directly: move them up or remove the folder")
            if f.suffix.lower() not in IMAGE_EXTENSIONS:
                raise LocalDataError(f"{f} is not an image file by its name (read: {', '.join(IMAGE_EXTENSIONS)}): "
                                     "remove it or convert it")
            files.append(f)
        if not files:
            raise LocalDataError(f"class folder {folder} is empty: put that class's images in it or remove it")
        out.append((name, files))
    return out


def _listdir(p: Path, what: str) -> list[str]:
    try:
        return sorted(os.listdir(p))
    except PermissionError:
        raise LocalDataError(f"{what} cannot be read by this process (permission denied): give the device's user "
                             "read access (chmod/chown), or put the data where it can read it") from None
    except OSError as exc:
        raise LocalDataError(f"{what} cannot be read: {exc.strerror or exc}") from None


def read_local_data(path: str | os.PathLike[str], run: RunData) -> tuple[ArrayImageSet, dict[str, int]]:
    """The device's data as one in-memory image set at the run's input size, labels as the run's class ids,
    and how many samples each class has (what the device logs, never sends)."""
    p = Path(path)
    scanned = scan_local_data(p)
    if p.is_file():
        return _read_npz(p, run)
    ids = {name: i for i, name in enumerate(run.classes)}
    unknown = [name for name, _ in scanned if name not in ids]
    if unknown:
        shown = ", ".join(run.classes[:20]) + (" ..." if len(run.classes) > 20 else "")
        raise LocalDataError(f"class folder {p / unknown[0]} is not a class of this run (the coordinator's classes: "
                             f"{shown}): rename it to one of them or remove it")
    samples = sorted(((f.name, name, f) for name, files in scanned for f in files))
    size = run.image_size
    images = np.empty((len(samples), size, size, 3), dtype=np.uint8)
    labels = np.empty(len(samples), dtype=np.int64)
    for row, (_, name, f) in enumerate(samples):
        images[row] = _decode(f, size)
        labels[row] = ids[name]
    counts = {name: len(files) for name, files in scanned}
    return ArrayImageSet(images, labels, image_size=size), counts


def _decode(f: Path, size: int) -> np.ndarray:
    """One file as uint8 (size, size, 3): RGB, resized down (never up) with the bilinear filter."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(f) as image:
            mode, (w, h) = image.mode, image.size
            if mode not in RGB_MODES:
                raise LocalDataError(f"{f} is a {mode} image (16-bit or floating point, not 8-bit colour or "
                                     "greyscale): save it as 8-bit RGB or greyscale (e.g. PNG or JPEG)")
            if w < size or h < size:
                raise LocalDataError(f"{f} is {w}x{h}, smaller than the run's {size}x{size} input: enlarging would "
                                     f"invent detail; give images of at least {size}x{size} (or run with a smaller "
                                     "--img-size)")
            image.draft("RGB", (size, size))
            rgb = image.convert("RGB")
            if rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
            return np.asarray(rgb, dtype=np.uint8)
    except LocalDataError:
        raise
    except PermissionError:
        raise LocalDataError(f"{f} cannot be read by this process (permission denied): give the device's user "
                             "read access") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise LocalDataError(f"{f} is not a readable image ({type(exc).__name__}: {exc}): it is corrupt or "
                             "truncated; replace or remove it") from None


def _read_npz(p: Path, run: RunData) -> tuple[ArrayImageSet, dict[str, int]]:
    try:
        with np.load(p, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files if key in ("x_train", "y_train", "classes")}
    except PermissionError:
        raise LocalDataError(f"{p} cannot be read by this process (permission denied)") from None
    except (OSError, ValueError) as exc:
        raise LocalDataError(f"{p} is not a readable pickle-free .npz ({exc}): write it with numpy.savez") from None
    missing = [k for k in ("x_train", "y_train") if k not in arrays]
    if missing:
        raise LocalDataError(f"{p} has no {', '.join(missing)}: a device's npz holds uint8 x_train (N, H, W, 3) and "
                             "integer y_train, with classes naming the labels")
    x, y = arrays["x_train"], arrays["y_train"]
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[3] != 3 or not len(x):
        raise LocalDataError(f"{p}: x_train is {x.dtype} {x.shape}, not a non-empty uint8 (N, H, W, 3) array")
    if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer):
        raise LocalDataError(f"{p}: y_train is {y.dtype} {y.shape}, not integers of shape ({len(x)},)")
    size = run.image_size
    if x.shape[1] < size or x.shape[2] < size:
        raise LocalDataError(f"{p}: its images are {x.shape[2]}x{x.shape[1]}, smaller than the run's {size}x{size} "
                             "input; give larger images (or run with a smaller --img-size)")
    ids = {name: i for i, name in enumerate(run.classes)}
    if "classes" in arrays:
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in arrays["classes"].tolist()]
        if y.size and (y.min() < 0 or y.max() >= len(names)):
            raise LocalDataError(f"{p}: y_train holds label {int(y.max() if y.max() >= len(names) else y.min())}, "
                                 f"outside its {len(names)} classes")
        used = sorted({names[int(v)] for v in np.unique(y)})
        unknown = [n for n in used if n not in ids]
        if unknown:
            raise LocalDataError(f"{p}: class {unknown[0]!r} is not a class of this run (the coordinator's classes: "
                                 f"{', '.join(run.classes[:20])}): relabel or drop its samples")
        labels = np.array([ids[names[int(v)]] for v in y], dtype=np.int64)
    else:
        if y.size and (y.min() < 0 or y.max() >= len(run.classes)):
            top = len(run.classes) - 1
            raise LocalDataError(f"{p}: y_train holds label {int(y.max() if y.max() > top else y.min())}, but the run "
                                 f"has {top + 1} classes (ids 0..{top}); add classes (the names of the labels) to the "
                                 "npz")
        labels = y.astype(np.int64)
    images = ArrayImageSet(x, labels, image_size=size)
    counts = {run.classes[int(c)]: int(n) for c, n in zip(*np.unique(labels, return_counts=True))}
    return images, counts


# -- writing (fedsga-edge partition) ----------------------------------------------------------------------

def _folder_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise LocalDataError(f"class name {name!r} cannot be a folder name; write the partition as npz instead")
    return name


def write_image_folder(dest: str | os.PathLike[str], images: np.ndarray, labels: np.ndarray,
                       classes: list[str]) -> int:
    """``dest/<class>/<position>.png``, losslessly, in the order given (``read_local_data`` restores it).
    Only the classes present get a folder (an empty one is an error on the device). Returns the count."""
    from PIL import Image

    root = Path(dest)
    root.mkdir(parents=True, exist_ok=False)
    width = max(6, len(str(len(images))))
    for row, (image, label) in enumerate(zip(images, labels)):
        folder = root / _folder_name(classes[int(label)])
        folder.mkdir(exist_ok=True)
        Image.fromarray(np.ascontiguousarray(image)).save(folder / f"{row:0{width}d}.png")
    return len(images)


def write_npz(dest: str | os.PathLike[str], images: np.ndarray, labels: np.ndarray, classes: list[str]) -> int:
    """The loaders' npz format (an empty test part), readable by ``--data`` and by ``--dataset npz:PATH``."""
    empty = np.empty((0, *images.shape[1:]), dtype=np.uint8)
    np.savez(dest, x_train=np.ascontiguousarray(images), y_train=np.asarray(labels, dtype=np.int64), x_test=empty,
             y_test=np.empty(0, dtype=np.int64), classes=np.array(classes))
    return len(images)
