"""The device runtime and `profile --runtime onnxruntime` with torch made unimportable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from _export_artifacts import must_show_artifacts, train_artifacts
from fedsga_edge.device.runtime import ArtifactError, PrefixRunner
from fedsga_edge.export.manifest import read_manifest
from fedsga_edge.export.onnx_prefix import PrefixModule

from fedsga_edge.models import create_model

# Any import of torch (or a torch submodule) raises, as on a device with only the `device` extra.
BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is not installed on this device ({name})")
    sys.meta_path.insert(0, _NoTorch())
    """
)


def _run_without_torch(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "device_script.py"
    script.write_text(
        BLOCK_TORCH
        + textwrap.dedent(code)
        + "\nassert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules)\n"
    )
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)


def test_must_show_profile_and_runner_without_torch(tmp_path) -> None:
    art = must_show_artifacts()
    manifest = read_manifest(art)
    torch.manual_seed(0)  # the export's seed: same random weights
    model = create_model("resnet18_cifar", width=0.25).eval()
    x = np.random.default_rng(3).standard_normal((3, 3, 32, 32), dtype=np.float32)
    prompts = model.init_prompts(4)
    refs = {}
    with torch.no_grad():
        for p in manifest["prefixes"]:
            refs[f"k{p['split']}"] = PrefixModule(model, p["depth"]).eval()(torch.from_numpy(x), prompts).numpy()
    np.savez(tmp_path / "ref.npz", x=x, prompts=prompts.numpy(), **refs)
    report = tmp_path / "P.json"
    proc = _run_without_torch(
        f"""
        import numpy as np
        from fedsga_edge.device.runtime import PrefixRunner, load_manifest
        ref = np.load({str(tmp_path / "ref.npz")!r})
        for p in load_manifest({str(art)!r})["prefixes"]:
            for variant, tol in (("fp32", 1e-4), ("fp16", 0.05), ("int8", None)):
                z = PrefixRunner({str(art)!r}, p["split"], variant=variant).forward(ref["x"], ref["prompts"])
                assert z.shape == ref["k%d" % p["split"]].shape, (variant, z.shape)
                if tol is not None:
                    assert np.abs(z - ref["k%d" % p["split"]]).max() <= tol * max(1.0, np.abs(z).max()), variant
        from fedsga_edge.cli.main import app
        sys.argv = ["fedsga-edge", "profile", "--artifacts", {str(art)!r}, "--runtime", "onnxruntime",
                    "--batch", "1", "--iters", "5", "--warmup", "1", "--json", {str(report)!r}]
        try:
            app()
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert [r["split"] for r in data["results"]] == [1, 2, 3]
    assert data["device"]["execution_provider"] == "CPUExecutionProvider"
    assert "p99" in data["results"][0]["latency_ms"]


def test_numpy_train_step_runs_without_torch(tmp_path) -> None:
    art = train_artifacts()
    proc = _run_without_torch(
        f"""
        import numpy as np
        from fedsga_edge.device.runtime import PrefixRunner
        r = PrefixRunner({str(art)!r}, 2)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((4, 3, 32, 32), dtype=np.float32)
        prompts = rng.standard_normal(r.prompts_shape, dtype=np.float32)
        target = rng.standard_normal((4, *r.activation_shape), dtype=np.float32)
        losses = []
        for _ in range(3):
            z = r.train_forward(x, prompts)
            losses.append(float(0.5 * np.mean((z - target) ** 2)))
            grads = r.train_step(x, (z - target) / z.size, prompts, lr=0.5)
        assert losses[2] < losses[1] < losses[0], losses
        assert set(grads) == {{"prompts", *r.manifest["prefixes"][0]["train"]["params"]}}
        print("losses", losses)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_runner_refuses_what_the_artifacts_cannot_do() -> None:
    art = must_show_artifacts()
    with pytest.raises(ArtifactError, match="split 9 not exported"):
        PrefixRunner(art, 9)
    runner = PrefixRunner(art, 1)
    with pytest.raises(ArtifactError, match="no train graphs"):
        runner.train_forward(np.zeros((1, 3, 32, 32), np.float32), np.zeros((4, 16), np.float32))
    with pytest.raises(ArtifactError, match="prompts must have shape"):
        runner.forward(np.zeros((1, 3, 32, 32), np.float32), np.zeros((5, 16), np.float32))
    with pytest.raises(ArtifactError, match="no manifest"):
        PrefixRunner(art / "nowhere", 1)


def test_runner_state_round_trip() -> None:
    runner = PrefixRunner(train_artifacts(), 2)
    state = runner.state_dict()
    name = runner.manifest["prefixes"][0]["train"]["params"][0]
    state[name] = state[name] + 1
    runner.load_state({name: state[name]})
    np.testing.assert_array_equal(runner.state[name], state[name])
    with pytest.raises(ArtifactError, match="shape"):
        runner.load_state({name: np.zeros(3, np.float32)})
