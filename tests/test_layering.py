"""Dependencies flow one way: core -> roles -> wiring; the wire, transport and broker tooling never need torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ["fedsga_edge/models", "fedsga_edge/data", "fedsga_edge/method", "fedsga_edge/wire", "fedsga_edge/transport",
        "fedsga_edge/config.py", "fedsga_edge/options.py", "fedsga_edge/tensors.py", "fedsga_edge/runfiles.py",
        "fedsga_edge/logthrottle.py"]
ROLES = ["coordinator", "device", "export"]
# Tools beside the roles, on the core only: whoever runs a broker uses fedsga_edge/broker, no role does.
TOOLS = ["fedsga_edge/broker"]
WIRING = ("fedsga_edge.cli", "fedsga_edge.simulation", "fedsga_edge.runbuild")
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


def _module_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports anywhere in it (inside functions too), relative ones resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


@pytest.mark.parametrize("role", ["coordinator", "device"])
def test_a_roles_modules_import_no_circle(role: str) -> None:
    """No module of a role reaches itself through its imports, deferred ones included: a circle means two
    modules that are one, or a piece that belongs in a third (the device's backend contract: device/backend.py)."""
    folder = ROOT / role
    modules = {}
    for f in folder.rglob("*.py"):
        parts = f.relative_to(folder).with_suffix("").parts
        modules[".".join(("fedsga_edge", role, *parts)).removesuffix(".__init__")] = f
    graph = {m: _module_imports(m, f, set(modules)) for m, f in modules.items()}
    for start in graph:
        seen, stack = set(), [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                assert nxt != start, f"import circle: {' -> '.join(path + [start])}"
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
