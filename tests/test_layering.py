"""Dependencies flow one way: core -> roles -> wiring, with no import circle anywhere; the wire, transport and
broker tooling never need torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ["fedsga_edge/models", "fedsga_edge/data", "fedsga_edge/method", "fedsga_edge/wire", "fedsga_edge/transport",
        "fedsga_edge/config.py", "fedsga_edge/options.py", "fedsga_edge/tensors.py", "fedsga_edge/runfiles.py",
        "fedsga_edge/logthrottle.py"]
ROLES = ["coordinator", "device", "export"]
# Tools beside the roles, on the core only: whoever runs a broker uses fedsga_edge/broker, no role does.
TOOLS = ["fedsga_edge/broker"]
WIRING = ("fedsga_edge.cli", "fedsga_edge.simulation", "fedsga_edge.runbuild", "fedsga_edge.trial",
          "fedsga_edge.fieldroles", "fedsga_edge.fieldconfig")
ABOVE_CORE = ("fedsga_edge.coordinator", "fedsga_edge.device", "fedsga_edge.export", "fedsga_edge.broker", *WIRING)


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _files(entries: list[str]) -> list[Path]:
    files: list[Path] = []
    for e in entries:
        p = ROOT / e
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return files


def test_core_imports_no_role_cli_or_wiring() -> None:
    for f in _files(CORE):
        bad = [m for m in _imports(f) if m.startswith(ABOVE_CORE)]
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_roles_do_not_import_each_other() -> None:
    for role in ROLES:
        others = tuple(f"fedsga_edge.{r}" for r in ROLES if r != role) + ("fedsga_edge.broker", *WIRING)
        for f in _files([role]):
            bad = [m for m in _imports(f) if m.startswith(others)]
            assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_tools_import_only_the_core() -> None:
    for f in _files(TOOLS):
        bad = [m for m in _imports(f) if m.startswith(ABOVE_CORE) and not m.startswith("fedsga_edge.broker")]
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_wire_transport_and_broker_tooling_import_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; import fedsga_edge.wire, fedsga_edge.transport, fedsga_edge.data, "
            "fedsga_edge.broker.launch, fedsga_edge.broker.config; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml lists packages by name: a new sub-package left out of it works in an editable
    install and is missing from a wheel (a device's `pip install fedsga-edge[device]`)."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {pkg: ROOT / where for pkg, where in tool["package-dir"].items()}
    found = set()
    for pkg, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((pkg, *rel)))
    assert found == listed, f"in the tree, not in pyproject.toml: {sorted(found - listed)}; listed, absent: {sorted(listed - found)}"


# -- import circles ---------------------------------------------------------------------------------------
#
# The graph has one node per module of the installed packages and an edge for every import statement in it:
# at the top, under ``if TYPE_CHECKING:`` and inside functions alike. A deferred or type-only import hides a
# circle from the interpreter, not from the design (device role/evaluate/methods was a circle of imports
# inside functions, export pipeline/calib/variants one of type-only imports). ``from X import a`` is an
# edge to the module X.a when there is one, else to X; ``importlib.import_module`` strings (the export
# package's lazy names) are not imports here.


def _modules(roots: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Every module of the packages, by dotted name: (its file, whether it is a package's __init__)."""
    mods: dict[str, tuple[Path, bool]] = {}
    for pkg, folder in roots.items():
        for f in sorted(folder.rglob("*.py")):
            rel = f.relative_to(folder).with_suffix("").parts
            is_pkg = rel[-1] == "__init__"
            mods[".".join((pkg, *(rel[:-1] if is_pkg else rel)))] = (f, is_pkg)
    return mods


def _import_edges(name: str, path: Path, is_pkg: bool, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            out |= {f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names}
    return {m for m in out if m in known and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _import_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    mods = _modules(roots)
    return {m: _import_edges(m, f, is_pkg, set(mods)) for m, (f, is_pkg) in mods.items()}


def test_no_import_circles() -> None:
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    graph = _import_graph({pkg: ROOT / where for pkg, where in tool["package-dir"].items()})
    assert len(graph) > 100 and "fedsga_edge.export.pipeline" in graph["fedsga_edge.cli.export_cmd"]
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_sees_deferred_type_only_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n")
    (pkg / "c.py").write_text("from . import a\nfrom pkg.sub import d\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("from .. import c\nfrom ..a import f\n")
    (pkg / "e.py").write_text("from . import a  # one way only: no circle\nimport importlib\n"
                              "importlib.import_module('pkg.e')\n")
    graph = _import_graph({"pkg": pkg})
    assert graph["pkg"] == {"pkg.a"} and graph["pkg.sub.d"] == {"pkg.c", "pkg.a"}
    assert _circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d"]]
