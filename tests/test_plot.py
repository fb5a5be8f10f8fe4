from __future__ import annotations

import json

from typer.testing import CliRunner

from fedsga_edge.cli.main import app
from fedsga_edge.report.data import split_shares


def _run(tmp_path, name, splits_per_round):
    run = tmp_path / name
    run.mkdir()
    rows = [{"round": t, "test_acc": 0.1 * t, "splits": splits} for t, splits in enumerate(splits_per_round, 1)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return run, rows


def test_split_shares_per_round(tmp_path) -> None:
    _, rows = _run(tmp_path, "a", [{"c0": 1, "c1": 1, "c2": 3, "c3": 2}, {"c0": 3, "c1": 3, "c2": 3, "c3": 3}])
    rounds, shares = split_shares(rows)
    assert rounds == [1, 2]
    assert shares == {1: [0.5, 0.0], 2: [0.25, 0.0], 3: [0.25, 1.0]}


def test_plot_writes_a_png_and_names_a_bad_folder(tmp_path) -> None:
    a, _ = _run(tmp_path, "a", [{"c0": 1}, {"c0": 2}])
    b, _ = _run(tmp_path, "b", [{"c0": 0}, {"c0": 0}])
    out = tmp_path / "fig.png"
    res = CliRunner().invoke(app, ["plot", str(a), str(b), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = CliRunner().invoke(app, ["plot", str(tmp_path / "nope"), "--out", str(out)])
    assert res.exit_code == 2 and "no metrics.jsonl" in res.output
