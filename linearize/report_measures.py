"""The measures :func:`linearize.report` runs: a registry, ``MEASURES``, and the built-in measures.

``MEASURES`` maps a name (the key in ``report.json``) to a :class:`Measure`: how to compute its value
from a :class:`MeasureContext` (the model, the data, the report's arguments), whether it applies to
gated and to unit models, its plot and its section of the HTML page. :func:`linearize.report` runs them
in order; :func:`register_measure` adds one of your own.

Built in, in this order (each skipped with a stated reason when it does not apply):

- ``units``: per-site channel counts and fractions (:func:`linearize.count_units`);
- ``path_length``: average path length, both variants (:func:`linearize.measures.average_path_length`);
- ``affinity``: the non-linearity signature, affinity score per site
  (:func:`linearize.measures.affinity_signature`);
- ``regions``: linear regions and absolute deviation along segments between data samples (or
  translation loops of images), for piecewise-linear models only (:func:`linearize.measures.linear_regions`);
- ``history``: the nonlinear fraction over training, from a :class:`linearize.Sparsifier` history;
- ``gates``: gate statistics of gated (DGN / DLGN) models (:func:`linearize.gated.gate_statistics`).
"""

from __future__ import annotations

import dataclasses
import html
import json
import keyword
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ._optional import MissingExtra
from .gated import gate_statistics
from .history import Record, summarize_history
from .html_pages import percent, table
from .inputs import Batches, model_device, to_device
from .plots import plot_affinity, plot_fraction, plot_gates, plot_history, plot_regions
from .unit import count_units, units

__all__ = ["Measure", "MeasureContext", "SkipMeasure", "MEASURES", "register_measure", "PLOTS",
           "REGIONS_MAX_REGIONS", "REGIONS_SECONDS"]

# Budget of the linear-regions walk (one float64 forward per region): an untrained CIFAR ResNet-20
# has thousands of regions on a segment between two images, at ~0.05-0.1 s a region on a CPU core.
REGIONS_MAX_REGIONS = 1000  # per segment
REGIONS_SECONDS = 10.0  # wall clock for all segments together
# PNG file names of the built-in measures' plots
PLOTS = {
    "fraction": "nonlinear_fraction.png",
    "affinity": "affinity_signature.png",
    "history": "fraction_history.png",
    "regions": "regions_ecdf.png",
    "gates": "gate_statistics.png",
}
# names a measure cannot take: the report's other fields and its first step (the NaN/inf check)
RESERVED = ("finite", "model", "num_samples", "tol", "excluded", "skipped", "custom")


class SkipMeasure(Exception):
    """Raised by a measure's ``compute`` when it does not apply; the message is the reason in ``skipped``."""


@dataclass
class MeasureContext:
    """What a measure reads: the model, the data and :func:`linearize.report`'s arguments.

    Attributes:
        data: the first ``max_samples`` samples of the data, cached (as given, on their device).
        batches: ``data`` in ``batch_size`` batches on the model's device.
        is_gated: a gated (DGN / DLGN) network.
        history: checked records of the sparsifier history, or ``None`` (see :mod:`linearize.history`).
        results: values of the measures that ran before this one, by name (``results["units"]``).
    """

    model: nn.Module
    data: Batches
    batches: Batches
    is_gated: bool
    tol: float
    batch_size: int
    max_samples: int
    segments: int
    paths: str
    sources: list | None
    max_regions: int | None
    regions_seconds: float | None
    progress: bool
    history: list[Record] | None = None
    results: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def inputs(self) -> Any:
        """All samples in one batch (a tensor ``[N, ...]`` or a dict of them), as given."""
        return self.data.concat()


