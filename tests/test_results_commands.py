"""RESULTS.md's tables stay rebuildable: every ``benchmarks/accuracy.py ... --tables-only`` command it prints beside a
table finds records of every method it names, each made with the settings the command plans.

A default changed since the runs (FedSGA's harmonizer form, a method's reference configuration) makes the benchmark
refuse those records by name; the command a reader copies must then say the setting they were made with, or the
records move under the variant that names it. Commands that write into a folder the reader chooses (``--out OUT``)
have no records to check.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from _bench import load_bench

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def table_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, argv) of each indented ``python benchmarks/accuracy.py`` command with ``--tables-only``, its
    backslash continuations joined and a trailing ``# comment`` dropped."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        start = i
        if lines[i].startswith("    python benchmarks/accuracy.py"):
            cmd = lines[i].strip()
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            cmd = re.split(r"\s+#\s", cmd, maxsplit=1)[0]
            argv = shlex.split(cmd)[2:]
            if "--tables-only" in argv and "OUT" not in argv:
                found.append((start + 1, argv))
        i += 1
    return found


def test_the_commands_are_found() -> None:
    text = ("    python benchmarks/accuracy.py --preset smoke --tables-only   # a comment\n"
            "    python benchmarks/accuracy.py --preset smoke \\\n        --methods static --tables-only\n"
            "    python benchmarks/accuracy.py --preset smoke --seeds 0\n"
            "    python benchmarks/accuracy.py --preset smoke --out OUT --tables-only\n")
    assert table_commands(text) == [(1, ["--preset", "smoke", "--tables-only"]),
                                    (2, ["--preset", "smoke", "--methods", "static", "--tables-only"])]


@pytest.mark.slow
def test_every_table_command_in_results_plans_runs_its_records_hold(monkeypatch) -> None:
    bench = load_bench("accuracy")
    monkeypatch.chdir(ROOT)  # the commands' relative --out folders, as a reader runs them
    commands = table_commands(RESULTS.read_text())
    assert len(commands) >= 15, "RESULTS.md's table commands were not found"
    problems: list[str] = []
    for line, argv in commands:
        _, _, out, _, runs = bench.prepare(argv)
        held = {r["method"] for r in runs if (out / r["dir"] / "summary.json").exists()}
        if missing := sorted({r["method"] for r in runs} - held):  # a table may hold some seeds or partitions
            problems.append(f"line {line}: no record of {', '.join(missing)} under {out}")
        try:
            bench.check_records(out, runs)  # what the command itself refuses before reading a record
        except SystemExit as refused:
            problems.append(f"line {line}: {' '.join(str(refused).split()[:40])}")
    assert not problems, "\n".join(problems)
