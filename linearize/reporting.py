"""``linearize.report``: where the nonlinearity of a network sits, as JSON, PNG plots and one HTML page.

:func:`report` runs every measure that applies to the model on a batch of data and returns a
:class:`Report` dataclass; :meth:`Report.save` writes ``report.json``, the PNG plots and a
self-contained ``report.html`` (images embedded as base64 data URIs). ``linearize report`` on the
command line (:func:`register_cli`) loads a model and data and does the same.

Measures (each skipped with a stated reason when it does not apply):

- nonlinear units: per-site channel counts and fractions (:func:`linearize.count_units`);
- average path length, both variants (:func:`linearize.measures.average_path_length`);
- non-linearity signature: affinity score per site (:func:`linearize.measures.affinity_signature`);
- linear regions and absolute deviation along segments between data samples (or translation
  loops of images), for piecewise-linear models only (:func:`linearize.measures.linear_regions`);
- the nonlinear fraction over training, from a :class:`linearize.Sparsifier` history;
- gate statistics of gated (DGN / DLGN) models (:func:`linearize.gated.gate_statistics`).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import gzip
import html
import importlib
import io
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ._optional import require
from .checks import arg_type, check_positive, check_positive_int, check_tol
from .inputs import Batches, call_model, eval_mode, hooks, model_device, to_device
from .unit import LinearizableActivation, check_finite_slopes, count_units, units

__all__ = ["Report", "report", "register_cli", "load_history", "MEASURES"]

MEASURES = ("units", "path_length", "affinity", "regions", "history", "gates")
# Budget of the linear-regions walk (one float64 forward per region): an untrained CIFAR ResNet-20
# has thousands of regions on a segment between two images, at ~0.05-0.1 s a region on a CPU core.
REGIONS_MAX_REGIONS = 1000  # per segment
REGIONS_SECONDS = 10.0  # wall clock for all segments together
PLOTS = {
    "fraction": "nonlinear_fraction.png",
    "affinity": "affinity_signature.png",
    "history": "fraction_history.png",
    "regions": "regions_ecdf.png",
    "gates": "gate_statistics.png",
}


# ----------------------------------------------------------------------------- the report


@dataclass
class Report:
    """Everything :func:`report` measured; ``None`` fields were skipped (see ``skipped``).

    Attributes:
        model: class name of the model.
        num_samples: samples of the data used (affinity, finiteness check).
        tol: a channel is linear when its slope ``a >= 1 - tol``.
        units: :func:`linearize.count_units` output: ``total``, ``nonlinear``, ``linear`` channels
            and ``sites`` ``{name: {kind, total, nonlinear, linear, fraction}}``, plus ``fraction``.
        path_length: :class:`~linearize.measures.paths.PathLengthResult` as a dict: ``normalized``,
            ``unnormalized`` (nonlinear units per path), ``log10_paths``, ``unit_calls``, ``merges``, ``method``.
        affinity: ``[[site, score], ...]`` in forward order (score 1 = affine).
        regions: ``segments`` (how they were built), ``counts`` (regions per segment) and
            ``deviation`` (exact absolute deviation from the chord per segment, line integral,
            mean over outputs), ``mean_count``, ``mean_deviation``; ``budget`` (``max_regions``,
            ``max_seconds``), ``complete``, ``stopped`` (the budget that stopped the walk, or
            ``None``) and ``covered`` (fraction of each segment walked). When ``complete`` is
            False, counts and deviations are those of the covered parts: lower bounds.
        history: ``steps``, ``total`` (nonlinear fraction of all channels) and ``sites``
            ``{name: [fraction per step]}`` from a sparsifier log.
        gates: per-site gate statistics of a gated model.
        excluded: ``{site: reason}`` of the activations ``convert`` left unconverted on purpose
            (``exclude_modules``/``target_modules`` filters, multiplicative gates such as
            squeeze-excitation sigmoids); they are not in ``units`` or any count.
        skipped: ``{measure: reason}`` for every measure that did not run.
    """

    model: str
    num_samples: int
    tol: float
    units: dict | None = None
    path_length: dict | None = None
    affinity: list | None = None
    regions: dict | None = None
    history: dict | None = None
    gates: dict | None = None
    excluded: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain JSON-serializable dict."""
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """The report as a JSON string (``report.json``)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def plots(self) -> dict[str, bytes]:
        """PNG images ``{file name: bytes}`` of the measures that ran."""
        out = {}
        if self.units is not None:
            out[PLOTS["fraction"]] = _plot_fraction(self.units)
        if self.affinity:
            out[PLOTS["affinity"]] = _plot_affinity(self.affinity)
        if self.history is not None:
            out[PLOTS["history"]] = _plot_history(self.history)
        if self.regions is not None:
            out[PLOTS["regions"]] = _plot_regions(self.regions)
        if self.gates:
            out[PLOTS["gates"]] = _plot_gates(self.gates)
        return out

    def to_html(self, images: Mapping[str, bytes] | None = None) -> str:
        """A self-contained HTML page: summary tables and the plots as base64 data URIs."""
        return _html(self, self.plots() if images is None else images)

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        """Write ``report.json``, the PNG plots and ``report.html`` into ``out_dir`` (created).

        Returns ``{file name: path}`` of everything written. Each file is written atomically.
        """
        from ._files import atomic_write

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        images = self.plots()
        written = {"report.json": atomic_write(out / "report.json", self.to_json())}
        for name, png in images.items():
            written[name] = atomic_write(out / name, png)
        written["report.html"] = atomic_write(out / "report.html", self.to_html(images))
        return written


def report(
    model: nn.Module,
    data: Any,
    *,
    history: str | Path | Mapping | None = None,
    tol: float = 0.0,
    max_samples: int = 512,
    segments: int = 16,
    paths: str = "pairs",
    batch_size: int = 128,
    sources: list | None = None,
    skip: Iterable[str] = (),
    progress: bool = True,
    max_regions: int | None = REGIONS_MAX_REGIONS,
    regions_seconds: float | None = REGIONS_SECONDS,
) -> Report:
    """Measure where the nonlinearity of ``model`` sits, on ``data``.

    Args:
        model: a model converted by :func:`linearize.convert` (or a gated network from
            ``convert(mode="dgn" | "dlgn")``).
        data: a tensor ``[N, ...]``, an ``(inputs, labels)`` pair, a dict of tensors with ``N`` rows
            (tokenizer output), or an iterable of such batches (a ``DataLoader``; see
            :mod:`linearize.inputs`); the first ``max_samples`` samples are read once and used by
            every measure. At least 2 are needed.
        history: a sparsifier history: a JSON path or dict written by
            :meth:`linearize.Sparsifier.save_history`, or a dict ``{step: {site: fraction}}``;
            read and checked before any measure runs.
        tol: in ``[0, 1)``: a channel is linear when its slope ``a >= 1 - tol``.
        max_samples: samples taken from ``data`` (at least 2).
        segments: number of input segments for linear regions and absolute deviation (0 skips them).
        paths: ``"pairs"`` (segments between consecutive samples) or ``"loops"`` (closed
            translation loops of images, 8 anchors of radius 4 px, seed 001; ``segments`` images).
        batch_size: forward batch size (at least 1).
        sources: inputs that start paths for the average path length (see
            :func:`~linearize.measures.average_path_length`).
        skip: measures not to run, from ``MEASURES`` (``"affinity"`` costs the most: an exact
            assignment of up to ``max_samples`` points per site).
        progress: tqdm progress bars.
        max_regions, regions_seconds: budget of the linear regions: at most ``max_regions`` per
            segment, and ``regions_seconds`` of wall-clock time for all segments (``None``: no
            limit; see :func:`~linearize.measures.linear_regions`). The defaults finish in seconds:
            on an untrained CIFAR ResNet-20, whose segments between test images hold ~50,000
            regions each, the regions stop after 12 s and the whole report takes 14 s on one CPU
            thread. A walk they stop is reported as partial (``regions["complete"]`` False, a
            warning in the HTML and the plot titles, a line on the command line).

    Example:
        >>> import linearize
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> model = linearize.convert(net, example_inputs=torch.randn(2, 4))
        >>> rep = linearize.report(model, torch.randn(64, 4), progress=False)
        >>> rep.regions["complete"], len(rep.regions["counts"])  # rep.save("out") writes the files
        (True, 16)

    Raises:
        ValueError: fewer than 2 samples, no activation sites (call ``linearize.convert``),
            NaN/inf activations (names the site), an unreadable ``history`` (names the file), an
            argument out of range (the regions budget included). :class:`~linearize.unit.NonFiniteSlopeError`:
            NaN/inf slopes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if paths not in ("pairs", "loops"):
        raise ValueError(f"paths must be 'pairs' or 'loops', got {paths!r}")
    tol = check_tol(tol)
    max_samples = check_positive_int(max_samples, "max_samples", minimum=2)
    segments = check_positive_int(segments, "segments", minimum=0)
    batch_size = check_positive_int(batch_size, "batch_size")
    gated = _gated_module()
    is_gated = gated is not None and isinstance(model, gated.GatedNetwork)
    if not is_gated and not units(model):
        raise ValueError(
            f"{type(model).__name__} has no activation sites to measure (no linearizable units): "
            "call linearize.convert(model) first"
        )
    skip = set(skip)
    if skip - set(MEASURES):
        raise ValueError(f"unknown measures in skip: {sorted(skip - set(MEASURES))}; known: {MEASURES}")
    max_regions = None if max_regions is None else check_positive_int(max_regions, "max_regions")
    regions_seconds = None if regions_seconds is None else check_positive(regions_seconds, "regions_seconds")
    check_finite_slopes(units(model), "report")
    records = _read_history(history) if history is not None and "history" not in skip else None
    data = Batches.of(data).limit(samples=max_samples).cached()
    n = data.num_samples
    if n < 2:
        raise ValueError(f"report needs at least 2 samples, got {n}: pass a larger batch")
    batches = data.split(batch_size).to(model_device(model))
    rep = Report(model=type(model).__name__, num_samples=n, tol=tol)
    conversion = getattr(model, "linearize_report", None)
    if callable(getattr(conversion, "excluded_sites", None)):
        rep.excluded = conversion.excluded_sites()
    bar = tqdm(("finite",) + MEASURES, desc="report", disable=not progress)
    for step in bar:
        bar.set_postfix_str(step)
        if step in skip:
            rep.skipped[step] = "skipped on request"
        elif step == "finite":
            _check_finite(model, batches)
        elif step == "units":
            if is_gated:
                rep.skipped["units"] = "gated model: it has gates, not slope units"
            else:
                rep.units = count_units(model, tol)
                rep.units["fraction"] = rep.units["nonlinear"] / rep.units["total"]
        elif step == "path_length":
            _path_length(rep, model, data, tol, sources, is_gated)
        elif step == "affinity":
            _affinity(rep, model, data, batch_size, max_samples, progress)
        elif step == "regions":
            _regions(rep, model, data.concat(), segments, paths, batch_size, is_gated, progress, max_regions, regions_seconds)
        elif step == "history":
            if records is None:
                rep.skipped["history"] = "no sparsifier history given"
            else:
                rep.history = _history_summary(records, rep.units)
        elif step == "gates":
            if is_gated:
                rep.gates = gated.gate_statistics(model, batches)
            else:
                rep.skipped["gates"] = "not a gated (DGN/DLGN) model"
    return rep


