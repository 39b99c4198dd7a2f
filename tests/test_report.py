"""linearize.report: JSON contents against independent measures, history formats, errors, CLI,
and the HTML page opened in a real headless Chromium."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn

import linearize
from linearize import reporting
from linearize.cli import report as cli_report
from linearize.measures import average_path_length

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _digits(n: int = 256) -> torch.Tensor:
    from sklearn.datasets import load_digits

    return torch.tensor(load_digits().data[:n], dtype=torch.float32) / 16.0


def _mlp(act: type[nn.Module] = nn.ReLU) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 24), act(), nn.Linear(24, 16), act(), nn.Linear(16, 10))
    return linearize.convert(model, example_inputs=torch.randn(2, 64))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[nn.Module, Path, torch.Tensor]:
    """An MLP on digits trained for 20 steps under a target schedule down to 50% nonlinear."""
    from sklearn.datasets import load_digits

    from linearize.schedules import target

    x, y = _digits(512), torch.tensor(load_digits().target[:512])
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 20
    sparsifier = linearize.Sparsifier(model, schedule=target(0.5, start=0, end=0.8), total_steps=steps, lam=1e-3)
    sparsifier.attach(opt)
    for step in range(steps):
        idx = torch.arange(step * 24, step * 24 + 64) % 512
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = sparsifier.save_history(tmp_path_factory.mktemp("history") / "history.json")
    return model, path, x


def test_report_on_digits_matches_measures(trained, tmp_path: Path) -> None:
    model, history, x = trained
    rep = linearize.report(model, x, history=history, max_samples=200, segments=8, progress=False)
    data = json.loads(rep.to_json())
    assert set(data) == {"model", "num_samples", "tol", "units", "path_length", "affinity", "regions",
                         "history", "gates", "excluded", "skipped"}
    assert data["num_samples"] == 200
    counts = linearize.count_units(model)
    assert {k: data["units"][k] for k in ("total", "nonlinear", "linear", "sites")} == counts
    assert data["units"]["fraction"] == pytest.approx(linearize.nonlinear_fraction(model))
    assert 0.3 < data["units"]["fraction"] < 0.7  # the sparsifier moved it from 1 towards 0.5
    apl = data["path_length"]
    assert apl["normalized"] == pytest.approx(average_path_length(model, x[:2]))
    assert apl["unnormalized"] == pytest.approx(average_path_length(model, x[:2], normalized=False))
    # a chain: both variants are the sum of per-site fractions
    assert apl["normalized"] == pytest.approx(sum(s["fraction"] for s in counts["sites"].values()))
    assert [s for s, _ in data["affinity"]] == list(counts["sites"])
    assert all(0.0 < v <= 1.0 for _, v in data["affinity"])
    regions = data["regions"]
    assert len(regions["counts"]) == len(regions["deviation"]) == 8
    exact = linearize.measures.linear_regions(model, x[:8], x[torch.arange(1, 9) % 200])
    assert regions["counts"] == exact.count.tolist()
    assert regions["complete"] and regions["stopped"] is None and regions["covered"] == [1.0] * 8
    assert regions["deviation"] == pytest.approx(exact.deviation().mean(1).tolist())
    # the last logged step is now: the history ends at the current fraction
    assert data["history"]["total"][-1] == pytest.approx(data["units"]["fraction"])
    assert data["history"]["total"][0] >= 0.9 > data["history"]["total"][-1] + 0.2
    assert data["history"]["steps"] == sorted(data["history"]["steps"])
    assert data["gates"] is None and "gates" in data["skipped"] and "regions" not in data["skipped"]

    written = rep.save(tmp_path)
    plots = [reporting.PLOTS[k] for k in ("fraction", "affinity", "history", "regions")]
    assert set(written) == {"report.json", "report.html", *plots}
    assert json.loads((tmp_path / "report.json").read_text()) == data
    for name in plots:
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "src=\"http" not in page


def test_a_report_saved_over_an_earlier_one_leaves_only_its_own_files(trained, tmp_path: Path) -> None:
    """Saving a report into the folder of an earlier one that ran more measures: the folder then holds what the
    same report saved into a new folder holds (the earlier plots of the measures that did not run are gone),
    and the user's own files, plot-like names included, are left alone."""
    model, history, x = trained
    first = linearize.report(model, x, history=history, max_samples=64, segments=4, progress=False)
    second = linearize.report(_mlp(), x, max_samples=64, segments=0, skip=["affinity"], progress=False)
    out = tmp_path / "out"
    assert len(first.save(out)) == 6  # report.json, report.html and 4 plots
    mine = {"notes.txt": b"mine", "plot.png": PNG_MAGIC, "report.txt": b"mine"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    second.save(out)
    second.save(tmp_path / "fresh")

    def files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    assert files(out) == {**files(tmp_path / "fresh"), **mine}
    fresh = {*files(tmp_path / "fresh")} - {".linearize.lock"}
    assert fresh == {"report.json", "report.html", reporting.PLOTS["fraction"]}


_SAVE_KILLED = r"""
import os, sys, torch, torch.nn as nn, linearize
torch.manual_seed(0)
m = linearize.convert(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)), example_inputs=torch.randn(1, 4))
with torch.no_grad():
    linearize.units(m)[0][1].slope.fill_(float(sys.argv[2]))
rep = linearize.report(m, torch.randn(32, 4), skip=["regions", "affinity", "path_length"], progress=False)
if sys.argv[3] == "kill":
    real = os.replace
    def replace(a, b):
        real(a, b)
        if os.path.basename(b) == "report.json":
            os._exit(9)  # killed right after the first of the report's own renames
    os.replace = replace
rep.save(sys.argv[1])
"""


def test_a_report_save_killed_between_its_renames_is_marked_and_refused_until_saved_again(tmp_path: Path) -> None:
    """A process killed (kill -9; here os._exit) after Report.save renamed the new report.json over the old one but
    before report.html: the folder held the new JSON beside the old HTML with nothing to tell, and --compare read it
    as one report. Now the folder holds report.incomplete, compare refuses the run naming it, and the next save
    leaves exactly what the same report saved into a fresh folder holds (truth: an uninterrupted save)."""
    import os
    import sys

    from linearize.comparison import load_run

    run, report = tmp_path / "run", tmp_path / "run" / "report"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"test_accuracy": 0.5}))

    def save(folder: Path, slope: str, how: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _SAVE_KILLED, str(folder), slope, how], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert save(report, "0.0", "ok").returncode == 0
    assert load_run(run).sites is not None and not (report / "report.incomplete").exists()
    old_html = (report / "report.html").read_bytes()
    killed = save(report, "1.0", "kill")
    assert killed.returncode == 9, killed.stderr
    assert json.loads((report / "report.json").read_text())["units"]["fraction"] == 0.0  # the new report's
    assert (report / "report.html").read_bytes() == old_html  # the old report's: the folder is mixed
    assert "may come from two different reports" in (report / "report.incomplete").read_text()
    with pytest.raises(linearize.LoadError, match=r"report holds report.incomplete: a save of its report was killed"):
        load_run(run)
    assert save(report, "1.0", "ok").returncode == 0
    assert save(tmp_path / "fresh", "1.0", "ok").returncode == 0

    def files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    assert files(report) == files(tmp_path / "fresh")
    assert load_run(run).sites is not None


