"""Data loaders against tiny fixtures written in each dataset's official on-disk format.

Nothing here touches the network: CIFAR is loaded with download=False, and the one test of a
failing download replaces torchvision's downloader with one that raises.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedsga_edge.data import (
    DATASETS,
    ArrayImageSet,
    DatasetBundle,
    DatasetError,
    FileImageSet,
    ImageSet,
    load_dataset,
    partition,
)
from fedsga_edge.data.datasets import CIFAR_STATS

# Colours far apart so that a decoded (lossy JPEG) image still tells which class wrote it.
COLOURS = [(220, 30, 30), (30, 220, 30), (30, 30, 220)]


def _check_split(split: ImageSet, size: int, count: int) -> np.ndarray:
    assert isinstance(split, ImageSet)
    assert len(split) == count and split.labels.shape == (count,) and split.labels.dtype == np.int64
    batch = split.get_batch(np.arange(count))
    assert batch.shape == (count, size, size, 3) and batch.dtype == np.uint8
    return batch


def _nearest_colour(batch: np.ndarray) -> list[int]:
    """Index in COLOURS of each image's mean colour."""
    means = batch.reshape(len(batch), -1, 3).mean(axis=1)
    return [int(np.argmin(np.abs(np.array(COLOURS) - mean).sum(axis=1))) for mean in means]


def _write_jpeg(path: Path, colour: tuple[int, int, int], size: tuple[int, int], mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).convert(mode).save(path, "JPEG", quality=95)


# ---------------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits() -> DatasetBundle:
    return load_dataset("digits")


