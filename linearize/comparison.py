"""``linearize.compare``: several runs (a baseline and linearized models, a sweep) on one HTML page.

(This module is ``linearize.comparison``, so that ``linearize.compare`` stays the function.)

Each run is an output directory of a recipe (``recipes/cifar.py``, ``recipes/wmt14.py``) or any folder
with a ``metrics.json``. Read from it, never by unpickling:

- ``metrics.json``: accuracy (``test_accuracy``, ``bleu``), loss, nonlinear fraction, average path
  length, fold cost (parameters, FLOPs), wall time;
- ``report/report.json`` (a run with ``--report``): per-site nonlinear fractions, the affinity
  signature along depth and the average path length;
- otherwise ``model/``, the linearize sidecar of ``linearize.save_pretrained`` (checksummed
  safetensors, read with :func:`linearize.serialization.load_unit_tensors`): per-site nonlinear
  fractions from the slopes (a channel is linear when ``a >= 1 - tol``, ``tol`` from the run's args).

A file of another form (a ``metrics.json`` that is a list of epochs, an edited ``report.json``) is refused with
:class:`linearize.LoadError` (a ``ValueError``) naming it, what is wrong and the fix.

The page is self-contained (plots as PNG data URIs), with the helpers of :mod:`linearize.plots` and
:mod:`linearize.html_pages`.
``linearize report --compare RUN_A RUN_B ... --out compare.html`` on the command line.
"""

from __future__ import annotations

import argparse
import html
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ._files import LoadError, check_given_folder, read_json
from .checks import is_real
from .html_pages import img, page, table
from .plots import figure, literal, png, site_axis
from .reporting import INCOMPLETE_NAME

__all__ = ["RunSummary", "compare", "load_run", "main"]


@dataclass
class RunSummary:
    """What :func:`compare` shows of one run (``None``: not available, reason in ``skipped``)."""

    name: str
    path: Path
    metrics: dict
    sites: dict[str, float] | None = None  # per-site nonlinear fraction of channels
    sites_from: str = ""
    affinity: list | None = None  # [[site, score], ...] in forward order
    path_length: dict | None = None
    skipped: dict[str, str] = field(default_factory=dict)


def load_run(path: str | Path, name: str | None = None) -> RunSummary:
    """The :class:`RunSummary` of the run directory ``path`` (it must hold ``metrics.json``).

    Example: ``load_run("runs/r20-late").sites`` -> ``{"layer1.0.relu": 0.12, ...}``
    """
    path = Path(path)
    check_given_folder(path, "a run")
    if not (path / "metrics.json").exists():  # a folder or FIFO there is refused by name when read
        raise FileNotFoundError(f"{path} has no metrics.json: pass the output directory of a run "
                                "(recipes/cifar.py or recipes/wmt14.py --output_dir)")
    run = RunSummary(name or path.name, path, _check_metrics(read_json(path / "metrics.json"), path / "metrics.json"))
    report_json = path / "report" / "report.json"
    if (path / "report" / INCOMPLETE_NAME).exists():
        raise LoadError(f"{path / 'report'} holds {INCOMPLETE_NAME}: a save of its report was killed part-way, so "
                        "report.json, report.html and the plots may come from two reports; save the report again "
                        "(linearize report, or the run again with --report), or remove report/")
    if report_json.is_file():
        rep = _check_report(read_json(report_json), report_json)
        units = rep.get("units")
        if units:
            run.sites = {site: s["fraction"] for site, s in units["sites"].items()}
            run.sites_from = "report/report.json"
        run.affinity = rep.get("affinity")
        run.path_length = rep.get("path_length")
        for what, reason in (rep.get("skipped") or {}).items():
            run.skipped[what] = reason
    else:
        run.skipped["affinity"] = "the run has no report/ (run it with --report)"
    if run.sites is None:
        run.sites = _sites_from_sidecar(run)
    return run


