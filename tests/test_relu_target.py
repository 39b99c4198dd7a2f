"""``schedules.target(relus=N)``: at most N nonlinear ReLUs (activation elements) per sample, the count the
private-inference literature reports, checked against counts made without linearize's counter."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import linearize
from linearize import schedules
from linearize.measures import count_relus

STEPS, START, END = 40, 0.1, 0.7


def small_cnn() -> nn.Sequential:
    """Two activation sites of different map sizes: 8 channels of 8 x 8, then 12 channels of 4 x 4."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 12, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 3, (64,), generator=g)


def map_sizes(model: nn.Module, x: torch.Tensor) -> list[int]:
    """Elements per channel of each ReLU's output in the *unconverted* model, by forward hooks (the truth)."""
    sizes = []
    handles = [m.register_forward_hook(lambda m, a, out: sizes.append(out[0, 0].numel()))
               for m in model.modules() if isinstance(m, nn.ReLU)]
    with torch.no_grad():
        model(x[:1])
    for h in handles:
        h.remove()
    return sizes


def brute_force_relus(model: nn.Module, sizes: list[int]) -> int:
    """Nonlinear ReLUs per sample: elements per channel times the channels whose slope is below 1."""
    return sum(size * int((unit.slope.detach() < 1).sum()) for size, (_, unit) in zip(sizes, linearize.units(model)))


def train(model: nn.Module, sparsifier: linearize.Sparsifier, optimizer: torch.optim.Optimizer, steps: range,
          after=None) -> None:
    x, y = data()
    for step in steps:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if after is not None:
            after(step)


def setup(relus: float, select: str = "slope", granularity: str = "channel", example_inputs=None):
    torch.manual_seed(0)
    model = linearize.convert(small_cnn())
    optimizer = torch.optim.SGD(linearize.param_groups(model), lr=0.05, momentum=0.9)
    inputs = data()[0][:2] if example_inputs is None else example_inputs
    sparsifier = linearize.Sparsifier(model, schedules.target(relus=relus, start=START, end=END), STEPS,
                                      select=select, granularity=granularity, example_inputs=inputs,
                                      log_every=1).attach(optimizer)
    return model, optimizer, sparsifier


@pytest.mark.parametrize("select, relus", [("slope", 300), ("slope", 333.5), ("saliency", 300), ("fit", 333.5)])
def test_a_relu_target_leaves_at_most_n_relus_within_one_channel_and_holds_them(select, relus):
    sizes = map_sizes(small_cnn(), data()[0])
    assert sizes == [64, 16]
    model, optimizer, sparsifier = setup(relus, select)
    counts = {}
    train(model, sparsifier, optimizer, range(STEPS),
          lambda step: counts.update({step: brute_force_relus(model, sizes)}))
    end = round(END * STEPS)
    held = {counts[s] for s in range(end, STEPS)}
    assert len(held) == 1, f"the count moved after the target's end: {counts}"
    nonlinear = held.pop()
    assert nonlinear <= relus and relus - nonlinear < max(sizes)  # within one channel's elements
    assert count_relus(model, data()[0][:1])["nonlinear"] == nonlinear
    assert sparsifier.history[-1]["nonlinear_relus"] == nonlinear
    assert counts[0] == 8 * 64 + 12 * 16  # nothing linear before the start


def test_whole_sites_reach_the_relu_target_within_one_site():
    sizes = map_sizes(small_cnn(), data()[0])
    model, optimizer, sparsifier = setup(200, granularity="site")
    train(model, sparsifier, optimizer, range(STEPS))
    nonlinear = brute_force_relus(model, sizes)
    assert nonlinear == 12 * 16  # 8 x 64 = 512 > 200: the first site goes linear whole, the second stays
    assert count_relus(model, data()[0][:1])["nonlinear"] == nonlinear