def test_digits_is_the_stratified_sklearn_set_at_32px(digits: DatasetBundle) -> None:
    assert digits.name == "digits" and digits.num_classes == 10 and digits.classes == [str(d) for d in range(10)]
    assert digits.image_size == 32 and digits.domain_names is None and digits.train.domains is None
    train = _check_split(digits.train, 32, 1437)
    _check_split(digits.test, 32, 360)
    assert np.array_equal(train[..., 0], train[..., 2])  # grey replicated to RGB
    assert train.min() == 0 and train.max() == 255  # 0..16 stretched to 0..255
    counts = np.bincount(digits.test.labels, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # stratified 20 %
    assert 0.25 < digits.mean[0] < 0.35 and 0.25 < digits.std[0] < 0.4


def test_digits_is_sklearns_split_and_loading_it_imports_no_sklearn(digits: DatasetBundle) -> None:
    """The stored split (fedsga_edge/data/digits_split.py) is scikit-learn's own call, the images are its
    load_digits images upscaled, and a process that loads digits never imports scikit-learn."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from fedsga_edge.data.digits_split import split_indices

    ref = load_digits()
    train_idx, test_idx = train_test_split(np.arange(len(ref.target)), test_size=0.2, stratify=ref.target,
                                           random_state=0)
    stored_train, stored_test = split_indices()
    assert np.array_equal(stored_train, train_idx) and np.array_equal(stored_test, test_idx)
    assert np.array_equal(digits.train.labels, ref.target[train_idx])
    assert np.array_equal(digits.test.labels, ref.target[test_idx])
    eight = load_dataset("digits", image_size=8)  # bilinear 8 -> 8 is the identity: the raw 0..16 values, scaled
    raw = np.rint(ref.images[test_idx] * (255.0 / 16.0)).astype(np.uint8)
    assert np.array_equal(eight.test.images[..., 0], raw)
    code = "import sys; from fedsga_edge.data import load_dataset as f; f('digits'); print('sklearn' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr[-1000:]


def test_digits_split_is_deterministic_and_resizable(digits: DatasetBundle) -> None:
    small = load_dataset("digits", image_size=16, root="/nonexistent")  # root is ignored
    assert np.array_equal(small.train.labels, digits.train.labels)
    assert small.train.get_batch(np.arange(3)).shape == (3, 16, 16, 3) and small.image_size == 16


# ----------------------------------------------------------------------------------- CIFAR


def _write_cifar(root: Path, name: str) -> tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]], list[str]]:
    """Writes batches exactly as the official Python pickles: dicts with a (N, 3072) uint8 CHW-flat 'data'."""
    rng = np.random.default_rng(1)
    if name == "cifar10":
        folder, sizes, label_key = root / "cifar-10-batches-py", {"train": 3, "test": 4}, "labels"
        batch_files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
        classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
        meta_file, meta = "batches.meta", {"label_names": classes, "num_cases_per_batch": 3, "num_vis": 3072}
    else:
        folder, sizes, label_key = root / "cifar-100-python", {"train": 7, "test": 5}, "fine_labels"
        batch_files = {"train": ["train"], "test": ["test"]}
        classes = [f"fine_{i}" for i in range(100)]
        meta_file, meta = (
            "meta",
            {"fine_label_names": classes, "coarse_label_names": [f"coarse_{i}" for i in range(20)]},
        )
    folder.mkdir(parents=True)
    expected = {}
    for split, files in batch_files.items():
        images, labels = [], []
        for file in files:
            data = rng.integers(0, 256, size=(sizes[split], 3072), dtype=np.uint8)
            batch_labels = rng.integers(0, len(classes), size=sizes[split]).tolist()
            entry = {
                "batch_label": f"{file} of fixture",
                label_key: batch_labels,
                "data": data,
                "filenames": [f"img_{i}.png" for i in range(sizes[split])],
            }
            if name == "cifar100":
                entry["coarse_labels"] = [label // 5 for label in batch_labels]
            with open(folder / file, "wb") as handle:
                pickle.dump(entry, handle, protocol=2)
            images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            labels += batch_labels
        expected[split] = (np.concatenate(images), np.array(labels))
    with open(folder / meta_file, "wb") as handle:
        pickle.dump(meta, handle, protocol=2)
    return folder, expected, classes


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any download attempt fails as it does offline."""
    import torchvision.datasets.cifar

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", offline)


def _trust_fixture(monkeypatch: pytest.MonkeyPatch, name: str, folder: Path) -> None:
    """Points torchvision's expected MD5s at the fixture's files, so its unmodified loader reads them."""
    from torchvision.datasets import CIFAR10, CIFAR100
    from torchvision.datasets.utils import calculate_md5

    cls = CIFAR10 if name == "cifar10" else CIFAR100
    for attr in ("train_list", "test_list"):
        monkeypatch.setattr(cls, attr, [[file, calculate_md5(folder / file)] for file, _ in getattr(cls, attr)])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": calculate_md5(folder / cls.meta["filename"])})


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_reads_torchvision_pickles(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_download: None
) -> None:
    folder, expected, classes = _write_cifar(tmp_path, name)
    _trust_fixture(monkeypatch, name, folder)
    bundle = load_dataset(name, tmp_path, download=False)
    assert bundle.name == name and bundle.classes == classes and bundle.num_classes == len(classes)
    assert bundle.image_size == 32 and (bundle.mean, bundle.std) == CIFAR_STATS[name]
    for split in ("train", "test"):
        images, labels = expected[split]
        batch = _check_split(getattr(bundle, split), 32, len(labels))
        assert np.array_equal(batch, images)  # CHW rows came back as the same pixels in NHWC
        assert np.array_equal(getattr(bundle, split).labels, labels)
    resized = load_dataset(name, tmp_path, download=False, image_size=16)
    assert resized.image_size == 16 and resized.test.get_batch(np.array([0, 1])).shape == (2, 16, 16, 3)


def test_cifar_refuses_files_with_foreign_checksums(tmp_path: Path, no_download: None) -> None:
    folder, _, _ = _write_cifar(tmp_path, "cifar10")
    with pytest.raises(DatasetError, match="MD5 checksums differ") as info:
        load_dataset("cifar10", tmp_path, download=False)
    assert str(folder) in str(info.value)


def test_cifar_failed_download_says_how_to_get_it(tmp_path: Path, no_download: None) -> None:
    with pytest.raises(DatasetError) as info:
        load_dataset("cifar10", tmp_path, download=True)
    message = str(info.value)
    assert "download failed" in message and "network unreachable" in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in message
    assert "<root>/cifar-10-batches-py/{data_batch_1" in message and "batches.meta" in message


# ---------------------------------------------------------------------------- Tiny-ImageNet


def _write_tinyimagenet(root: Path) -> Path:
    base = root / "tiny-imagenet-200"
    wnids = ["n02", "n01", "n03"]  # not sorted, as in the official file
    base.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (base / "words.txt").write_text("n00\tentity\nn01\tgoldfish, Carassius auratus\nn02\ttabby, tabby cat\n")
    for wnid in wnids:
        colour = COLOURS[sorted(wnids).index(wnid)]
        for i in range(2):
            _write_jpeg(
                base / "train" / wnid / "images" / f"{wnid}_{i}.JPEG",
                colour,
                (64, 64),
                "L" if i and wnid == "n03" else "RGB",
            )
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text(f"{wnid}_0.JPEG\t0\t0\t63\t63\n")
    annotations = []
    for i, wnid in enumerate(["n03", "n01", "n02", "n01"]):
        _write_jpeg(base / "val" / "images" / f"val_{i}.JPEG", COLOURS[sorted(wnids).index(wnid)], (64, 64))
        annotations.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(annotations) + "\n")
    return base