def test_site_names_holding_dollar_signs_are_saved_and_plotted_as_written(tmp_path: Path) -> None:
    """Module names are free text: ``$\\foo$`` (not mathtext matplotlib knows) used to fail the save after every
    measure ran, ``$\\alpha$`` was drawn as a Greek letter. Truth: each name drawn as plain text."""
    from collections import OrderedDict

    from linearize import plots

    names = ["act$\\alpha$", "cost$\\foo$", "one$dollar"]
    torch.manual_seed(0)
    layers = OrderedDict([("fc0", nn.Linear(8, 6)), (names[0], nn.ReLU()), ("fc1", nn.Linear(6, 6)),
                          (names[1], nn.ReLU()), ("fc2", nn.Linear(6, 6)), (names[2], nn.ReLU()),
                          ("out", nn.Linear(6, 2))])
    model = linearize.convert(nn.Sequential(layers), example_inputs=torch.randn(2, 8))
    rep = linearize.report(model, torch.randn(16, 8), segments=2, skip=["affinity"], progress=False)
    written = rep.save(tmp_path)
    assert {"report.json", "report.html", reporting.PLOTS["fraction"]} <= set(written)
    assert list(json.loads((tmp_path / "report.json").read_text())["units"]["sites"]) == names

    fig = plots.figure(6.0)
    ax = fig.add_subplot()
    plots.site_axis(ax, names)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for label, name in zip(ax.get_xticklabels(), names):
        plain = fig.text(0, 0, name, parse_math=False, rotation=90, fontsize=7)
        size = plain.get_window_extent(renderer).size
        assert label.get_window_extent(renderer).size == pytest.approx(size, abs=0.01), name


