"""Check lines in the style of Optimum's exporter, and the summary table that ends an export.

Functions here take data and return text or rich renderables; only :func:`print_checks` and
:func:`print_summary` write, and they write to the console they are given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

__all__ = ["Check", "all_passed", "format_checks", "human_bytes", "summary_table"]

OK, FAIL = "✓", "x"


@dataclass(frozen=True)
class Check:
    """One validation verdict: ``-[✓] all values close (atol: 0.0001)``."""

    ok: bool
    text: str
    detail: str = ""  # shown after the text when the check fails (what was found instead)

    def line(self) -> str:
        mark = OK if self.ok else FAIL
        tail = f": {self.detail}" if self.detail and not self.ok else ""
        return f"\t-[{mark}] {self.text}{tail}"

    def to_dict(self) -> dict:
        return asdict(self)


def all_passed(checks: Iterable[Check]) -> bool:
    return all(c.ok for c in checks)


def format_checks(title: str, checks: Sequence[Check]) -> str:
    """``Validating ONNX model prefix_k2.onnx...`` followed by one line per check."""
    return "\n".join([title, *(c.line() for c in checks)])


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _kb(n: float) -> str:
    """Compact byte count for table cells: 64K, 751K, 2.1M."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return f"{n:.0f}B"


def _si(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.2f}{unit}" if v < 10 else f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return f"{n:.0f}"


def summary_table(manifest: dict):
    """One row per prefix: split, depth, params, FLOPs (torch, per sample), MACs (ONNX graph, per sample),
    activation shape and fp32 bytes per sample, file size, validation diff, int8 size and speed-up, train check."""
    from rich import box
    from rich.table import Table

    title = f"{manifest['model']['arch']} prefixes -> {manifest.get('out_dir', '')}"
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    for col in (
        "k",
        "depth",
        "params",
        "FLOPs",
        "MACs",
        "z shape",
        "z bytes",
        "file",
        "diff",
        "int8",
        "grad err",
        "ok",
    ):
        table.add_column(col, justify="left" if col in ("z shape", "int8", "grad err") else "right", no_wrap=True)
    for p in manifest["prefixes"]:
        act = p["activation"]
        q = p.get("int8")
        t = p.get("train")
        int8 = "-"
        if q:
            int8 = f"{_kb(q['bytes'])} x{q['speedup']:.1f}" if q.get("speedup") else _kb(q["bytes"])
        train = "-"
        if t:
            train = f"{t['max_rel_grad_err']:.0e}" if t.get("max_rel_grad_err") is not None else "yes"
        table.add_row(
            str(p["split"]),
            str(p["depth"]),
            _si(p["params"]),
            _si(p["flops_per_sample"]),
            _si(p["macs_onnx"]) if p.get("macs_onnx") is not None else "-",
            "x".join(map(str, act["shape"])),
            _kb(act["bytes_per_sample"]["fp32"]),
            _kb(p["bytes"]),
            f"{p['validation']['max_abs_diff']:.1e}",
            int8,
            train,
            OK if p["valid"] else FAIL,
        )
    return table