@dataclass(frozen=True)
class Measure:
    """One measure of the report.

    Attributes:
        compute: ``compute(ctx: MeasureContext)`` returns the measure's value, JSON-serializable
            (numbers, strings, lists, dicts); it raises :class:`SkipMeasure` when it does not apply.
        title: heading of its section in the HTML page (default: the measure's name).
        gated, plain: ``True`` when it runs on gated (DGN / DLGN) networks, resp. on models with
            slope units; otherwise the reason it is skipped on them.
        plot: ``plot(value)`` returns PNG bytes, written as ``plot_file`` (default ``<name>.png``) and
            embedded in its section (with ``alt`` text); not called for ``None`` or an empty value.
        section: ``section(value, image, report)`` returns the HTML body of its section (``image``: the
            ``<img>`` of its plot, or ""); default: the image and the value as JSON.
        summary: ``summary(value)`` returns a line that ``linearize report`` prints, or ``None``.
        skipped_section: show the section (with the reason) when the measure was skipped.
    """

    compute: Callable[[MeasureContext], Any]
    title: str = ""
    gated: bool | str = True
    plain: bool | str = True
    plot: Callable[[Any], bytes] | None = None
    plot_file: str | None = None
    alt: str = ""
    section: Callable[[Any, str, Any], str] | None = None
    summary: Callable[[Any], str | None] | None = None
    skipped_section: bool = True

    def skip_reason(self, is_gated: bool) -> str | None:
        """Why it does not run on this kind of model, or ``None`` when it does."""
        applies = self.gated if is_gated else self.plain
        return None if applies is True else str(applies)

    def body(self, value: Any, image: str, report: Any) -> str:
        """The HTML body of its section."""
        if self.section is not None:
            return self.section(value, image, report)
        return f"{image}<pre>{html.escape(json.dumps(value, indent=2))}</pre>"


MEASURES: dict[str, Measure] = {}


def register_measure(name: str, measure: Measure | Callable[[MeasureContext], Any], *, overwrite: bool = False,
                     **fields: Any) -> Measure:
    """Add a measure to the report (``MEASURES``), run after those registered before it.

    Args:
        name: its key in ``report.json`` (an identifier; the report's own fields are refused).
        measure: a :class:`Measure`, or its ``compute(ctx)`` function.
        overwrite: replace a measure of that name (a built-in one included, in its place); without it
            an existing name raises.
        fields: :class:`Measure` fields (``title``, ``plot``, ``section``, ``gated``, ...).

    Returns the registered :class:`Measure`.

    Example::

        def widest(ctx):  # ctx: MeasureContext
            return max(unit.num_channels for _, unit in linearize.units(ctx.model))

        register_measure("widest_site", widest, title="Widest site")
        linearize.report(model, data).custom["widest_site"]  # also in report.json and report.html
    """
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"measure name {name!r} must be an identifier (letters, digits, _): it is a JSON key "
                         "and a file name")
    if name in RESERVED:
        raise ValueError(f"measure name {name!r} is taken by the report itself ({', '.join(RESERVED)}): "
                         "pick another")
    if name in MEASURES and not overwrite:
        raise ValueError(f"a measure named {name!r} is already registered: pass overwrite=True to replace it, "
                         "or pick another name")
    if isinstance(measure, Measure):
        measure = dataclasses.replace(measure, **fields)
    elif callable(measure):
        measure = Measure(measure, **fields)
    else:
        raise TypeError(f"measure {name!r} must be a Measure or a function compute(ctx), "
                        f"got {type(measure).__name__}")
    for part in ("compute", "plot", "section", "summary"):
        fn = getattr(measure, part)
        if not callable(fn) and not (fn is None and part != "compute"):
            raise TypeError(f"measure {name!r}: {part} must be a function{'' if part == 'compute' else ' or None'}, "
                            f"got {type(fn).__name__}")
    if measure.plot is not None and measure.plot_file is None:
        measure = dataclasses.replace(measure, plot_file=f"{name}.png")
    f = measure.plot_file
    if f is not None and (not isinstance(f, str) or f in ("", ".", "..") or Path(f).name != f or "\\" in f):
        raise ValueError(f"measure {name!r}: plot_file must be a plain file name (written into the report "
                         f"folder), got {f!r}")
    files = {m.plot_file: n for n, m in MEASURES.items() if m.plot_file is not None and n != name}
    if measure.plot_file in files or measure.plot_file in ("report.json", "report.html"):
        raise ValueError(f"measure {name!r}: plot file {measure.plot_file!r} is already written by "
                         f"{files.get(measure.plot_file, 'the report')}: pass another plot_file")
    MEASURES[name] = measure
    return measure