def _check_metrics(m: Any, path: Path) -> dict:
    """``m``, the JSON of the ``metrics.json`` at ``path``, when it has the form the recipes write (the fields
    :func:`compare` computes with); else :class:`LoadError` naming the file, what is wrong and the fix."""
    def bad(what: str) -> LoadError:
        return LoadError(f"{path}: {what}. compare reads the metrics.json a recipe writes at the end of a run "
                         "(recipes/cifar.py, recipes/wmt14.py): pass such a run's output directory, or fix the file")

    if not isinstance(m, dict):
        raise bad(f"expected a JSON object (the run's final metrics), got {type(m).__name__}")
    for key in ("args", "fold"):
        if m.get(key) is not None and not isinstance(m[key], dict):
            raise bad(f"{key!r} is {type(m[key]).__name__}, not a JSON object")
    tol = (m.get("args") or {}).get("tol")
    if tol is not None and not is_real(tol):
        raise bad(f"'args.tol' is {tol!r}, not a number")
    fold = m.get("fold") or {}
    for key in ("params_before", "params_after", "flops_before", "flops_after"):
        if fold.get(key) is not None and not is_real(fold[key]):
            raise bad(f"'fold.{key}' is {fold[key]!r}, not a number")
    if ("units_total" in m) != ("units_nonlinear" in m):
        raise bad("it has only one of 'units_total' and 'units_nonlinear'")
    return m


def _check_report(rep: Any, path: Path) -> dict:
    """``rep``, the JSON of the ``report.json`` at ``path``, when it has the form :meth:`linearize.Report.save`
    writes (the fields :func:`compare` shows); else :class:`LoadError` naming the file, what is wrong and the fix."""
    def bad(what: str) -> LoadError:
        return LoadError(f"{path}: {what}. compare reads the report.json of linearize.report (Report.save, "
                         "linearize report, a recipe's --report): write it again with this linearize, or remove it")

    if not isinstance(rep, dict):
        raise bad(f"expected a JSON object, got {type(rep).__name__}")
    units = rep.get("units")
    if units and not (isinstance(units, dict) and isinstance(units.get("sites"), dict)
                      and all(isinstance(s, dict) and is_real(s.get("fraction")) for s in units["sites"].values())):
        raise bad("'units' is not {\"sites\": {site: {\"fraction\": number, ...}}, ...}")
    affinity = rep.get("affinity")
    if affinity is not None and not (isinstance(affinity, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and is_real(p[1]) for p in affinity)):
        raise bad("'affinity' is not a list of [site, score] pairs")
    for key in ("path_length", "skipped"):
        if rep.get(key) is not None and not isinstance(rep[key], dict):
            raise bad(f"{key!r} is {type(rep[key]).__name__}, not a JSON object")
    if not all(isinstance(reason, str) for reason in (rep.get("skipped") or {}).values()):
        raise bad("'skipped' is not a {measure: reason} object of strings")
    return rep


def _sites_from_sidecar(run: RunSummary) -> dict[str, float] | None:
    """Per-site nonlinear fractions from the slopes saved in ``run.path / "model"``."""
    from .serialization import load_unit_tensors

    model_dir = run.path / "model"
    if (model_dir / "recipe.json").is_file():
        meta = read_json(model_dir / "recipe.json")
        if not isinstance(meta, dict):
            raise LoadError(f"{model_dir / 'recipe.json'}: expected the JSON object a recipe writes, got "
                            f"{type(meta).__name__}: restore the file or run the recipe again")
        if meta.get("linearize", "prelu") in (None, "none"):
            run.skipped["units"] = "a baseline without linearizable units (--linearize none)"
            return None
    try:
        tensors = load_unit_tensors(model_dir)
    except FileNotFoundError:
        run.skipped["units"] = f"no linearize sidecar in {model_dir} and no report/report.json"
        return None
    tol = float((run.metrics.get("args") or {}).get("tol") or 0.0)
    slopes = {k[: -len(".slope")]: v for k, v in tensors.items() if k.endswith(".slope")}
    if not slopes:
        run.skipped["units"] = "a gated model (no slopes): run it with --report for its gate statistics"
        return None
    run.sites_from = f"model/ slopes (linear when a >= 1 - {tol:g})"
    return {site: float((s < 1.0 - tol).float().mean()) for site, s in slopes.items()}


def _get(m: dict, *keys: str) -> Any:
    for key in keys:
        if not isinstance(m, dict) or key not in m:
            return None
        m = m[key]
    return m


