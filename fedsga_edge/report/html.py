"""The report page: one self-contained HTML file (CSS inline, images as base64 PNG data URIs)."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Section", "markdown_to_html", "render_page", "table_html"]


@dataclass
class Section:
    """One plot of the report: a title, a sentence saying what it shows, and its PNG or a note why not.

    ``absent``: set when the runs hold nothing for it (a phrase naming it and what records it, e.g. "fleet
    timing (<code>--fleet</code>)"); the page then lists it in one line at its end instead of an empty box."""

    key: str
    title: str
    text: str
    png: Path | None = None
    note: str | None = None
    extra_html: str = ""
    data: Any = field(default=None, repr=False)
    absent: str | None = None


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1150px;color:#222;
background:#fff;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}
h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.8em}
h3{font-size:1.02em}
img{max-width:100%;border:1px solid #e3e3e3}
table{border-collapse:collapse;font-size:.82em;margin:.6em 0}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right;vertical-align:top}
th{background:#f1f3f6}td.l,th.l{text-align:left}
tr:nth-child(even) td{background:#fafafa}
.note{background:#fff7e0;border-left:4px solid #e0a800;padding:6px 10px;margin:.6em 0}
.meta{color:#666;font-size:.88em}code,pre{background:#f4f4f4;font-size:.88em}pre{padding:8px;overflow-x:auto}
nav a{margin-right:1em}
.summary li{margin:.25em 0}.absent{color:#555;border-top:1px solid #ccc;padding-top:.6em;margin-top:1.8em}
"""

_ALIGN = re.compile(r"^:?-{1,}:?$")


def _inline(text: str) -> str:
    """Markdown inline markup we use in tables.md: **bold**, `code`, *em*; everything else escaped."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    out = re.sub(r"(?<![*\w])\*([^*]+)\*(?!\*)", r"<i>\1</i>", out)
    return out


def _cells(line: str) -> list[str]:
    line = line.strip()
    if line.startswith("|"):
        line = line[1:]
    if line.endswith("|") and not line.endswith("\\|"):
        line = line[:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)]


def markdown_to_html(md: str) -> str:
    """A small Markdown subset: headings, pipe tables (with alignment), lists, paragraphs, code fences."""
    lines = md.splitlines()
    out: list[str] = []
    i = 0
    para: list[str] = []

    def flush() -> None:
        if para:
            out.append("<p>" + _inline(" ".join(para)) + "</p>")
            para.clear()

    while i < len(lines):
        line = lines[i]
        s = line.strip()
        if s.startswith("```"):
            flush()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            out.append("<pre>" + html.escape("\n".join(lines[i + 1:j])) + "</pre>")
            i = j + 1
            continue
        if s.startswith("|") and i + 1 < len(lines) and all(_ALIGN.match(c) for c in _cells(lines[i + 1]) if c):
            flush()
            head = _cells(s)
            aligns = []
            for c in _cells(lines[i + 1]):
                aligns.append("l" if not c.endswith(":") else "")
            rows = []
            j = i + 2
            while j < len(lines) and lines[j].strip().startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            out.append(table_html(head, rows, aligns))
            i = j
            continue
        m = re.match(r"^(#{1,6})\s+(.*)$", s)
        if m:
            flush()
            level = min(len(m.group(1)) + 2, 6)  # the page's own h1/h2 stay above
            out.append(f"<h{level}>{_inline(m.group(2))}</h{level}>")
        elif re.match(r"^[-*]\s+", s):
            flush()
            items = []
            while i < len(lines) and re.match(r"^[-*]\s+", lines[i].strip()):
                items.append("<li>" + _inline(re.sub(r"^[-*]\s+", "", lines[i].strip())) + "</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif not s:
            flush()
        else:
            para.append(s)
        i += 1
    flush()
    return "\n".join(out)


def table_html(head: list[str], rows: list[list[str]], aligns: list[str] | None = None, raw: bool = False) -> str:
    """An HTML table; cells are markdown-inline text unless ``raw`` (then already HTML)."""
    aligns = aligns or ["l"] + [""] * (len(head) - 1)

    def cls(j: int) -> str:
        return ' class="l"' if j < len(aligns) and aligns[j] == "l" else ""

    fmt = (lambda x: x) if raw else _inline
    cells = "".join(f"<th{cls(j)}>{fmt(h)}</th>" for j, h in enumerate(head))
    parts = [f"<table><thead><tr>{cells}</tr></thead><tbody>"]
    for r in rows:
        parts.append("<tr>" + "".join(f"<td{cls(j)}>{fmt(c)}</td>" for j, c in enumerate(r)) + "</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def _img(png: Path, alt: str) -> str:
    b64 = base64.b64encode(png.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _plain(text: str) -> str:
    """A note's HTML as plain text, for a tooltip."""
    return html.escape(html.unescape(re.sub(r"<[^>]+>", "", text)))


def render_page(title: str, meta: list[str], sections: list[Section], tail_html: str = "",
                head_html: str = "") -> str:
    """The whole page: header, ``head_html`` (the summary), a link per section with something to show, each
    one's image (inlined) or note, then tables; the sections with nothing to show in one line at the end."""
    shown = [s for s in sections if s.absent is None]
    absent = [s for s in sections if s.absent is not None]
    nav = " ".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in shown)
    body = [f"<h1>{html.escape(title)}</h1>"]
    body += [f'<p class="meta">{m}</p>' for m in meta]
    body.append(head_html)
    body.append(f"<nav>{nav} <a href=\"#runs\">runs</a></nav>")
    for s in shown:
        body.append(f'<h2 id="{s.key}">{html.escape(s.title)}</h2>')
        body.append(f"<p>{s.text}</p>")
        if s.png is not None:
            body.append(_img(s.png, s.title))
        if s.note:
            body.append(f'<p class="note">{s.note}</p>')
        body.append(s.extra_html)
    body.append(tail_html)
    if absent:
        items = ", ".join(f'<span id="{s.key}" title="{_plain(s.note or "")}">{s.absent}</span>' for s in absent)
        body.append(f'<p class="absent" id="absent">not in these runs: {items}.</p>')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")