def test_smooth_model_skips_regions_with_reason() -> None:
    model = _mlp(nn.GELU)
    rep = linearize.report(model, _digits(64), progress=False)
    assert rep.regions is None and "smooth" in rep.skipped["regions"] and "gelu" in rep.skipped["regions"]
    assert rep.path_length["normalized"] == pytest.approx(2.0)
    assert rep.history is None and rep.affinity is not None
    assert reporting.PLOTS["regions"] not in rep.plots()


def test_translation_loops_of_images() -> None:
    torch.manual_seed(0)  # an MLP on 8x8 images (float64 convs under forward AD are slow on CPU)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    linearize.convert(model, example_inputs=torch.randn(2, 1, 8, 8))
    x = _digits(16).view(-1, 1, 8, 8)
    rep = linearize.report(model, x, segments=3, paths="loops", skip=["affinity"], progress=False)
    x0, x1 = linearize.measures.translation_loops(x[:3])
    exact = linearize.measures.linear_regions(model, x0, x1)
    assert len(rep.regions["counts"]) == 3 * 8 and rep.regions["counts"] == exact.count.tolist()
    assert "translation loops" in rep.regions["segments"]
    with pytest.raises(ValueError, match="unknown measures"):
        linearize.report(model, x, skip=["regoins"], progress=False)


def test_regions_budget_gives_a_marked_partial_result(tmp_path: Path, one_thread) -> None:
    """max_regions=2: every segment with more regions keeps its first two, exactly those of the
    complete walk, and the JSON, the HTML and the plot say the result is partial."""
    model, x = _mlp(), _digits(64)
    x0, x1 = x[:6], x[torch.arange(1, 7)]
    full = linearize.measures.linear_regions(model, x0, x1, max_regions=None)
    assert full.complete and (full.count > 2).sum() >= 3
    rep = linearize.report(model, x, segments=6, max_regions=2, skip=["affinity", "path_length"], progress=False)
    r = rep.regions
    assert r["counts"] == full.count.clamp(max=2).tolist()
    assert not r["complete"] and r["stopped"] == "max_regions=2"
    assert r["budget"] == {"max_regions": 2, "max_seconds": reporting.REGIONS_SECONDS}
    for s in range(6):  # a truncated segment is covered up to the end of its 2nd region
        expected = 1.0 if full.count[s] <= 2 else full.regions(s)["end"][1].item()
        assert r["covered"][s] == pytest.approx(expected, abs=1e-12)
        assert r["deviation"][s] <= full.deviation()[s].mean().item() + 1e-12
    written = rep.save(tmp_path)
    page = written["report.html"].read_text()
    assert "Partial result" in page and "max_regions=2" in page and "lower bounds" in page
    assert json.loads(written["report.json"].read_text())["regions"]["complete"] is False
    complete = linearize.report(model, x, segments=6, skip=["affinity", "path_length"], progress=False)
    assert complete.regions["complete"] and complete.regions["counts"] == full.count.tolist()
    assert "Partial result" not in complete.to_html()
    for bad, match in (({"max_regions": 0}, "max_regions"), ({"regions_seconds": -1.0}, "regions_seconds")):
        with pytest.raises(ValueError, match=match):  # before any measure runs
            linearize.report(model, x, progress=False, **bad)