# ----------------------------------------------------------------------------- measures


def _path_length(rep: Report, model: nn.Module, data: Batches, tol: float, sources, is_gated: bool) -> None:
    if is_gated:
        rep.skipped["path_length"] = "gated model: the average path length counts slope units"
        return
    from .measures.paths import average_path_length

    example = to_device(data.limit(samples=2).concat(), model_device(model))
    rep.path_length = average_path_length(model, example, tol=tol, sources=sources, detailed=True).to_dict()


def _affinity(rep: Report, model: nn.Module, data: Batches, batch_size: int, max_samples: int, progress: bool) -> None:
    try:
        affinity = importlib.import_module(".measures.affinity", __package__)
    except ImportError as err:
        rep.skipped["affinity"] = f"linearize.measures.affinity is not available: {err}"
        return
    try:
        sig = affinity.affinity_signature(
            model, data, batch_size=batch_size, max_samples=max(2, max_samples), progress=progress
        )
    except ValueError as err:  # e.g. no site the signature can read; NaN/inf was checked before
        rep.skipped["affinity"] = str(err)
        return
    rep.affinity = [[name, float(score)] for name, score in sig]


def _regions(rep: Report, model, inputs, segments: int, paths: str, batch_size: int, is_gated: bool, progress: bool,
             max_regions: int | None, max_seconds: float | None) -> None:
    smooth = sorted({u.kind for _, u in units(model) if not u.is_prelu})
    if is_gated:
        reason = "gated model: products of gates and values are not piecewise linear"
    elif smooth:
        reason = f"not piecewise linear: smooth activation kinds {smooth}"
    elif not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point():
        reason = "needs a floating-point input tensor (token ids have no segments between them)"
    elif segments < 1:
        reason = "segments < 1"
    else:
        reason = None
    if reason is not None:
        rep.skipped["regions"] = reason
        return
    try:
        regions = importlib.import_module(".measures.regions", __package__)
    except ImportError as err:
        rep.skipped["regions"] = f"linearize.measures.regions is not available: {err}"
        return
    if paths == "loops":
        if inputs.ndim != 4:
            rep.skipped["regions"] = f"translation loops need images [N, C, H, W], got {tuple(inputs.shape)}"
            return
        x0, x1 = regions.translation_loops(inputs[:segments])
        how = f"closed translation loops (8 anchors, radius 4 px) of {min(segments, len(inputs))} images"
    else:
        idx = torch.arange(min(segments, len(inputs)))
        x0, x1 = inputs[idx], inputs[(idx + 1) % len(inputs)]
        how = "straight segments between consecutive samples"
    try:
        with warnings.catch_warnings():  # a partial result is marked in the report itself
            warnings.simplefilter("ignore", regions.PartialResultWarning)
            res = regions.linear_regions(model, x0, x1, batch_size=batch_size, progress=progress,
                                         max_regions=max_regions, max_seconds=max_seconds)
    except ValueError as err:
        rep.skipped["regions"] = str(err)
        return
    counts = res.count.tolist()
    deviation = res.deviation().mean(1).tolist()
    rep.regions = {
        "segments": how,
        "counts": counts,
        "deviation": deviation,
        "mean_count": float(np.mean(counts)),
        "mean_deviation": float(np.mean(deviation)),
        "budget": {"max_regions": max_regions, "max_seconds": max_seconds},
        "complete": res.complete,
        "stopped": res.stopped,
        "covered": res.covered.tolist(),
    }


