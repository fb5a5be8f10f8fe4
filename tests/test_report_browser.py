"""The quick start's report as a new user first sees it: rendered by headless Chromium from a real run."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

from fedsga_edge.cli.main import app
from fedsga_edge.report import build_report

# The README's quick start (static SplitFed, digits, 3 devices, 2 rounds, resnet18_cifar at width 0.25, seed 0),
# in one process and cut to two batches a round: the same kind of run folder in seconds.
QUICK = ["simulate", "--dataset", "digits", "--clients", "3", "--rounds", "2", "--model", "resnet18_cifar",
         "--width", "0.25", "--strategy", "static", "--seed", "0", "--local-epochs", "1", "--max-batches", "2",
         "--device", "cpu", "--threads", "1", "--quiet"]


def _chromium() -> str | None:
    names = ("chromium", "chromium-browser", "google-chrome", "chrome")
    return next((p for n in names if (p := shutil.which(n))), None)


def _text(dom: str) -> str:
    """The page's visible text in document order: tags out, entities as they read."""
    import html

    body = re.sub(r"<(style|script)[^>]*>.*?</\1>", "", dom, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", body)))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="no chromium binary")
def test_quick_start_report_opens_with_what_the_run_did_in_a_browser(tmp_path) -> None:
    import matplotlib.image as mpimg

    run = tmp_path / "quickstart"
    res = CliRunner().invoke(app, [*QUICK, "--out", str(run)])
    assert res.exit_code == 0, res.output[-3000:]
    rep = build_report([run], [], tmp_path / "report")
    assert rep.errors == []
    browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'profile'}"]
    url = rep.html.resolve().as_uri()
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    text = _text(dom)
    # the page opens with what the run did: its rounds, devices, accuracy and bytes, before any plot
    summary = text.index("What these runs did")
    first_plot = text.index("Test accuracy per round")
    assert summary < first_plot, text[:2000]
    line = text[summary:first_plot]
    final = rep.runs[0].summary["final_acc"]
    assert "2 rounds with 3 devices (every device in every round)" in line, line
    assert f"test accuracy {100 * final:.2f} %" in line and " MB up and " in line, line
    # the sections a static run has nothing for: no box each, one line at the end naming them and their flag
    assert text.rstrip().endswith(".") and "not in these runs:" in text[-1500:], text[-1500:]
    absent = text[text.index("not in these runs:"):]
    for name in ("fleet timing (--fleet)", "federated accuracy (--eval-holdout)", "split depths",
                 "estimator reliability", "probe losses", "latency per split depth (--profile"):
        assert name in absent, absent
    assert "no run has" not in text and "no profile given" not in text  # no empty box says what is missing
    assert text.count("not in these runs:") == 1 and absent.index("not in these runs:") == 0

    shot = tmp_path / "quickstart_report.png"
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1200,1600", url], capture_output=True,
                   timeout=180, check=False)
    assert shot.is_file(), "chromium wrote no screenshot"
    img = mpimg.imread(shot)[..., :3]
    assert img.shape[:2] == (1600, 1200)
    assert float(img.std()) > 0.08  # not a blank page
    top = img[:400]  # the header and the summary: dark text on white, not an empty band
    assert (top.mean(axis=2) < 0.4).mean() > 0.005
    chroma = img.max(axis=2) - img.min(axis=2)
    assert (chroma > 0.25).mean() > 0.001  # the plots' coloured lines and the links rendered (0.0036 measured)
    assert len({tuple(c) for c in (img[::4, ::4] * 255).astype(np.uint8).reshape(-1, 3)}) > 100
