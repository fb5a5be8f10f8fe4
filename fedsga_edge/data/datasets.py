"""load_dataset: every supported dataset from its official on-disk layout, as one DatasetBundle.

Heavy dependencies are imported inside the loader that needs them (torchvision for CIFAR, Pillow for
resizing and image files; digits reads its file from the scikit-learn install without importing it), so
importing this module costs numpy only.

Normalisation statistics: CIFAR-10/100 use their standard published values; digits and npz
files are measured exactly on their train split at the returned image_size (a histogram pass,
well under a second for 50k images); Tiny-ImageNet and DomainNet use the ImageNet statistics,
because measuring them would decode every file of a large folder dataset.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .imagesets import ArrayImageSet, DatasetError, FileImageSet, ImageSet, channel_stats

DATASETS: tuple[str, ...] = ("digits", "cifar10", "cifar100", "tinyimagenet", "domainnet")
DOMAINNET_DOMAINS: tuple[str, ...] = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
DATA_ROOT_ENV = "FEDSGA_EDGE_DATA"

Stats = tuple[float, float, float]
# Mean and std over all train pixels (not the per-image std figures some code bases copy).
CIFAR_STATS: dict[str, tuple[Stats, Stats]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
IMAGENET_STATS: tuple[Stats, Stats] = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

TINYIMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
DOMAINNET_URL = "http://ai.bu.edu/M3SDA/"
# DomainNet photos are a few hundred pixels wide; 64 keeps CPU runs affordable.
DOMAINNET_DEFAULT_SIZE = 64
SPEC_HELP = "digits, cifar10, cifar100, tinyimagenet, domainnet[:DOMAIN,...], npz:PATH"


@dataclass
class DatasetBundle:
    """Both splits of one dataset plus what a model and a normaliser need to know about them."""

    name: str
    train: ImageSet
    test: ImageSet
    num_classes: int
    classes: list[str]
    image_size: int
    mean: Stats
    std: Stats
    domain_names: list[str] | None = None


def default_root() -> Path:
    """$FEDSGA_EDGE_DATA, else ~/.cache/fedsga-edge/data: one place that survives across working dirs."""
    return Path(os.environ.get(DATA_ROOT_ENV) or Path.home() / ".cache" / "fedsga-edge" / "data")


def load_dataset(
    spec: str,
    root: str | os.PathLike[str] | None = None,
    *,
    download: bool = True,
    image_size: int | None = None,
) -> DatasetBundle:
    """Loads ``spec`` (one of DATASETS, ``domainnet:clipart,real`` or ``npz:PATH``) from ``root``.

    ``root`` defaults to :func:`default_root`; digits and npz ignore it. ``download`` only
    applies to CIFAR (torchvision fetches it). ``image_size`` defaults to the native size
    (digits and CIFAR 32, Tiny-ImageNet 64, DomainNet 64, npz the stored size).
    Every failure a user can cause raises DatasetError naming the expected layout.
    """
    name, _, option = spec.partition(":")
    name = name.strip().lower()
    if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1):
        raise DatasetError(f"image_size must be a positive int, got {image_size!r}")
    if name == "npz":
        if not option:
            raise DatasetError("npz needs a path: 'npz:/path/to/file.npz'")
        return _load_npz(Path(option).expanduser(), image_size)
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {spec!r}; valid: {SPEC_HELP}")
    if option and name != "domainnet":
        raise DatasetError(f"{name} takes no ':' option (got {spec!r}); valid: {SPEC_HELP}")
    if name == "digits":
        return _load_digits(image_size)
    base = Path(root).expanduser() if root is not None else default_root()
    if name in CIFAR_STATS:
        return _load_cifar(name, base, download, image_size)
    if name == "tinyimagenet":
        return _load_tinyimagenet(base, image_size)
    return _load_domainnet(base, option, image_size)


def _array_bundle(
    name: str, train: ArrayImageSet, test: ArrayImageSet, classes: list[str], stats: tuple[Stats, Stats] | None
) -> DatasetBundle:
    mean, std = stats if stats is not None else channel_stats(train.images)
    return DatasetBundle(name, train, test, len(classes), classes, train.image_size, mean, std)


def _load_digits(image_size: int | None) -> DatasetBundle:
    """scikit-learn's bundled 8x8 digits as S x S RGB (S=32 by default): real data with zero setup.

    Each image is resized once from 8x8 straight to S x S with PIL's bilinear filter on the float
    0..16 values, then scaled to 0..255, rounded and replicated to three channels. The 80/20 split
    is stratified by label with seed 0, so it is identical on every machine: scikit-learn's
    ``train_test_split``, stored (``digits_split``). The data file is read from the scikit-learn install
    without importing scikit-learn (about a CPU-second per process, every agent of a digits run).
    """
    import gzip
    import importlib.util

    from PIL import Image

    from .digits_split import split_indices

    spec = importlib.util.find_spec("sklearn")
    where = next(iter(spec.submodule_search_locations or ()), None) if spec is not None else None
    csv = Path(where) / "datasets" / "data" / "digits.csv.gz" if where else None
    if csv is None or not csv.is_file():
        raise DatasetError("digits ships with scikit-learn, which is not installed: pip install scikit-learn")
    with gzip.open(csv) as f:
        table = np.loadtxt(f, delimiter=",")  # what sklearn.datasets.load_digits reads: 64 pixels, then the label
    size = image_size or 32
    gray = np.empty((len(table), size, size), dtype=np.uint8)
    for row, flat in enumerate(table[:, :-1]):
        image = flat.reshape(8, 8)
        upscaled = np.asarray(Image.fromarray(image.astype(np.float32)).resize((size, size), Image.Resampling.BILINEAR))
        gray[row] = np.clip(np.rint(upscaled * (255.0 / 16.0)), 0, 255)
    images = np.repeat(gray[..., None], 3, axis=3)
    labels = table[:, -1].astype(np.int64)
    train_idx, test_idx = split_indices()
    if len(labels) != len(train_idx) + len(test_idx):
        raise DatasetError(f"{csv} holds {len(labels)} digits, the stored split {len(train_idx) + len(test_idx)}")
    train = ArrayImageSet(images[train_idx], labels[train_idx])
    test = ArrayImageSet(images[test_idx], labels[test_idx])
    return _array_bundle("digits", train, test, [str(d) for d in range(10)], None)


def _load_cifar(name: str, root: Path, download: bool, image_size: int | None) -> DatasetBundle:
    """CIFAR through torchvision's own loader, which verifies the MD5 of every original pickle.

    A copy that fails that check (corrupted, or re-encoded, e.g. as JPEG) is refused;
    re-encoded copies load through the ``npz:`` spec instead.
    """
    try:
        from torchvision.datasets import CIFAR10, CIFAR100
    except ImportError as exc:
        raise DatasetError(f"{name} is read with torchvision, which is not installed: pip install torchvision") from exc
    cls = CIFAR10 if name == "cifar10" else CIFAR100
    folder = root / cls.base_folder
    files = [file for file, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    try:
        train_raw = cls(str(root), train=True, download=download)
        test_raw = cls(str(root), train=False)
    # torchvision raises RuntimeError for missing or corrupt files, and a download can fail with
    # network, HTTP, tar or disk errors of many types; each becomes the one error below, chained.
    except Exception as exc:
        missing = [file for file in files if not (folder / file).is_file()]
        problem = (
            f"missing {', '.join(missing)}"
            if missing
            else "the files are there but their MD5 checksums differ from the originals (corrupted or re-encoded)"
        )
        attempt = "download failed" if download else "download=False"
        raise DatasetError(
            f"{name}: cannot load {folder}: {problem} ({attempt}: {exc}). Expected torchvision's layout "
            f"<root>/{cls.base_folder}/{{{', '.join(files)}}} holding the original Python pickles. Get it with "
            f"load_dataset({name!r}, root, download=True) on a machine with internet, or download {cls.url} "
            f"and extract it into {root}."
        ) from exc
    train = ArrayImageSet(train_raw.data, np.asarray(train_raw.targets), image_size=image_size)
    test = ArrayImageSet(test_raw.data, np.asarray(test_raw.targets), image_size=image_size)
    return _array_bundle(name, train, test, list(train_raw.classes), CIFAR_STATS[name])


def _read_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _load_tinyimagenet(root: Path, image_size: int | None) -> DatasetBundle:
    """Tiny-ImageNet-200 from the official zip's layout; the labelled val split serves as test.

    Labels index the sorted wnids (the order torchvision's ImageFolder gives train/); class names
    are the first synonym in words.txt, or the wnid where words.txt lacks it.
    """
    base = root / "tiny-imagenet-200"
    layout = (
        "<root>/tiny-imagenet-200/{wnids.txt, words.txt, train/<wnid>/images/*.JPEG, "
        "val/images/*.JPEG, val/val_annotations.txt}"
    )

    def fail(problem: str) -> DatasetError:
        return DatasetError(
            f"tinyimagenet: {problem} (looked in {base}). Expected the official layout {layout}. "
            f"It is not downloaded automatically: fetch {TINYIMAGENET_URL} and unzip it into {root}."
        )

    for required in ("wnids.txt", "val/val_annotations.txt"):
        if not (base / required).is_file():
            raise fail(f"missing {required}")
    wnids = sorted(_read_lines(base / "wnids.txt"))
    label_of = {wnid: label for label, wnid in enumerate(wnids)}
    words: dict[str, str] = {}
    if (base / "words.txt").is_file():
        for line in _read_lines(base / "words.txt"):
            wnid, _, names = line.partition("\t")
            words[wnid] = names.split(",")[0].strip()
    classes = [words.get(wnid) or wnid for wnid in wnids]

    train_paths: list[Path] = []
    train_labels: list[int] = []
    for wnid, label in label_of.items():
        folder = base / "train" / wnid / "images"
        if not folder.is_dir():
            raise fail(f"missing train/{wnid}/images/")
        files = sorted(name for name in os.listdir(folder) if name.lower().endswith(".jpeg"))
        if not files:
            raise fail(f"no .JPEG files in train/{wnid}/images/")
        train_paths += [folder / name for name in files]
        train_labels += [label] * len(files)

    val_folder = base / "val" / "images"
    present = set(os.listdir(val_folder)) if val_folder.is_dir() else set()
    test_paths: list[Path] = []
    test_labels: list[int] = []
    for number, line in enumerate(_read_lines(base / "val" / "val_annotations.txt"), start=1):
        fields = line.split()
        if len(fields) < 2 or fields[1] not in label_of:
            raise fail(f"val/val_annotations.txt line {number} is not '<file> <wnid from wnids.txt> ...': {line!r}")
        if fields[0] not in present:
            raise fail(f"val/images/{fields[0]} listed in val_annotations.txt is missing")
        test_paths.append(val_folder / fields[0])
        test_labels.append(label_of[fields[1]])

    size = image_size or 64
    train = FileImageSet(train_paths, np.array(train_labels), size)
    test = FileImageSet(test_paths, np.array(test_labels), size)
    mean, std = IMAGENET_STATS
    return DatasetBundle("tinyimagenet", train, test, len(classes), classes, size, mean, std)


def _load_domainnet(root: Path, option: str, image_size: int | None) -> DatasetBundle:
    """DomainNet from the official image folders and <domain>_{train,test}.txt list files.

    ``option`` selects domains (``clipart,real``); by default every domain whose two list files
    exist is used. Domain ids index ``domain_names`` in that order. Labels are the list files'
    own; a class's name is the folder its images sit in. Images load lazily at 64 px by default.
    """
    layout = (
        "<root>/<domain>/<class>/<file>.jpg with list files <root>/<domain>_train.txt and "
        "<root>/<domain>_test.txt, one '<domain>/<class>/<file>.jpg <label>' per line"
    )

    def fail(problem: str) -> DatasetError:
        return DatasetError(
            f"domainnet: {problem} (looked in {root}). Expected the official layout {layout}, domains among "
            f"{', '.join(DOMAINNET_DOMAINS)}. It is not downloaded automatically: get the images and the "
            f"train/test lists from {DOMAINNET_URL} and extract them into {root}."
        )

    def has_lists(domain: str) -> bool:
        return all((root / f"{domain}_{split}.txt").is_file() for split in ("train", "test"))

    if option:
        domains = list(dict.fromkeys(part.strip().lower() for part in option.split(",") if part.strip()))
        unknown = [domain for domain in domains if domain not in DOMAINNET_DOMAINS]
        if unknown or not domains:
            raise fail(f"unknown domain(s) {', '.join(unknown) or repr(option)}")
        for domain in domains:
            if not has_lists(domain):
                raise fail(f"missing {domain}_train.txt or {domain}_test.txt")
    else:
        domains = [domain for domain in DOMAINNET_DOMAINS if has_lists(domain)]
        if not domains:
            raise fail("no <domain>_train.txt / <domain>_test.txt pair found")
    for domain in domains:
        if not (root / domain).is_dir():
            raise fail(f"missing the image folder {domain}/")

    names: dict[int, str] = {}

    def read_split(split: str) -> tuple[list[Path], list[int], list[int]]:
        paths: list[Path] = []
        labels: list[int] = []
        domain_ids: list[int] = []
        for domain_id, domain in enumerate(domains):
            list_file = f"{domain}_{split}.txt"
            for number, line in enumerate(_read_lines(root / list_file), start=1):
                fields = line.rsplit(None, 1)
                parts = fields[0].split("/")
                if len(fields) != 2 or len(parts) != 3 or not fields[1].isdigit():
                    raise fail(f"{list_file} line {number} is not '<domain>/<class>/<file> <label>': {line!r}")
                label = int(fields[1])
                if names.setdefault(label, parts[1]) != parts[1]:
                    raise fail(
                        f"{list_file} line {number} gives label {label} to class {parts[1]}, elsewhere {names[label]}"
                    )
                paths.append(root / fields[0])
                labels.append(label)
                domain_ids.append(domain_id)
        return paths, labels, domain_ids

    train_split = read_split("train")
    test_split = read_split("test")
    if not train_split[0]:
        raise fail(f"the train lists of {', '.join(domains)} are empty")
    classes = [names.get(label, f"class_{label}") for label in range(max(names) + 1)]
    size = image_size or DOMAINNET_DEFAULT_SIZE
    train = FileImageSet(train_split[0], np.array(train_split[1]), size, np.array(train_split[2]))
    test = FileImageSet(test_split[0], np.array(test_split[1]), size, np.array(test_split[2]))
    mean, std = IMAGENET_STATS
    return DatasetBundle("domainnet", train, test, len(classes), classes, size, mean, std, domain_names=domains)


def _load_npz(path: Path, image_size: int | None) -> DatasetBundle:
    """A plain array file (a re-encoded or pre-resized copy of a dataset); read without unpickling.

    Optional ``d_train`` / ``d_test`` carry domain ids (e.g. Office-31's three domains) so that
    ``--partition domain`` works on an npz as it does on DomainNet; ``domains`` names the ids.
    """
    layout = (
        "a .npz holding uint8 NHWC arrays x_train and x_test (3 channels), integer label arrays y_train "
        "and y_test, and optionally classes (an array of str) and, for a domain partition, non-negative "
        "integer domain id arrays d_train and d_test (one per sample) with domains (an array of str, "
        "the name of each id)"
    )

    def fail(problem: str) -> DatasetError:
        return DatasetError(f"npz: {problem} ({path}). Expected {layout}.")

    if not path.is_file():
        raise fail("no such file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as exc:
        raise fail(f"not a readable pickle-free .npz: {exc}") from exc
    missing = [key for key in ("x_train", "y_train", "x_test", "y_test") if key not in arrays]
    if missing:
        raise fail(f"missing {', '.join(missing)}")
    for split in ("train", "test"):
        images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
            raise fail(f"x_{split} is {images.dtype} {images.shape}, not uint8 (N, H, W, 3)")
        if labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer):
            raise fail(f"y_{split} is {labels.dtype} {labels.shape}, not integers of shape ({len(images)},)")
        if labels.size and labels.min() < 0:
            raise fail(f"y_{split} holds negative labels")
    if not len(arrays["x_train"]):
        raise fail("x_train is empty")
    top = int(max(arrays["y_train"].max(), arrays["y_test"].max(initial=0)))
    classes = [str(name) for name in arrays["classes"]] if "classes" in arrays else [str(c) for c in range(top + 1)]
    if top >= len(classes):
        raise fail(f"label {top} is out of range for {len(classes)} classes")
    domain_ids, domain_names = _npz_domains(arrays, fail)
    try:
        train = ArrayImageSet(arrays["x_train"], arrays["y_train"], domain_ids["train"], image_size=image_size)
        test = ArrayImageSet(arrays["x_test"], arrays["y_test"], domain_ids["test"], image_size=train.image_size)
    except DatasetError as exc:
        raise fail(str(exc)) from exc
    bundle = _array_bundle(path.stem, train, test, classes, None)
    bundle.domain_names = domain_names
    return bundle


def _npz_domains(
    arrays: dict[str, np.ndarray], fail: Callable[[str], DatasetError]
) -> tuple[dict[str, np.ndarray | None], list[str] | None]:
    """Checks the optional d_train / d_test / domains arrays; ids are per split, names shared.

    Checked here rather than left to ArrayImageSet so that a bad file fails at load time with the
    key's name, not later inside partition() as an out-of-range domain or a shape mismatch.
    """
    names: list[str] | None = None
    if "domains" in arrays:
        raw = arrays["domains"]
        if raw.ndim != 1 or not len(raw) or raw.dtype.kind not in "US":
            raise fail(f"domains is {raw.dtype} {raw.shape}, not a non-empty 1-D array of str")
        names = [name.decode() if isinstance(name, bytes) else str(name) for name in raw.tolist()]
    ids: dict[str, np.ndarray | None] = {}
    for split in ("train", "test"):
        key = f"d_{split}"
        if key not in arrays:
            ids[split] = None
            continue
        values, count = arrays[key], len(arrays[f"y_{split}"])
        if values.shape != (count,) or (values.size and not np.issubdtype(values.dtype, np.integer)):
            raise fail(f"{key} is {values.dtype} {values.shape}, not integers of shape ({count},)")
        if values.size and values.min() < 0:
            raise fail(f"{key} holds negative domain ids (min {int(values.min())})")
        if names is not None and values.size and values.max() >= len(names):
            raise fail(f"{key} holds domain id {int(values.max())}, out of range for {len(names)} domains")
        ids[split] = values.astype(np.int64)
    if ids["train"] is None and (ids["test"] is not None or names is not None):
        raise fail("d_test or domains is given without d_train")
    if names is None and ids["train"] is not None:
        top = max(int(v.max(initial=-1)) for v in ids.values() if v is not None)
        names = [str(d) for d in range(top + 1)]
    return ids, names
