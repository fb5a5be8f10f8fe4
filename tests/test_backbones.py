"""Every registered backbone, with no table kept here: exact splits, its units, aggregation and export.

The contract is the model's (``SplitModel.unit_of``), not a parameter-name convention: the throwaway
backbone registered below names its head ``classifier.*`` and still exports, runs a split round in
``run_simulation`` and aggregates, with no edit anywhere else.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from _export_artifacts import MUST_SHOW_ARGS, must_show_artifacts
from torch import Tensor, nn

from fedsga_edge.method.aggregation import DeviceUpdate, aggregate_round, group_by_unit
from fedsga_edge.models import SplitModel, builtin_models, create_model, list_models, model_entry, register_model
from fedsga_edge.models.prompts import PromptBias


# -- a throwaway backbone: this file and its decorator are all it takes -------------------------------------
class _Stem(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn, self.prompt = nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), PromptBias()

    def forward(self, x: Tensor, prompts: Tensor | None = None) -> Tensor:
        return self.prompt(F.relu(self.bn(self.conv(x))), prompts)


class _Conv(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


class ToySplit(SplitModel):
    """Four blocks, splits after 1, 2, 3; the head lives under ``classifier``, not ``head``."""

    head_name = "classifier"
    interface_pool_axes = (2, 3)

    def __init__(self, num_classes: int, img_size: int, channels: int) -> None:
        blocks = [_Stem(channels), _Conv(channels), _Conv(channels), _Conv(channels)]
        super().__init__(blocks, nn.Linear(channels, num_classes), (1, 2, 3), channels, channels, img_size)

    def pool(self, h: Tensor) -> Tensor:
        return h.mean(dim=(2, 3))


TOY = "toy_split_net"


@register_model(small={"num_classes": 10})
def toy_split_net(num_classes: int = 10, img_size: int = 32, channels: int = 8) -> ToySplit:
    """A throwaway four-block CNN whose head is ``classifier.*`` (registered by tests/test_backbones.py)."""
    return ToySplit(num_classes, img_size, channels)


def _models_heavy_full() -> list:
    """Every registered model; a heavy one marked ``full`` (FEDSGA_EDGE_FULL_TESTS=1 runs it, `-m full` picks it)."""
    return [pytest.param(n, marks=pytest.mark.full(f"{n} is registered heavy: seconds and GBs even small"))
            if model_entry(n).heavy else n for n in list_models()]


def _small(name: str) -> SplitModel:
    torch.manual_seed(0)
    return create_model(name, **model_entry(name).small).eval()


# -- the registry -------------------------------------------------------------------------------------------
def test_the_package_catalog_is_what_registers() -> None:
    """The torch-free catalog (the CLI's --model help) names exactly the package's registered backbones."""
    own = {n for n in list_models() if model_entry(n).build.__module__.startswith("fedsga_edge.models.")}
    assert own == set(builtin_models()) and own
    assert TOY in list_models() and TOY not in builtin_models()
    with pytest.raises(ValueError, match="registered twice"):
        register_model(toy_split_net)


# -- every registered backbone ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list_models())
def test_prefix_then_suffix_equals_full_forward_exactly(name: str) -> None:
    model = _small(name)
    x = torch.randn(3, 3, model.input_size, model.input_size)
    prompts = model.init_prompts(4, torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x, prompts)
        assert full.shape == (3, model.head.out_features)
        for k in range(1, model.num_splits + 1):
            depth = model.depth_of(k)
            z = model.prefix(x, depth, prompts)
            assert tuple(z.shape[1:]) == model.interface_shape(depth, 4)
            assert z.shape[1] - model.interface_shape(depth)[0] in (0, model.prompt_positions(4))
            assert torch.equal(model.head(model.suffix(z, depth)), full), f"split {k} is not exact"
        assert model.interface_pool(model.prefix(x, model.depth_of(1), prompts)).shape == (3, model.phi_input_dim)


@pytest.mark.parametrize("name", list_models())
def test_every_weight_belongs_to_the_unit_that_owns_it(name: str) -> None:
    model = _small(name)
    owner = {id(t): j for j, m in enumerate([*model.blocks, model.head]) for t in m.state_dict(keep_vars=True).values()}
    state = model.state_dict(keep_vars=True)
    assert {k: model.unit_of(k) for k in state} == {k: owner[id(t)] for k, t in state.items()}
    assert sorted(group_by_unit(state, model.unit_of)) == list(range(model.num_blocks + 1))
    with pytest.raises(ValueError, match="'blocks.0.nope'"):
        model.unit_of("blocks.0.nope")


@pytest.mark.parametrize("name", _models_heavy_full())  # four float copies of the model: GBs for a heavy one
def test_every_unit_aggregates_by_the_models_units(name: str) -> None:
    """Split-1 device (100 samples), FedAvg device (300) and the server's copy: hand-computed means per unit."""
    model = _small(name)
    L, d1 = model.num_blocks, model.depth_of(1)
    glob = group_by_unit(model.state_dict(), model.unit_of)

    def shifted(units: dict[int, dict[str, Tensor]], c: float) -> dict[int, dict[str, Tensor]]:
        return {j: {k: v + c if v.is_floating_point() else v for k, v in s.items()} for j, s in units.items()}

    a = DeviceUpdate("a", d1, 100, {j: s for j, s in shifted(glob, 1.0).items() if j < d1})
    b = DeviceUpdate("b", L + 1, 300, shifted(glob, 3.0))
    new = aggregate_round(glob, [a, b], shifted(glob, 2.0))
    for j, s in new.items():
        want = 2.5 if j < d1 else 2.75  # (100*1 + 300*3) / 400, then (100*2 + 300*3) / 400 through the server
        for k, v in s.items():
            if v.is_floating_point():
                torch.testing.assert_close(v, glob[j][k] + want, msg=f"{k} (unit {j})")
    model.load_state_dict({k: v for s in new.values() for k, v in s.items()}, strict=True)


def _export_split(name: str) -> int:
    """The deepest split holds every block type; a heavy backbone exports its first one only."""
    return 1 if model_entry(name).heavy else _small(name).num_splits


@pytest.mark.slow
@pytest.mark.parametrize("name", _models_heavy_full())
def test_every_registered_model_exports_and_validates(name: str, tmp_path) -> None:
    from fedsga_edge.export.manifest import read_manifest, sha256_file
    from fedsga_edge.export.onnx_prefix import file_opset
    from fedsga_edge.export.pipeline import ExportConfig, export_prefixes

    if MUST_SHOW_ARGS[MUST_SHOW_ARGS.index("--model") + 1] == name:  # every split exported by that fixture already
        out = must_show_artifacts()
        m = read_manifest(out)
        p = m["prefixes"][-1]
    else:
        m = export_prefixes(_export_config(name, tmp_path, _export_split(name)), log=lambda _: None)
        (p,) = m["prefixes"]
        out = tmp_path
    assert p["valid"], p["validation"]
    assert p["validation"]["batch"] == 3 and p["validation"]["max_abs_diff"] <= 1e-4
    assert sha256_file(out / p["file"]) == p["sha256"]
    assert p["macs_vs_flops"] == pytest.approx(1.0, abs=0.02)
    assert file_opset(out / p["file"]) == 18
    model = create_model(name, **_options(m["config"]))
    assert m["model"]["units"] == {k: model.unit_of(k) for k in model.state_dict()}
    assert m["model"]["interface_pool_axes"] == list(model.interface_pool_axes)
    assert m["model"]["prompts_as_tokens"] == (model.prompt_positions(1) == 1)


def _export_config(name: str, out, split: int, **kw):
    from dataclasses import fields

    from fedsga_edge.export.pipeline import ExportConfig

    own = {f.name for f in fields(ExportConfig)}
    small = dict(model_entry(name).small)
    return ExportConfig(model=name, out=out, splits=(split,), **{k: v for k, v in small.items() if k in own},
                        model_args={k: v for k, v in small.items() if k not in own}, **kw)


def _options(config: dict) -> dict:
    return {"width": config["width"], "img_size": config["img_size"], "num_classes": config["num_classes"],
            **config.get("model_args", {})}


@pytest.mark.slow
def test_opset_17_is_converted_after_export(tmp_path) -> None:
    from fedsga_edge.export.onnx_prefix import file_opset
    from fedsga_edge.export.pipeline import export_prefixes

    (p,) = export_prefixes(_export_config("resnet18", tmp_path, 1, opset=17), log=lambda _: None)["prefixes"]
    assert p["valid"], p["validation"]
    assert file_opset(tmp_path / p["file"]) == 17
    assert any(c["text"] == "ONNX opset is 17" and c["ok"] for c in p["validation"]["checks"])


# -- the throwaway backbone end to end ---------------------------------------------------------------------
def _round_weights(monkeypatch) -> list[tuple[bool, int | None, set[str]]]:
    """(full, split, weight names) of every round_start a device receives."""
    from fedsga_edge.device.role import SplitClient

    seen: list[tuple[bool, int | None, set[str]]] = []
    handle = SplitClient.handle

    def spy(self, msg):
        if msg.kind == "round_start":
            seen.append((bool(msg.body.get("full")), msg.body.get("split"), set(msg.body.get("weights") or {})))
        return handle(self, msg)

    monkeypatch.setattr(SplitClient, "handle", spy)
    return seen


def _run(tmp_path, digits, strategy: str) -> dict:
    from fedsga_edge.config import RunConfig, TrainConfig
    from fedsga_edge.simulation import run_simulation

    cfg = RunConfig(dataset="digits", model=TOY, clients=2, rounds=1, strategy=strategy, split=1, seed=0,
                    device="cpu", train=TrainConfig(local_epochs=1, batch_size=16, max_batches=2))
    run_simulation(cfg, tmp_path, bundle=digits)
    return torch.load(tmp_path / "checkpoint.pt", weights_only=False)["model"]


def test_a_backbone_registered_here_runs_a_split_round(tmp_path, digits, monkeypatch) -> None:
    seen = _round_weights(monkeypatch)
    final = _run(tmp_path, digits, "static")
    model = _small(TOY)
    assert set(final) == set(model.state_dict()) and any(k.startswith("classifier.") for k in final)
    assert seen and all(not full and split == 1 for full, split, _ in seen)
    below = {k for k in final if model.unit_of(k) < model.depth_of(1)}
    assert all(names == below for _, _, names in seen)  # each device got exactly its prefix's units
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("round") == 1 for r in records)


