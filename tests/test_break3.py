"""Third break-it round: defects a hostile review found in the cost targets, the distillation option,
HF config reading, schedule checks and the issue-19 plots (each test failed on the code it was written
against)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import linearize

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, dtype=torch.float32) -> None:
    for i in range(steps):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i)).to(dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_cost_target_plan_survives_moving_the_model_after_construction():
    # recipes/cifar.py builds the Sparsifier (example_inputs: a CPU image) and then lets
    # accelerator.prepare move the model to the GPU; the plan is made at the target's start, by
    # folding a deepcopy of the moved model with the CPU inputs. On a CPU-only machine the same
    # path is taken by a dtype move (.double()), which is what this test does.
    model = _mlp()
    x = torch.randn(1, 8)
    linearize.convert(model, example_inputs=x)
    opt = torch.optim.SGD(linearize.param_groups(model), lr=0.01)
    sp = linearize.Sparsifier(model, linearize.schedules.target(flops=0.3, start=2, end=6), total_steps=8,
                              granularity="site", example_inputs=x).attach(opt)
    model.double()  # as accelerator.prepare's model.to(device)
    _train(model, opt, 8, torch.float64)
    assert sp.cost_plan is not None and sp.cost_plan[-1]["cost"] <= 0.3


@pytest.mark.parametrize("content", ['"linearize"', '["linearize"]', '"a linearized model"'])
def test_hf_config_json_of_the_wrong_type_is_refused_by_name(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises((linearize.LoadError, FileNotFoundError)) as err:
        linearize.from_pretrained(model, tmp_path)
    assert "config.json" in str(err.value) or "linearize_config.json" in str(err.value)


def test_target_schedule_after_the_end_of_training_is_refused():
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    with pytest.raises(ValueError):
        linearize.Sparsifier(model, linearize.schedules.target(0.25, start=100, end=200), total_steps=50)


def test_target_power_nan_is_refused_at_construction():
    with pytest.raises(ValueError, match="power"):
        linearize.schedules.target(0.25, power=float("nan"))


@pytest.mark.parametrize("temperature", [float("inf"), 1e30])
def test_distill_loss_never_returns_nan_for_an_accepted_temperature(temperature):
    s, t = torch.randn(4, 5), torch.randn(4, 5)
    try:
        loss = linearize.distill_loss(s, t, "logits", temperature=temperature)
    except ValueError:
        return  # refusing the temperature is a fix too
    assert torch.isfinite(loss)


def test_wmt14_cost_target_error_names_the_real_fix(tmp_path, capsys):
    import wmt14

    with pytest.raises((SystemExit, ValueError)) as err:
        wmt14.parse_args(["--output_dir", str(tmp_path), "--target-flops", "0.5"])
    message = str(err.value) + capsys.readouterr().err.strip().splitlines()[-1]  # the error, not the usage
    assert "granularity" not in message and "--target" in message


@pytest.mark.parametrize("extra", [["--schedule", "none"], ["--linearize", "none"]])
def test_cifar_cost_target_without_pressure_is_refused(tmp_path, extra):
    import cifar

    with pytest.raises((SystemExit, ValueError)):
        cifar.parse_args(["--output_dir", str(tmp_path), "--target-flops", "0.5", "--granularity", "site"] + extra)


def test_apl_plot_keeps_variant_runs_out_of_the_plain_late_series(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from reproduce import full as F
    from reproduce import measure as R

    axes = {}

    def plot(path, draw):
        fig, ax = plt.subplots()
        draw(ax)
        axes[Path(path).name] = (fig, ax)

    monkeypatch.setattr(R, "plot", plot)
    run = {"task": "c10", "schedule": "late", "target": 0.1, "apl": {"normalized": 3.0}}
    runs = {"r20_late_10_s0": {**run, "variant": None, "seed": 0, "test_accuracy": 0.90},
            "r20_late_10_kd_s0": {**run, "variant": "kd", "seed": 0, "test_accuracy": 0.80,
                                  "apl": {"normalized": 2.0}}}
    F._plots(tmp_path, {}, runs)
    fig, ax = axes["path_length_vs_accuracy.png"]
    try:
        late = [line for line in ax.get_lines() if line.get_label() == "10 classes, late"]
        assert len(late) == 1 and len(late[0].get_xdata()) == 1  # the kd run is not a plain late run
    finally:
        plt.close(fig)