def load_history(history: str | Path | Mapping, counts: dict | None = None) -> dict:
    """Nonlinear fraction over training: ``{"steps", "total", "sites": {name: [fraction]}}``.

    Args:
        history: a JSON file or dict from :meth:`linearize.Sparsifier.save_history`
            (``{"history": [{"step", "sites": {...}, "nonlinear_fraction"}, ...]}``) or a dict
            ``{step: {site: fraction}}`` (steps may be strings, as after a JSON round trip).
        counts: :func:`linearize.count_units` of the model, to weight sites by their channels when
            the log has no total; without it the total is the unweighted mean over sites.
    """
    return _history_summary(_read_history(history), counts)


_Record = tuple[int, dict[str, float], "float | None"]


def _read_history(history: str | Path | Mapping) -> list[_Record]:
    """Records ``(step, {site: fraction}, logged total or None)`` of a sparsifier history, by step.

    Every fraction must be a number in ``[0, 1]``; errors name the file.
    """
    source = "the sparsifier history"
    if isinstance(history, (str, Path)):
        path = Path(history)
        source = f"sparsifier history {str(path)!r}"
        if not path.is_file():
            raise FileNotFoundError(f"{source} does not exist")
        try:
            history = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
            raise ValueError(f"{source} is not valid JSON ({err})") from None
    if not isinstance(history, Mapping):
        raise TypeError(f"{source} must be a JSON path or a dict, got {type(history).__name__}")
    try:
        if "history" in history:
            if not isinstance(history["history"], list):
                raise ValueError("its 'history' is not a list of records")
            records = [(_history_step(r["step"]), _history_sites(r.get("sites", {})),
                        _history_fraction(r.get("nonlinear_fraction"), "nonlinear_fraction", optional=True))
                       for r in history["history"]]
        else:
            records = [(_history_step(step), _history_sites(sites), None) for step, sites in history.items()]
    except KeyError as err:
        raise ValueError(f"{source}: a record has no {err} key (expected the JSON of "
                         "Sparsifier.save_history or a {step: {site: fraction}} dict)") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err} (expected the JSON of Sparsifier.save_history or a "
                         "{step: {site: fraction}} dict)") from None
    if not records:
        raise ValueError(f"{source} is empty")
    return sorted(records, key=lambda r: r[0])


