"""Channels a target keeps nonlinear: their mean slope in the history, and the warning when the push left them
mostly linear (nonlinear in name only). The truth is read from the slopes themselves, in the loop."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

import linearize
from linearize import schedules as S

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 80


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    return torch.tensor(d.data[:1280], dtype=torch.float32) / 16.0, torch.tensor(d.target[:1280])


def kept_mean(model: nn.Module) -> float | None:
    """Brute force: the mean over every channel with slope < 1 of its slope."""
    slopes = [float(a) for _, u in linearize.units(model) for a in u.slope.detach().flatten()]
    kept = [a for a in slopes if a < 1.0]
    return math.fsum(kept) / len(kept) if kept else None


def run(digits, select: str, end: int, lr: float):
    """Train a converted MLP with a 25% target reached at ``end``; return the slopes' mean at the end step as
    the loop saw it, the Sparsifier and the warnings."""
    x, y = digits
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                            nn.Linear(64, 10)))
    opt = torch.optim.SGD(linearize.param_groups(model), lr=lr, momentum=0.9)
    sp = linearize.Sparsifier(model, S.target(0.25, start=0, end=end), STEPS, select=select,
                              log_every=1).attach(opt)
    at_end = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            b = torch.arange(step * 16, step * 16 + 16) % len(x)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()  # the Sparsifier steps here (attach)
            if step == end:
                at_end = kept_mean(model)
    said = [str(w.message) for w in caught if "channels kept nonlinear sit at mean slope" in str(w.message)]
    return model, sp, at_end, said


def test_a_push_that_outruns_the_loss_warns_with_the_measured_mean(digits):
    model, sp, at_end, said = run(digits, "slope", end=20, lr=0.05)
    assert at_end is not None and at_end > 0.5  # the truth: the kept channels are mostly linear
    assert len(said) == 1 and f"mean slope {at_end:.2f}" in said[0] and "select='fit'" in said[0]
    recorded = next(h for h in sp.history if h["step"] == 21)["nonlinear_mean_slope"]  # logged after step 20
    assert recorded == pytest.approx(at_end, abs=1e-6)
    assert sp.nonlinear_mean_slope() == pytest.approx(kept_mean(model), abs=1e-6)


def test_a_selection_without_push_keeps_the_channels_nonlinear_and_is_silent(digits):
    model, sp, at_end, said = run(digits, "fit", end=20, lr=0.05)
    assert at_end is not None and at_end < 0.5 and said == []
    assert linearize.nonlinear_fraction(model) == pytest.approx(0.25, abs=1 / 128)


def test_the_mean_is_none_when_every_channel_is_linear():
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
    sp = linearize.Sparsifier(model, S.target(0.5), total_steps=10)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.fill_(1.0)
    assert sp.nonlinear_mean_slope() is None
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.tensor([1.0, 0.2, 0.4, 1.0, 1.0, 1.0, 1.0, 1.0]))
    assert sp.nonlinear_mean_slope() == pytest.approx(0.3)
