"""Hooks a user registered on an activation module before ``convert`` keep running on the unit (or the
dispatcher of a reused module) that replaces it: once per call, changing the output as before, and the
user's handles still remove them. The truth: the unconverted model with the same hooks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import linearize


class Net(nn.Module):
    def __init__(self, act: nn.Module, twice: bool) -> None:
        super().__init__()
        self.l1, self.act, self.l2, self.twice = nn.Linear(4, 4), act, nn.Linear(4, 4), twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.l1(x))
        return self.act(self.l2(h)) if self.twice else self.l2(h)


@pytest.mark.parametrize("act", [nn.ReLU(), nn.GELU(), nn.SiLU()], ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("twice", [False, True], ids=["called once", "reused"])
def test_hooks_on_a_replaced_activation_run_once_per_call_and_their_handles_remove_them(act, twice):
    net, x = Net(copy.deepcopy(act), twice), torch.randn(3, 4)
    calls: list[tuple[int, ...]] = []
    pre = net.act.register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape)))
    post = net.act.register_forward_hook(lambda m, args, out: out * 2)  # changes the output
    plain = copy.deepcopy(net)  # the truth, hooks included
    want = plain(x)
    expected = list(calls)
    calls.clear()
    converted = linearize.convert(net, example_inputs=x)
    calls.clear()
    assert torch.equal(converted(x), want)  # slope 0: the original function, hook included
    assert calls == expected  # once per call of the site
    with torch.no_grad():  # a linear site now: the hook acts on the unit's output
        for _, unit in linearize.units(converted):
            unit.slope.fill_(1.0)
    calls.clear()
    h = converted.l1(x) * 2
    assert torch.allclose(converted(x), (converted.l2(h) * 2) if twice else converted.l2(h))
    pre.remove(), post.remove()
    calls.clear()
    with torch.no_grad():
        for _, unit in linearize.units(converted):
            unit.slope.zero_()
    bare = Net(copy.deepcopy(act), twice)
    bare.load_state_dict(plain.state_dict())
    assert torch.equal(converted(x), bare(x)) and calls == []  # removed by the user's own handles


def test_a_backward_hook_on_a_replaced_activation_sees_the_same_gradients():
    torch.manual_seed(0)
    net, x = Net(nn.GELU(), False), torch.randn(3, 4)
    grads: list[torch.Tensor] = []
    net.act.register_full_backward_hook(lambda m, gin, gout: grads.append(gout[0].clone()))
    plain = copy.deepcopy(net)
    plain(x).sum().backward()
    want = list(grads)
    grads.clear()
    converted = linearize.convert(net, example_inputs=x)
    grads.clear()
    converted(x).sum().backward()
    assert len(grads) == len(want) == 1 and torch.equal(grads[0], want[0])


class Plain(nn.Module):
    """``b(relu(a(x)))``: Linear(4, 8), ReLU, Linear(8, 3), whose layers a hook can be put on by name."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


def _counted_linear_though_not_affine(model: nn.Module, x: torch.Tensor) -> None:
    """With every unit at slope 1 the model is still not affine (the truth: f(x) + f(-x) - 2 f(0) is not 0), and
    ``nonlinear_fraction``, which reads 0.0, warns about the hook."""
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.fill_(1.0)
        assert (model(x) + model(-x) - 2 * model(torch.zeros(1, 4))).abs().max() > 1e-3  # not affine
    with pytest.warns(RuntimeWarning, match="a hook that changes the module's result"):
        assert linearize.nonlinear_fraction(model) == 0.0


@pytest.mark.parametrize("where", ["forward hook", "forward pre-hook"])
def test_an_activation_applied_by_a_hook_that_changes_the_result_is_listed_and_counts_warn(where):
    """A hook that returns ``F.relu`` of its module's output (input) is part of the model's function: with every
    unit at slope 1 the model is still not affine (the truth: f(x) + f(-x) - 2 f(0)), so the report lists
    the hook's call and count_units warns."""
    torch.manual_seed(0)
    model, x = Plain(), torch.randn(5, 4)
    if where == "forward hook":
        model.a.register_forward_hook(lambda m, args, out: torch.nn.functional.relu(out))
    else:
        model.b.register_forward_pre_hook(lambda m, args: (torch.nn.functional.relu(args[0]),))
    with pytest.warns(UserWarning, match=f"relu \\({where}\\)"):
        linearize.convert(model, example_inputs=x)
    owner = "a" if where == "forward hook" else "b"
    assert model.linearize_report.hooks == {f"{owner}: relu ({where})": 1}
    _counted_linear_though_not_affine(model, x)


def test_a_monitoring_hook_that_calls_an_activation_is_not_listed():
    """A hook that only reads (returns None) does not change the function: nothing listed, no warning."""
    torch.manual_seed(0)
    model, x = Plain(), torch.randn(5, 4)
    seen = []
    model.a.register_forward_hook(lambda m, args, out: seen.append(torch.nn.functional.relu(out).mean()))
    model.b.register_forward_pre_hook(lambda m, args: seen.append(torch.relu(args[0]).mean()))
    linearize.convert(model, example_inputs=x)
    assert model.linearize_report.hooks == {} and model.linearize_report.problems() == []
    assert seen  # the hooks ran in the probe


@pytest.mark.parametrize("form", ["F.relu(out, inplace=True)", "out.relu_()", "pre-hook F.relu_(args[0])"])
def test_an_activation_a_hook_applies_in_place_is_listed_and_counts_warn(form):
    """A hook that applies ``relu`` in place to its module's output (input) returns None but changes the result
    just as one returning ``F.relu(out)`` does: with every unit at slope 1 the model is still not affine (the
    truth: f(x) + f(-x) - 2 f(0)), so the report lists the hook's call and count_units warns."""
    torch.manual_seed(0)
    model, x = Plain(), torch.randn(5, 4)

    def relu_inplace(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        torch.nn.functional.relu(out, inplace=True)

    def relu_method(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.relu_()

    def relu_pre(m: nn.Module, args: tuple) -> None:
        torch.nn.functional.relu_(args[0])

    if form == "pre-hook F.relu_(args[0])":
        model.b.register_forward_pre_hook(relu_pre)
    else:
        model.a.register_forward_hook(relu_inplace if form == "F.relu(out, inplace=True)" else relu_method)
    with pytest.warns(UserWarning, match="forward"):
        linearize.convert(model, example_inputs=x)
    assert len(model.linearize_report.hooks) == 1
    _counted_linear_though_not_affine(model, x)
