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
        assert set(grads) == {{"prompts", *r.entry["train"]["params"]}}
        r1 = PrefixRunner({str(art)!r}, 1, state=r.state)  # one device, one set of weights
        z1, h1 = r1.train_forward(x, prompts, return_h1=True)
        assert h1.shape == (4, z1.shape[1]) and np.allclose(h1, z1.mean(axis=(2, 3)), atol=1e-5)
        ze, he = r1.eval_forward(x, prompts, return_h1=True)
        assert ze.shape == z1.shape and np.isfinite(ze).all() and np.allclose(he, ze.mean(axis=(2, 3)), atol=1e-5)
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
    name = runner.entry["train"]["params"][0]
    state[name] = state[name] + 1
    runner.load_state({name: state[name]})
    np.testing.assert_array_equal(runner.state[name], state[name])
    with pytest.raises(ArtifactError, match="shape"):
        runner.load_state({name: np.zeros(3, np.float32)})


def _model_with(state: dict[str, np.ndarray]):
    """resnet18_cifar width 0.25 whose prefix weights and BN buffers are ``state``."""
    model = create_model("resnet18_cifar", width=0.25)
    missing = set(state) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=False)
    return model


def _perturbed(runner: PrefixRunner, seed: int) -> None:
    """Weights and running stats other than the exported ones: they must act as graph inputs."""
    gen = np.random.default_rng(seed)
    t = runner.entry["train"]
    new = {}
    for name in t["params"]:
        v = runner.state[name]
        new[name] = (v + 0.1 * np.abs(v).mean() * gen.standard_normal(v.shape)).astype(np.float32)
    for name in t["buffers"]:
        v = runner.state[name]
        new[name] = (v + 0.5 * np.abs(gen.standard_normal(v.shape))).astype(np.float32)
    runner.load_state(new)


def test_eval_forward_and_h1_match_torch() -> None:
    runner = PrefixRunner(train_artifacts(), 2)
    _perturbed(runner, 1)
    gen = np.random.default_rng(2)
    x = gen.standard_normal((3, 3, 32, 32), dtype=np.float32)
    prompts = gen.standard_normal(runner.prompts_shape, dtype=np.float32)
    model = _model_with(runner.state_dict())
    d1, xt, pt = model.depth_of(1), torch.from_numpy(x), torch.from_numpy(prompts)
    assert runner.depth > d1  # h1 comes from inside the graph, not from its output

    with torch.no_grad():
        model.eval()
        z_ref = model.prefix(xt, runner.depth, pt).numpy()
        h1_eval_ref = model.interface_pool(model.prefix(xt, d1, pt)).numpy()
        model.train()
        h1_ref = model.interface_pool(model.prefix(xt, d1, pt)).numpy()  # train-mode BN: batch statistics
    before = runner.state_dict()
    z, h1_eval = runner.eval_forward(x, prompts, return_h1=True)
    np.testing.assert_allclose(z, z_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(h1_eval, h1_eval_ref, rtol=1e-4, atol=1e-5)
    for k, v in runner.state_dict().items():  # eval mode leaves the running stats alone
        np.testing.assert_array_equal(v, before[k])
    assert np.abs(runner.forward(x, prompts) - z).max() > 1e-2  # the frozen export differs: weights are inputs

    z_train, h1 = runner.train_forward(x, prompts, return_h1=True)
    assert h1.shape == (3, runner.state["blocks.0.bn1.weight"].shape[0]) == h1_ref.shape
    np.testing.assert_allclose(h1, h1_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(runner.train_forward(x, prompts, update_stats=False), z_train)


def test_runners_of_one_device_share_one_state() -> None:
    art = train_artifacts()
    shared: dict[str, np.ndarray] = {}
    r1 = PrefixRunner(art, 1, state=shared)
    r2 = PrefixRunner(art, 2, state=shared)
    assert r1.state is r2.state is shared
    assert set(r1.keys) < set(r2.keys) == set(shared)
    _perturbed(r2, 3)
    gen = np.random.default_rng(4)
    x = gen.standard_normal((4, 3, 32, 32), dtype=np.float32)
    prompts = gen.standard_normal(r1.prompts_shape, dtype=np.float32)
    dz = gen.standard_normal((4, *r2.activation_shape), dtype=np.float32)

    # The split-2 runner trains (BN stats written, params stepped in place with an edited gradient)...
    r2.set_optimizer(momentum=0.9)
    stem_w = shared["blocks.0.conv1.weight"]
    w0 = stem_w.copy()
    r2.train_forward(x, prompts)
    grads = r2.gradients(x, dz, prompts)
    grads["blocks.0.conv1.weight"] = grads["blocks.0.conv1.weight"] + 0.01  # a caller's term (FedProx & co.)
    r2.sgd_step(grads, lr=1e-4)
    assert shared["blocks.0.conv1.weight"] is stem_w  # in place: every runner holds the same array
    np.testing.assert_allclose(stem_w, w0 - 1e-4 * grads["blocks.0.conv1.weight"], rtol=1e-6, atol=1e-7)
    assert np.abs(stem_w - w0).max() > 1e-4 * np.abs(w0).max()
    assert shared["blocks.1.layer.0.bn1.num_batches_tracked"] == 1
    with pytest.raises(ArtifactError, match="not split 1's params"):
        r1.sgd_step({"blocks.2.layer.0.conv1.weight": grads["blocks.2.layer.0.conv1.weight"]}, lr=0.1)

    # ...and the split-1 runner computes with those weights and statistics (eval and train mode).
    model = _model_with(dict(shared))
    with torch.no_grad():
        ref = model.eval().prefix(torch.from_numpy(x), r1.depth, torch.from_numpy(prompts)).numpy()
    np.testing.assert_allclose(r1.eval_forward(x, prompts), ref, rtol=1e-4, atol=1e-4)
    assert sorted(r1.state_dict()) == sorted(r1.keys)
    mean_before = shared["blocks.0.bn1.running_mean"].copy()
    r1.train_forward(x, prompts)
    assert shared["blocks.1.layer.0.bn1.num_batches_tracked"] == 2
    assert np.abs(r2.state_dict()["blocks.0.bn1.running_mean"] - mean_before).max() > 1e-3


def test_gradients_reuse_the_forward_only_for_the_same_batch() -> None:
    """train_step reuses what train_forward kept for the same x and prompts; for another batch (or
    with no forward before) it runs the forward itself, so the gradients stay those of its inputs."""
    art = train_artifacts()
    a, b = PrefixRunner(art, 1), PrefixRunner(art, 1)
    gen = np.random.default_rng(5)
    x1, x2 = (gen.standard_normal((2, 3, 32, 32), dtype=np.float32) for _ in range(2))
    prompts = gen.standard_normal(a.prompts_shape, dtype=np.float32)
    dz = gen.standard_normal((2, *a.activation_shape), dtype=np.float32)
    a.train_forward(x2, prompts, update_stats=False)
    ref = a.gradients(x2, dz, prompts)  # the documented order
    b.train_forward(x1, prompts, update_stats=False)
    other = b.gradients(x2, dz, prompts)  # kept activations are x1's: not used
    again = b.gradients(x2, dz, prompts)  # nothing kept any more: a fresh forward
    for name, value in ref.items():
        np.testing.assert_allclose(other[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(again[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(b.gradients(x1, dz, prompts)["prompts"] - ref["prompts"]).max() > 1e-4  # x matters
