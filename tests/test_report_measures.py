"""The report's measure registry (linearize.report_measures): a measure of one's own runs, lands in
report.json, report.html, its plot file and the command line; names are checked."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import linearize
from linearize import reporting
import linearize.cli
from linearize.cli import build_parser
from linearize.report_measures import RESERVED, Measure, SkipMeasure

PNG = b"\x89PNG\r\n\x1a\nnot-really-an-image"
BUILT_IN = ["units", "path_length", "affinity", "regions", "history", "gates"]
FAST = ["path_length", "affinity", "regions"]  # the slow built-ins, not under test here


@pytest.fixture
def registry():
    """``MEASURES``, restored (content and order) after the test."""
    before = dict(reporting.MEASURES)
    yield reporting.MEASURES
    reporting.MEASURES.clear()
    reporting.MEASURES.update(before)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    linearize.convert(model, example_inputs=torch.randn(2, 8))
    with torch.no_grad():
        linearize.units(model)[0][1].slope[:2] = 1.0  # 2 of 6 channels linear
    return model


def test_built_in_measures_keep_their_names_and_order():
    assert list(reporting.MEASURES) == BUILT_IN
    assert linearize.register_measure is reporting.register_measure
    fields = {f.name for f in dataclasses.fields(reporting.Report)}
    assert set(RESERVED) == fields - set(BUILT_IN) | {"finite"}  # every other field of the report is refused


def test_a_registered_measure_is_in_the_json_the_html_and_its_plot(registry, tmp_path):
    def mean_output(ctx):
        with torch.no_grad():
            return {"mean": float(ctx.model(ctx.inputs).mean()), "samples": ctx.data.num_samples,
                    "nonlinear_before": ctx.results["units"]["nonlinear"]}

    linearize.register_measure("mean_output", mean_output, title="Mean output", plot=lambda value: PNG)
    model, x = _model(), torch.randn(32, 8)
    rep = linearize.report(model, x, max_samples=20, skip=FAST, progress=False)
    with torch.no_grad():
        truth = float(model(x[:20]).double().mean())
    value = json.loads(rep.to_json())["mean_output"]
    assert value["mean"] == pytest.approx(truth, rel=1e-5) and value["samples"] == 20
    assert value["nonlinear_before"] == 4  # ran after units, and saw its result
    assert rep["mean_output"] == rep.custom["mean_output"] == value and "mean_output" not in rep.skipped
    written = rep.save(tmp_path)
    assert written["mean_output.png"].read_bytes() == PNG
    page = written["report.html"].read_text()
    assert "<h2>Mean output</h2>" in page and '&quot;samples&quot;: 20' in page and 'title="mean_output.png"' in page
    assert page.index("<h2>Nonlinear units</h2>") < page.index("<h2>Mean output</h2>")  # registry order
    registry.pop("mean_output")  # unregistered later: the report's page still shows its value, as JSON
    assert "<h2>mean_output</h2>\n<pre>{" in rep.to_html({})
    registry["mean_output"] = Measure(mean_output, title="Mean output")
    # a report without it (skipped on request) names it as skipped, in the JSON and the page
    rep = linearize.report(model, x, skip=FAST + ["mean_output"], progress=False)
    assert rep["mean_output"] is None and rep.skipped["mean_output"] == "skipped on request"
    assert "<h2>Mean output</h2>\n<p class=\"skip\">Skipped: skipped on request" in rep.to_html({})


def test_a_plot_that_fails_loses_no_measure(registry, tmp_path):
    """A registered measure's plot raises in ``save``: the error propagates, and report.json already holds every
    measure (truth: the counts of the model's slopes, 2 of 6 channels linear)."""
    def broken(value):
        raise RuntimeError("plot broke")

    linearize.register_measure("answer", lambda ctx: 42, plot=broken)
    rep = linearize.report(_model(), torch.randn(16, 8), skip=FAST, progress=False)
    with pytest.raises(RuntimeError, match="plot broke"):
        rep.save(tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["answer"] == 42 and (saved["units"]["total"], saved["units"]["linear"]) == (6, 2)


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".linearize.lock"}


def test_a_plot_that_fails_over_an_earlier_report_saves_the_new_one_whole(registry, tmp_path):
    """Saved over an earlier report, a report whose registered plot fails used to replace report.json only,
    beside the earlier report.html and PNGs (two reports in one folder). Now the folder holds the new report:
    its JSON and page show the new model's counts (truth: its slopes, 4 of 6 channels linear, against 2), its
    working plot is redrawn, the failing plot's old PNG is gone, and the page names the failure."""
    linearize.register_measure("answer", lambda ctx: 41, plot=lambda value: PNG)
    first = linearize.report(_model(), torch.randn(16, 8), skip=FAST, progress=False)
    first.save(tmp_path)
    before = _files(tmp_path)
    assert set(before) == {"report.json", "report.html", "answer.png", reporting.PLOTS["fraction"]}

    def broken(value):
        raise RuntimeError("plot broke")

    linearize.register_measure("answer", lambda ctx: 42, plot=broken, overwrite=True)
    model = _model()
    with torch.no_grad():
        linearize.units(model)[0][1].slope[:4] = 1.0
    second = linearize.report(model, torch.randn(16, 8), skip=FAST, progress=False)
    with pytest.raises(RuntimeError, match="plot broke"):
        second.save(tmp_path)
    after = _files(tmp_path)
    assert set(after) == {"report.json", "report.html", reporting.PLOTS["fraction"]}
    saved = json.loads(after["report.json"])
    assert saved["answer"] == 42 and (saved["units"]["total"], saved["units"]["linear"]) == (6, 4)
    page = after["report.html"].decode()
    assert "<td>6</td><td>4</td><td>2</td>" in before["report.html"].decode()  # channels, nonlinear, linear
    assert "<td>6</td><td>2</td><td>4</td>" in page and "<td>6</td><td>4</td><td>2</td>" not in page
    assert "answer.png failed: RuntimeError: plot broke" in page
    assert after[reporting.PLOTS["fraction"]] != before[reporting.PLOTS["fraction"]]


def test_a_save_that_fails_to_write_leaves_the_earlier_report_as_it_was(registry, tmp_path):
    """A file of the new report cannot be written (a folder holds its name): the save raises before it has
    replaced any file, so the folder holds the earlier report byte for byte, and no temporary file."""
    linearize.report(_model(), torch.randn(16, 8), skip=FAST, progress=False).save(tmp_path)
    before = _files(tmp_path)
    (tmp_path / "answer.png").mkdir()
    linearize.register_measure("answer", lambda ctx: 42, plot=lambda value: PNG)
    second = linearize.report(_model(), torch.randn(16, 8), skip=FAST, progress=False)
    with pytest.raises(IsADirectoryError, match="answer.png"):
        second.save(tmp_path)
    assert _files(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, ".linearize.lock", "answer.png"])


