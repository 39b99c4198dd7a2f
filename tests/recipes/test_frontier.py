"""``recipes/reproduce/frontier.py``: which committed runs it puts on the frontier, and their nonlinear ReLUs
per image against a brute-force count (every unit's input map, position by position, over its channels whose
slope is below 1), on two committed airbench94 models."""

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

from reproduce import frontier  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name, groups", [
    ("ab94_late_10_s0", ("ab94", "late", "10", None, "0")),
    ("ab94_late_r12900_elem_s1", ("ab94", "late", "r12900", "elem", "1")),
    ("r20_base_s0", ("r20", "base", None, None, "0")),
    ("ab94_late_10_fit_s0", ("ab94", "late", "10", "fit", "0")),
    ("ab94_late_r12900_elemfit_long_s0", ("ab94", "late", "r12900", "elemfit_long", "0")),
])
def test_run_names_parse_into_network_schedule_target_variant_seed(name, groups):
    assert frontier.RUN.match(name).groups() == groups


def brute_force_nonlinear_relus(model: torch.nn.Module, image: torch.Tensor) -> dict[str, int]:
    """Per unit: the positions of its input map times its channels with slope < 1 (element units: the
    positions whose own slope is < 1)."""
    counts, handles = {}, []
    for name, unit in linearize.units(model):
        def hook(m, args, out, unit=unit, name=name):
            x = args[0][0]  # one image: [C, H, W]
            slope = unit.slope.detach()
            if unit.granularity == "element":
                counts[name] = int((slope < 1).sum())
            else:
                counts[name] = int((slope < 1).sum()) * x[0].numel()
        handles.append(unit.register_forward_hook(hook))
    with torch.no_grad():
        model(image)
    for h in handles:
        h.remove()
    return counts


def test_frontier_rows_count_nonlinear_relus_as_brute_force_and_skip_other_studies(tmp_path):
    import cifar

    for run in ("ab94_base_s0", "ab94_late_2_s0"):
        (tmp_path / run).symlink_to(RESULTS / run)
    (tmp_path / "ab94_late_2_distill_s0").symlink_to(RESULTS / "ab94_late_2_s0")  # another study: left out
    frontier.main(["--results-dir", str(tmp_path)])
    rows = {r["run"]: r for r in json.loads((tmp_path / "frontier" / "frontier.json").read_text())["runs"]}
    assert set(rows) == {"ab94_base_s0", "ab94_late_2_s0"}
    base, late = rows["ab94_base_s0"], rows["ab94_late_2_s0"]
    assert base["relus_total"] == base["relus_nonlinear"] == late["relus_total"] == 81_560  # airbench94's GELUs
    model = cifar.load_model(RESULTS / "ab94_late_2_s0" / "model")
    per_unit = brute_force_nonlinear_relus(model, torch.zeros(1, 3, 32, 32))
    assert late["relus_nonlinear"] == sum(per_unit.values())
    assert {n: k for n, (k, _) in late["sites"].items()} == per_unit  # the core-network table's counts
    metrics = json.loads((RESULTS / "ab94_late_2_s0" / "metrics.json").read_text())
    assert late["accuracy"] == pytest.approx(100 * metrics["test_accuracy"]) and late["target"] == 0.02
    md = (tmp_path / "frontier" / "frontier.md").read_text()
    # the mean slope of the channels left nonlinear, from the saved tensors themselves (not the loader)
    from safetensors.torch import load_file

    saved = load_file(next((RESULTS / "ab94_late_2_s0" / "model").glob("linearize_units-*.safetensors")))
    slopes = torch.cat([t.flatten().double() for k, t in saved.items() if k.endswith("slope")])
    assert late["kept_slope"] == pytest.approx(float(slopes[slopes < 1].mean()), rel=1e-6)
    assert base["kept_slope"] == 0.0  # a plain model: every unit a full GELU
    assert (f"| [ab94_late_2_s0](../ab94_late_2_s0/metrics.json) | airbench94 | late | 2.0% | "
            f"{late['kept_slope']:.2f} | 9,984 of 81,560") in md
    core = md.split("Where the nonlinear elements of the airbench94 runs sit")[1]
    assert "| ab94_late_2_s0 | 6,727 (29%) |" in core and "ab94_base_s0" not in core  # the stem: 7 of 24 x 961
    assert (tmp_path / "frontier" / "frontier.png").stat().st_size > 10_000
    # max-pool comparisons, written out from the architecture: 2x2 pools (3 comparisons per output) to 64 x 15 x 15,
    # 256 x 7 x 7 and 256 x 3 x 3, then a 3x3 pool (8 per output) to 256 x 1 x 1
    assert late["max_pool_comparisons"] == 3 * (64 * 15 * 15 + 256 * 7 * 7 + 256 * 3 * 3) + 8 * 256 == 89_792
    assert "| 89,792 |" in md and late["device"] == "CPU"


def test_max_pool_comparisons_are_each_window_less_one_per_output_and_zero_without_pools():
    pools = torch.nn.Sequential(torch.nn.MaxPool2d(2), torch.nn.ReLU(), torch.nn.MaxPool2d((1, 3)))
    x = torch.randn(2, 3, 8, 9)  # first pool: 3 x 4 x 4 outputs of 4 inputs, second: 3 x 4 x 1 outputs of 3
    assert frontier.max_pool_comparisons(pools, x) == 3 * 4 * 4 * 3 + 3 * 4 * 1 * 2
    assert frontier.max_pool_comparisons(torch.nn.Sequential(torch.nn.AvgPool2d(2)), x) == 0
    assert not pools[0]._forward_hooks  # the counting hooks are gone
