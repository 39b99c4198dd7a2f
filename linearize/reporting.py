"""``linearize.report``: where the nonlinearity of a network sits, as JSON, PNG plots and one HTML page.

:func:`report` runs the measures of the registry ``MEASURES`` (:mod:`linearize.report_measures`:
nonlinear units, average path length, affinity signature, linear regions, the nonlinear fraction over
training, gate statistics, and any added with :func:`register_measure`) on a batch of data and returns
a :class:`Report` dataclass; :meth:`Report.save` writes ``report.json``, the PNG plots
(:mod:`linearize.plots`) and a self-contained ``report.html`` (:mod:`linearize.html_pages`, images
embedded as base64 data URIs).

``linearize report`` on the command line (:func:`register_cli`, :func:`run_cli`) loads a model and data
(:mod:`linearize.cli.readers`) and does the same. (The subcommand is defined here, not in
:mod:`linearize.cli`, because ``reporting.register_cli`` is public and the command line imports this
module: the other way round would be an import cycle.)
"""

from __future__ import annotations

import dataclasses
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from .checks import check_positive, check_positive_int, check_tol
from .gated import GaLU, GatedNetwork
from .history import load_history, read_history
from .html_pages import img, page
from .inputs import Batches, call_model, eval_mode, hooks, inputs_fit, model_device
from .report_measures import (MEASURES, PLOTS, REGIONS_MAX_REGIONS, REGIONS_SECONDS, Measure, MeasureContext,
                              SkipMeasure, register_measure)
from .unit import check_finite_slopes, sites as unit_sites, units

__all__ = ["Report", "report", "load_history", "MEASURES", "Measure", "MeasureContext",
           "SkipMeasure", "register_measure", "PLOTS", "REGIONS_MAX_REGIONS", "REGIONS_SECONDS"]


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
        custom: values of the measures added with :func:`register_measure` (also top-level keys of
            :meth:`to_dict`, like the built-in ones).
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
    custom: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        """The value of measure ``name`` (``None``: skipped or not run), built in or registered."""
        if name in _FIELDS:
            return getattr(self, name)
        return self.custom.get(name)

    def __setitem__(self, name: str, value: Any) -> None:
        """Set the value of measure ``name`` (a field when built in, else in ``custom``)."""
        if name in _FIELDS:
            setattr(self, name, value)
        else:
            self.custom[name] = value

    def to_dict(self) -> dict:
        """Plain JSON-serializable dict; registered measures are top-level keys like the built-in ones."""
        out = dataclasses.asdict(self)
        out.update(out.pop("custom"))
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The report as a JSON string (``report.json``)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def plots(self) -> dict[str, bytes]:
        """PNG images ``{file name: bytes}`` of the measures that ran (and have a plot)."""
        return self._draw(stop=True)[0]

    def _draw(self, stop: bool) -> tuple[dict[str, bytes], dict[str, Exception]]:
        """The plots that drew, and ``{file name: error}`` of those whose ``plot`` raised (``stop``: raise it)."""
        images, failed = {}, {}
        for name, measure in MEASURES.items():
            value = self[name]
            if measure.plot is not None and value is not None and not _empty(value):
                try:
                    images[measure.plot_file] = measure.plot(value)
                except Exception as err:
                    if stop:
                        raise
                    failed[measure.plot_file] = err
        return images, failed

    def to_html(self, images: Mapping[str, bytes] | None = None,
                failed: Mapping[str, Exception] | None = None) -> str:
        """A self-contained HTML page: summary tables and the plots as base64 data URIs; a plot in ``failed``
        (``{file name: error}``) is replaced by a line giving its error."""
        images = self.plots() if images is None else images
        failed = {} if failed is None else failed
        parts = [f"<h1>linearize report: {html.escape(self.model)}</h1>",
                 f"<p>{self.num_samples} samples; a channel is linear when its slope a &ge; 1 &minus; {self.tol:g}.</p>"]
        for name in [*MEASURES, *(n for n in self.custom if n not in MEASURES)]:
            measure = MEASURES.get(name, _UNREGISTERED)
            if name in self.skipped:
                if not measure.skipped_section:
                    continue
                body = f'<p class="skip">Skipped: {html.escape(self.skipped[name])}</p>'
            elif self[name] is None:
                continue
            else:
                file = measure.plot_file
                image = img(images[file], measure.alt or measure.title or name, file) if file in images else ""
                if file in failed:
                    error = f"{type(failed[file]).__name__}: {failed[file]}"
                    image = f'<p class="skip">Plot {html.escape(file)} failed: {html.escape(error)}</p>'
                body = measure.body(self[name], image, self)
            parts.append(f"<h2>{html.escape(measure.title or name)}</h2>\n{body}")
        return page(f"linearize report: {self.model}", parts)

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        """Write ``report.json``, the PNG plots and ``report.html`` into ``out_dir`` (created).

        Returns ``{file name: path}`` of everything written. The plots are drawn first; then every file is
        written to a temporary name and, once all are written, renamed over the old one, and the files an earlier
        report wrote there that this one does not (the plots of measures that did not run this time) are removed,
        so the folder holds this report only, never files of two reports (a failed write leaves the earlier
        report as it was). The renames are not one step: while they run, the folder holds ``report.incomplete``
        (written after every file, removed last), so a save killed between two renames leaves that file, saying
        the folder may hold files of two reports, and readers (``linearize report --compare``) refuse it until
        the report is saved again. Other files in it are left alone; saves into one folder take turns on its save lock
        (``.linearize.lock``, left there). A plot that fails (a registered measure's ``plot``) loses no measure:
        the report is saved without that plot (its old PNG removed, its error shown in ``report.html``), then its
        error is raised. ``NotADirectoryError`` naming ``out_dir`` when it (or a parent) is a file.
        """
        from ._files import atomic_write_all, check_folder, fsync_path, remove_stale, save_lock

        out = Path(out_dir)
        check_folder(out, "report folder")
        images, failed = self._draw(stop=False)  # before anything is written
        files = {"report.json": self.to_json(), **images, "report.html": self.to_html(images, failed)}
        out.mkdir(parents=True, exist_ok=True)
        ours = {"report.json", "report.html", *(m.plot_file for m in MEASURES.values() if m.plot_file)}
        with save_lock(out) as outermost:
            written = atomic_write_all(out, files, marker=(INCOMPLETE_NAME, INCOMPLETE_TEXT))
            if outermost:
                remove_stale(out, {*written, INCOMPLETE_NAME}, lambda name: name in ours or name == INCOMPLETE_NAME)
            (out / INCOMPLETE_NAME).unlink()  # the commit point: the folder holds this report, whole
            fsync_path(out)
        if failed:
            file, err = next(iter(failed.items()))
            err.add_note(f"Report.save: {out} holds this report without the plot {file} (its error is shown in "
                         "report.html); fix that measure's plot and save again to draw it")
            raise err
        return written