def _history_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, str)) or not str(step).lstrip("-").isdigit():
        raise ValueError(f"step {step!r} is not an integer")
    return int(step)


def _history_fraction(value: Any, what: str, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} is {value!r}, not a fraction in [0, 1]")  # NaN fails the range test too
    return float(value)


def _history_sites(sites: Any) -> dict[str, float]:
    if not isinstance(sites, Mapping):
        raise TypeError(f"sites {sites!r} is not a {{site: fraction}} dict")
    return {str(name): _history_fraction(f, f"the fraction of site {name!r}") for name, f in sites.items()}


def _history_summary(records: list[_Record], counts: dict | None) -> dict:
    """:func:`load_history`'s result from checked records, sites weighted by ``counts`` channels."""
    names = list(dict.fromkeys(name for _, sites, _ in records for name in sites))
    widths = {n: s["total"] for n, s in (counts or {}).get("sites", {}).items()}
    total = []
    for _, sites, logged in records:
        if logged is not None:
            total.append(float(logged))
        elif sites and all(n in widths for n in sites):
            total.append(sum(f * widths[n] for n, f in sites.items()) / sum(widths[n] for n in sites))
        else:
            total.append(float(np.mean(list(sites.values()))) if sites else None)
    return {
        "steps": [r[0] for r in records],
        "total": total,
        "sites": {n: [r[1].get(n) for r in records] for n in names},
    }


# ----------------------------------------------------------------------------- data


@torch.no_grad()
def _check_finite(model: nn.Module, batches: Batches) -> None:
    """One forward over the inputs; raise naming the first site with NaN/inf input or output."""
    gated = _gated_module()
    sites = [(name, m) for name, m in model.named_modules()
             if isinstance(m, LinearizableActivation) or (gated is not None and isinstance(m, gated.GaLU))]

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            for what, t in (("input", args[0] if args else None), ("output", out)):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                    raise ValueError(
                        f"activation site {name!r} has NaN/inf values in its {what}: check the "
                        "model's weights and the input data (normalization, dtype overflow)"
                    )
        return hook

    with hooks() as handles, eval_mode(model):
        handles += [m.register_forward_hook(hook_for(name)) for name, m in sites]
        for batch in batches:
            call_model(model, batch)


