"""Self-contained HTML pages (the report's and the comparison's): style, tables, images as data URIs.

Nothing on a page is fetched: plots are embedded as base64 PNG data URIs, and a small script marks
each image ``data-loaded="yes"``/``"no"`` once the page has loaded (for headless checks).
"""

from __future__ import annotations

import base64
import html
from typing import Any

__all__ = ["CSS", "SCRIPT", "table", "img", "page", "percent"]

CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;display:block;margin:.5em 0}
.skip{color:#777;font-style:italic}.partial{color:#a40;border-left:4px solid #a40;padding-left:.6em}"""

# marks each image with data-loaded="yes"/"no" once the page has loaded (for headless checks)
SCRIPT = """window.addEventListener("load", function () {
  var ok = true;
  for (var img of document.images) {
    var loaded = img.complete && img.naturalWidth > 0;
    img.setAttribute("data-loaded", loaded ? "yes" : "no");
    ok = ok && loaded;
  }
  document.body.setAttribute("data-images", ok ? "loaded" : "broken");
});"""


def table(header: list[str], rows: list[list[Any]]) -> str:
    """An HTML table; floats with 4 significant digits, everything escaped.

    Example: ``table(["site", "score"], [["1", 0.98765]])`` has a cell ``<td>0.9877</td>``.
    """
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def img(png: bytes, alt: str, name: str | None = None) -> str:
    """An ``<img>`` holding ``png`` as a data URI; ``name`` (the PNG's file name) becomes its title."""
    data = base64.b64encode(png).decode("ascii")
    title = "" if name is None else f' title="{html.escape(name)}"'
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}"{title}>'


def page(title: str, parts: list[str]) -> str:
    """The whole page: ``parts`` (HTML fragments) in order under ``<body>``, with the style and the script."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}'
            f"</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(parts)
            + f"\n<script>{SCRIPT}</script>\n</body></html>\n")


def percent(fraction: float) -> str:
    """``0.37 -> '37%'``, ``3.2e-5 -> '0.0032%'``: three significant digits at most, however small."""
    return f"{100 * float(fraction):.3g}%"
