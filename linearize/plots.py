"""PNG figures of the report and the comparison page (matplotlib, the ``report`` extra).

Each ``plot_*`` function takes a measure's JSON value (as in ``report.json``) and returns PNG bytes;
:func:`figure`, :func:`png`, :func:`site_axis` and :func:`literal` are the shared pieces (headless Agg
canvas, sites along the x axis, names shown as written).
"""

from __future__ import annotations

import io

import numpy as np

from ._optional import require

__all__ = ["figure", "png", "site_axis", "literal", "plot_fraction", "plot_affinity", "plot_history",
           "plot_regions", "plot_gates"]


def figure(width: float, height: float = 3.6):
    """A matplotlib ``Figure`` on an Agg canvas (no display needed); ``MissingExtra`` without matplotlib.

    Example: ``fig = figure(6.0); ax = fig.add_subplot(); ...; data = png(fig)``
    """
    require("matplotlib", what="the report's plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def png(fig) -> bytes:
    """``fig`` as PNG bytes (tight layout)."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def literal(text: str) -> str:
    """``text`` as a matplotlib label that shows it as written: ``$`` escaped, so that a name holding ``$...$``
    is not rendered (or refused) as mathtext.

    Example: ``literal("act$x$") == r"act\\$x\\$"``, drawn as ``act$x$``
    """
    return text.replace("$", r"\$")


def site_axis(ax, names: list[str]) -> None:
    """Activation sites as x tick labels, in forward order, shown as written (:func:`literal`)."""
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([literal(n) for n in names], rotation=90, fontsize=7)
    ax.set_xlim(-0.6, len(names) - 0.4)


def plot_fraction(counts: dict) -> bytes:
    """Bars: nonlinear fraction of channels per site (``report.json["units"]``)."""
    names = list(counts["sites"])
    fig = figure(max(6.0, 0.3 * len(names) + 2), 4.5)
    ax = fig.add_subplot()
    ax.bar(range(len(names)), [s["fraction"] for s in counts["sites"].values()], color="tab:blue")
    ax.axhline(counts["fraction"], color="tab:red", lw=1, ls="--", label=f"all channels: {counts['fraction']:.3f}")
    site_axis(ax, names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("nonlinear fraction of channels")
    ax.set_title("Nonlinear units per site")
    ax.legend(loc="upper right", fontsize=8)
    return png(fig)


def plot_affinity(signature: list) -> bytes:
    """The affinity score along depth (``report.json["affinity"]``)."""
    names = [s for s, _ in signature]
    fig = figure(max(6.0, 0.3 * len(names) + 2), 4.5)
    ax = fig.add_subplot()
    ax.plot(range(len(names)), [v for _, v in signature], marker="o", color="tab:green")
    site_axis(ax, names)
    ax.set_ylim(min(0.5, min(v for _, v in signature) - 0.05), 1.02)
    ax.set_ylabel("affinity score (1 = affine)")
    ax.set_title("Non-linearity signature along depth")
    ax.grid(alpha=0.3)
    return png(fig)


def plot_history(history: dict) -> bytes:
    """Nonlinear fraction over training, all channels and per site (``report.json["history"]``)."""
    fig = figure(7.0)
    ax = fig.add_subplot()
    steps = history["steps"]
    for values in history["sites"].values():
        pts = [(s, v) for s, v in zip(steps, values) if v is not None]
        if pts:
            ax.plot(*zip(*pts), color="0.75", lw=0.8)
    total = [np.nan if v is None else v for v in history["total"]]
    ax.plot(steps, total, color="tab:red", lw=2, label="all channels")
    ax.plot([], [], color="0.75", lw=0.8, label="per site")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("nonlinear fraction")
    ax.set_ylim(0, 1.05)
    ax.set_title("Nonlinear fraction over training")
    ax.legend(fontsize=8)
    return png(fig)


def _ecdf(ax, values: list[float], xlabel: str) -> None:
    x = np.sort(np.asarray(values, dtype=float))
    y = np.arange(1, len(x) + 1) / len(x)
    ax.step(np.concatenate([[x[0]], x]), np.concatenate([[0.0], y]), where="post")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of segments")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def plot_regions(regions: dict) -> bytes:
    """ECDFs of region counts and absolute deviations per segment (``report.json["regions"]``)."""
    fig = figure(9.0)
    ax1, ax2 = fig.subplots(1, 2)
    partial = "" if regions.get("complete", True) else ", partial: lower bounds"
    _ecdf(ax1, regions["counts"], "linear regions per segment")
    ax1.set_title(f"Region counts (ECDF{partial})")
    _ecdf(ax2, regions["deviation"], "absolute deviation from the chord")
    ax2.set_title(f"Absolute deviation (ECDF{partial})")
    return png(fig)


def plot_gates(gates: dict) -> bytes:
    """Fraction of gates on and mean gate entropy per site (``report.json["gates"]``)."""
    names = list(gates)
    fig = figure(max(6.0, 0.4 * len(names) + 2), 4.5)
    ax = fig.add_subplot()
    pos = np.arange(len(names))
    ax.bar(pos - 0.2, [g["fraction_on"] for g in gates.values()], 0.4, label="fraction of gates on")
    ax.bar(pos + 0.2, [g["entropy"] for g in gates.values()], 0.4, label="mean gate entropy (bits)")
    site_axis(ax, names)
    ax.set_ylim(0, 1.05)
    ax.set_title("Gate statistics per site")
    ax.legend(fontsize=8)
    return png(fig)
