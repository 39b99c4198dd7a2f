"""Every model committed under ``recipes/results/<run>/model`` loads with ``cifar.load_model`` and computes
what its run recorded in ``metrics.json`` (the independent truth, written when the run finished): the same
unit counts, finite logits of one per class, a folded model that agrees with it, and, when the CIFAR-10
data of the runs is at hand, the same average path length on the run's first 64 test images."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import linearize

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "recipes" / "results"
sys.path.insert(0, str(REPO / "recipes"))

import cifar  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
RUNS = sorted(p.parent.name for p in RESULTS.glob("*/model") if (p / "recipe.json").is_file())


def test_the_results_hold_models_of_both_sweeps():
    assert {"r20_base_s0", "r20_late_10_s0", "mnv2_x0_5_base_s0", "mnv2_x0_5_lat_70_s0"} <= set(RUNS)


@pytest.mark.parametrize("run", RUNS)
def test_a_committed_model_loads_and_computes_what_its_run_recorded(run):
    metrics = json.loads((RESULTS / run / "metrics.json").read_text())
    meta = json.loads((RESULTS / run / "model" / "recipe.json").read_text())
    model = cifar.load_model(RESULTS / run / "model")
    assert not model.training
    assert meta["arch"] == metrics["arch"] and meta["linearize"] == metrics["args"]["linearize"]
    x = torch.randn(4, 3, meta["image_size"], meta["image_size"])
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (4, meta["num_classes"]) and torch.isfinite(logits).all()
    if meta["linearize"] == "none":
        assert not linearize.units(model) and "nonlinear_fraction" not in metrics
        return
    counts = linearize.count_units(model, metrics["args"]["tol"])
    assert (counts["total"], counts["nonlinear"]) == (metrics["units_total"], metrics["units_nonlinear"])
    folded = linearize.fold(model, x)  # verifies itself against the model on x (raises beyond its tolerance)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), logits, rtol=1e-3, atol=1e-3 * float(logits.abs().max()))


@pytest.mark.skipif(not Path(json.loads((RESULTS / "r20_late_10_s0" / "metrics.json").read_text())["args"]["data_dir"])
                    .exists(), reason="the CIFAR-10 data of the committed runs is not on this machine")
@pytest.mark.parametrize("run", [r for r in RUNS if "average_path_length" in json.loads(
    (RESULTS / r / "metrics.json").read_text())])
def test_a_committed_model_has_the_recorded_path_length_on_its_test_images(run):
    from reproduce.measure import cifar_inputs

    metrics = json.loads((RESULTS / run / "metrics.json").read_text())
    x = cifar_inputs(RESULTS / run, None, 64)[0]
    got = float(linearize.measures.average_path_length(cifar.load_model(RESULTS / run / "model"), x, normalized=True))
    assert got == pytest.approx(metrics["average_path_length"], rel=1e-6)