def _ratio(m: dict, what: str) -> float | None:
    before, after = _get(m, "fold", f"{what}_before"), _get(m, "fold", f"{what}_after")
    return after / before if before and after is not None else None


# (column, value of a run's metrics.json); a column shows when any run has a value
COLUMNS: list[tuple[str, Callable[[dict], Any]]] = [
    ("recipe", lambda m: m.get("recipe")),
    ("model", lambda m: m.get("arch") or m.get("model_size")),
    ("linearize", lambda m: _get(m, "args", "linearize")),
    ("schedule", lambda m: _get(m, "args", "schedule")),
    ("target", lambda m: _get(m, "args", "target")),
    ("steps", lambda m: m.get("steps")),
    ("nonlinear fraction", lambda m: m.get("nonlinear_fraction")),
    ("nonlinear / channels", lambda m: f"{m['units_nonlinear']} / {m['units_total']}"
     if "units_total" in m else None),
    ("average path length", lambda m: m.get("average_path_length")),
    ("test accuracy", lambda m: m.get("test_accuracy")),
    ("BLEU", lambda m: m.get("bleu")),
    ("test loss", lambda m: m.get("test_loss")),
    ("params (folded)", lambda m: f"{m['fold']['params_before']} -> {m['fold']['params_after']}"
     if _get(m, "fold", "params_after") is not None else None),
    ("FLOPs ratio (folded)", lambda m: _ratio(m, "flops")),
    ("wall time (s)", lambda m: m.get("wall_time_s")),
]


def _cell(v: Any) -> Any:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–" if v is None else str(v)
    return v


def _site_order(runs: Sequence[RunSummary], attr: str) -> list[str]:
    """Sites in forward order: the first run's order, then sites only later runs have."""
    order: list[str] = []
    for run in runs:
        values = getattr(run, attr)
        names = [s for s, _ in values] if attr == "affinity" else list(values)
        order += [s for s in names if s not in order]
    return order


def _plot_sites(runs: Sequence[RunSummary], sites: list[str]) -> bytes:
    """Grouped bars: per-site nonlinear fraction, one colour per run."""
    fig = figure(max(7.0, 0.25 * len(sites) * max(1, len(runs)) ** 0.5 + 3), 4.5)
    ax = fig.add_subplot()
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        xs = [k + (i - (len(runs) - 1) / 2) * width for k in range(len(sites))]
        ax.bar(xs, [run.sites.get(s, float("nan")) for s in sites], width, label=literal(run.name))
    site_axis(ax, sites)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("nonlinear fraction of channels")
    ax.set_title("Nonlinear units per site")
    ax.legend(fontsize=8)
    return png(fig)