def _gated_module():
    try:
        return importlib.import_module(".gated", __package__)
    except ImportError:
        return None


# ----------------------------------------------------------------------------- plots


def _figure(width: float, height: float = 3.6):
    require("matplotlib", what="the report's plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _site_axis(ax, names: list[str]) -> None:
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=90, fontsize=7)
    ax.set_xlim(-0.6, len(names) - 0.4)


def _plot_fraction(counts: dict) -> bytes:
    names = list(counts["sites"])
    fig = _figure(max(6.0, 0.3 * len(names) + 2), 4.5)
    ax = fig.add_subplot()
    ax.bar(range(len(names)), [s["fraction"] for s in counts["sites"].values()], color="tab:blue")
    ax.axhline(counts["fraction"], color="tab:red", lw=1, ls="--", label=f"all channels: {counts['fraction']:.3f}")
    _site_axis(ax, names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("nonlinear fraction of channels")
    ax.set_title("Nonlinear units per site")
    ax.legend(loc="upper right", fontsize=8)
    return _png(fig)


def _plot_affinity(signature: list) -> bytes:
    names = [s for s, _ in signature]
    fig = _figure(max(6.0, 0.3 * len(names) + 2), 4.5)
    ax = fig.add_subplot()
    ax.plot(range(len(names)), [v for _, v in signature], marker="o", color="tab:green")
    _site_axis(ax, names)
    ax.set_ylim(min(0.5, min(v for _, v in signature) - 0.05), 1.02)
    ax.set_ylabel("affinity score (1 = affine)")
    ax.set_title("Non-linearity signature along depth")
    ax.grid(alpha=0.3)
    return _png(fig)


def _plot_history(history: dict) -> bytes:
    fig = _figure(7.0)
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
    return _png(fig)


def _ecdf(ax, values: list[float], xlabel: str) -> None:
    x = np.sort(np.asarray(values, dtype=float))
    y = np.arange(1, len(x) + 1) / len(x)
    ax.step(np.concatenate([[x[0]], x]), np.concatenate([[0.0], y]), where="post")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of segments")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def _plot_regions(regions: dict) -> bytes:
    fig = _figure(9.0)
    ax1, ax2 = fig.subplots(1, 2)
    partial = "" if regions.get("complete", True) else ", partial: lower bounds"
    _ecdf(ax1, regions["counts"], "linear regions per segment")
    ax1.set_title(f"Region counts (ECDF{partial})")
    _ecdf(ax2, regions["deviation"], "absolute deviation from the chord")
    ax2.set_title(f"Absolute deviation (ECDF{partial})")
    return _png(fig)


def _plot_gates(gates: dict) -> bytes:
    names = list(gates)
    fig = _figure(max(6.0, 0.4 * len(names) + 2), 4.5)
    ax = fig.add_subplot()
    pos = np.arange(len(names))
    ax.bar(pos - 0.2, [g["fraction_on"] for g in gates.values()], 0.4, label="fraction of gates on")
    ax.bar(pos + 0.2, [g["entropy"] for g in gates.values()], 0.4, label="mean gate entropy (bits)")
    _site_axis(ax, names)
    ax.set_ylim(0, 1.05)
    ax.set_title("Gate statistics per site")
    ax.legend(fontsize=8)
    return _png(fig)


# ----------------------------------------------------------------------------- HTML


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;display:block;margin:.5em 0}
.skip{color:#777;font-style:italic}.partial{color:#a40;border-left:4px solid #a40;padding-left:.6em}"""

# marks each image with data-loaded="yes"/"no" once the page has loaded (for headless checks)
_SCRIPT = """window.addEventListener("load", function () {
  var ok = true;
  for (var img of document.images) {
    var loaded = img.complete && img.naturalWidth > 0;
    img.setAttribute("data-loaded", loaded ? "yes" : "no");
    ok = ok && loaded;
  }
  document.body.setAttribute("data-images", ok ? "loaded" : "broken");
});"""


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(images: Mapping[str, bytes], key: str, alt: str) -> str:
    name = PLOTS[key]
    if name not in images:
        return ""
    data = base64.b64encode(images[name]).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}" title="{name}">'


def _section(title: str, rep: Report, key: str, body: str) -> str:
    if key in rep.skipped:
        body = f'<p class="skip">Skipped: {html.escape(rep.skipped[key])}</p>'
    return f"<h2>{html.escape(title)}</h2>\n{body}"


def _percent(fraction: float) -> str:
    """``0.37 -> '37%'``, ``3.2e-5 -> '0.0032%'``: three significant digits at most, however small."""
    return f"{100 * float(fraction):.3g}%"