def test_default_regions_budget_stops_an_untrained_cifar_resnet20(one_thread) -> None:
    """The slow case that motivated the budget: one segment through an untrained CIFAR ResNet-20 holds
    thousands of regions (it ran for minutes); the report's time budget stops it, marked partial."""
    import sys
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import cifar

    torch.manual_seed(0)
    model = linearize.convert(cifar.build_model("resnet20", 10).eval(), example_inputs=torch.zeros(2, 3, 32, 32))
    x = torch.randn(2, 3, 32, 32)
    start = time.monotonic()
    rep = linearize.report(model, x, segments=1, regions_seconds=1.0, progress=False,
                           skip=["units", "path_length", "affinity", "history", "gates"])
    elapsed = time.monotonic() - start
    r = rep.regions
    assert not r["complete"] and r["stopped"] == "max_seconds=1" and r["covered"][0] < 0.5
    assert r["counts"][0] >= 1 and elapsed < 30  # a few forwards past the budget at most
    assert reporting.REGIONS_SECONDS is not None and reporting.REGIONS_MAX_REGIONS is not None


def test_cli_regions_budget_flags(tmp_path: Path, capsys, one_thread) -> None:
    torch.save(_mlp(), tmp_path / "mlp.pt")
    out = tmp_path / "out"
    assert _cli(["report", str(tmp_path / "mlp.pt"), "--data", "digits", "--num-samples", "16", "--segments", "4",
                 "--max-regions", "1", "--regions-seconds", "none", "--skip", "affinity",
                 "--output-dir", str(out), "--no-progress", "--trust-pickle"]) == 0
    regions = json.loads((out / "report.json").read_text())["regions"]
    assert regions["budget"] == {"max_regions": 1, "max_seconds": None} and regions["counts"] == [1, 1, 1, 1]
    assert not regions["complete"] and "partial result, stopped at max_regions=1" in capsys.readouterr().out
    for bad, message in ((["--max-regions", "0"], "--max-regions must be an int >= 1"),
                         (["--regions-seconds", "-1"], "--regions-seconds must be > 0"),
                         (["--max-regions", "many"], "invalid int value")):
        with pytest.raises(SystemExit):
            _cli(["report", "mlp.pt", "--data", "digits", *bad])
        assert message in capsys.readouterr().err


def test_a_history_holding_an_integer_too_long_for_python_is_a_load_error_naming_it(tmp_path: Path) -> None:
    """A history file with an integer of more than 4,300 digits (Python's int-string limit): report(history=)
    refuses it naming the file, as any other damaged JSON (it was a bare ValueError naming no file)."""
    path = tmp_path / "history.json"
    path.write_text('{"1": {"a": ' + "9" * 5000 + "}}")
    with pytest.raises(linearize.LoadError, match=rf"{path}: not valid JSON for this reader: it holds an integer"):
        linearize.report(_mlp(), _digits(16), history=path, progress=False, skip=["regions"])


def test_history_formats_and_weighting() -> None:
    counts = linearize.count_units(_mlp())  # sites "1" (24 channels) and "3" (16 channels)
    plain = {"100": {"1": 0.5, "3": 1.0}, "0": {"1": 1.0, "3": 1.0}}
    h = reporting.load_history(plain, counts)
    assert h["steps"] == [0, 100]
    assert h["total"] == pytest.approx([1.0, (0.5 * 24 + 16) / 40])
    assert h["sites"] == {"1": [1.0, 0.5], "3": [1.0, 1.0]}
    assert reporting.load_history(plain)["total"][1] == pytest.approx(0.75)  # unweighted without counts
    logged = {"history": [{"step": 3, "sites": {"1": 0.25}, "nonlinear_fraction": 0.4}]}
    assert reporting.load_history(logged, counts)["total"] == [0.4]
    with pytest.raises(FileNotFoundError):
        reporting.load_history("/nonexistent/history.json")
    with pytest.raises(ValueError, match="empty"):
        reporting.load_history({})