def test_a_head_not_named_head_reaches_fedavg_devices(tmp_path, digits, monkeypatch) -> None:
    """The bug this contract fixes: a head outside ``head.*`` silently missed every FedAvg round start."""
    seen = _round_weights(monkeypatch)
    final = _run(tmp_path, digits, "fedavg")
    assert seen and all(full for full, _, _ in seen)
    assert all(names == set(final) for _, _, names in seen), "a FedAvg device must get every unit, the head too"


@pytest.mark.slow
def test_a_backbone_registered_here_exports_its_units_for_the_onnx_device(tmp_path) -> None:
    from fedsga_edge.export.pipeline import export_prefixes

    m = export_prefixes(_export_config(TOY, tmp_path, 2, train=True), log=lambda _: None)
    (p,) = m["prefixes"]
    assert p["valid"], p["validation"]
    units = m["model"]["units"]
    assert units["classifier.weight"] == units["classifier.bias"] == 4
    assert not any(k.startswith("head.") for k in units)
    assert all(units[n] < p["depth"] for n in p["train"]["params"])


# -- what the torch-free device reads instead of asking the model ------------------------------------------
def _manifest(**model: object) -> dict:
    base = {"arch": TOY, "num_classes": 10, "prompts_m": 4, "units": {"classifier.weight": 4},
            "interface_pool_axes": [2, 3], "prompts_as_tokens": False, "prompt_std": 1.0}
    return {"model": base | model, "prefixes": [{"split": 1, "train": {"forward_file": "f.onnx"}}]}