def _regions_note(regions: dict) -> str:
    """A warning paragraph when the regions walk was stopped by its budget (empty when complete)."""
    if regions.get("complete", True):
        return ""
    covered = regions["covered"]
    short = sum(c < 1 for c in covered)
    return (f'<p class="partial"><strong>Partial result</strong>: the walk stopped at its budget '
            f"({html.escape(str(regions['stopped']))}) on {short} of {len(covered)} segments, after "
            f"{_percent(np.mean(covered))} of their length on average. Counts and deviations cover the "
            "walked parts only: lower bounds. Raise the budget (max_regions / regions_seconds, or "
            "--max-regions / --regions-seconds) for the complete result.</p>")


def _html(rep: Report, images: Mapping[str, bytes]) -> str:
    parts = [f"<h1>linearize report: {html.escape(rep.model)}</h1>",
             f"<p>{rep.num_samples} samples; a channel is linear when its slope a &ge; 1 &minus; {rep.tol:g}.</p>"]
    body = ""
    if rep.units is not None:
        u = rep.units
        body = (_table(["channels", "nonlinear", "linear", "nonlinear fraction"],
                       [[u["total"], u["nonlinear"], u["linear"], u["fraction"]]])
                + _img(images, "fraction", "nonlinear fraction per site")
                + _table(["site", "kind", "channels", "nonlinear", "fraction"],
                         [[n, s["kind"], s["total"], s["nonlinear"], s["fraction"]] for n, s in u["sites"].items()]))
    if rep.excluded:
        body += ("<p>Not converted on purpose, so not counted:</p>"
                 + _table(["site", "reason"], [[n, why] for n, why in rep.excluded.items()]))
    parts.append(_section("Nonlinear units", rep, "units", body))
    body = ""
    if rep.path_length is not None:
        p = rep.path_length
        body = _table(["normalized APL", "unnormalized APL", "log10 paths", "unit calls", "merges", "graph"],
                      [[p["normalized"], p["unnormalized"], p["log10_paths"], p["unit_calls"], p["merges"], p["method"]]])
        body += ("<p>Normalized: a random walk from output to input that splits equally at every merge; "
                 "unnormalized: every channel-level path equally likely.</p>")
    parts.append(_section("Average path length", rep, "path_length", body))
    body = ""
    if rep.affinity is not None:
        body = _img(images, "affinity", "affinity signature") + _table(["site", "affinity score"], rep.affinity)
    parts.append(_section("Non-linearity signature (affinity score)", rep, "affinity", body))
    body = ""
    if rep.regions is not None:
        r = rep.regions
        body = (_regions_note(r) + f"<p>{html.escape(r['segments'])}: {len(r['counts'])} segments, mean {r['mean_count']:.4g} "
                f"regions, mean absolute deviation {r['mean_deviation']:.4g}.</p>" + _img(images, "regions", "region ECDFs"))
    parts.append(_section("Linear regions and absolute deviation", rep, "regions", body))
    body = ""
    if rep.history is not None:
        h = rep.history
        body = (_img(images, "history", "nonlinear fraction over training")
                + f"<p>{len(h['steps'])} logged steps, last nonlinear fraction {h['total'][-1]}.</p>")
    parts.append(_section("Nonlinear fraction over training", rep, "history", body))
    if rep.gates is not None:
        rows = [[s, g["channels"], g["fraction_on"], g["entropy"], g["always_on"], g["always_off"]] for s, g in rep.gates.items()]
        parts.append("<h2>Gate statistics</h2>" + _img(images, "gates", "gate statistics") + _table(["site", "channels", "fraction on", "entropy (bits)", "always on", "always off"], rows))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>linearize report: '
            f"{html.escape(rep.model)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(parts) + f"\n<script>{_SCRIPT}</script>\n</body></html>\n")


# ----------------------------------------------------------------------------- command line

