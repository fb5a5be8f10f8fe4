"""Check lines in the style of Optimum's exporter, and the summary table that ends an export.

Functions here take data and return text or rich renderables; only :func:`print_checks` and
:func:`print_summary` write, and they write to the console they are given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

__all__ = ["Check", "format_checks", "all_passed", "summary_table", "human_bytes"]

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


def _si(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def summary_table(manifest: dict):  # noqa: ANN201 - rich.table.Table, imported lazily
    """One row per prefix: split, depth, params, FLOPs, MACs, activation, file sizes, validation."""
    from rich.table import Table

    table = Table(title=f"{manifest['model']['arch']} prefixes -> {manifest.get('out_dir', '')}", show_lines=False)
    for col, justify in (
        ("k", "right"),
        ("depth", "right"),
        ("file", "left"),
        ("params", "right"),
        ("FLOPs/sample", "right"),
        ("MACs (onnx)", "right"),
        ("activation", "left"),
        ("act fp32/int8", "right"),
        ("size", "right"),
        ("max |diff|", "right"),
        ("int8", "left"),
        ("train", "left"),
        ("ok", "center"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for p in manifest["prefixes"]:
        act = p["activation"]
        v = p["validation"]
        q = p.get("int8")
        t = p.get("train")
        int8 = "-"
        if q:
            int8 = f"{human_bytes(q['bytes'])}, dev {q['max_abs_dev']:.3g}"
            if q.get("speedup") is not None:
                int8 += f", x{q['speedup']:.2f}"
        train = "-"
        if t:
            train = f"grad rel {t['max_rel_grad_err']:.1e}" if t.get("max_rel_grad_err") is not None else "yes"
        table.add_row(
            str(p["split"]),
            str(p["depth"]),
            p["file"],
            _si(p["params"]),
            _si(p["flops_per_sample"]),
            _si(p["macs_onnx"]) if p.get("macs_onnx") is not None else "-",
            "x".join(map(str, act["shape"])),
            f"{human_bytes(act['bytes_per_sample']['fp32'])}/{human_bytes(act['bytes_per_sample']['int8'])}",
            human_bytes(p["bytes"]),
            f"{v['max_abs_diff']:.2e}",
            int8,
            train,
            OK if p["valid"] else FAIL,
        )
    return table
