"""A Sparsifier that nothing steps warns once, from the optimizer's own step; one that is used says nothing."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer_module

import linearize
from linearize import LinearizableActivation
from linearize import schedules as S

NEVER = "never stepped"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), LinearizableActivation("relu", 16, -1), nn.Linear(16, 3))


def loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int, after=None) -> list[str]:
    """``steps`` plain training steps; the messages of every warning raised on the way."""
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
    return [str(w.message) for w in caught]


def global_post_hooks() -> int:
    return len(torch_optimizer_module._global_optimizer_post_hooks)


def test_a_sparsifier_nobody_steps_warns_once_naming_the_fix():
    model = mlp()
    opt = torch.optim.SGD(linearize.param_groups(model), lr=0.1)
    sp = linearize.Sparsifier(model, S.target(0.5, start=0, end=1.0), total_steps=10)
    said = loop(model, opt, 6)
    never = [m for m in said if NEVER in m]
    assert len(never) == 1, said
    assert "sparsifier.step()" in never[0] and "attach(optimizer)" in never[0] and "SGD" in never[0]
    slopes = torch.cat([u.slope.detach().flatten() for _, u in linearize.units(model)])
    assert slopes.max() < 0.1  # what the warning reports: no pressure applied (the loss gradient alone moved them)
    assert sp.step_count == 0


@pytest.mark.parametrize("use", ["step", "attach"])
def test_a_sparsifier_in_use_says_nothing_and_its_watch_is_gone(use):
    before = global_post_hooks()
    model = mlp()
    opt = torch.optim.AdamW(linearize.param_groups(model), lr=1e-3)
    sp = linearize.Sparsifier(model, S.target(0.5, start=0, end=1.0), total_steps=10)
    if use == "attach":
        sp.attach(opt)
    said = loop(model, opt, 10, after=sp.step if use == "step" else None)
    assert not [m for m in said if NEVER in m], said
    assert sp.step_count == 10
    sp.detach()
    assert global_post_hooks() == before


def test_an_optimizer_without_the_slopes_does_not_count():
    model, other = mlp(), nn.Linear(8, 3)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    sp = linearize.Sparsifier(model, S.target(0.5, start=0, end=1.0), total_steps=10)
    assert not [m for m in loop(other, opt, 5) if NEVER in m]
    # the slopes' own optimizer still counts
    said = loop(model, torch.optim.SGD(linearize.param_groups(model), lr=0.1), 3)
    assert [m for m in said if NEVER in m]
    del sp


def test_a_discarded_sparsifier_leaves_no_hook_behind_and_holds_nothing_alive():
    before = global_post_hooks()
    model = mlp()
    sp = linearize.Sparsifier(model, S.target(0.5, start=0, end=1.0), total_steps=10)
    assert global_post_hooks() == before + 1
    alive = __import__("weakref").ref(sp)
    del sp
    gc.collect()
    assert alive() is None  # the hook references no Sparsifier
    opt = torch.optim.SGD(linearize.param_groups(model), lr=0.1)
    assert not [m for m in loop(model, opt, 3) if NEVER in m]
    assert global_post_hooks() == before  # removed itself at the next optimizer step


def test_the_warning_raised_as_an_error_stops_the_step_once_and_then_never_again():
    model = mlp()
    opt = torch.optim.SGD(linearize.param_groups(model), lr=0.1)
    sp = linearize.Sparsifier(model, S.target(0.5, start=0, end=1.0), total_steps=10)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raised = 0
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