def test_tinyimagenet_official_layout(tmp_path: Path) -> None:
    _write_tinyimagenet(tmp_path)
    bundle = load_dataset("tinyimagenet", tmp_path)
    assert bundle.classes == ["goldfish", "tabby", "n03"] and bundle.num_classes == 3  # sorted wnids
    assert bundle.image_size == 64 and bundle.domain_names is None
    train = _check_split(bundle.train, 64, 6)
    assert bundle.train.labels.tolist() == [0, 0, 1, 1, 2, 2]
    assert _nearest_colour(train)[:5] == [0, 0, 1, 1, 2]
    assert np.array_equal(train[5, ..., 0], train[5, ..., 1])  # the greyscale JPEG came back as RGB
    test = _check_split(bundle.test, 64, 4)
    assert bundle.test.labels.tolist() == [2, 0, 1, 0] == _nearest_colour(test)
    small = load_dataset("tinyimagenet", tmp_path, image_size=24)
    assert small.test.get_batch(np.array([1])).shape == (1, 24, 24, 3)


def test_tinyimagenet_missing_val_image_is_named(tmp_path: Path) -> None:
    base = _write_tinyimagenet(tmp_path)
    (base / "val" / "images" / "val_2.JPEG").unlink()
    with pytest.raises(DatasetError, match="val/images/val_2.JPEG"):
        load_dataset("tinyimagenet", tmp_path)


# -------------------------------------------------------------------------------- DomainNet


def _write_domainnet(root: Path) -> None:
    classes = ["aircraft_carrier", "airplane"]
    for domain, per_class in (("clipart", 3), ("real", 2), ("sketch", 1)):
        lines = {"train": [], "test": []}
        for label, name in enumerate(classes):
            for i in range(per_class):
                relative = f"{domain}/{name}/{domain}_{label:03d}_{i:06d}.jpg"
                _write_jpeg(
                    root / relative,
                    COLOURS[label],
                    (90 + 10 * i, 70),
                    "L" if (domain, label, i) == ("real", 1, 1) else "RGB",
                )
                lines["test" if i == 0 else "train"].append(f"{relative} {label}")
        (root / f"{domain}_train.txt").write_text("\n".join(lines["train"]) + "\n")
        if domain != "sketch":  # sketch has no test list: the default selection must leave it out
            (root / f"{domain}_test.txt").write_text("\n".join(lines["test"]) + "\n")


def test_domainnet_uses_domains_with_both_lists(tmp_path: Path) -> None:
    _write_domainnet(tmp_path)
    bundle = load_dataset("domainnet", tmp_path)
    assert bundle.domain_names == ["clipart", "real"] and bundle.classes == ["aircraft_carrier", "airplane"]
    assert bundle.image_size == 64 and bundle.num_classes == 2
    train = _check_split(bundle.train, 64, 6)
    assert bundle.train.domains is not None and bundle.train.domains.tolist() == [0, 0, 0, 0, 1, 1]
    assert bundle.train.labels.tolist() == [0, 0, 1, 1, 0, 1]
    assert _nearest_colour(train)[:5] == [0, 0, 1, 1, 0]
    assert np.array_equal(train[5, ..., 0], train[5, ..., 2])  # the greyscale JPEG came back as RGB
    _check_split(bundle.test, 64, 4)
    assert bundle.test.domains is not None and bundle.test.domains.tolist() == [0, 0, 1, 1]
    clients = partition(bundle.train.labels, 2, "domain", domains=bundle.train.domains, min_samples=1)
    assert [set(bundle.train.domains[c].tolist()) for c in clients] == [{0}, {1}]