@pytest.mark.parametrize("step", ["1" + "0" * 400, str(2**63), "9" * 5000, 2**63, -(2**63) - 1])
def test_a_history_step_past_an_int64_is_refused_naming_the_file(tmp_path: Path, step) -> None:
    """A step too large for the sparsifier's int64 count (and for a float: the plot broke in matplotlib when the
    report was saved, with a note blaming the measure's plot) is refused when the history is read, naming the file
    and the step; the largest int64 is read, and its report saves with the plot."""
    path = tmp_path / "history.json"
    largest = torch.iinfo(torch.int64).max
    path.write_text(json.dumps({"history": [{"step": 1, "sites": {"1": 1.0}}, {"step": step, "sites": {"1": 0.5}}]})
                    if isinstance(step, int) else json.dumps({"1": {"1": 1.0}, step: {"1": 0.5}}))
    with pytest.raises(ValueError, match=rf"sparsifier history '{path}': step -?\d+.* is out of range: a sparsifier "
                                         rf"counts at most {largest:,} steps"):
        linearize.report(_mlp(), _digits(32), history=path, progress=False, skip=["regions"])
    path.write_text(json.dumps({"1": {"1": 1.0}, str(largest): {"1": 0.5}}))
    rep = linearize.report(_mlp(), _digits(32), history=path, progress=False, skip=["regions"])
    assert rep.history["steps"] == [1, largest]
    rep.save(tmp_path / "report")
    assert (tmp_path / "report" / "fraction_history.png").is_file()


def test_bad_input() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="at least 2 samples"):
        linearize.report(model, _digits(1), progress=False)
    with pytest.raises(ValueError, match="no activation sites"):
        linearize.report(nn.Sequential(nn.Linear(64, 3), nn.ReLU()), _digits(8), progress=False)
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="site '3' has NaN/inf"):
        linearize.report(model, _digits(8), progress=False)
    with pytest.raises(TypeError, match="data must be"):
        linearize.report(_mlp(), "digits", progress=False)


def test_loader_batches_are_collected() -> None:
    x = _digits(100)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(100)), batch_size=16)
    rep = linearize.report(_mlp(), loader, max_samples=40, segments=2, progress=False)
    ref = linearize.report(_mlp(), x[:40], segments=2, progress=False)
    assert rep.num_samples == 40
    assert [s for s, _ in rep.affinity] == [s for s, _ in ref.affinity]
    assert [v for _, v in rep.affinity] == pytest.approx([v for _, v in ref.affinity])
    assert rep.regions["counts"] == ref.regions["counts"]


def test_gated_model_reports_gate_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 10))
    gated = linearize.convert(model, mode="dgn", example_inputs=torch.randn(2, 64))
    x = _digits(64)
    rep = linearize.report(gated, x, progress=False)
    assert rep.units is None and rep.path_length is None and rep.regions is None
    assert {"units", "path_length", "regions"} <= set(rep.skipped)
    with torch.no_grad():  # gates of site "1" are on where the feature network's first layer is > 0
        on = (gated.feature[0](x) > 0).double()
    assert rep.gates["1"]["fraction_on"] == pytest.approx(float(on.mean()))
    assert rep.gates["1"]["always_off"] == int((on.sum(0) == 0).sum())
    assert reporting.PLOTS["gates"] in rep.plots()