def test_skip_reasons_of_a_measure(registry):
    def needs_wide(ctx):
        widths = [u.num_channels for _, u in linearize.units(ctx.model)]
        if max(widths) < 100:
            raise SkipMeasure(f"widest site has {max(widths)} channels, fewer than 100")
        return max(widths)

    linearize.register_measure("wide", needs_wide, section=lambda v, image, rep: f"<p>{v}</p>")
    linearize.register_measure("gated_only", Measure(lambda ctx: 1, plain="needs a gated model"))
    rep = linearize.report(_model(), torch.randn(8, 8), skip=FAST, progress=False)
    assert rep.skipped["wide"] == "widest site has 6 channels, fewer than 100"
    assert rep.skipped["gated_only"] == "needs a gated model" and rep["gated_only"] is None
    data = rep.to_dict()
    assert data["wide"] is None and data["gated_only"] is None
    page = rep.to_html({})
    assert "<h2>wide</h2>\n<p class=\"skip\">Skipped: widest site has 6 channels" in page


def test_unknown_and_reused_names_are_refused(registry):
    linearize.register_measure("mine", lambda ctx: 1.0)
    with pytest.raises(ValueError, match=r"unknown measures in skip: \['mnie'\]; known: units, .*gates, mine"):
        linearize.report(_model(), torch.randn(8, 8), skip=["mnie"], progress=False)
    with pytest.raises(ValueError, match="'mine' is already registered: pass overwrite=True"):
        linearize.register_measure("mine", lambda ctx: 2.0)
    with pytest.raises(ValueError, match="'units' is already registered"):
        linearize.register_measure("units", lambda ctx: 2.0)
    linearize.register_measure("mine", lambda ctx: 2.0, overwrite=True)
    assert list(registry) == BUILT_IN + ["mine"]
    rep = linearize.report(_model(), torch.randn(8, 8), skip=FAST, progress=False)
    assert rep["mine"] == 2.0 and rep.units["nonlinear"] == 4
    for bad, match in (("skipped", "taken by the report itself"), ("model", "taken by the report itself"),
                       ("my measure", "must be an identifier"), ("class", "must be an identifier")):
        with pytest.raises(ValueError, match=match):
            linearize.register_measure(bad, lambda ctx: 0)
    with pytest.raises(ValueError, match="plot file 'regions_ecdf.png' is already written by regions"):
        linearize.register_measure("other", lambda ctx: 0, plot=lambda v: PNG, plot_file="regions_ecdf.png")
    with pytest.raises(TypeError, match="must be a Measure or a function"):
        linearize.register_measure("number", 3)
    assert list(registry) == BUILT_IN + ["mine"]  # nothing refused was registered