def test_domainnet_selects_domains(tmp_path: Path) -> None:
    _write_domainnet(tmp_path)
    bundle = load_dataset("domainnet:real", tmp_path, image_size=32)
    assert bundle.domain_names == ["real"] and bundle.train.domains.tolist() == [0, 0]
    assert bundle.train.get_batch(np.array([1])).shape == (1, 32, 32, 3)
    with pytest.raises(DatasetError, match="missing sketch_train.txt or sketch_test.txt"):
        load_dataset("domainnet:clipart,sketch", tmp_path)
    with pytest.raises(DatasetError, match="unknown domain.*photos.*clipart, infograph, painting"):
        load_dataset("domainnet:photos", tmp_path)


def test_domainnet_missing_image_names_its_path(tmp_path: Path) -> None:
    _write_domainnet(tmp_path)
    bundle = load_dataset("domainnet:clipart", tmp_path)
    os.remove(bundle.train.paths[0])
    with pytest.raises(DatasetError, match="cannot read image .*clipart_000_000001.jpg"):
        bundle.train.get_batch(np.array([0]))


# -------------------------------------------------------------------------------------- npz


def test_npz_arrays(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x_train = rng.integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    x_test = np.full((2, 8, 8, 3), 77, dtype=np.uint8)
    np.savez(
        tmp_path / "tiny.npz",
        x_train=x_train,
        y_train=np.arange(6) % 3,
        x_test=x_test,
        y_test=np.array([2, 0]),
        classes=np.array(["a", "b", "c"]),
    )
    bundle = load_dataset(f"npz:{tmp_path / 'tiny.npz'}")
    assert bundle.name == "tiny" and bundle.classes == ["a", "b", "c"] and bundle.image_size == 8
    assert np.array_equal(_check_split(bundle.train, 8, 6), x_train)
    assert np.allclose(bundle.mean, x_train.reshape(-1, 3).mean(axis=0) / 255)
    assert np.allclose(bundle.std, x_train.reshape(-1, 3).std(axis=0) / 255)
    resized = load_dataset(f"npz:{tmp_path / 'tiny.npz'}", image_size=12)
    assert np.array_equal(_check_split(resized.test, 12, 2), np.full((2, 12, 12, 3), 77, dtype=np.uint8))


@pytest.mark.parametrize(
    ("arrays", "problem"),
    [
        ({"x_train": np.zeros((2, 4, 4, 3), np.uint8), "y_train": np.zeros(2, int)}, "missing x_test, y_test"),
        (
            {
                "x_train": np.zeros((2, 4, 4, 3)),
                "y_train": np.zeros(2, int),
                "x_test": np.zeros((1, 4, 4, 3), np.uint8),
                "y_test": np.zeros(1, int),
            },
            "x_train is float64",
        ),
        (
            {
                "x_train": np.zeros((2, 4, 4, 3), np.uint8),
                "y_train": np.zeros(2, int),
                "x_test": np.zeros((1, 4, 4, 3), np.uint8),
                "y_test": np.zeros(1, int),
                "classes": np.array([{"not": "data"}], dtype=object),
            },
            "pickle-free",
        ),
    ],
)
def test_npz_errors_name_problem_and_layout(tmp_path: Path, arrays: dict[str, np.ndarray], problem: str) -> None:
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DatasetError, match=problem) as info:
        load_dataset(f"npz:{tmp_path / 'bad.npz'}")
    assert "uint8 NHWC arrays x_train and x_test" in str(info.value)


def _domain_arrays() -> dict[str, np.ndarray]:
    """36 train / 9 test images in 3 domains of 3 classes, domain d coloured COLOURS[d]."""
    d_train, d_test = np.repeat(np.arange(3), 12), np.repeat(np.arange(3), 3)
    return {
        "x_train": np.array(COLOURS, dtype=np.uint8)[d_train][:, None, None, :].repeat(4, 1).repeat(4, 2),
        "y_train": np.arange(36) % 3,
        "x_test": np.array(COLOURS, dtype=np.uint8)[d_test][:, None, None, :].repeat(4, 1).repeat(4, 2),
        "y_test": np.arange(9) % 3,
        "d_train": d_train,
        "d_test": d_test,
        "domains": np.array(["amazon", "dslr", "webcam"]),
    }