def test_the_onnx_device_reads_the_contract_from_the_manifest() -> None:
    from fedsga_edge.device.onnx_backend import check_artifacts
    from fedsga_edge.device.runtime import ArtifactError

    def check(manifest: dict, prompts_m: int) -> None:
        check_artifacts(manifest, model=TOY, width=None, num_classes=10, img_size=None, prompts_m=prompts_m)

    check(_manifest(), 0)  # prompts as a bias: zero prompts are no prompts
    with pytest.raises(ArtifactError, match="prompt tokens, which are positions"):
        check(_manifest(prompts_as_tokens=True), 0)
    old = _manifest()
    del old["model"]["units"], old["model"]["interface_pool_axes"]
    with pytest.raises(ArtifactError, match="records no units, interface_pool_axes .*export again"):
        check(old, 4)


def test_the_model_help_needs_no_torch() -> None:
    """The CLI builds --model help on a torch-free device too."""
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None; from fedsga_edge.models import models_help; print(models_help())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == " | ".join(builtin_models()).split() and "resnet18_cifar" in res.stdout


@pytest.mark.slow
def test_export_reads_the_head_size_under_the_models_own_head_name(tmp_path) -> None:
    """``export --checkpoint`` sizes the head from the checkpoint: ``classifier.weight`` here, ``fc`` upstream."""
    import torchvision

    from fedsga_edge.export.onnx_prefix import weights_sha256
    from fedsga_edge.export.pipeline import ExportConfig, _checkpoint_info, export_prefixes

    trained = create_model(TOY, num_classes=7)
    torch.save({"model": trained.state_dict()}, tmp_path / "toy.pt")
    m = export_prefixes(ExportConfig(model=TOY, out=tmp_path / "onnx", checkpoint=tmp_path / "toy.pt", splits=(1,)),
                        log=lambda _: None)
    assert m["model"]["num_classes"] == 7 and m["model"]["weights_sha256"] == weights_sha256(trained)
    torch.save(torchvision.models.resnet18(num_classes=5).state_dict(), tmp_path / "tv.pt")
    assert _checkpoint_info(tmp_path / "tv.pt", create_model("resnet18", width=0.25))[0] == 5