def test_progress_false_shows_no_gate_statistics_bar(capfd: pytest.CaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 24), nn.ReLU(), nn.Linear(24, 10))
    gated = linearize.convert(model, mode="dlgn", example_inputs=torch.randn(2, 64))
    rep = linearize.report(gated, _digits(64), progress=False)
    assert rep.gates is not None
    assert "gate statistics" not in capfd.readouterr().err


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="linearize")
    cli_report.register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_pickled_model_on_digits(tmp_path: Path, capsys) -> None:
    model = _mlp()
    with torch.no_grad():
        linearize.units(model)[1][1].slope[:4] = 1.0
    torch.save(model, tmp_path / "mlp.pt")
    out = tmp_path / "out"
    assert _cli(["report", str(tmp_path / "mlp.pt"), "--data", "digits", "--num-samples", "64",
                 "--segments", "4", "--output-dir", str(out), "--no-progress", "--trust-pickle"]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["units"]["nonlinear"] == 40 - 4 and data["num_samples"] == 64
    assert (out / "report.html").is_file() and "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_output_dir_that_cannot_be_a_folder_is_refused_before_anything_runs(tmp_path: Path, cli_refusal,
                                                                                 monkeypatch, where) -> None:
    """``--output-dir`` that is a file, or a path under one: one line naming it, before the model is loaded or
    any measure runs (a report measured to be lost), the file left as it was. ``Report.save`` into it: the same."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    out = blocker if where == "a file" else blocker / "report"
    monkeypatch.setattr(cli_report, "load_model_and_data", lambda args: pytest.fail("the model was loaded"))
    monkeypatch.setattr(cli_report, "report", lambda *a, **k: pytest.fail("the report was measured"))
    err = cli_refusal(["report", "resnet18", "--data", "digits", "--output-dir", str(out)])
    said = "is a file" if where == "a file" else f"is under the file {blocker}"
    assert f"error: --output-dir {out} {said}, not a folder" in err and "give the path of a folder" in err
    rep = linearize.report(_mlp(), _digits(16), segments=0, skip=["affinity"], progress=False)
    with pytest.raises(NotADirectoryError, match=re.escape(f"report folder {out} {said}, not a folder")):
        rep.save(out)
    assert blocker.read_text() == "mine"


def test_cli_torchvision_checkpoint_of_converted_model(tmp_path: Path) -> None:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.get_model("resnet18", weights=None, num_classes=10)
    linearize.convert(model, example_inputs=torch.randn(2, 3, 32, 32))
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope[: u.num_channels // 2] = 1.0
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    images = tmp_path / "images" / "cls"
    images.mkdir(parents=True)
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for i in range(6):
        arr = (torch.rand(32, 32, 3, generator=gen) * 255).to(torch.uint8).numpy()
        Image.fromarray(arr).save(images / f"{i}.png")
    out = tmp_path / "out"
    _cli(["report", "resnet18", "--num-classes", "10", "--checkpoint", str(tmp_path / "ckpt.pt"),
          "--data", str(tmp_path / "images"), "--output-dir", str(out), "--no-progress", "--segments", "2",
          "--skip", "affinity"])
    data = json.loads((out / "report.json").read_text())
    assert data["units"]["fraction"] == pytest.approx(0.5)
    assert data["num_samples"] == 6 and data["path_length"]["method"] == "fx"
    assert data["regions"] is None and "max_pool" in data["skipped"]["regions"]  # resnet18 has max pooling
    assert data["affinity"] is None and data["skipped"]["affinity"] == "skipped on request"


def test_cli_hf_directory_with_sidecar_on_jsonl(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import gzip

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "a man is riding a horse two dogs play in the snow the woman reads a book".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(words))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(tmp_path)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    model.save_pretrained(tmp_path)
    linearize.convert(model)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope[:8] = 1.0
    linearize.save_pretrained(model, tmp_path)
    with gzip.open(tmp_path / "texts.jsonl.gz", "wt") as f:
        for i in range(12):
            f.write(json.dumps({"translation": {"en": " ".join(words[i % 5: i % 5 + 6]), "de": "x"}}) + "\n")
    _cli(["report", str(tmp_path), "--data", str(tmp_path / "texts.jsonl.gz"), "--output-dir", str(tmp_path / "out"),
          "--no-progress", "--max-length", "10", "--skip", "affinity"])
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["model"] == "BertForSequenceClassification" and data["num_samples"] == 12
    assert [s["fraction"] for s in data["units"]["sites"].values()] == [0.75, 0.75, 0.5]  # FFN GELUs, pooler tanh
    # logits: 2 residual FFN blocks (each halved by its skip), then the pooler's tanh
    assert data["path_length"]["normalized"] == pytest.approx(0.75 / 2 * 2 + 0.5)
    assert data["path_length"]["method"] == "record"
    assert "smooth" in data["skipped"]["regions"]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _dump_dom(page: Path, tmp_path: Path) -> str:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=5000",
           "--dump-dom", page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout


# The test's own probe, independent of the page's script: once the page has loaded, every image gets its
# decoded width and every table its laid-out size and the number of cells the browser built.
_PROBE = """<script>window.addEventListener("load", function () {
  for (var img of document.images) img.setAttribute("data-probe-width", img.complete ? img.naturalWidth : 0);
  for (var t of document.querySelectorAll("table")) {
    var box = t.getBoundingClientRect();
    t.setAttribute("data-probe-box", Math.round(box.width) + "x" + Math.round(box.height));
    t.setAttribute("data-probe-cells", t.querySelectorAll("td, th").length);
  }
  document.body.setAttribute("data-probe", "done");
});</script>"""


class _Elements(HTMLParser):
    """The ``<img>`` and ``<table>`` elements of a page, with their attributes and (tables) their cell count."""

    def __init__(self, html_text: str) -> None:
        super().__init__()
        self.images: list[dict] = []
        self.tables: list[dict] = []
        self.body: dict = {}
        self._open: list[dict] = []
        self.feed(html_text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "img":
            self.images.append(dict(attrs))
        elif tag == "table":
            self.tables.append({**dict(attrs), "cells": 0})
            self._open.append(self.tables[-1])
        elif tag in ("td", "th") and self._open:
            self._open[-1]["cells"] += 1
        elif tag == "body":
            self.body = dict(attrs)

    def handle_endtag(self, tag: str) -> None:
        if tag == "table" and self._open:
            self._open.pop()


def _render(page: Path, tmp_path: Path) -> tuple[_Elements, _Elements]:
    """The page as written (parsed here) and as Chromium rendered it, with the probe's measurements."""
    source = page.read_text(encoding="utf-8")
    probed = tmp_path / f"probed-{page.name}"
    probed.write_text(source.replace("</body>", _PROBE + "</body>", 1), encoding="utf-8")
    rendered = _Elements(_dump_dom(probed, tmp_path))
    assert rendered.body.get("data-probe") == "done", "the page's load event never fired"
    return _Elements(source), rendered