def test_npz_domains_load_and_drive_the_domain_partition(tmp_path: Path) -> None:
    arrays = _domain_arrays()
    np.savez(tmp_path / "office.npz", **arrays)
    bundle = load_dataset(f"npz:{tmp_path / 'office.npz'}")
    assert bundle.domain_names == ["amazon", "dslr", "webcam"]
    assert np.array_equal(bundle.train.domains, arrays["d_train"]) and bundle.train.domains.dtype == np.int64
    assert np.array_equal(bundle.test.domains, arrays["d_test"])
    assert _nearest_colour(bundle.train.get_batch(np.arange(36))) == arrays["d_train"].tolist()
    clients = partition(bundle.train.labels, 6, "domain", domains=bundle.train.domains, alpha=0.5, min_samples=2)
    served = [set(bundle.train.domains[c].tolist()) for c in clients]
    assert all(len(s) == 1 for s in served) and sorted(s.pop() for s in served) == [0, 0, 1, 1, 2, 2]
    assert sorted(np.concatenate(clients).tolist()) == list(range(36))

    # without names the ids still load, named by their number; without ids there is no domain info
    del arrays["domains"]
    np.savez(tmp_path / "unnamed.npz", **arrays)
    assert load_dataset(f"npz:{tmp_path / 'unnamed.npz'}").domain_names == ["0", "1", "2"]
    np.savez(tmp_path / "plain.npz", **{k: v for k, v in arrays.items() if not k.startswith("d_")})
    plain = load_dataset(f"npz:{tmp_path / 'plain.npz'}")
    assert plain.domain_names is None and plain.train.domains is None and plain.test.domains is None


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"d_train": np.zeros(35, np.int64)}, r"d_train is int64 \(35,\), not integers of shape \(36,\)"),
        ({"d_train": np.zeros(36)}, r"d_train is float64 \(36,\), not integers"),
        ({"d_train": np.full(36, -1)}, "d_train holds negative domain ids"),
        ({"d_train": np.full(36, 3)}, "d_train holds domain id 3, out of range for 3 domains"),
        ({"d_test": np.full(9, 5)}, "d_test holds domain id 5, out of range for 3 domains"),
        ({"domains": np.array([1, 2, 3], np.int64)}, "domains is int64 .*not a non-empty 1-D array of str"),
    ],
    ids=["short", "float", "negative", "out-of-range", "test-out-of-range", "names-not-str"],
)
def test_npz_bad_domains_name_the_key(tmp_path: Path, change: dict[str, np.ndarray], problem: str) -> None:
    np.savez(tmp_path / "bad.npz", **(_domain_arrays() | change))
    with pytest.raises(DatasetError, match=problem) as info:
        load_dataset(f"npz:{tmp_path / 'bad.npz'}")
    assert "d_train and d_test" in str(info.value)  # the layout text names the optional keys


def test_npz_domain_names_without_ids_are_refused(tmp_path: Path) -> None:
    arrays = {k: v for k, v in _domain_arrays().items() if k != "d_train"}
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DatasetError, match="without d_train"):
        load_dataset(f"npz:{tmp_path / 'bad.npz'}")


# shared/ lies beside the checkout (developers and CI alike).
CIFAR_PACK = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10" / "jpegpack.npz"
OFFICE31 = Path(__file__).resolve().parents[2] / "shared" / "data" / "office31" / "office31_32.npz"


@pytest.mark.integration
@pytest.mark.skipif(not OFFICE31.exists(), reason="real Office-31 npz not present")
def test_real_office31_through_npz() -> None:
    bundle = load_dataset(f"npz:{OFFICE31}")
    assert (len(bundle.train), len(bundle.test), bundle.num_classes, bundle.image_size) == (3290, 820, 31, 32)
    assert bundle.domain_names == ["amazon", "dslr", "webcam"]
    assert np.bincount(bundle.train.domains).tolist() == [2254, 399, 637]  # per the pack's README
    assert np.bincount(bundle.test.domains).tolist() == [563, 99, 158]
    clients = partition(bundle.train.labels, 9, "domain", domains=bundle.train.domains, alpha=0.5)
    assert [set(bundle.train.domains[c].tolist()) for c in clients] == [{0}, {1}, {2}] * 3


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(not CIFAR_PACK.exists(), reason="real CIFAR-10 pack not present")
def test_real_cifar10_through_npz(tmp_path: Path) -> None:
    """Materializes the shared real CIFAR-10 once (about 10 s) and caches it for later runs."""
    cache = Path.home() / ".cache" / "fedsga-edge" / "cifar10.npz"
    if not cache.exists():
        made = tmp_path / "cifar10.npz"
        subprocess.run([sys.executable, str(CIFAR_PACK.parent / "materialize.py"), str(made)], check=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"cifar10.{os.getpid()}.part")
        shutil.copyfile(made, partial)
        os.replace(partial, cache)
    bundle = load_dataset(f"npz:{cache}")
    assert (len(bundle.train), len(bundle.test), bundle.num_classes, bundle.image_size) == (50000, 10000, 10, 32)
    assert bundle.classes == (CIFAR_PACK.parent / "classes.txt").read_text().split()
    assert np.bincount(bundle.train.labels).tolist() == [5000] * 10
    assert np.allclose(bundle.mean, CIFAR_STATS["cifar10"][0], atol=0.01)
    assert np.allclose(bundle.std, CIFAR_STATS["cifar10"][1], atol=0.01)


