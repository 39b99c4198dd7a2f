"""A Sparsifier that nothing steps warns once, at the user's optimizer.step(); one that is used says nothing, and
the watch never breaks an optimizer step, whatever other Sparsifiers, hooks and threads the process holds."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer_module

import linearize
from linearize import LinearizableActivation
from linearize import schedules as S
from linearize.sparsity.watch import STEPS

NEVER = "since a Sparsifier over them last stepped"


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), LinearizableActivation("relu", 16, -1), nn.Linear(16, 3))


def sparsifier(model: nn.Module, cls=linearize.Sparsifier) -> linearize.Sparsifier:
    return cls(model, S.target(0.5, start=0, end=1.0), total_steps=10)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(linearize.param_groups(params) if isinstance(params, nn.Module) else params, lr=0.1)


def loop(model: nn.Module, opts, steps: int, after=None) -> list[warnings.WarningMessage]:
    """``steps`` training steps (every optimizer of ``opts`` steps, then ``after(i)``); every warning raised."""
    opts = opts if isinstance(opts, (list, tuple)) else [opts]
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            for opt in opts:
                opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            for opt in opts:
                opt.step()
            if after is not None:
                after(i)
    return list(caught)


def never(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if NEVER in str(w.message)]


def test_a_sparsifier_nobody_steps_warns_once_at_the_users_step_naming_the_fix():
    model = mlp()
    sp = sparsifier(model)
    assert not never(loop(model, sgd(model), STEPS - 1))
    caught = never(loop(model, sgd(model), 3 * STEPS))
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert f"SGD stepped the unit slopes {STEPS} times" in message
    assert "sparsifier.step() after each optimizer.step()" in message and "attach(optimizer)" in message
    assert caught[0].filename == __file__  # the user's optimizer.step(), not torch's hook loop
    assert max(float(s.max()) for s in sp.slopes()) < 0.1 and sp.step_count == 0  # indeed no pressure applied


@pytest.mark.parametrize("use", ["step", "attach", "every 3rd step"])
def test_a_sparsifier_in_use_says_nothing(use):
    model = mlp()
    opt = torch.optim.AdamW(linearize.param_groups(model), lr=1e-3)
    sp = sparsifier(model)
    if use == "attach":
        sp.attach(opt)
    after = {"step": lambda i: sp.step(), "attach": None, "every 3rd step": lambda i: i % 3 == 2 and sp.step()}[use]
    assert not never(loop(model, opt, 3 * STEPS, after=after))
    assert sp.step_count == (STEPS if use == "every 3rd step" else 3 * STEPS)


def test_slopes_split_over_two_optimizers_count_per_optimizer():
    model = mlp()
    first = linearize.units(model)[0][1].slope
    rest = [p for p in model.parameters() if p is not first]
    sp = sparsifier(model)
    opts = [sgd([first]), torch.optim.Adam(rest, lr=1e-3)]
    assert not never(loop(model, opts, 2 * STEPS, after=lambda i: sp.step()))
    caught = never(loop(model, opts, STEPS))
    assert len(caught) == 1 and "stepped the unit slopes 10 times" in str(caught[0].message)


def test_an_optimizer_without_the_slopes_or_with_frozen_slopes_does_not_count():
    model, other = mlp(), nn.Linear(8, 3)
    sp = sparsifier(model)
    assert not never(loop(other, torch.optim.SGD(other.parameters(), lr=0.1), 2 * STEPS))
    for s in sp.slopes():
        s.requires_grad_(False)  # a weights-only phase: the slopes do not move
    assert not never(loop(model, sgd(model), 2 * STEPS))
    for s in sp.slopes():
        s.requires_grad_(True)
    assert never(loop(model, sgd(model), STEPS))  # the slopes' own optimizer counts once they move


def test_other_sparsifiers_and_hooks_never_break_an_optimizer_step():
    """Sparsifiers built and dropped, a throwaway query, Sparsifiers built inside a global hook before another one,
    and a hook registered after them all: every step runs every hook, and the used Sparsifier is silent."""
    model = mlp()
    for _ in range(50):
        sparsifier(model)  # dropped at once
    sparsifier(model).nonlinear_mean_slope()  # a throwaway query (held by a reference cycle until collected)
    built, later = [], []
    first = torch_optimizer_module.register_optimizer_step_post_hook(lambda *a: built.append(sparsifier(mlp(1))))
    second = torch_optimizer_module.register_optimizer_step_post_hook(lambda *a: later.append(1))
    try:
        sp = sparsifier(model)
        assert not never(loop(model, sgd(model), 2 * STEPS, after=lambda i: sp.step()))
        assert len(later) == 2 * STEPS and sp.step_count == 2 * STEPS
    finally:
        first.remove()
        second.remove()


def test_a_throwaway_sparsifier_nobody_holds_does_not_warn_for_a_plain_fine_tune():
    model = mlp()
    gc.disable()  # keep it in its reference cycle: the watch must find out that it is garbage
    try:
        print(sparsifier(model).nonlinear_fraction())
        assert not never(loop(model, sgd(model), 2 * STEPS))
    finally:
        gc.enable()


def test_an_earlier_sparsifier_of_the_model_still_alive_is_silent_once_a_new_one_drives_the_slopes():
    model = mlp()
    stale = sparsifier(model)  # e.g. a notebook cell run twice: the first result is still referenced
    sp = sparsifier(model)
    assert not never(loop(model, sgd(model), 2 * STEPS, after=lambda i: sp.step()))
    assert stale.step_count == 0


def test_a_resumed_or_reoptimized_sparsifier_that_is_not_attached_again_warns():
    model = mlp()
    opt = sgd(model)
    first = sparsifier(model).attach(opt)
    loop(model, opt, 3)
    state = first.state_dict()
    first.detach()
    resumed = sparsifier(model)
    resumed.load_state_dict(state)
    assert resumed.step_count == 3
    assert len(never(loop(model, opt, STEPS))) == 1
    again = sparsifier(model)
    again.load_state_dict(state)
    again.attach(opt)
    assert not never(loop(model, opt, 2 * STEPS)) and again.step_count == 3 + 2 * STEPS
    # a second phase with a new optimizer, the Sparsifier still attached to the first one
    assert len(never(loop(model, sgd(model), STEPS))) == 1


def test_slopes_replaced_after_the_sparsifier_was_built_are_watched():
    model = mlp()
    sp = sparsifier(model)
    model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)  # new slope Parameters
    assert all(a is b for a, b in zip(sp.slopes(), [u.slope for _, u in linearize.units(model)]))
    assert len(never(loop(model, sgd(model), STEPS))) == 1


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_model_and_sparsifier_that_nothing_steps_warns(how):
    model = mlp()
    sp = sparsifier(model)
    sp.step()  # the original was used
    twin_model, twin = copy.deepcopy((model, sp)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, sp)))
    assert len(never(loop(twin_model, sgd(twin_model), STEPS))) == 1
    assert twin.step_count == 1


def test_subclasses_with_value_equality_are_watched_each_on_its_own():
    @dataclasses.dataclass(eq=True)
    class Unhashable(linearize.Sparsifier):  # eq without hash: instances cannot be dict keys
        def __init__(self, *a, **k):
            linearize.Sparsifier.__init__(self, *a, **k)

    class Equal(linearize.Sparsifier):
        def __eq__(self, other):
            return isinstance(other, Equal)

        def __hash__(self):
            return 0

    for cls in (Unhashable, Equal):
        a_model, b_model = mlp(), mlp(1)
        a, b = sparsifier(a_model, cls), sparsifier(b_model, cls)
        assert not never(loop(a_model, sgd(a_model), 2 * STEPS, after=lambda i: a.step()))
        assert len(never(loop(b_model, sgd(b_model), STEPS))) == 1, cls  # b's watch is b's alone
        del b


def test_threads_building_sparsifiers_while_others_step_never_break_a_step():
    model = mlp()
    sp = sparsifier(model)
    opt = sgd(model)
    errors: list[BaseException] = []
    stop = threading.Event()

    def build():
        try:
            while not stop.is_set():
                kept = [sparsifier(mlp(2)) for _ in range(5)]
                del kept
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    builders = [threading.Thread(target=build) for _ in range(2)]
    for t in builders:
        t.start()
    try:
        assert not never(loop(model, opt, 300, after=lambda i: sp.step()))
    finally:
        stop.set()
        for t in builders:
            t.join(60)
    assert not errors and sp.step_count == 300


def test_a_discarded_sparsifier_is_not_kept_alive_by_its_watch():
    model = mlp()
    alive = weakref.ref(sparsifier(model))
    gc.collect()
    assert alive() is None
    assert not never(loop(model, sgd(model), 2 * STEPS))


def test_the_warning_raised_as_an_error_stops_one_step_and_then_never_again():
    model = mlp()
    opt = sgd(model)
    sp = sparsifier(model)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    raised = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3 * STEPS):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            try:
                opt.step()
            except UserWarning as e:
                assert NEVER in str(e)
                raised += 1
    assert raised == 1
    del sp