def test_a_value_json_cannot_hold_names_the_measure(registry):
    linearize.register_measure("raw", lambda ctx: torch.zeros(2))
    with pytest.raises(TypeError, match="measure 'raw' returned a value report.json cannot hold"):
        linearize.report(_model(), torch.randn(8, 8), skip=FAST, progress=False)


def test_the_command_line_knows_registered_measures(registry, capsys, tmp_path):
    linearize.register_measure("samples", lambda ctx: ctx.data.num_samples, summary=lambda v: f"samples seen: {v}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 5), nn.ReLU(), nn.Linear(5, 10))  # digits: 64 features
    torch.save(model, tmp_path / "mlp.pt")
    argv = ["report", str(tmp_path / "mlp.pt"), "--trust-pickle", "--data", "digits", "--num-samples", "12",
            "--output-dir", str(tmp_path / "out"), "--no-progress", "--skip", *FAST]
    assert linearize.cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "samples seen: 12" in out and "nonlinear channels: 5 / 5" in out
    assert json.loads((tmp_path / "out" / "report.json").read_text())["samples"] == 12
    with pytest.raises(SystemExit):
        build_parser().parse_args(["report", "m.pt", "--data", "digits", "--skip", "nothing"])
    assert "invalid choice: 'nothing'" in capsys.readouterr().err


def test_register_measure_refuses_a_plot_file_outside_the_report_folder(tmp_path):
    """Truth: ``Report.save(out_dir)`` writes every plot into ``out_dir``; a measure's ``plot_file`` is
    "a file name" (register_measure docs), so ``"../escape.png"`` or an absolute path must be refused
    with a ValueError at registration. Observed: accepted, and ``save`` would write it outside."""
    from linearize.report_measures import MEASURES, register_measure

    try:
        with pytest.raises(ValueError):
            register_measure("hostile_escape", lambda ctx: 1.0, plot=lambda v: b"png",
                             plot_file=str(tmp_path / ".." / "escape.png"))
    finally:
        MEASURES.pop("hostile_escape", None)


def test_report_refuses_a_non_finite_measure_value_by_name():
    """Truth: ``report()`` checks every measure value against what ``report.json`` can hold (``_checked``)
    and names the measure otherwise; ``report.json`` is written with ``allow_nan=False``. A measure
    returning NaN must therefore either be refused by ``report()`` naming the measure, or be written.
    Observed: ``report()`` accepts NaN (its check uses ``json.dumps`` with NaN allowed) and
    ``to_json()`` / ``save()`` then raise a bare "Out of range float values" naming nothing."""
    from linearize.report_measures import MEASURES, register_measure

    register_measure("hostile_nan", lambda ctx: {"score": float("nan")})
    try:
        model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                                  example_inputs=torch.randn(2, 4))
        skip = [k for k in MEASURES if k not in ("hostile_nan", "units")]
        try:
            rep = linearize.report(model, torch.randn(8, 4), skip=skip, progress=False)
        except (TypeError, ValueError) as err:
            assert "hostile_nan" in str(err)
        else:
            rep.to_json()
    finally:
        MEASURES.pop("hostile_nan", None)


def test_register_measure_refuses_non_callable_parts():
    """Truth (register_measure docs): a measure is a ``compute(ctx)`` function, its ``plot`` a function
    ``plot(value) -> bytes``; a function given bare is checked (``TypeError``), so a ``Measure`` whose
    ``compute`` is ``5`` or whose ``plot`` is a string must be refused too. Observed: both registered;
    the report fails later, after the measures before it ran, with "'int' object is not callable"."""
    from linearize.report_measures import MEASURES, Measure, register_measure

    try:
        with pytest.raises(TypeError):
            register_measure("hostile_compute", Measure(compute=5))
        with pytest.raises(TypeError):
            register_measure("hostile_plot", lambda ctx: 1.0, plot="fraction.png")
    finally:
        MEASURES.pop("hostile_compute", None)
        MEASURES.pop("hostile_plot", None)
