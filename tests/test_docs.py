"""The docs cannot drift silently: every section reference resolves, every path they name exists, and the layer
map of docs/architecture.md lists every module.

A section reference is a markdown file's name followed by a quoted heading, with or without a comma between
them, anywhere in README.md, docs/*.md, benchmarks/RESULTS.md or the project's Python files. It resolves when
the file exists and one of its headings starts with the quoted words (at a word's end): a reference may name a
heading by its first words. A heading is a markdown heading or the bold words that open a paragraph
(``**FedBABU** (...)``, ``**Check before decode.**``). Paths are checked where a reader would copy them: inside backticks in the markdown
files, and anywhere in the benchmark scripts (their usage lines name record folders).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ["fedsga_edge", "coordinator", "device", "export"]
PYTHON = sorted(p for d in [*PACKAGES, "benchmarks", "tests"] for p in (ROOT / d).rglob("*.py"))
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))
# Folders a repository path starts with (the checkout's top level), and the files at its root.
TOP = ("benchmarks/", "docs/", "fedsga_edge/", "coordinator/", "device/", "export/", "tests/", "fleets/")
ROOT_FILES = ("README.md", "pyproject.toml")
# Files a command writes, named beside the folder it writes them to: that folder must exist, not the file.
WRITTEN = ("results.json", "tables.md", "run.log", ".png", ".html")

REFERENCE = re.compile(r'(?<![\w/])((?:benchmarks/|docs/)?(?:[a-z_]+|README|RESULTS)\.md),?\s+"([^"]+)"')
HEADING = re.compile(r"^(?:#{1,6}\s+(.+?)\s*|\*\*([^*\n]+?)\.?\*\*.*)$", re.MULTILINE)


def _text(path: Path) -> str:
    """The file's text with a comment's line breaks joined (a reference may run over two comment lines)."""
    text = path.read_text()
    return re.sub(r"\n[ \t]*#[ \t]*", " ", text) if path.suffix == ".py" else text


def _md_file(name: str) -> Path | None:
    for base in (ROOT, ROOT / "docs", ROOT / "benchmarks"):
        if (base / name).exists():
            return base / name
    return None


def _headings(path: Path) -> list[str]:
    text = re.sub(r"^(    |\t).*$", "", path.read_text(), flags=re.MULTILINE)  # a code block's # is no heading
    return [" ".join((h or bold).split()) for h, bold in HEADING.findall(text)]


def _resolves(section: str, headings: list[str]) -> bool:
    return any(h == section or (h.startswith(section) and not h[len(section)].isalnum()) for h in headings)


def references() -> list[tuple[str, str, str]]:
    """(where, file, section) for every section reference in the docs and the Python files."""
    found = []
    for path in [*DOCS, *PYTHON]:
        for m in REFERENCE.finditer(_text(path)):
            found.append((str(path.relative_to(ROOT)), m.group(1), " ".join(m.group(2).split())))
    return found


def test_every_section_reference_names_a_heading_that_exists() -> None:
    refs = references()
    assert len(refs) > 50, "the reference pattern no longer finds the docs' references"
    bad = []
    for where, name, section in refs:
        path = _md_file(name)
        if path is None:
            bad.append(f'{where}: {name}, "{section}": no file {name}')
        elif not _resolves(section, _headings(path)):
            bad.append(f'{where}: {name}, "{section}": no such heading in {path.relative_to(ROOT)}')
    assert not bad, "section references that do not resolve:\n  " + "\n  ".join(sorted(set(bad)))


def _path_token(token: str) -> str | None:
    """The repository path a token names, or None (a placeholder, a shell variable, not a path)."""
    token = token.strip("'\"`()[],;.:").split("=")[-1].split("::")[0]
    token = re.sub(r":\d+$", "", token)
    if not token.startswith(TOP) and token not in ROOT_FILES:
        return None
    if any(c in token for c in "<>*{}$|") or "..." in token:
        return None
    return token


def named_paths() -> list[tuple[str, str]]:
    """(where, path) for every repository path in the docs' backticks and anywhere in the benchmark scripts."""
    found = []
    for path in DOCS:
        for span in re.findall(r"`([^`\n]+)`", path.read_text()):
            found += [(str(path.relative_to(ROOT)), p) for t in span.split() if (p := _path_token(t))]
    for path in SCRIPTS:
        for t in re.findall(r"(?<![\w/.])(?:%s)[^\s'\"`]*" % "|".join(re.escape(t) for t in TOP), path.read_text()):
            if p := _path_token(t):
                found.append((str(path.relative_to(ROOT)), p))
    return found


def test_every_path_the_docs_and_scripts_name_exists() -> None:
    paths = named_paths()
    assert len(paths) > 50, "the path pattern no longer finds the docs' paths"
    bad = []
    for where, p in paths:
        target = ROOT / p
        if p.endswith(WRITTEN):
            target = target.parent
        if not target.exists():
            bad.append(f"{where}: {p}")
    assert not bad, "paths named in the docs or scripts that do not exist:\n  " + "\n  ".join(sorted(set(bad)))


def layer_map() -> dict[str, set[str]]:
    """docs/architecture.md's layer map: folder -> the module names listed on its lines (a line without a folder
    continues the one above)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, set[str]] = {}
    folder = None
    for line in section.splitlines():
        if not line.startswith("    "):
            folder = None
            continue
        words = line.split("(", 1)[0].split()
        if words and words[0] in ("core", "roles", "tools", "wiring"):
            words = words[1:]
        if words and words[0].endswith("/"):
            folder, words = words[0], words[1:]
        if folder:
            listed.setdefault(folder, set()).update(words)
    return listed


def test_the_layer_map_lists_every_module() -> None:
    listed = layer_map()
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            folder = str(path.parent.relative_to(ROOT)) + "/"
            if path.stem not in listed.get(folder, set()):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, ("docs/architecture.md, \"Layers\" does not list these modules (add each name to its "
                         "folder's line, under its layer):\n  " + "\n  ".join(missing))
    stale = [f"{folder}{name}.py" for folder, names in listed.items() for name in names
             if not (ROOT / folder / f"{name}.py").exists()]
    assert not stale, "docs/architecture.md, \"Layers\" lists modules that do not exist:\n  " + "\n  ".join(stale)


def test_the_sections_the_benchmarks_write_are_results_headings() -> None:
    """latency.py and int8_accuracy.py ``--results`` replace a section of RESULTS.md by its heading: a heading
    renamed in RESULTS.md would make them append a second copy instead."""
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
    written = [(path.name, h) for path in SCRIPTS
               for h in re.findall(r'^\w*SECTION = "(#+ [^"]+)"', path.read_text(), re.MULTILINE)]
    assert len(written) >= 3
    missing = [f"{name}: {h}" for name, h in written if h not in results]
    assert not missing, "sections the benchmarks write that RESULTS.md lacks:\n  " + "\n  ".join(missing)


def test_a_written_section_replaces_its_own_subsection_only(tmp_path) -> None:
    from _bench import load_bench

    latency = load_bench("latency")
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\n## Latency\n\n### Latency per split depth\n\nold\n\n### int8\n\nkept\n\n## Faults\n")
    latency.write_section(path, "### Latency per split depth\n\nnew\n")
    assert path.read_text() == "# Results\n\n## Latency\n\n### Latency per split depth\n\nnew\n\n### int8\n\nkept\n\n## Faults\n"
