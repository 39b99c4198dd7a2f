"""Structured pressure (for the speed study, ``recipes/reproduce/speed.py``):
``Sparsifier(granularity="site")`` moves the channels of a call site together (group lasso) and a target
makes whole sites linear, the only linearity fold can turn into fewer layers of a convolutional network.
Truths: the closed form of the group proximal step, and the site layout of the model."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import linearize
from linearize import schedules as S


def _mlp(widths=(6, 10, 16)) -> nn.Module:
    torch.manual_seed(0)
    layers, cin = [], 4
    for w in widths:
        layers += [nn.Linear(cin, w), nn.GELU()]
        cin = w
    return linearize.convert(nn.Sequential(*layers, nn.Linear(cin, 3)), example_inputs=torch.randn(2, 4))


def test_site_push_is_the_group_proximal_step_and_a_site_turns_linear_at_once():
    model = _mlp()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.rand(u.num_channels, generator=gen) * 0.9)
    start = {n: (1 - u.slope.detach().double()).clone() for n, u in linearize.units(model)}
    rate = 0.05
    sp = linearize.Sparsifier(model, S.constant(), total_steps=100, rate=rate, granularity="site")
    for step in range(1, 40):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no optimizer here: the slopes only move by the push
            sp.step()
        for name, u in linearize.units(model):
            gap0 = start[name]
            n = gap0.numel()
            norm = max(0.0, gap0.norm().item() - step * rate * math.sqrt(n))  # the closed form
            expected = gap0 * (norm / gap0.norm().item())
            gap = 1 - u.slope.detach().double()
            torch.testing.assert_close(gap, expected, atol=1e-6, rtol=0)
            linear = u.slope == 1
            assert bool(linear.all()) or not bool(linear.any())  # all channels at once, never some


def test_site_target_makes_whole_sites_linear_within_one_site_of_the_target():
    model = _mlp()
    x, y = torch.randn(256, 4), torch.randint(0, 3, (256,))
    opt = torch.optim.SGD(linearize.param_groups(model, weight_decay=0.0), lr=0.05)
    sp = linearize.Sparsifier(model, S.target(0.5, start=0, end=40), total_steps=50, granularity="site").attach(opt)
    for _ in range(50):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    widths = {n: u.num_channels for n, u in linearize.units(model)}
    linear_sites = {n for n, u in linearize.units(model) if bool((u.slope == 1).all())}
    for n, u in linearize.units(model):  # every site all linear or with no linear channel
        assert n in linear_sites or not bool((u.slope == 1).any())
    total = sum(widths.values())
    nonlinear = 1 - sum(widths[n] for n in linear_sites) / total
    assert nonlinear == linearize.nonlinear_fraction(model) <= 0.5
    assert nonlinear > 0.5 - max(widths.values()) / total  # rounded up by at most one site
    assert sp.state_dict()["granularity"] == "site"


def test_site_penalty_is_the_group_lasso():
    model = _mlp()
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.uniform_(0, 1)
    sp = linearize.Sparsifier(model, S.constant(), total_steps=10, rate=0.1, granularity="site", mode="loss")
    truth = sum(0.1 * math.sqrt(u.num_channels) * (1 - u.slope.detach().double()).norm().item()
                for _, u in linearize.units(model))
    assert sp.penalty().item() == pytest.approx(truth, rel=1e-6)


def test_granularity_is_checked_and_must_match_on_resume():
    model = _mlp()
    with pytest.raises(ValueError, match="granularity must be one of"):
        linearize.Sparsifier(model, S.target(0.5), total_steps=10, granularity="layer")
    state = linearize.Sparsifier(model, S.target(0.5), total_steps=10, granularity="site").state_dict()
    with pytest.raises(ValueError, match="granularity"):
        linearize.Sparsifier(model, S.target(0.5), total_steps=10).load_state_dict(state)


def test_group_penalty_gradient_is_finite_at_a_linear_site():
    """Truth: ``||1 - a||_2`` has a subgradient of 0 where the gap is 0 (torch.linalg.norm backward gives
    0 there, as the penalty's earlier ``gap.norm()`` did). With ``granularity="site"`` and
    ``mode="loss"``, a site whose slopes all reached 1 must not give NaN slope gradients. Observed: all
    NaN; in the documented loop (``target(0.5, end=10)``, ``mode="loss"``, ``granularity="site"``, SGD,
    loss + penalty) the first site the projection snaps to 1 turns NaN and step 1 raises
    ``NonFiniteSlopeError: ... Training diverged``."""
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
    sp = linearize.Sparsifier(model, S.constant(0.1), total_steps=10, mode="loss", granularity="site")
    first, second = (u for _, u in linearize.units(model))
    with torch.no_grad():
        first.slope.fill_(1.0)  # this site is exactly linear (its channels are free, not frozen)
    sp.penalty().backward()
    assert torch.isfinite(second.slope.grad).all()
    assert torch.isfinite(first.slope.grad).all()  # observed: all NaN
