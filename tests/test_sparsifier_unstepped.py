"""A Sparsifier that nothing steps warns once, at the user's optimizer.step(); one that is used says nothing, and
the watch never breaks an optimizer step, whatever other Sparsifiers and hooks the process holds."""

from __future__ import annotations

import copy
import gc
import pickle
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer_module

import linearize
from linearize import LinearizableActivation
from linearize import schedules as S

NEVER = "was not stepped since it was built or loaded"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), LinearizableActivation("relu", 16, -1), nn.Linear(16, 3))


def sparsifier(model: nn.Module) -> linearize.Sparsifier:
    return linearize.Sparsifier(model, S.target(0.5, start=0, end=1.0), total_steps=10)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(linearize.param_groups(model), lr=0.1)


def loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int, after=None) -> list[warnings.WarningMessage]:
    """``steps`` plain training steps; every warning raised on the way."""
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if after is not None:
                after()
    return list(caught)


def never(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if NEVER in str(w.message)]


def global_post_hooks() -> int:
    return len(torch_optimizer_module._global_optimizer_post_hooks)


def test_a_sparsifier_nobody_steps_warns_once_at_the_users_step_naming_the_fix():
    model = mlp()
    sp = sparsifier(model)
    caught = never(loop(model, sgd(model), 6))
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "sparsifier.step()" in message and "attach(optimizer)" in message and "SGD" in message
    assert caught[0].filename == __file__  # the user's optimizer.step(), not torch's hook loop
    slopes = torch.cat([u.slope.detach().flatten() for _, u in linearize.units(model)])
    assert slopes.max() < 0.1 and sp.step_count == 0  # what the warning reports: no pressure applied


@pytest.mark.parametrize("use", ["step", "attach"])
def test_a_sparsifier_in_use_says_nothing(use):
    model = mlp()
    opt = torch.optim.AdamW(linearize.param_groups(model), lr=1e-3)
    sp = sparsifier(model)
    if use == "attach":
        sp.attach(opt)
    assert not never(loop(model, opt, 10, after=sp.step if use == "step" else None))
    assert sp.step_count == 10
    sp.detach()


def test_an_optimizer_without_the_slopes_does_not_count():
    model, other = mlp(), nn.Linear(8, 3)
    sp = sparsifier(model)
    assert not never(loop(other, torch.optim.SGD(other.parameters(), lr=0.1), 5))
    assert never(loop(model, sgd(model), 3))  # the slopes' own optimizer still counts
    del sp


def test_other_sparsifiers_and_later_hooks_never_break_an_optimizer_step():
    """Sparsifiers built and dropped, a throwaway one, one never used, and a hook registered after them all:
    every step runs every hook, the used Sparsifier is silent, and the process holds one watch hook at most."""
    before = global_post_hooks()
    model = mlp()
    for _ in range(50):
        sparsifier(model)  # dropped at once
    sparsifier(model).nonlinear_mean_slope()  # a throwaway query
    later = []
    handle = torch_optimizer_module.register_optimizer_step_post_hook(lambda *a: later.append(1))
    try:
        sp = sparsifier(model)
        opt = sgd(model)
        assert not never(loop(model, opt, 5, after=sp.step))
        assert len(later) == 5 and sp.step_count == 5
    finally:
        handle.remove()
    assert global_post_hooks() <= before + 1


def test_an_earlier_sparsifier_of_the_model_still_alive_is_silent_once_a_new_one_drives_the_slopes():
    model = mlp()
    stale = sparsifier(model)  # e.g. a notebook cell run twice: the first result is still referenced
    sp = sparsifier(model)
    assert not never(loop(model, sgd(model), 5, after=sp.step))
    assert stale.step_count == 0


def test_a_resumed_sparsifier_that_is_not_attached_again_warns():
    model = mlp()
    opt = sgd(model)
    first = sparsifier(model).attach(opt)
    loop(model, opt, 3)
    state = first.state_dict()
    first.detach()
    resumed = sparsifier(model)
    resumed.load_state_dict(state)
    assert resumed.step_count == 3
    assert len(never(loop(model, opt, 3))) == 1
    again = sparsifier(model)
    again.load_state_dict(state)
    again.attach(opt)
    assert not never(loop(model, opt, 3)) and again.step_count == 6


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_model_and_sparsifier_that_nothing_steps_warns(how):
    model = mlp()
    sp = sparsifier(model)
    sp.step()  # the original was used
    twin_model, twin = copy.deepcopy((model, sp)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, sp)))
    assert len(never(loop(twin_model, sgd(twin_model), 3))) == 1
    assert twin.step_count == 1


def test_a_discarded_sparsifier_is_not_kept_alive_by_its_watch():
    model = mlp()
    alive = weakref.ref(sparsifier(model))
    gc.collect()
    assert alive() is None
    assert not never(loop(model, sgd(model), 3))


def test_the_warning_raised_as_an_error_stops_one_step_and_then_never_again():
    model = mlp()
    opt = sgd(model)
    sp = sparsifier(model)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    raised = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            try:
                opt.step()
            except UserWarning as e:
                assert NEVER in str(e)
                raised += 1
    assert raised == 1
    del sp