# ----------------------------------------------------------------------------- units


def _units(ctx: MeasureContext) -> dict:
    counts = count_units(ctx.model, ctx.tol)
    counts["fraction"] = counts["nonlinear"] / counts["total"]
    return counts


def _units_section(u: dict, image: str, report: Any) -> str:
    body = (table(["channels", "nonlinear", "linear", "nonlinear fraction"],
                  [[u["total"], u["nonlinear"], u["linear"], u["fraction"]]])
            + image
            + table(["site", "kind", "channels", "nonlinear", "fraction"],
                    [[n, s["kind"], s["total"], s["nonlinear"], s["fraction"]] for n, s in u["sites"].items()]))
    if report.excluded:
        body += ("<p>Not converted on purpose, so not counted:</p>"
                 + table(["site", "reason"], [[n, why] for n, why in report.excluded.items()]))
    return body


register_measure(
    "units", _units, title="Nonlinear units", gated="gated model: it has gates, not slope units",
    plot=plot_fraction, plot_file=PLOTS["fraction"], alt="nonlinear fraction per site", section=_units_section,
    summary=lambda u: f"nonlinear channels: {u['nonlinear']} / {u['total']} ({u['fraction']:.2%})",
)


# ----------------------------------------------------------------------------- average path length


def _path_length(ctx: MeasureContext) -> dict:
    from .measures.paths import average_path_length

    example = to_device(ctx.data.limit(samples=2).concat(), model_device(ctx.model))
    return average_path_length(ctx.model, example, tol=ctx.tol, sources=ctx.sources, detailed=True).to_dict()


def _path_length_section(p: dict, image: str, report: Any) -> str:
    return (table(["normalized APL", "unnormalized APL", "log10 paths", "unit calls", "merges", "graph"],
                  [[p["normalized"], p["unnormalized"], p["log10_paths"], p["unit_calls"], p["merges"], p["method"]]])
            + "<p>Normalized: a random walk from output to input that splits equally at every merge; "
            "unnormalized: every channel-level path equally likely.</p>")


register_measure(
    "path_length", _path_length, title="Average path length",
    gated="gated model: the average path length counts slope units", section=_path_length_section,
    summary=lambda p: f"average path length: normalized {p['normalized']:.3f}, unnormalized {p['unnormalized']:.3f}",
)


# ----------------------------------------------------------------------------- affinity


def _affinity(ctx: MeasureContext) -> list:
    try:
        from .measures.affinity import affinity_signature
    except MissingExtra as err:  # scipy / threadpoolctl: the report extra
        raise SkipMeasure(str(err)) from None
    try:
        sig = affinity_signature(ctx.model, ctx.data, batch_size=ctx.batch_size, max_samples=max(2, ctx.max_samples),
                                 progress=ctx.progress)
    except ValueError as err:  # e.g. no site the signature can read; NaN/inf was checked before
        raise SkipMeasure(str(err)) from None
    return [[name, float(score)] for name, score in sig]


register_measure(
    "affinity", _affinity, title="Non-linearity signature (affinity score)", plot=plot_affinity,
    plot_file=PLOTS["affinity"], alt="affinity signature",
    section=lambda sig, image, report: image + table(["site", "affinity score"], sig),
)


# ----------------------------------------------------------------------------- linear regions


