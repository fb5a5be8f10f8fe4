"""Revert each of the method's fixes in a scratch copy and show that the test guarding it fails.

A test that passes whatever the code does guards nothing. For each fix below this script copies the
working tree (tracked files, with their uncommitted edits) to a scratch folder, installs it editable into
a scratch venv that sees this interpreter's packages (a plain install, a venv or a venv over a venv: its
site-packages folders are listed in the scratch venv, after the copy's own editable install), runs the
guarding tests once unchanged (they must
pass), then, one fix at a time, puts the old code back (an exact text replacement that must match once:
if the code moved, the script stops and says so), runs the same tests and expects them to fail.

    python benchmarks/diagnostics/mutations.py            # every fix; exit status 1 if a revert survives
    python benchmarks/diagnostics/mutations.py --only q   # one of them

The scratch folder is removed at the end (``--keep`` keeps it). Nothing in the working tree is changed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Revert:
    name: str
    what: str  # the fix, and what the old code did
    path: str
    fixed: str  # text in the fixed code (must occur exactly once)
    old: str  # the code before the fix
    tests: tuple[str, ...]
    more: tuple[tuple[str, str], ...] = ()  # further (fixed, old) pairs in the same file, reverted together


REVERTS = (
    Revert("q", "q is the prompts' movement under one set of weights; old: ||m^t - m^{t-1}|| of the descriptors",
           "device/fedsga.py", 'client.state.extra["q"] = prompt_variation(prompts, before, alpha)',
           'client.state.extra["q"] = (0.0 if client.state.m_prev is None\n'
           '                                        else float(np.linalg.norm(client.state.m_last - client.state.m_prev)))',
           ("tests/test_method_q.py",)),
    Revert("round-one-pairs", "a first observation's pair is not stored; old: every probed pair is stored",
           "fedsga_edge/method/estimator.py", "return not (float(obs[1]) == 0.0 and float(r_prev) == 0.0)",
           "return True",
           ("tests/test_method_calibration.py::test_a_first_observation_is_not_informative",
            "tests/test_method_calibration.py::test_round_one_pairs_are_not_stored_and_gamma_keeps_its_prior")),
    Revert("prior", "the fit has a prior worth two pairs; old: plain BCE, 200 Adam steps",
           "fedsga_edge/method/estimator.py", "PRIOR_PAIRS = 2.0", "PRIOR_PAIRS = 0.0",
           ("tests/test_method_calibration.py::test_four_pairs_of_one_label_do_not_saturate_r",)),
    Revert("probe-slice", "the probe batch comes from a slice never trained on; old: a batch of the training data",
           "device/fedsga.py", "held = client.data.probe_indices\n    if held is None:",
           "held = None\n    if held is None:",
           ("tests/test_method_calibration.py::test_the_probe_batch_is_disjoint_from_every_training_batch",)),
    Revert("calibration-floor", "calibration rounds train at least to p_ref; old: the policy's split",
           "device/fedsga.py", "floor = reference_index(K) if calibrate else 1", "floor = 1",
           ("tests/test_method_rules.py::test_calibration_rounds_train_at_least_to_p_ref_whatever_the_policy_says",)),
    Revert("headline-split", "the headline split is the most trained, ties to the shallower; old: ties to the deeper",
           "coordinator/evaluation.py", "return min(split, key=lambda k: (-split[k], k))",
           "return max(split, key=lambda k: (split[k], k))",
           ("tests/test_method_rules.py::test_the_headline_split_is_the_most_trained_ties_to_the_shallower_and_p_ref_before_any",)),
    Revert("gamma-next-round", "each round sends the Gamma refitted at the end of the round before; "
           "old (a stale copy): the first Gamma sent, every round",
           "coordinator/strategies/fedsga.py", "estimator=to_numpy_state(self.estimator.state_dict()),",
           'estimator=self.__dict__.setdefault("_sent", {k: v.copy() for k, v in\n'
           '                                                       to_numpy_state(self.estimator.state_dict()).items()}),',
           ("tests/test_method_rules.py::test_gamma_refit_on_a_calibration_round_is_sent_from_the_next_round",)),
    Revert("label-freshness", "the probe's label is made at the round's end, the server's blocks p_1..p_ref "
           "as fresh as the device's; old: at the probe, against the server's blocks as the round started",
           "coordinator/strategies/fedsga.py",
           'self._calibration.append({"client": msg.sender, "z1": z1, "zref": zref, "y": y, "o": self._bounded(o),\n'
           '                                  "r_prev": r_prev})',
           'self._calibration.append(label_probe(self, {"client": msg.sender, "z1": z1, "zref": zref, "y": y,\n'
           '                                                     "o": self._bounded(o), "r_prev": r_prev}))',
           ("tests/test_method_calibration.py::"
            "test_the_label_runs_the_server_blocks_after_the_round_like_the_devices_blocks",),
           more=(("self._calibration = [label_probe(self, p) for p in self._calibration]",
                  'self._calibration = [p if "s" in p else label_probe(self, p) for p in self._calibration]'),)),
    Revert("probe-on-calibration-rounds", "the probe slice is held out on calibration rounds only; old: on "
           "every round (a permanent slice)",
           "device/fedsga.py", 'if fed.estimator and not plan.full and self.settings.get("calibrate"):',
           "if fed.estimator and not plan.full:",
           ("tests/test_method_calibration.py::test_the_probe_slice_is_held_out_on_calibration_rounds_only",)),
)


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    for raw in filter(None, files):
        rel = raw.decode()
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _site_folders() -> list[str]:
    """This interpreter's package folders, whatever installed it (its own, a venv's, the base's under a venv)."""
    return [p for p in dict.fromkeys(sys.path) if p and Path(p).name in ("site-packages", "dist-packages")
            and Path(p).is_dir()]


