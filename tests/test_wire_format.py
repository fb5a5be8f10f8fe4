"""``--wire-format``: fp16 / int8 for the per-batch tensors on the wire, model weights always fp32.

docs/protocol.md ("Messages") says which tensors a lossy format may touch; these tests check it on
the bytes that really cross the loopback transport of a simulated round, and on a Peer pair.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import msgpack
import numpy as np
import pytest
from _runs import assert_test_accuracy, tiny_config

from fedsga_edge.runbuild import validate_config
from fedsga_edge.transport import LoopbackTransport, Peer
from fedsga_edge.wire import TENSOR_FORMATS, decode


def _encodings(payload: bytes) -> dict[str, set[str]]:
    """Top-level body field -> the tensor encodings (raw, fp16, int8) found anywhere under it."""
    body = msgpack.unpackb(payload, raw=False)["body"]
    out: dict[str, set[str]] = defaultdict(set)

    def walk(field: str, v: Any) -> None:
        if isinstance(v, dict) and "__t" in v:
            out[field].add(v.get("enc", "raw"))
        elif isinstance(v, dict):
            for x in v.values():
                walk(field, x)
        elif isinstance(v, list):
            for x in v:
                walk(field, x)

    for name, value in body.items():
        walk(name, value)
    return out


def _one_round(wire_format: str, strategy: str = "static") -> tuple[dict[str, Any], dict[str, int], dict[str, dict[str, set[str]]]]:
    """A 1-round simulation; its record, wire bytes per message kind and tensor encodings per kind."""
    from fedsga_edge.simulation import Simulation

    sim = Simulation(tiny_config(strategy, rounds=1, clients=2, max_batches=2, wire_format=wire_format))
    by_kind: dict[str, int] = defaultdict(int)
    encs: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))

    def note(payload: bytes) -> None:
        kind = decode(payload).kind
        by_kind[kind] += len(payload)
        for name, e in _encodings(payload).items():
            encs[kind][name] |= e

    t = sim.transport
    request, send = t.request, t.send

    def observed_request(src: str, dst: str, payload: bytes, **kw: Any) -> bytes:
        note(payload)
        reply = request(src, dst, payload, **kw)
        note(reply)
        return reply

    def observed_send(src: str, dst: str, payload: bytes) -> None:
        note(payload)
        send(src, dst, payload)

    t.request, t.send = observed_request, observed_send  # observe the real path, change nothing
    rec = next(sim.rounds())
    return rec, dict(by_kind), encs


def test_int8_quarters_the_activation_bytes_keeps_weights_fp32_and_still_trains() -> None:
    rec32, kinds32, enc32 = _one_round("fp32")
    rec8, kinds8, enc8 = _one_round("int8")
    # fp32: nothing lossy anywhere
    assert all(e == {"raw"} for fields in enc32.values() for e in fields.values())
    # int8: the per-batch tensors only; labels, weights and the round start's tensors stay exact
    assert enc8["activation"]["z"] == {"int8"} and enc8["activation"]["y"] == {"raw"}
    assert enc8["gradient"]["dz"] == {"int8"}
    for kind in ("update", "round_start"):  # (round 1 of a static run sends its weights in round_start)
        assert enc8[kind]["weights"] == {"raw"}, (kind, dict(enc8[kind]))
    # about a quarter of the activation and gradient bytes (envelope and int64 labels keep it above 1/4)
    for kind in ("activation", "gradient"):
        ratio = kinds8[kind] / kinds32[kind]
        assert 0.24 < ratio < 0.30, (kind, ratio)
    assert kinds8["update"] == kinds32["update"]  # same weights shapes, fp32 both times
    assert rec8["bytes_up"] < rec32["bytes_up"]
    assert rec32["bytes_up"] - rec8["bytes_up"] == kinds32["activation"] - kinds8["activation"]  # all of the saving
    assert math.isfinite(rec8["train_loss"])
    assert_test_accuracy(rec8, 360)  # digits' test set


def test_fedsga_under_fp16_rounds_h1_and_the_probe_but_not_phi_s_prototypes_or_weights() -> None:
    rec, _, enc = _one_round("fp16", "fedsga")  # round 1 calibrates: the probe travels too
    assert enc["activation"]["z"] == enc["activation"]["h1"] == {"fp16"}
    assert enc["probe"]["z1"] == enc["probe"]["zref"] == {"fp16"} and enc["probe"]["y"] == {"raw"}
    assert enc["gradient"]["dz"] == {"fp16"}
    lossless = {kind: fields for kind, fields in enc.items() if kind not in ("activation", "probe", "gradient")}
    assert "round_start" in lossless and "update" in lossless
    assert all(e == {"raw"} for fields in lossless.values() for e in fields.values()), lossless
    assert math.isfinite(rec["train_loss"])
    assert_test_accuracy(rec, 360)


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_a_lossy_peer_rounds_per_batch_tensors_only_and_any_receiver_decodes_them(fmt: str) -> None:
    t = LoopbackTransport()
    got: list[Any] = []
    server = Peer(t, "coordinator", "r")  # fp32 receiver: decodes whatever encoding arrives
    server.register(lambda m: got.append(m) or server.reply(m, "ack"))
    device = Peer(t, "client-000", "r", tensor_format=fmt)
    rng = np.random.default_rng(0)
    w = {"blocks.0.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 1e-3,
         "blocks.0.bn.running_mean": rng.standard_normal(8).astype(np.float32)}
    device.call("coordinator", "update", 1, {"weights": w, "num_samples": 10})
    z = rng.standard_normal((4, 8, 2, 2)).astype(np.float32)
    y = np.array([0, 3, 9, 1], np.int64)
    device.call("coordinator", "activation", 1, {"z": z, "y": y, "split": 1})
    device.call("coordinator", "activation", 1, {"z": z, "y": y, "split": 1, "extra": z})  # an unnamed float
    upd, act, odd = got
    for name, a in w.items():  # weights: bit-exact and still fp32
        assert upd.body["weights"][name].dtype == np.float32
        assert np.array_equal(upd.body["weights"][name], a)
    assert act.body["z"].dtype == np.float32 and not np.array_equal(act.body["z"], z)  # rounded ...
    assert np.abs(act.body["z"] - z).max() <= np.abs(z).max() * (2**-10 if fmt == "fp16" else 1 / 254) * 1.01
    assert np.array_equal(act.body["y"], y) and act.body["y"].dtype == np.int64  # labels exact
    assert np.array_equal(odd.body["z"], z) and np.array_equal(odd.body["extra"], z)  # sent raw as a whole
    assert device.format_for(device.message("update", 1, {"weights": w, "num_samples": 1})) == "raw"


def test_a_bad_wire_format_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--wire-format must be one of fp32, fp16, int8, int4, auto .*'int3'"):
        validate_config(tiny_config(wire_format="int3"))
    from typer.testing import CliRunner

    from fedsga_edge.cli.main import app

    res = CliRunner().invoke(app, ["simulate", "--wire-format", "raw", "--quiet"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "--wire-format must be one of fp32, fp16, int8, int4, auto" in res.output
    assert set(TENSOR_FORMATS) == {"raw", "fp16", "int8", "int4"}  # what WIRE_FORMATS maps onto


def test_the_field_commands_take_the_flag_and_trial_hands_it_on(tmp_path) -> None:
    import json

    import typer.main

    from fedsga_edge.cli.main import app
    from fedsga_edge.cli.simulate import RUN_FLAGS, run_config
    from fedsga_edge.config import RunConfig

    commands = typer.main.get_command(app).commands
    own = {"coordinator": ["--broker", "mqtt://127.0.0.1:1", "--run-dir", str(tmp_path)],
           "device": ["--broker", "mqtt://127.0.0.1:1", "--index", "0", "--state-dir", str(tmp_path)], "trial": []}
    for name, args in own.items():
        ctx = commands[name].make_context(name, [*args, "--wire-format", "fp16"])
        assert ctx.params["wire_format"] == "fp16", name
        assert run_config(**{k: v for k, v in ctx.params.items() if k in RUN_FLAGS}).wire_format == "fp16"
    # trial hands the devices and the coordinator a RunConfig JSON: the field survives it
    back = RunConfig.from_dict(json.loads(json.dumps(tiny_config(wire_format="int8").to_dict())))
    assert back.wire_format == "int8"
