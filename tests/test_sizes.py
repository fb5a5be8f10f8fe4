"""Small pieces in the coordinator's round path and the transports: no class over 300 lines, no function
over 80 (as the AST counts them: ``end_lineno - lineno + 1``). The strategies are not counted here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS, MAX_FUNCTION = 300, 80


def _too_big() -> list[str]:
    paths = [p for p in (ROOT / "coordinator").glob("*.py")] + list((ROOT / "fedsga_edge" / "transport").rglob("*.py"))
    out = []
    for path in sorted(paths):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > (MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION):
                    out.append(f"{path.relative_to(ROOT)}: {node.name} has {lines} lines")
    return out


def test_no_class_over_300_lines_and_no_function_over_80() -> None:
    assert _too_big() == []