_FIELDS = {f.name for f in dataclasses.fields(Report)} - {"custom"}
# in a report folder while Report.save replaces its files: left there, the save was killed part-way
INCOMPLETE_NAME = "report.incomplete"
INCOMPLETE_TEXT = ("A save of the report in this folder was interrupted (the process was killed while it renamed "
                   "the files into place): report.json, report.html and the PNG plots may come from two different "
                   "reports. Save the report again (Report.save, linearize report, the recipe's --report).\n")


def _empty(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict)) and not value


# how the page shows the value of a measure unregistered since the report was made: as JSON
_UNREGISTERED = Measure(compute=lambda ctx: None)


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
    """Measure where the nonlinearity of ``model`` sits, on ``data``: every measure of ``MEASURES``, in order.

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
        skip: measures not to run, names of ``MEASURES`` (the built-in ones and those added with
            :func:`register_measure`; ``"affinity"`` costs the most: an exact assignment of up to
            ``max_samples`` points per site).
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
    is_gated = isinstance(model, GatedNetwork)
    if not is_gated and not units(model):
        raise ValueError(
            f"{type(model).__name__} has no activation sites to measure (no linearizable units): "
            "call linearize.convert(model) first"
        )
    measures = dict(MEASURES)  # the registry as it is now, even if a measure registers another
    skip = set(skip)
    if skip - set(measures):
        raise ValueError(f"unknown measures in skip: {sorted(skip - set(measures))}; known: {', '.join(measures)} "
                         "(register_measure adds one)")
    max_regions = None if max_regions is None else check_positive_int(max_regions, "max_regions")
    regions_seconds = None if regions_seconds is None else check_positive(regions_seconds, "regions_seconds")
    check_finite_slopes(units(model), "report")
    records = read_history(history) if history is not None and "history" not in skip else None
    data = Batches.of(data).limit(samples=max_samples).cached()
    n = data.num_samples
    if n < 2:
        raise ValueError(f"report needs at least 2 samples, got {n}: pass a larger batch")
    batches = data.split(batch_size).to(model_device(model))
    rep = Report(model=type(model).__name__, num_samples=n, tol=tol)
    conversion = getattr(model, "linearize_report", None)
    if callable(getattr(conversion, "excluded_sites", None)):
        rep.excluded = conversion.excluded_sites()
    ctx = MeasureContext(model=model, data=data, batches=batches, is_gated=is_gated, tol=tol, batch_size=batch_size,
                         max_samples=max_samples, segments=segments, paths=paths, sources=sources,
                         max_regions=max_regions, regions_seconds=regions_seconds, progress=progress, history=records)
    bar = tqdm(("finite", *measures), desc="report", disable=not progress)
    for step in bar:
        bar.set_postfix_str(step)
        if step == "finite":
            _check_finite(model, batches)
            continue
        reason = "skipped on request" if step in skip else measures[step].skip_reason(is_gated)
        if reason is None:
            try:
                rep[step] = ctx.results[step] = _checked(step, measures[step].compute(ctx))
            except SkipMeasure as err:
                reason = str(err)
        if reason is not None:
            rep[step] = None  # a key in report.json for every measure, like the built-in fields
            rep.skipped[step] = reason
    return rep


def _checked(name: str, value: Any) -> Any:
    """``value`` if it can go into ``report.json``; a clear error naming the measure otherwise."""
    try:
        json.dumps(value, allow_nan=False)  # as report.json is written
    except (TypeError, ValueError) as err:
        raise TypeError(f"measure {name!r} returned a value report.json cannot hold ({err}): return numbers "
                        "(finite: NaN and inf are not JSON), strings, lists and dicts (tensor.tolist(), "
                        "float(x)) or None") from None
    return value


@torch.no_grad()
def _check_finite(model: nn.Module, batches: Batches) -> None:
    """One forward over the inputs; raise naming the first site with NaN/inf input or output."""
    sites = unit_sites(model, also=lambda m: isinstance(m, GaLU))

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
            with inputs_fit(batch, "data batch"):
                call_model(model, batch)