def _scratch_venv(venv: Path) -> Path:
    """A venv whose python imports this interpreter's packages: ``--system-site-packages`` alone reaches the base
    interpreter's, not those of a venv it runs in, so the folders go into a .pth of its own (read after the
    editable install of the copy, which comes first)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "zz-outer-packages.pth").write_text("\n".join(_site_folders()) + "\n")
    return python


def _pytest(python: Path, cwd: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "FEDSGA_TEST_SHARED"} | {"OMP_NUM_THREADS": "1"}
    res = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
                         cwd=cwd, env=env, capture_output=True, text=True)
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    return res.returncode, lines[-1] if lines else res.stderr.strip()[-300:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=[r.name for r in REVERTS], help="one fix (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder and venv")
    args = ap.parse_args()
    chosen = [r for r in REVERTS if not args.only or r.name in args.only]
    scratch = Path(tempfile.mkdtemp(prefix="fedsga-mutations-"))
    try:
        _copy_tree(scratch)
        python = _scratch_venv(scratch / ".venv")
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(scratch)],
                       check=True, cwd=scratch)
        where = subprocess.run([str(python), "-c", "import fedsga_edge.device.role as m; print(m.__file__)"],
                               check=True, capture_output=True, text=True, cwd="/").stdout.strip()
        if not where.startswith(str(scratch)):
            print(f"the scratch venv imports the package from {where}, not the copy: stopping", file=sys.stderr)
            return 2
        tests = tuple(dict.fromkeys(t for r in chosen for t in r.tests))
        t0 = time.time()
        rc, tail = _pytest(python, scratch, tests)
        print(f"unchanged code: {tail} ({time.time() - t0:.0f} s)", flush=True)
        if rc != 0:
            print("the guarding tests fail on the unchanged code: nothing to learn from the reverts", file=sys.stderr)
            return 2
        survived = []
        for r in chosen:
            path = scratch / r.path
            text = reverted = path.read_text()
            for fixed, old in ((r.fixed, r.old), *r.more):
                if text.count(fixed) != 1:
                    print(f"{r.name}: {r.path} holds {text.count(fixed)} copies of the fixed code, expected 1: "
                          "update this script", file=sys.stderr)
                    return 2
                reverted = reverted.replace(fixed, old)
            path.write_text(reverted)
            t0 = time.time()
            try:
                rc, tail = _pytest(python, scratch, r.tests)
            finally:
                path.write_text(text)
            verdict = "fails, as it must" if rc == 1 else ("SURVIVED" if rc == 0 else f"error (pytest exit {rc})")
            if rc != 1:
                survived.append(r.name)
            print(f"{r.name:18s} {verdict:17s} {tail} ({time.time() - t0:.0f} s)\n    {r.what}\n    "
                  f"{r.path}; {', '.join(t.split('::')[-1] if '::' in t else t for t in r.tests)}", flush=True)
        print(f"{len(chosen) - len(survived)} of {len(chosen)} reverts caught" + (f"; survived: {survived}" if survived else ""))
        return 1 if survived else 0
    finally:
        if args.keep:
            print(f"scratch copy kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