_IMAGE_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
_NORMS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand to a ``linearize`` argument parser; returns its parser."""
    p = subparsers.add_parser(
        "report",
        help="measure where a model's nonlinearity sits; write report.json, PNG plots and report.html",
        description="Load a model, run the linearize measures on data and write report.json, PNG plots "
        "and a self-contained report.html into --output-dir. A model without units is converted first "
        "(slopes 0: every channel nonlinear).",
    )
    p.add_argument("model", help="a torchvision builder name (resnet18), a Hugging Face model directory "
                   "(with linearize_config.json if saved by linearize.save_pretrained), or a .pt file "
                   "holding a whole pickled nn.Module (needs --trust-pickle)")
    p.add_argument("--data", required=True, help="'digits' (sklearn demo data), an image folder, the CIFAR-10 "
                   ".tar.gz of JPEGs, or a JSONL(.gz) text file (Hugging Face models)")
    p.add_argument("--checkpoint", help="state_dict file for a torchvision model (plain or converted)")
    p.add_argument("--num-classes", type=int, help="output classes of the torchvision model (default: builder's)")
    p.add_argument("--units", help="directory written by linearize.save_pretrained for a torchvision model")
    p.add_argument("--history", help="sparsifier history JSON (Sparsifier.save_history)")
    p.add_argument("--output-dir", default="linearize-report", help="where to write (default linearize-report)")
    p.add_argument("--num-samples", type=arg_type(check_positive_int, "--num-samples", 2), default=512,
                   help="samples used, at least 2 (default 512)")
    p.add_argument("--segments", type=arg_type(check_positive_int, "--segments", 0), default=16,
                   help="segments for linear regions (default 16; 0 skips them)")
    p.add_argument("--max-regions", type=_or_none(arg_type(check_positive_int, "--max-regions")),
                   default=REGIONS_MAX_REGIONS, metavar="N",
                   help=f"linear regions: stop a segment after N regions ('none': no limit; default {REGIONS_MAX_REGIONS})")
    p.add_argument("--regions-seconds", type=_or_none(arg_type(check_positive, "--regions-seconds")),
                   default=REGIONS_SECONDS, metavar="S",
                   help=f"linear regions: stop all segments after S seconds ('none': no limit; default {REGIONS_SECONDS:g}); "
                   "a stopped walk is reported as partial")
    p.add_argument("--paths", choices=["pairs", "loops"], default="pairs", help="segments between samples or translation loops")
    p.add_argument("--tol", type=arg_type(check_tol, 1.0, "--tol"), default=0.0,
                   help="in [0, 1): a channel is linear when a >= 1 - tol (default 0)")
    p.add_argument("--batch-size", type=arg_type(check_positive_int, "--batch-size"), default=128,
                   help="forward batch size (default 128)")
    p.add_argument("--normalize", choices=["auto", "cifar10", "imagenet", "none"], default="auto",
                   help="image normalization (auto: cifar10 for the .tar.gz, imagenet for folders)")
    p.add_argument("--image-size", type=arg_type(check_positive_int, "--image-size"),
                   help="resize images to this square size")
    p.add_argument("--text-field", help="JSONL field with the text, dotted for nesting (default: text, sentence or translation.en)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory)")
    p.add_argument("--max-length", type=arg_type(check_positive_int, "--max-length"), default=64,
                   help="tokens per text (default 64)")
    p.add_argument("--skip", nargs="+", default=[], choices=MEASURES, metavar="MEASURE",
                   help=f"measures not to run, of: {', '.join(MEASURES)}")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    from .models import add_trust_pickle

    add_trust_pickle(p)
    p.set_defaults(func=run_cli)
    return p


def _or_none(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An ``argparse`` ``type=``: ``'none'`` (no limit) as ``None``, anything else through ``parse``."""
    def wrapped(text: str) -> object:
        return None if text.strip().lower() == "none" else parse(text)

    wrapped.__name__ = parse.__name__  # argparse names the type in its "invalid" message
    return wrapped


def run_cli(args: argparse.Namespace) -> int:
    """Run the ``report`` subcommand; prints where the files went."""
    model, data = _load_model_and_data(args)
    rep = report(model, data, history=args.history, tol=args.tol, max_samples=args.num_samples,
                 segments=args.segments, paths=args.paths, batch_size=args.batch_size,
                 skip=args.skip, progress=not args.no_progress, max_regions=args.max_regions,
                 regions_seconds=args.regions_seconds)
    written = rep.save(args.output_dir)
    if rep.units is not None:
        print(f"nonlinear channels: {rep.units['nonlinear']} / {rep.units['total']} ({rep.units['fraction']:.2%})")
    if rep.path_length is not None:
        print(f"average path length: normalized {rep.path_length['normalized']:.3f}, "
              f"unnormalized {rep.path_length['unnormalized']:.3f}")
    if rep.regions is not None and not rep.regions["complete"]:
        print(f"linear regions: partial result, stopped at {rep.regions['stopped']} after "
              f"{_percent(np.mean(rep.regions['covered']))} of the segments' length on average "
              "(counts are lower bounds; raise --max-regions / --regions-seconds)")
    for what, reason in rep.skipped.items():
        print(f"skipped {what}: {reason}")
    print(f"wrote {', '.join(sorted(written))} to {Path(args.output_dir).resolve()}")
    return 0


