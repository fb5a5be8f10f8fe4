"""Export artifacts shared by the export / backward / device / profile tests, built once per run.

Exports cost seconds each on a 2-core machine, so every test module asks this cache instead of
exporting its own copy (a module-level cache: pytest fixtures in separate modules would rebuild).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import typer

_CACHE: dict[str, Path] = {}
_ROOT = Path(tempfile.mkdtemp(prefix="fedsga-export-tests-"))
atexit.register(shutil.rmtree, _ROOT, True)

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
    if "must_show" not in _CACHE:
        from typer.testing import CliRunner

        out = _ROOT / "resnet18_cifar_w025"
        result = CliRunner().invoke(cli_app(), [*MUST_SHOW_ARGS, "--out", str(out)])
        assert result.exit_code == 0, result.output
        (out / "export.log").write_text(result.output)
        _CACHE["must_show"] = out
    return _CACHE["must_show"]


def train_artifacts() -> Path:
    """resnet18_cifar width 0.25, every candidate split with --train: the backward / runtime / profile
    tests use splits 1 and 2 (split 2: stem, layer1, layer2: strided and 1x1 convs, BN; two runners of
    one device share one state), the ONNX device tests all three (FedSGA may pick any split). One export
    for all of them: it is the slowest fixture of the suite."""
    if "train" not in _CACHE:
        from fedsga_edge.export.pipeline import ExportConfig, export_prefixes

        out = _ROOT / "resnet18_cifar_w025_train"
        manifest = export_prefixes(ExportConfig(model="resnet18_cifar", width=0.25, out=out, train=True),
                                   log=lambda _: None)
        assert all(p["valid"] for p in manifest["prefixes"]), manifest
        _CACHE["train"] = out
    return _CACHE["train"]


def device_artifacts() -> Path:
    """What a torch-free device of a FedSGA run needs: every split with --train (the same export)."""
    return train_artifacts()