def test_a_sequence_model_counts_one_relu_per_token_and_channel():
    torch.manual_seed(0)
    x = torch.randn(16, 5, 8)
    model = linearize.convert(nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)), example_inputs=x[:2])
    optimizer = torch.optim.SGD(linearize.param_groups(model), lr=0.05)
    sparsifier = linearize.Sparsifier(model, schedules.target(relus=22, start=0.0, end=0.5), 20, example_inputs=x[:2])
    sparsifier.attach(optimizer)
    for _ in range(20):
        optimizer.zero_grad(), model(x).square().mean().backward(), optimizer.step()
    nonlinear_channels = int((linearize.units(model)[0][1].slope < 1).sum())
    assert nonlinear_channels == 4  # 5 tokens each: 20 <= 22 < 25
    assert count_relus(model, x[:1])["nonlinear"] == 5 * nonlinear_channels


@pytest.mark.parametrize("select", ["slope", "fit"])
def test_on_element_units_relus_n_is_the_fraction_n_over_total(select):
    def run(schedule):
        torch.manual_seed(0)
        x, y = data()
        model = linearize.convert(small_cnn(), example_inputs=x[:2], granularity="element")
        optimizer = torch.optim.SGD(linearize.param_groups(model), lr=0.05, momentum=0.9)
        linearize.Sparsifier(model, schedule, STEPS, select=select).attach(optimizer)  # no example_inputs needed
        for _ in range(STEPS):
            optimizer.zero_grad(), nn.functional.cross_entropy(model(x), y).backward(), optimizer.step()
        return model

    total = 8 * 64 + 12 * 16
    by_relus = run(schedules.target(relus=77, start=START, end=END))
    by_fraction = run(schedules.target(77 / total, start=START, end=END))
    for (_, a), (_, b) in zip(linearize.units(by_relus), linearize.units(by_fraction)):
        assert torch.equal(a.slope, b.slope)
    assert count_relus(by_relus, data()[0][:1]) == {**count_relus(by_fraction, data()[0][:1])}
    assert count_relus(by_relus, data()[0][:1])["nonlinear"] == 77
    assert sum(int((u.slope < 1).sum()) for _, u in linearize.units(by_relus)) == 77


@pytest.mark.parametrize("bad", [0, -5, math.nan, math.inf, -math.inf])
def test_a_relu_count_that_is_not_a_positive_finite_number_is_refused(bad):
    with pytest.raises(ValueError, match=r"relus .*positive finite"):
        schedules.target(relus=bad)


@pytest.mark.parametrize("bad", [True, "100", [100]])
def test_a_relu_count_that_is_not_a_number_is_refused(bad):
    with pytest.raises(TypeError, match="relus"):
        schedules.target(relus=bad)


def test_refusals_name_the_input_the_total_and_the_fix():
    with pytest.raises(ValueError, match="exactly one goal"):
        schedules.target(0.1, relus=100)
    with pytest.raises(ValueError, match="exactly one goal"):
        schedules.target(flops=0.5, relus=100)
    with pytest.raises(ValueError, match=r"relus=705\) is above this model's 704 ReLUs.*at most 704"):
        setup(705)
    setup(704)  # the whole model: allowed
    model = linearize.convert(small_cnn())
    with pytest.raises(ValueError, match=r"example_inputs"):
        linearize.Sparsifier(model, schedules.target(relus=100), STEPS)


def test_channels_frozen_nonlinear_that_keep_the_budget_out_of_reach_warn_with_the_floor():
    model, optimizer, sparsifier = setup(300)
    with torch.no_grad():
        linearize.units(model)[0][1].frozen.fill_(0.0)  # the first site (8 x 64 = 512 ReLUs) stays nonlinear
        linearize.units(model)[0][1].slope.fill_(0.0)
    with pytest.warns(UserWarning, match=r"relus=300 cannot be reached.*hold 512 of the 704"):
        train(model, sparsifier, optimizer, range(STEPS))
    assert brute_force_relus(model, [64, 16]) == 512  # the floor: every free channel went linear


