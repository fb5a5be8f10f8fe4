"""Export artifacts shared by the export / backward / device / profile tests, built once per run.

Exports cost seconds each on a 2-core machine (the train export about two minutes), so every test
module asks this cache instead of exporting its own copy (a module-level cache: pytest fixtures in
separate modules would rebuild). Under pytest-xdist the workers share one folder for the run
(``FEDSGA_TEST_SHARED``, made by tests/conftest.py before the workers start): the first worker to ask
builds an artifact under a file lock, the others wait for it and read the same files. Tests only
read these folders (a test that changes a file copies the folder first).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import typer

_CACHE: dict[str, Path] = {}
FULL = bool(os.environ.get("FEDSGA_EDGE_FULL_TESTS"))


def _root() -> Path:
    """The run's shared folder (conftest.py), or a private one when this module is used outside pytest."""
    shared = os.environ.get("FEDSGA_TEST_SHARED")
    if shared:
        return Path(shared)
    root = Path(tempfile.mkdtemp(prefix="fedsga-export-tests-"))
    atexit.register(shutil.rmtree, root, True)
    os.environ["FEDSGA_TEST_SHARED"] = str(root)
    return root


def _built(name: str, build: Callable[[Path], None]) -> Path:
    """``root/name``, built by ``build(folder)`` once per run whichever process asks first."""
    if name not in _CACHE:
        root = _root()
        out = root / name
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also if the build fails)
            if not (root / f"{name}.done").exists():
                shutil.rmtree(out, ignore_errors=True)  # a build that failed in another worker
                build(out)
                (root / f"{name}.done").touch()
        _CACHE[name] = out
    return _CACHE[name]


# The "must show" command: resnet18_cifar at width 0.25, every candidate split, plus fp16 and int8
# on the bundled digits data (small calibration / evaluation sets to stay fast).
MUST_SHOW_ARGS = [
    "export",
    "--model",
    "resnet18_cifar",
    "--width",
    "0.25",
    "--fp16",
    "--int8",
    "--calib-data",
    "digits",
    "--calib-samples",
    "64",
    "--eval-samples",
    "96",
]


def cli_app() -> typer.Typer:
    """A throwaway root app with our two commands (the project's root is the lead's)."""
    from fedsga_edge.cli import export_cmd, profile_cmd

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:  # a callback keeps `export` / `profile` as sub-commands
        pass

    export_cmd.register(app)
    profile_cmd.register(app)
    return app


def must_show_artifacts() -> Path:
    """DIR from `fedsga-edge export --model resnet18_cifar --width 0.25 --out DIR` (+ fp16, int8)."""
    def build(out: Path) -> None:
        from typer.testing import CliRunner

        result = CliRunner().invoke(cli_app(), [*MUST_SHOW_ARGS, "--out", str(out)])
        assert result.exit_code == 0, result.output
        (out / "export.log").write_text(result.output)

    return _built("resnet18_cifar_w025", build)


def train_artifacts() -> Path:
    """resnet18_cifar width 0.25, splits 1 and 2 with --train: the backward / runtime / profile tests use
    both (split 2: stem, layer1, layer2: strided and 1x1 convs, BN; two runners of one device share one
    state); the ONNX device runs of the tests train at p_ref (split 2, the middle of 3 candidates) or
    split 1, which every test's seed picks (a split asked for but not exported fails the run, loudly).
    Split 3 (layer3: the same block types as layer2) is left out: its train export alone took 173 s of
    this fixture's 380 s, the slowest of the suite. FEDSGA_EDGE_FULL_TESTS=1 exports all three (and every
    test using this then runs on split 3's graphs too). One export for all of them."""
    def build(out: Path) -> None:
        from fedsga_edge.export.pipeline import ExportConfig, export_prefixes

        manifest = export_prefixes(ExportConfig(model="resnet18_cifar", width=0.25, out=out, train=True,
                                                splits=None if FULL else (1, 2)), log=lambda _: None)
        assert all(p["valid"] for p in manifest["prefixes"]), manifest

    return _built("resnet18_cifar_w025_train", build)


def device_artifacts() -> Path:
    """What a torch-free device of a FedSGA run needs: every split with --train (the same export)."""
    return train_artifacts()