def _regions(ctx: MeasureContext) -> dict:
    from .measures.regions import PartialResultWarning, linear_regions, translation_loops

    inputs, segments = ctx.inputs, ctx.segments
    smooth = sorted({u.kind for _, u in units(ctx.model) if not u.is_prelu})
    if smooth:
        raise SkipMeasure(f"not piecewise linear: smooth activation kinds {smooth}")
    if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point():
        raise SkipMeasure("needs a floating-point input tensor (token ids have no segments between them)")
    if segments < 1:
        raise SkipMeasure("segments < 1")
    if ctx.paths == "loops":
        if inputs.ndim != 4:
            raise SkipMeasure(f"translation loops need images [N, C, H, W], got {tuple(inputs.shape)}")
        x0, x1 = translation_loops(inputs[:segments])
        how = f"closed translation loops (8 anchors, radius 4 px) of {min(segments, len(inputs))} images"
    else:
        idx = torch.arange(min(segments, len(inputs)))
        x0, x1 = inputs[idx], inputs[(idx + 1) % len(inputs)]
        how = "straight segments between consecutive samples"
    try:
        with warnings.catch_warnings():  # a partial result is marked in the report itself
            warnings.simplefilter("ignore", PartialResultWarning)
            res = linear_regions(ctx.model, x0, x1, batch_size=ctx.batch_size, progress=ctx.progress,
                                 max_regions=ctx.max_regions, max_seconds=ctx.regions_seconds)
    except ValueError as err:
        raise SkipMeasure(str(err)) from None
    counts = res.count.tolist()
    deviation = res.deviation().mean(1).tolist()
    return {
        "segments": how,
        "counts": counts,
        "deviation": deviation,
        "mean_count": float(np.mean(counts)),
        "mean_deviation": float(np.mean(deviation)),
        "budget": {"max_regions": ctx.max_regions, "max_seconds": ctx.regions_seconds},
        "complete": res.complete,
        "stopped": res.stopped,
        "covered": res.covered.tolist(),
    }


def _regions_note(regions: dict) -> str:
    """A warning paragraph when the regions walk was stopped by its budget (empty when complete)."""
    if regions.get("complete", True):
        return ""
    covered = regions["covered"]
    short = sum(c < 1 for c in covered)
    return (f'<p class="partial"><strong>Partial result</strong>: the walk stopped at its budget '
            f"({html.escape(str(regions['stopped']))}) on {short} of {len(covered)} segments, after "
            f"{percent(np.mean(covered))} of their length on average. Counts and deviations cover the "
            "walked parts only: lower bounds. Raise the budget (max_regions / regions_seconds, or "
            "--max-regions / --regions-seconds) for the complete result.</p>")


def _regions_section(r: dict, image: str, report: Any) -> str:
    return (_regions_note(r) + f"<p>{html.escape(r['segments'])}: {len(r['counts'])} segments, mean "
            f"{r['mean_count']:.4g} regions, mean absolute deviation {r['mean_deviation']:.4g}.</p>" + image)


def _regions_summary(r: dict) -> str | None:
    if r["complete"]:
        return None
    return (f"linear regions: partial result, stopped at {r['stopped']} after {percent(np.mean(r['covered']))} "
            "of the segments' length on average (counts are lower bounds; raise --max-regions / --regions-seconds)")


register_measure(
    "regions", _regions, title="Linear regions and absolute deviation",
    gated="gated model: products of gates and values are not piecewise linear", plot=plot_regions,
    plot_file=PLOTS["regions"], alt="region ECDFs", section=_regions_section, summary=_regions_summary,
)


# ----------------------------------------------------------------------------- history and gates


def _history(ctx: MeasureContext) -> dict:
    if ctx.history is None:
        raise SkipMeasure("no sparsifier history given")
    return summarize_history(ctx.history, ctx.results.get("units"))


register_measure(
    "history", _history, title="Nonlinear fraction over training", plot=plot_history, plot_file=PLOTS["history"],
    alt="nonlinear fraction over training",
    section=lambda h, image, report: f"{image}<p>{len(h['steps'])} logged steps, last nonlinear fraction "
    f"{h['total'][-1]}.</p>",
)


def _gates_section(gates: dict, image: str, report: Any) -> str:
    rows = [[s, g["channels"], g["fraction_on"], g["entropy"], g["always_on"], g["always_off"]]
            for s, g in gates.items()]
    return image + table(["site", "channels", "fraction on", "entropy (bits)", "always on", "always off"], rows)


register_measure(
    "gates", lambda ctx: gate_statistics(ctx.model, ctx.batches, progress=ctx.progress), title="Gate statistics",
    plain="not a gated (DGN/DLGN) model", plot=plot_gates, plot_file=PLOTS["gates"], alt="gate statistics",
    section=_gates_section, skipped_section=False,
)