def _load_model_and_data(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    import linearize

    from ._files import LoadError, safe_torch_load
    from .models import load_model

    spec = Path(args.model)
    hf_dir = spec.is_dir()
    trust = args.trust_pickle
    model = load_model(spec, args.num_classes, trust_pickle=trust)
    data = _load_data(args, model, spec if hf_dir else None)
    example = Batches.of(data).limit(samples=2).concat()
    if hf_dir and (spec / "linearize_config.json").is_file():
        model = linearize.from_pretrained(model, spec, example_inputs=example)
    elif args.units:
        model = linearize.from_pretrained(model, args.units, example_inputs=example)
    state = safe_torch_load(args.checkpoint, trust_pickle=trust, what="--checkpoint") if args.checkpoint else None
    if state is not None and not isinstance(state, Mapping):
        raise LoadError(f"--checkpoint {args.checkpoint} holds a {type(state).__name__}, not a state_dict; "
                        "a whole pickled model goes in MODEL (with --trust-pickle)")
    converted = bool(units(model)) or getattr(model, "linearize_config", None) is not None
    if not converted and state is not None and any(k.endswith(".slope") for k in state):
        model, converted = linearize.convert(model, example_inputs=example), True
    if state is not None:
        model.load_state_dict(state)
        from .serialization import _unit_problem

        for name, unit in units(model):  # the checks of linearize.from_pretrained, on the loaded slopes
            problem = _unit_problem(unit.slope, unit.frozen, unit.num_channels)
            if problem:
                raise LoadError(f"--checkpoint {args.checkpoint}: unit {name!r}: {problem}; refusing to report "
                                "on it (slopes must be finite in [0, 1], frozen channels at their value)")
    if not converted:
        print(f"{type(model).__name__} has no linearizable units: converting it (every channel nonlinear)")
        model = linearize.convert(model, example_inputs=example)
    return model.eval(), data


def _load_data(args: argparse.Namespace, model: nn.Module, hf_dir: Path | None) -> Any:
    src, n = args.data, args.num_samples
    if src == "digits":
        load_digits = require("sklearn.datasets", what="--data digits").load_digits

        x = torch.tensor(load_digits().data[:n], dtype=torch.float32) / 16.0
        from .example_inputs import input_layer

        return x.view(-1, 1, 8, 8) if isinstance(input_layer(model), nn.Conv2d) else x
    path = Path(src)
    if not path.exists():
        raise FileNotFoundError(f"--data {src}: no such file or directory (or use 'digits')")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        if hf_dir is None:
            raise ValueError("JSONL text data needs a Hugging Face model directory (for its tokenizer)")
        return _load_text(path, n, args.text_field, Path(args.tokenizer) if args.tokenizer else hf_dir,
                          args.max_length, model)
    norm = args.normalize if args.normalize != "auto" else ("cifar10" if name.endswith((".tar.gz", ".tgz")) else "imagenet")
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        images = _tar_images(path, n)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in _IMAGE_EXT)
        if not files:
            raise ValueError(f"no images ({', '.join(_IMAGE_EXT)}) under {path}")
        pick = np.random.default_rng(0).permutation(len(files))[:n]
        images = [files[i].read_bytes() for i in sorted(pick)]
    else:
        raise ValueError(f"--data {src}: expected 'digits', an image folder, a .tar.gz of images or a .jsonl file")
    return _decode(images, args.image_size, norm)


def _tar_images(path: Path, n: int) -> list[bytes]:
    import tarfile

    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.lower().endswith(_IMAGE_EXT)]
        if not members:
            raise ValueError(f"{path} holds no images")
        test = [m for m in members if "/test/" in f"/{m.name}"]
        members = test or members  # the held-out split when there is one
        pick = np.random.default_rng(0).permutation(len(members))[:n]
        return [tar.extractfile(members[i]).read() for i in sorted(pick)]


def _decode(images: list[bytes], size: int | None, norm: str) -> torch.Tensor:
    from PIL import Image

    out = []
    for raw in tqdm(images, desc="images", leave=False):
        img = Image.open(io.BytesIO(raw)).convert("RGB")
        if size:
            img = img.resize((size, size), Image.BILINEAR)
        out.append(torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1))
    if len({tuple(t.shape) for t in out}) > 1:
        raise ValueError("images have different sizes: pass --image-size")
    x = torch.stack(out)
    if norm != "none":
        mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in _NORMS[norm])
        x = (x - mean) / std
    return x


def _load_text(path: Path, n: int, text_field: str | None, tokenizer_dir: Path, max_length: int, model: nn.Module) -> dict:
    transformers = require("transformers", what="a text model's report")

    opener = gzip.open if path.name.lower().endswith(".gz") else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                texts.append(_text_of(json.loads(line), text_field))
                if len(texts) >= n:
                    break
    try:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"no tokenizer found in {tokenizer_dir}: pass --tokenizer DIR") from err
    batch = dict(tok(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"))
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        batch["decoder_input_ids"] = batch["input_ids"].clone()
    return batch


def _text_of(record: dict, text_field: str | None) -> str:
    if text_field is None:
        for key in ("text", "sentence"):
            if key in record:
                return record[key]
        if "translation" in record:
            tr = record["translation"]
            return tr.get("en", next(iter(tr.values())))
        raise KeyError(f"no text field in JSONL record with keys {list(record)}: pass --text-field")
    value: Any = record
    for key in text_field.split("."):
        if not isinstance(value, dict) or key not in value:
            raise KeyError(f"JSONL record has no field {text_field!r} (keys {list(record)})")
        value = value[key]
    return str(value)