def _plot_affinity(runs: Sequence[RunSummary], sites: list[str]) -> bytes:
    """Affinity signatures along depth, one line per run."""
    fig = figure(max(7.0, 0.3 * len(sites) + 2), 4.5)
    ax = fig.add_subplot()
    low = 1.0
    for run in runs:
        score = dict((s, v) for s, v in run.affinity)
        ax.plot(range(len(sites)), [score.get(s, float("nan")) for s in sites], marker="o", label=literal(run.name))
        low = min([low, *score.values()])
    site_axis(ax, sites)
    ax.set_ylim(min(0.5, low - 0.05), 1.02)
    ax.set_ylabel("affinity score (1 = affine)")
    ax.set_title("Non-linearity signature along depth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)


def _html(runs: Sequence[RunSummary]) -> str:
    names = [r.name for r in runs]
    cols = [(label, [_cell(get(r.metrics)) for r in runs]) for label, get in COLUMNS]
    cols = [(label, vals) for label, vals in cols if any(v != "–" for v in vals)]
    parts = [f"<h1>linearize: {len(runs)} runs compared</h1>",
             "<p>" + "; ".join(f"<b>{html.escape(r.name)}</b>: {html.escape(str(r.path))}" for r in runs) + "</p>",
             "<h2>Accuracy, nonlinearity and cost (metrics.json)</h2>",
             table(["run"] + [label for label, _ in cols], [[n] + [vals[i] for _, vals in cols]
                                                                for i, n in enumerate(names)])]
    with_sites = [r for r in runs if r.sites]
    parts.append("<h2>Nonlinear units per site</h2>")
    if with_sites:
        sites = _site_order(with_sites, "sites")
        parts.append(img(_plot_sites(with_sites, sites), "nonlinear fraction per site"))
        parts.append("<p>From " + "; ".join(f"{html.escape(r.name)}: {html.escape(r.sites_from)}"
                                            for r in with_sites) + ".</p>")
        parts.append(table(["site"] + [r.name for r in with_sites],
                              [[s] + [_cell(r.sites.get(s)) for r in with_sites] for s in sites]))
    parts += _skips(runs, "units")
    with_aff = [r for r in runs if r.affinity]
    parts.append("<h2>Non-linearity signature (affinity score)</h2>")
    if with_aff:
        sites = _site_order(with_aff, "affinity")
        parts.append(img(_plot_affinity(with_aff, sites), "affinity signatures"))
        scores = [dict((s, v) for s, v in r.affinity) for r in with_aff]
        parts.append(table(["site"] + [r.name for r in with_aff],
                              [[s] + [_cell(sc.get(s)) for sc in scores] for s in sites]))
    parts += _skips(runs, "affinity")
    with_apl = [r for r in runs if r.path_length]
    if with_apl:
        parts.append("<h2>Average path length (report.json)</h2>")
        parts.append(table(["run", "normalized APL", "unnormalized APL", "log10 paths"],
                              [[r.name, r.path_length.get("normalized"), r.path_length.get("unnormalized"),
                                r.path_length.get("log10_paths")] for r in with_apl]))
    return _shown(page(f"linearize: {', '.join(names)}", parts))  # paths in it too (the skip reasons name files)


def _skips(runs: Sequence[RunSummary], what: str) -> list[str]:
    return [f'<p class="skip">{html.escape(r.name)}: {html.escape(r.skipped[what])}</p>'
            for r in runs if what in r.skipped]


def _shown(name: str) -> str:
    """A file or folder name (or a text holding such names) as page and plot text: a name whose bytes are not
    UTF-8 (a Latin-1 ``run-café`` from an old archive, which Python holds with surrogates) has those bytes
    escaped, as ``run-caf\\xe9``.

    Example:
        >>> _shown(os.fsdecode(b"run-caf\\xe9")), _shown("run-café")
        ('run-caf\\\\xe9', 'run-café')
    """
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _names(paths: Sequence[Path]) -> list[str]:
    """Run names: the folder names (:func:`_shown`), with parents added until they differ."""
    depth = 1
    while True:
        names = [_shown("/".join(p.resolve().parts[-depth:])) for p in paths]
        if len(set(names)) == len(names) or depth >= max(len(p.resolve().parts) for p in paths):
            return names
        depth += 1


def compare(runs: Sequence[str | Path], out: str | Path | None = None) -> str:
    """One self-contained HTML page comparing ``runs`` (output directories); written to ``out`` if given.

    Example::

        html = linearize.compare(["runs/baseline", "runs/late-0.1"], out="compare.html")
    """
    if len(runs) < 1:
        raise ValueError("compare needs at least one run directory")
    paths = [Path(r) for r in runs]
    summaries = [load_run(p, n) for p, n in zip(paths, _names(paths))]
    page = _html(summaries)
    if out is not None:
        from ._files import atomic_write

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(Path(out), page)
    return page


def main(argv: Sequence[str]) -> int:
    """``linearize report --compare RUN_A RUN_B ... [--out compare.html]``."""
    p = argparse.ArgumentParser(prog="linearize report --compare",
                                description="Compare run directories (baseline and linearized models) on one "
                                "self-contained HTML page: per-site nonlinear fractions, affinity signatures, "
                                "path length, accuracy and cost from each run's metrics.json.")
    p.add_argument("--compare", nargs="+", required=True, metavar="RUN", help="run output directories")
    p.add_argument("--out", "--output", default="compare.html", help="the HTML page to write (default compare.html)")
    args = p.parse_args(list(argv))
    compare(args.compare, out=args.out)
    print(f"wrote {_shown(str(Path(args.out).resolve()))} ({len(args.compare)} runs)")
    return 0
