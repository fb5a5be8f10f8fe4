"""The backbones this package registers, read from the source without importing torch.

The CLI's ``--model`` help is built on a torch-free device too, so listing the backbones must not
import them. A backbone module is any file here with a ``@register_model`` function: this scan
finds it (so adding a backbone is that one file), and the registry imports exactly these modules
on first use. The decorator stays the single declaration; nothing here is kept by hand.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

__all__ = ["backbone_modules", "builtin_models", "models_help"]

_HERE = Path(__file__).parent


def _registered(tree: ast.Module) -> dict[str, str]:
    """``{name: first docstring line}`` of the module's top-level ``@register_model`` functions."""
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(_is_register(d) for d in node.decorator_list):
            out[node.name] = (ast.get_docstring(node) or "").strip().split("\n")[0]
    return out


def _is_register(d: ast.expr) -> bool:
    target = d.func if isinstance(d, ast.Call) else d
    return (isinstance(target, ast.Name) and target.id == "register_model") or (
        isinstance(target, ast.Attribute) and target.attr == "register_model"
    )


@cache
def _scan() -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    for path in sorted(_HERE.glob("*.py")):
        if path.stem.startswith("_") or path.stem in ("catalog", "registry"):
            continue
        names = _registered(ast.parse(path.read_text(), str(path)))
        if names:
            found[path.stem] = names
    return found


def backbone_modules() -> list[str]:
    """Submodules of ``fedsga_edge.models`` that register backbones (imported by the registry)."""
    return list(_scan())


def builtin_models() -> dict[str, str]:
    """``{model name: one-line summary}`` of every backbone this package registers, sorted by name."""
    return dict(sorted((n, s) for names in _scan().values() for n, s in names.items()))


def models_help() -> str:
    """The ``--model`` help text: every registered backbone name (torch-free, so any CLI can show it)."""
    return " | ".join(builtin_models())
