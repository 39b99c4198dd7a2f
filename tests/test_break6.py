"""Break tests for issue 20's cost-target change (fd736c6): budget against the original model, sites
outside the plan glide to slope 0, planning folds not stopped by a verification they do not need.
Each test was written failing against fd736c6 (a helper session, "break it"); the fixes followed."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import linearize
from linearize import schedules as S
from linearize.folding import count_flops
from linearize.unit import ChannelPReLU


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mlp() -> nn.Module:
    """The same four-site MLP as tests/test_cost.py (sites "1", "3", "5", "7")."""
    torch.manual_seed(0)
    widths = [16, 64, 8, 64, 64, 4]
    layers = []
    for i in range(len(widths) - 1):
        layers += [nn.Linear(widths[i], widths[i + 1]), nn.ReLU()]
    return linearize.convert(nn.Sequential(*layers[:-1]).eval())


def _quiet_steps(sp, n: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(n):
            sp.step()


def test_plan_ends_at_its_shortest_prefix_within_the_budget(monkeypatch):
    """Measured costs that are not monotone in the set of linear groups (latency timing noise, fold merges
    that need two sites) once gave the pruned plan ``[3, 5, 7]`` (sites) whose prefix ``[3, 5]`` already met
    the budget; the path holds the shortest prefix within it, and site "7" was held at ``1 - release``
    forever (a PReLU no plan measured) while ``cost_plan[-1]`` listed it as linear. Now the plan ends at
    that prefix: at the end every site is linear or at its original activation, as the plan counted."""
    table = {frozenset({1, 2}): 0.3, frozenset({1, 2, 3}): 0.3}  # else 0.2 saved per linear group

    def fake_cost(self, linear):
        return 1.0 if linear is None else table.get(linear, 1.0 - 0.2 * len(linear))

    monkeypatch.setattr(linearize.Sparsifier, "_folded_cost", fake_cost)
    model, x = _mlp(), torch.randn(4, 16)
    with torch.no_grad():  # importance (slope gap): site "1" < "3" < "5" < "7"
        for (_, u), s in zip(linearize.units(model), [0.9, 0.0, 0.8, 0.7]):
            u.slope.fill_(s)
    sp = linearize.Sparsifier(model, S.target(flops=0.3, end=10), total_steps=12, granularity="site",
                              example_inputs=x)
    _quiet_steps(sp, 12)
    planned = set(sp.cost_plan[-1]["sites"])
    assert planned == {"3", "5"} and sp.cost_plan[-1]["cost"] <= 0.3
    assert all(p["cost"] > 0.3 for p in sp.cost_plan[:-1])  # no shorter prefix meets it
    slopes = {n: u.slope.detach() for n, u in linearize.units(model)}
    for name, s in slopes.items():
        assert bool((s == 1).all()) or bool((s == 0).all()), (name, s.unique().tolist())
    assert {n for n, s in slopes.items() if bool((s == 1).all())} == planned


def _bias_dominated() -> tuple[nn.Module, torch.Tensor]:
    """Linear-BN-ReLU-Linear-BN whose output is dominated by the last BatchNorm's bias (50): its
    sample-to-sample spread is about 1% of its scale. Every layer is merged with a BatchNorm when folded."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2), nn.BatchNorm1d(2)).eval()
    with torch.no_grad():
        net[4].bias.fill_(50.0)
    return linearize.convert(net), torch.randn(8, 4)


@pytest.mark.parametrize("cost", ["flops", "latency"])
def test_planning_is_not_stopped_by_a_verification_it_does_not_need(cost):
    """A model whose outputs vary by about 1% of their scale across the example batch (a bias-dominated
    head) folds and verifies at fold's default; planning at a looser rtol once called that output "the
    same for every sample" (fold's rtol is also its vacuity threshold) and raised FoldVerificationError.
    Planning folds copies at slopes 0 / 1 only to measure their structure: they are not verified
    (``fold(verify=False)``), and the summary says so instead of reporting an error of 0."""
    model, x = _bias_dominated()
    linearize.fold(copy.deepcopy(model), x, latency=False)  # the model folds and verifies at the default
    sp = linearize.Sparsifier(model, S.target(**{cost: 1.0}), total_steps=10, granularity="site",
                              example_inputs=x)
    assert sp.state_dict()["cost_reference"] > 0
    summary = linearize.fold(copy.deepcopy(model), x, latency=False, verify=False).linearize_fold_summary
    assert math.isnan(summary.max_abs_error) and "not verified" in summary.verify_dtype


def test_verify_false_returns_what_verification_refuses():
    """``tol`` snaps slopes 0.4 to the plain ReLU: an approximation fold's verification refuses; with
    ``verify=False`` the same folded structure comes back (the units replaced), unverified."""
    model, x = _mlp(), torch.randn(16, 16)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.fill_(0.4)
    with pytest.raises(linearize.FoldVerificationError):
        linearize.fold(model, x, tol=0.45, latency=False)
    folded = linearize.fold(model, x, tol=0.45, latency=False, verify=False)
    assert sum(isinstance(m, nn.ReLU) for m in folded.modules()) == 4 and not linearize.units(folded)


def test_target_class_docs_name_the_new_reference():
    """What: the docstring of ``linearize.schedules.Target`` (its ``flops`` / ``latency`` attributes).
    Expected: like ``target()``, the README and the error messages after this commit: the cost is a
    fraction of the *original* model folded (every slope 0).
    Observed: it still says "a fraction in (0, 1] of the same model folded with no site linear", the
    reference this commit replaced (it differs: partly linear sites fold to PReLUs, not the original)."""
    doc = " ".join(S.Target.__doc__.split())
    assert "folded with no site linear" not in doc


def test_site_outside_the_plan_with_a_frozen_linear_channel_stays_a_prelu_and_is_counted_so():
    """A channel frozen linear (``freeze(data=...)``: stably active) in a site the plan leaves out: its free
    channels glide to 0, the frozen one stays 1, so the site folds to a ChannelPReLU (as the docs say), and
    the plan's cost counts that form: the frozen, folded model costs exactly ``cost_plan[-1]["cost"]``."""
    model, x = _mlp(), torch.randn(4, 16)
    units = dict(linearize.units(model))
    with torch.no_grad():
        for u in units.values():
            u.slope.fill_(0.5)
        mask = torch.zeros(64, dtype=torch.bool)
        mask[0] = True
        units["1"].freeze_(mask, 1.0)
        units["1"].project_()
    sp = linearize.Sparsifier(model, S.target(flops=0.5, end=10), total_steps=12, granularity="site",
                              example_inputs=x)
    _quiet_steps(sp, 12)
    assert "1" not in sp.cost_plan[-1]["sites"]
    assert bool((units["1"].slope[1:] == 0).all()) and units["1"].slope[0] == 1
    linearize.freeze(model, tol=0.0)
    folded = linearize.fold(model, x, latency=False)
    assert sum(isinstance(m, ChannelPReLU) for m in folded.modules()) == 1
    assert count_flops(folded, x) / sp.state_dict()["cost_reference"] == sp.cost_plan[-1]["cost"]
