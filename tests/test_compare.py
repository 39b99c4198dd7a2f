"""``linearize.compare`` / ``linearize report --compare``: tiny cifar-recipe runs on fake images side by side.

Truths: each run's numbers read here from its own ``metrics.json`` and ``report/report.json``, and the
per-site nonlinear fractions of its model loaded through the recipe (``cifar.load_model``) and counted
with :func:`linearize.count_units`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import linearize
from test_report import _chromium, _dump_dom

sys.path.insert(0, str(Path(__file__).resolve().parent / "recipes"))  # tests/recipes/
from test_resume import CIFAR_CLASSES, write_images  # noqa: E402  (also puts recipes/ on sys.path)

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A baseline (no units), a linearized run with --report --fold, and one without a report."""
    import cifar

    root = tmp_path_factory.mktemp("compare")
    data = write_images(root / "data", {"train": {c: 16 for c in CIFAR_CLASSES}, "test": {c: 4 for c in CIFAR_CLASSES}})
    common = ["--data-dir", str(data), "--cache-dir", str(root / "cache"), "--image-size", "8", "--arch", "resnet20",
              "--batch-size", "8", "--eval-batch-size", "12", "--lr", "0.05", "--log_every", "1"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        import linearize.kernels as kernels

        mp.setenv(kernels.ENV_SWITCH, "0")
        mp.setattr(kernels, "_state", dict(kernels._state))  # the "off" stays in this fixture
        out = {"baseline": root / "baseline", "late": root / "late", "early": root / "early"}
        cifar.main(common + ["--linearize", "none", "--schedule", "none", "--max-steps", "3",
                             "--output_dir", str(out["baseline"])])
        cifar.main(common + ["--schedule", "late", "--late-start", "0.25", "--ramp-end", "0.75", "--target", "0.34",
                             "--lam", "0.01", "--max-steps", "6", "--report", "--report-samples", "24", "--fold",
                             "--output_dir", str(out["late"])])
        cifar.main(common + ["--schedule", "early", "--ramp-end", "0.5", "--target", "0.5", "--lam", "0.01",
                             "--max-steps", "4", "--output_dir", str(out["early"])])
    torch.set_num_threads(threads)
    return out


def _fmt(v: float) -> str:
    return f"{v:.4g}"  # as the report's tables print numbers


def _rows(page: str) -> list[list[str]]:
    """Every table row of ``page`` as its cells' text."""
    return [re.findall(r"<t[dh]>(.*?)</t[dh]>", row) for row in re.findall(r"<tr>(.*?)</tr>", page)]


def _site_fractions(run: Path) -> dict[str, float]:
    import cifar

    model = cifar.load_model(run / "model")
    return {site: s["fraction"] for site, s in linearize.count_units(model)["sites"].items()}


def test_compare_page_holds_each_runs_numbers(runs, tmp_path):
    page_path = tmp_path / "compare.html"
    page = linearize.compare([runs["baseline"], runs["late"], runs["early"]], out=page_path)
    assert page_path.read_text() == page
    rows = _rows(page)
    header = next(r for r in rows if r[:1] == ["run"] and "test accuracy" in r)
    by_run = {r[0]: r for r in rows[rows.index(header) + 1:rows.index(header) + 4]}
    assert sorted(by_run) == sorted(runs), by_run
    for name, run in runs.items():
        m = json.loads((run / "metrics.json").read_text())
        row = dict(zip(header, by_run[name]))
        assert row["test accuracy"] == _fmt(m["test_accuracy"])
        assert row["test loss"] == _fmt(m["test_loss"])
        assert row["steps"] == str(m["steps"])
        if "nonlinear_fraction" in m:
            assert row["nonlinear fraction"] == _fmt(m["nonlinear_fraction"])
            assert row["average path length"] == _fmt(m["average_path_length"])
        else:
            assert row["nonlinear fraction"] == "–"
    late = json.loads((runs["late"] / "metrics.json").read_text())
    assert dict(zip(header, by_run["late"]))["FLOPs ratio (folded)"] == _fmt(
        late["fold"]["flops_after"] / late["fold"]["flops_before"])

    # per-site fractions: the report run's and the sidecar run's, against count_units of the loaded models
    site_header = next(r for r in rows if r[:1] == ["site"] and "late" in r and "early" in r)
    sites = {r[0]: dict(zip(site_header, r)) for r in rows if len(r) == len(site_header) and r[0] != "site"}
    for name in ("late", "early"):
        truth = _site_fractions(runs[name])
        assert truth and all(sites[s][name] == _fmt(f) for s, f in truth.items())
    assert "baseline: a baseline without linearizable units" in page

    # affinity signature: from the report run's report.json
    report = json.loads((runs["late"] / "report" / "report.json").read_text())
    aff_header = next(r for r in rows if r[:1] == ["site"] and r[1:] == ["late"])
    aff_rows = {r[0]: r[1] for r in rows if len(r) == 2 and r[0] != "site"}
    assert report["affinity"] and all(aff_rows[s] == _fmt(v) for s, v in report["affinity"])
    assert aff_header == ["site", "late"]
    assert "early: the run has no report/" in page
    assert page.count("data:image/png;base64,") == 2  # sites and affinity plots


def test_cli_report_compare_writes_the_page(runs, tmp_path, capsys):
    from linearize.cli import main

    out = tmp_path / "page.html"
    assert main(["report", "--compare", str(runs["baseline"]), str(runs["late"]), "--out", str(out)]) == 0
    assert str(out.resolve()) in capsys.readouterr().out
    assert out.read_text() == linearize.compare([runs["baseline"], runs["late"]])
    with pytest.raises(FileNotFoundError, match="has no metrics.json"):
        linearize.compare([tmp_path])


def test_run_and_site_names_holding_dollar_signs_are_compared(tmp_path):
    """Run folders and sites named with matplotlib mathtext (``$\\foo$``) used to fail the plots of the page."""
    site = "act$\\foo$"
    run = tmp_path / "run$\\bar$"
    (run / "report").mkdir(parents=True)
    (run / "metrics.json").write_text("{}")
    (run / "report" / "report.json").write_text(json.dumps({"units": {"sites": {site: {"fraction": 0.5}}},
                                                            "affinity": [[site, 0.75]]}))
    page = linearize.compare([run])
    assert page.count("data:image/png;base64,") == 2  # sites and affinity plots
    assert [site, "0.5"] in _rows(page) and [site, "0.75"] in _rows(page)


def test_run_folders_whose_names_are_not_utf8_are_compared(tmp_path, capsys):
    """A run folder named in Latin-1 bytes (``run-caf\\xe9``, not UTF-8) beside a UTF-8 ``run-café``: the page and
    its plots are written (they failed in matplotlib, then in writing the page), the Latin-1 name shown with
    its byte escaped, the UTF-8 one as it is; a run without report/ or model/ has its skip reason shown too."""
    from linearize.cli import main

    site = "relu1"
    runs = []
    for name, report in ((b"run-caf\xe9", True), ("run-café".encode(), True), (b"bare-\xe9", False)):
        run = os.path.join(os.fsencode(tmp_path), name)
        os.makedirs(os.path.join(run, b"report"))
        with open(os.path.join(run, b"metrics.json"), "w") as f:
            json.dump({"test_accuracy": 0.5}, f)
        if report:
            with open(os.path.join(run, b"report", b"report.json"), "w") as f:
                json.dump({"units": {"sites": {site: {"fraction": 0.25}}}, "affinity": [[site, 0.75]]}, f)
        runs.append(os.fsdecode(run))
    out = tmp_path / "compare.html"
    assert main(["report", "--compare", *runs, "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    page = out.read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 2  # sites and affinity plots
    rows = _rows(page)
    assert ["site", "run-caf\\xe9", "run-café"] in rows and [site, "0.25", "0.25"] in rows
    assert ["run-caf\\xe9", "0.5"] in rows and ["run-café", "0.5"] in rows and ["bare-\\xe9", "0.5"] in rows
    assert f"bare-\\xe9: no linearize sidecar in {tmp_path}/bare-\\xe9/model" in page


def test_a_runs_metrics_json_given_for_its_folder_or_a_fifo_is_named_not_missing(tmp_path):
    """A run's metrics.json given instead of the run folder, and a FIFO where metrics.json should be: the error
    names the file and the fix (it said the folder had no metrics.json); the run folder itself is compared."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"test_accuracy": 0.5}))
    with pytest.raises(NotADirectoryError, match=rf"{run}/metrics.json is a file, not a folder: a run is loaded "
                                                 rf"from its folder; pass the folder that holds it \({run}\)"):
        linearize.compare([run / "metrics.json"])
    assert ["run", "0.5"] in _rows(linearize.compare([run]))
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "metrics.json")
    with pytest.raises(linearize.LoadError, match=rf"{tmp_path}/fifo/metrics.json is not a regular file \(a FIFO"):
        linearize.compare([tmp_path / "fifo"])


GOOD_METRICS = {"recipe": "cifar", "test_accuracy": 0.9, "args": {"tol": 0.001}}
GOOD_REPORT = {"units": {"sites": {"relu1": {"fraction": 0.5}}}, "affinity": [["relu1", 0.9]],
               "path_length": {"normalized": 2.0}}


@pytest.mark.parametrize("file, content, wrong", [
    ("metrics.json", [{"epoch": 1, "test_accuracy": 0.5}], "expected a JSON object (the run's final metrics)"),
    ("metrics.json", {**GOOD_METRICS, "fold": {"flops_before": "3", "flops_after": "1"}}, "'fold.flops_before' is '3'"),
    ("metrics.json", {**GOOD_METRICS, "args": ["--tol", "0.1"]}, "'args' is list"),
    ("metrics.json", {**GOOD_METRICS, "units_total": 10}, "it has only one of 'units_total' and 'units_nonlinear'"),
    ("report/report.json", [], "expected a JSON object, got list"),
    ("report/report.json", {**GOOD_REPORT, "units": [1]}, "'units' is not"),
    ("report/report.json", {**GOOD_REPORT, "units": {"total": 3}}, "'units' is not"),
    ("report/report.json", {**GOOD_REPORT, "path_length": [1, 2]}, "'path_length' is list"),
    ("report/report.json", {**GOOD_REPORT, "affinity": [["relu1"]]}, "'affinity' is not a list of [site, score]"),
    ("report/report.json", {**GOOD_REPORT, "skipped": {"regions": 1}}, "'skipped' is not"),
])
def test_compare_refuses_a_run_file_of_another_form_naming_it(tmp_path, cli_refusal, file, content, wrong):
    """A metrics.json that is a list (one record per epoch, as other tools write), a report.json edited or of
    another version: one line naming the file, what is wrong and the fix, not a traceback."""
    run = tmp_path / "run"
    (run / "report").mkdir(parents=True)
    files = {"metrics.json": GOOD_METRICS, "report/report.json": GOOD_REPORT, file: content}
    for name, value in files.items():
        (run / name).write_text(json.dumps(value))
    line = cli_refusal(["report", "--compare", str(run), "--out", str(tmp_path / "c.html")])
    assert f"{run / file}: {wrong}" in line and ("write it again" in line or "fix the file" in line), line
    assert not (tmp_path / "c.html").exists()


def test_a_metrics_json_holding_an_integer_too_long_for_python_is_refused_naming_it(tmp_path, cli_refusal):
    """A metrics.json with an integer of more than 4,300 digits (Python's int-string limit): one line naming the
    file, as for any other damaged JSON (it was a bare ValueError naming no run or file)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text('{"recipe": "cifar", "steps": ' + "9" * 5000 + "}")
    line = cli_refusal(["report", "--compare", str(run), "--out", str(tmp_path / "c.html")])
    assert f"{run / 'metrics.json'}: not valid JSON for this reader: it holds an integer of more than 4,300" in line
    assert not (tmp_path / "c.html").exists()


def test_compare_reads_the_good_forms_of_the_crafted_files(tmp_path):
    """The files the refusals above edit, as written: the page shows their numbers."""
    run = tmp_path / "run"
    (run / "report").mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps(GOOD_METRICS))
    (run / "report" / "report.json").write_text(json.dumps(GOOD_REPORT))
    rows = _rows(linearize.compare([run]))
    assert ["relu1", "0.5"] in rows and ["relu1", "0.9"] in rows and ["run", "2", "None", "None"] in rows


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary (Debian: apt-get install -y chromium)")
def test_compare_page_renders_in_headless_chromium(runs, tmp_path):
    page = tmp_path / "compare.html"
    linearize.compare([runs["baseline"], runs["late"], runs["early"]], out=page)
    dom = _dump_dom(page, tmp_path)
    assert dom.count('data-loaded="yes"') == 2 and 'data-images="loaded"' in dom
