"""Sizes: no class over 300 lines and no function or method over 80, in every module outside tests/ and
benchmarks/. A unit that grows past these holds more than one job; split it where the jobs part.

A unit's size is its lines from its ``def`` or ``class`` line to its last line (docstring and comments
included, decorators not), as the AST reports them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS = 300
MAX_FUNCTION = 80
SKIP = {"tests", "benchmarks", "build", "dist", "node_modules"}


def _sources(root: Path) -> Iterator[Path]:
    """Every .py file of the project, less tests/, benchmarks/, hidden folders, build output and virtual envs."""
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if any(p in SKIP or p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        if any((root.joinpath(*parts[:i + 1]) / "pyvenv.cfg").exists() for i in range(len(parts))):
            continue
        yield path


def oversized(source: str, where: str = "<source>") -> list[str]:
    """Each class over MAX_CLASS lines and each function or method over MAX_FUNCTION, as
    ``where:line Qualified.name is N lines (limit L)``."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                limit = MAX_CLASS if isinstance(child, ast.ClassDef) else MAX_FUNCTION
                name = f"{prefix}{child.name}"
                if lines > limit:
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    found.append(f"{where}:{child.lineno} {kind} {name} is {lines} lines (limit {limit})")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_class_over_300_lines_and_no_function_over_80() -> None:
    found = [o for f in _sources(ROOT) for o in oversized(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))]
    assert not found, "too big:\n" + "\n".join(found)


def test_the_size_check_sees_classes_functions_methods_and_nested_functions() -> None:
    def body(n: int, indent: str = "    ") -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    source = ("@decorated\ndef long():\n" + body(MAX_FUNCTION)  # lines 2-82: one over
              + "def short():\n" + body(MAX_FUNCTION - 1)  # lines 83-162: exactly the limit
              + "class Big:\n" + "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_CLASS // 2))
              + "    def host(self):\n        def nested():\n" + body(MAX_FUNCTION, " " * 12)
              + "        return nested\n")
    found = oversized(source, "mod.py")
    assert [f.split(" is ")[0] for f in found] == [
        "mod.py:2 function long", "mod.py:163 class Big", "mod.py:464 function Big.host",
        "mod.py:465 function Big.host.nested"], found
    assert found[0].endswith("is 81 lines (limit 80)") and found[3].endswith("is 81 lines (limit 80)")


def test_the_sources_are_the_projects_modules_less_tests_and_benchmarks() -> None:
    files = {str(f.relative_to(ROOT)) for f in _sources(ROOT)}
    assert {"fedsga_edge/cli/main.py", "coordinator/server.py", "device/agent.py", "export/pipeline.py"} <= files
    assert not any(f.startswith(("tests/", "benchmarks/")) for f in files)