def test_the_state_round_trips_and_resumes_as_the_uninterrupted_run():
    model, optimizer, sparsifier = setup(300)
    train(model, sparsifier, optimizer, range(STEPS))
    whole = [u.slope.detach().clone() for _, u in linearize.units(model)]

    model, optimizer, sparsifier = setup(300)
    train(model, sparsifier, optimizer, range(STEPS // 2))
    state = json.loads(json.dumps(sparsifier.state_dict()))  # JSON, as a checkpoint keeps it
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": optimizer.state_dict()}
    assert state["relu_positions"] == [64, 16] and state["schedule"]["relus"] == 300
    sparsifier.detach()

    resumed, optimizer2, sparsifier2 = setup(300)
    resumed.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["optimizer"])
    sparsifier2.load_state_dict(state)
    assert sparsifier2.state_dict() == state
    train(resumed, sparsifier2, optimizer2, range(STEPS // 2, STEPS))
    for a, (_, unit) in zip(whole, linearize.units(resumed)):
        assert torch.equal(a, unit.slope.detach())

    with pytest.raises(ValueError, match="example_inputs of the shape"):
        setup(300, example_inputs=torch.randn(2, 3, 16, 16))[2].load_state_dict(state)
    with pytest.raises(ValueError, match="schedule"):
        setup(299)[2].load_state_dict(state)


def test_schedules_without_relus_describe_themselves_as_before():
    assert "relus" not in schedules.target(0.1).to_dict()  # saved states and histories of older runs still match
    assert schedules.from_dict(schedules.target(relus=10).to_dict()).relus == 10


# ----------------------------------------------------------------------------- the CIFAR recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
CIFAR = Path(os.environ.get("LINEARIZE_CIFAR10", Path(__file__).resolve().parents[2] / "shared" / "data" /
                            "cifar10-jpeg.tar.gz"))


@pytest.mark.parametrize("bad, match", [(["--target-relus", "100", "--target", "0.2"], "give one target"),
                                        (["--target-relus", "100", "--target-flops", "0.5", "--granularity", "site"],
                                         "give one target"),
                                        (["--target-relus", "0"], "positive finite"),
                                        (["--target-relus", "nan"], "positive finite"),
                                        (["--target-relus", "100", "--schedule", "none"], "steers the sparsity"),
                                        (["--units", "element", "--linearize", "dgn", "--schedule", "none"],
                                         "makes blend units")])
def test_the_cifar_recipe_refuses_a_bad_relu_budget(bad, match, tmp_path, capsys):
    sys.path.insert(0, str(RECIPES))
    import cifar

    with pytest.raises(SystemExit):
        cifar.parse_args(["--output_dir", str(tmp_path)] + bad)
    assert match in capsys.readouterr().err
    assert cifar.parse_args(["--output_dir", str(tmp_path), "--target-relus", "5e4"]).target is None


@pytest.mark.skipif(not CIFAR.exists(), reason=f"real CIFAR-10 images not found at {CIFAR}")
@pytest.mark.parametrize("units", ["element"])  # (channel units: the Sparsifier's tests above, same plumbing)
def test_the_cifar_recipe_reaches_its_relu_budget_and_reports_relus_per_image(units, tmp_path):
    args = ["--data-dir", str(CIFAR), "--cache-dir", str(tmp_path / "cache"), "--subset", "256", "--eval-subset", "64",
            "--image-size", "16", "--arch", "resnet20", "--batch-size", "32", "--eval-batch-size", "64",
            "--epochs", "1", "--lr", "0.05", "--schedule", "early", "--target-relus", "20000", "--ramp-end", "0.75",
            "--units", units, "--freeze", "--output_dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(RECIPES / "cifar.py"), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["relus_total"] == 188_416 // 4  # ResNet-20's published count, on 16x16 images
    # a channel target leaves whole channels (the largest maps: 16 x 16 elements); an element target, elements
    assert 20_000 - (16 * 16 if units == "channel" else 1) < metrics["relus_nonlinear"] <= 20_000
    history = json.loads((tmp_path / "run" / "sparsifier_history.json").read_text())["history"]
    assert history[-1]["nonlinear_relus"] == metrics["relus_nonlinear"]
    sys.path.insert(0, str(RECIPES))
    import cifar

    model = cifar.load_model(tmp_path / "run" / "model")  # the saved units come back as they trained
    found = linearize.units(model)
    assert {u.granularity for _, u in found} == {units}
    assert count_relus(model, torch.zeros(1, 3, 16, 16))["nonlinear"] == metrics["relus_nonlinear"]
    if units == "element":  # one unit call per site: each nonlinear slope is one nonlinear ReLU per image
        assert sum(int((~u.linear_mask()).sum()) for _, u in found) == metrics["relus_nonlinear"]