# ------------------------------------------------------------------------- errors and misc


@pytest.mark.parametrize(
    ("spec", "looked_at", "layout"),
    [
        (
            "cifar10",
            "cifar-10-batches-py",
            "<root>/cifar-10-batches-py/{data_batch_1, data_batch_2, data_batch_3, data_batch_4, data_batch_5, "
            + "test_batch, batches.meta}",
        ),
        ("cifar100", "cifar-100-python", "<root>/cifar-100-python/{train, test, meta}"),
        (
            "tinyimagenet",
            "tiny-imagenet-200",
            "<root>/tiny-imagenet-200/{wnids.txt, words.txt, train/<wnid>/images/*.JPEG",
        ),
        ("domainnet", "", "<root>/<domain>/<class>/<file>.jpg with list files <root>/<domain>_train.txt"),
    ],
)
def test_wrong_root_names_dataset_path_and_layout(tmp_path: Path, spec: str, looked_at: str, layout: str) -> None:
    with pytest.raises(DatasetError) as info:
        load_dataset(spec, tmp_path / "nowhere", download=False)
    message = str(info.value)
    assert message.startswith(f"{spec}:") and str(tmp_path / "nowhere" / looked_at) in message and layout in message


def test_no_download_sources_say_so(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not downloaded automatically.*tiny-imagenet-200.zip"):
        load_dataset("tinyimagenet", tmp_path)


@pytest.mark.parametrize(
    ("spec", "problem"), [("mnist", "unknown dataset"), ("cifar10:x", "takes no ':' option"), ("npz:", "needs a path")]
)
def test_bad_spec_lists_valid_ones(spec: str, problem: str) -> None:
    with pytest.raises(DatasetError, match=problem) as info:
        load_dataset(spec)
    if problem != "needs a path":
        assert all(name in str(info.value) for name in DATASETS) and "npz:PATH" in str(info.value)


def test_bad_image_size() -> None:
    with pytest.raises(DatasetError, match="image_size"):
        load_dataset("digits", image_size=0)


def test_array_image_set_resizes_once_and_validates() -> None:
    images = np.full((3, 10, 10, 3), 200, dtype=np.uint8)
    images[1] = 20
    images_set = ArrayImageSet(images, np.array([0, 1, 0]), domains=np.array([1, 1, 0]), image_size=5)
    assert images_set.images.shape == (3, 5, 5, 3) and images_set.get_batch(np.array([1]))[0].max() == 20
    assert images_set.domains.dtype == np.int64
    with pytest.raises(DatasetError, match="uint8"):
        ArrayImageSet(images.astype(np.float32), np.zeros(3, int))
    with pytest.raises(DatasetError, match="one entry per image"):
        ArrayImageSet(images, np.zeros(2, int))
    with pytest.raises(DatasetError, match="non-square"):
        ArrayImageSet(np.zeros((1, 4, 6, 3), np.uint8), np.zeros(1, int))
    assert isinstance(FileImageSet([], np.zeros(0, int), 8), ImageSet)


@pytest.mark.integration
def test_importing_the_data_layer_needs_numpy_only() -> None:
    modules = "('torch', 'torchvision', 'sklearn', 'PIL')"
    code = f"import sys, fedsga_edge.data; print([m for m in {modules} if m in sys.modules])"
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert result.stdout.strip() == "[]"