def _broken_images_and_empty_tables(source: _Elements, rendered: _Elements) -> tuple[list[str], list[str]]:
    assert len(rendered.images) == len(source.images) and len(rendered.tables) == len(source.tables)
    broken = [img.get("alt", "?") for img in rendered.images if int(img["data-probe-width"]) <= 0]
    empty = [f"table {i}" for i, (ours, theirs) in enumerate(zip(source.tables, rendered.tables))
             if theirs["data-probe-cells"] != str(ours["cells"])
             or min(int(v) for v in theirs["data-probe-box"].split("x")) <= 0]
    return broken, empty


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary (Debian: apt-get install -y chromium)")
def test_html_report_renders_every_image_and_table_in_headless_chromium(trained, tmp_path: Path) -> None:
    """report.html opened in a real browser: every embedded plot decodes (naturalWidth > 0) and every table is
    laid out with all the cells written; the page's own load marks agree. Negative controls: a corrupt PNG and a
    hidden table are caught."""
    model, history, x = trained
    rep = linearize.report(model, x, history=history, max_samples=64, segments=4, progress=False)
    page = rep.save(tmp_path / "report")["report.html"]
    source, rendered = _render(page, tmp_path)
    assert len(source.images) == 4 and len(source.tables) >= 3
    assert _broken_images_and_empty_tables(source, rendered) == ([], [])
    assert [img["data-loaded"] for img in rendered.images] == ["yes"] * 4
    assert rendered.body["data-images"] == "loaded"

    broken = tmp_path / "broken.html"
    text = page.read_text(encoding="utf-8").replace("base64,iVBOR", "base64,AAAA", 1)
    broken.write_text(text.replace("<table>", '<table style="display:none">', 1), encoding="utf-8")
    source, rendered = _render(broken, tmp_path)
    images, tables = _broken_images_and_empty_tables(source, rendered)
    assert len(images) == 1 and tables == ["table 0"]
    assert [img["data-loaded"] for img in rendered.images].count("no") == 1 and rendered.body["data-images"] == "broken"


def test_linearize_cli_has_report_subcommand(capsys) -> None:
    """``linearize report`` is wired into the package's command line (once cli.py exists)."""
    cli = pytest.importorskip("linearize.cli")
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["report", "--help"])
    assert exit_info.value.code == 0 and "--output-dir" in capsys.readouterr().out
