"""Call-site dispatch (reused activation modules and functional calls matched by call order) stays right
under threads, exceptions, interrupts, user hooks and activation checkpointing.

Truths: the unconverted model (every slope 0), a hand-written blend of the same weights and slopes, and the
same converted model without threads or checkpointing.
"""

from __future__ import annotations

import copy
import math
import sys
import threading
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint

import linearize
from linearize.functional_sites import FunctionalSiteError


class Functional(nn.Module):
    """Two functional calls in its own forward (one unit each)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.b(F.relu(self.a(x)))))


class Reused(nn.Module):
    """One ReLU module called twice (a CallSites dispatcher with two units)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.act(self.b(self.act(self.a(x)))))


def random_slopes(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.rand(u.slope.shape, generator=g))


def _slopes(model: nn.Module) -> list[torch.Tensor]:
    return [u.slope.detach() for _, u in linearize.units(model)]


def by_hand(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Functional / Reused with units, written out: PReLU unit then GELU blend (or two PReLU units)."""
    a1, a2 = _slopes(model)
    h = model.a(x)
    h = torch.where(h >= 0, h, a1 * h)
    h = model.b(h)
    h = (1 - a2) * F.gelu(h) + a2 * h if isinstance(model, Functional) else torch.where(h >= 0, h, a2 * h)
    return model.c(h)


def _run_threads(model: nn.Module, x: torch.Tensor, reference: torch.Tensor, threads: int = 4,
                 reps: int = 8) -> tuple[int, list[str]]:
    wrong, errors = [0], []

    def work() -> None:
        for _ in range(reps):
            try:
                with torch.no_grad():
                    wrong[0] += not torch.equal(model(x), reference)
            except Exception as e:  # noqa: BLE001 -- counted and shown
                errors.append(f"{type(e).__name__}: {e}")

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return wrong[0], errors


def converted(cls: type[nn.Module]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A converted ``cls`` with random slopes, an input, and its output written out by hand."""
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    model = linearize.convert(cls().eval(), example_inputs=x)
    random_slopes(model)
    with torch.no_grad():
        return model, x, by_hand(model, x)


@pytest.mark.parametrize("cls", [Functional, Reused])
def test_threads_dispatch_each_forward_on_its_own(cls):
    model, x, reference = converted(cls)
    assert torch.allclose(model(x), reference, atol=1e-6)
    with torch.no_grad():
        reference = model(x)
    assert _run_threads(model, x, reference) == (0, [])


def test_threads_on_a_converted_resnet18_give_the_original_outputs():
    torch.manual_seed(0)
    original = torchvision.models.resnet18(num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    model = linearize.convert(copy.deepcopy(original), example_inputs=x)  # slopes 0: the original function
    with torch.no_grad():
        reference = original(x)
    assert torch.allclose(model(x), reference, atol=1e-5)
    random_slopes(model)
    with torch.no_grad():
        reference = model(x)
    assert _run_threads(model, x, reference, threads=3, reps=3) == (0, [])


class _Fails(nn.Module):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.error, self.armed = error, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise self.error("stop here")
        return x


class FailsAfterRelu(Functional):
    """Raises (when armed) after its first functional call, inside a child module."""

    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.fail = _Fails(error)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.b(self.fail(F.relu(self.a(x))))))


def failing(error: type[BaseException]) -> tuple[FailsAfterRelu, torch.Tensor, torch.Tensor]:
    """A converted FailsAfterRelu with random slopes, an input, and its output (unarmed) written out by hand."""
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    model = linearize.convert(FailsAfterRelu(error).eval(), example_inputs=x)
    random_slopes(model)
    with torch.no_grad():
        return model, x, by_hand(model, x)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_exception_or_interrupt_inside_a_forward_leaves_no_interception_behind(error):
    model, x, reference = failing(error)
    model.fail.armed = True
    with pytest.raises(error):
        model(x)
    # anything computed afterwards is the plain function, never a unit's
    assert F.relu(torch.tensor(-2.0)).item() == 0.0
    assert torch.relu(torch.tensor([-3.0, 1.0])).tolist() == [0.0, 1.0]
    assert F.gelu(torch.tensor(-1.0)).item() == pytest.approx(-0.15865525, abs=1e-6)
    model.fail.armed = False
    assert torch.allclose(model(x), reference, atol=1e-6)
    assert torch._C._len_torch_function_stack() == 0  # a stale interception is removed by the next forward
    assert torch.allclose(model(x), reference, atol=1e-6)


class Nested(Functional):
    """Functional calls in its own forward around a child that makes functional calls of its own (two owners,
    one inside the other: the inner forward suspends the outer's interception)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Functional()
        self.b = nn.Linear(3, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.b(self.inner(F.relu(x)))))


def _interrupted_at(line: int, model: nn.Module, x: torch.Tensor) -> bool:
    """Run ``model(x)`` with a KeyboardInterrupt raised at the ``line``-th line linearize's dispatch code runs
    (a Ctrl-C can land on any of them); False when the forward has fewer lines (it ran to the end)."""
    files = {linearize.dispatch.__file__, linearize.functional_sites.__file__}
    count = [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename not in files:
            return None
        if event == "line":
            count[0] += 1
            if count[0] == line:
                sys.settrace(None)
                raise KeyboardInterrupt("Ctrl-C")
        return tracer

    sys.settrace(tracer)
    try:
        model(x)
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_a_ctrl_c_on_any_line_of_the_dispatch_leaves_nothing_behind():
    """A KeyboardInterrupt on each line the dispatch runs, in turn (hooks that open and close a forward's scope,
    the interception, nested owners): the next forward of the model and of another converted model computes
    their functions, no interception stays on the thread, and plain torch calls are untouched."""
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    model = linearize.convert(Nested().eval(), example_inputs=x)
    other = linearize.convert(Functional().eval(), example_inputs=x)
    random_slopes(model)
    random_slopes(other, seed=1)
    with torch.no_grad():
        reference, other_reference = model(x), other(x)
        assert torch.allclose(other_reference, by_hand(other, x), atol=1e-6)
        line = 1
        while _interrupted_at(line, model, x):
            assert F.relu(torch.tensor(-2.0)).item() == 0.0, line
            assert torch.equal(other(x), other_reference), line
            assert torch.equal(model(x), reference), line
            assert torch._C._len_torch_function_stack() == 0, line
            line += 1
            assert line < 2000  # bounded: a forward runs a few hundred lines of dispatch
    assert line > 20  # the interrupts did land inside the dispatch


def test_a_ctrl_c_in_converts_check_run_leaves_no_mode_on_the_thread():
    """A KeyboardInterrupt in the second forward convert makes (its check run on the converted model) is rolled
    back, but the dispatch mode of the given-back model stayed on the thread's torch-function stack for good:
    every torch op paid for it and torch.compile(fullgraph=True) of unrelated code raised. Truth: the stack as
    before convert, a fullgraph compile of an unrelated function computing it, and the model as given."""

    class Stops(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act, self.calls = nn.Linear(4, 8), nn.Linear(8, 8), nn.GELU(), 0

        def forward(self, x):
            self.calls += 1
            h = self.act(F.relu(self.a(x)))
            if self.calls == 2:
                raise KeyboardInterrupt("Ctrl-C")
            return self.act(self.b(h))

    torch.manual_seed(0)
    model, x = Stops(), torch.randn(3, 4)
    original = copy.deepcopy(model)
    depth = torch._C._len_torch_function_stack()
    with pytest.raises(KeyboardInterrupt):
        linearize.convert(model, example_inputs=x)
    assert torch._C._len_torch_function_stack() == depth
    assert not linearize.units(model) and torch.equal(model(x), original(x))
    fn = torch.compile(lambda t: torch.relu(t) * 2, backend="eager", fullgraph=True)
    assert torch.equal(fn(x), torch.relu(x) * 2)


def test_an_outer_forward_that_catches_an_inner_ones_interrupt_computes_its_function():
    """The inner owner's closing hook never runs (a KeyboardInterrupt skips it) and its interception stays on
    top: the outer forward's own calls must still reach the outer units, and nothing stays behind after it."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.stop = nn.Linear(4, 4), False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.fc(x))
            if self.stop:
                raise KeyboardInterrupt
            return h

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.inner = nn.Linear(4, 4), Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.gelu(self.fc(x))
            try:
                h = self.inner(h)
            except KeyboardInterrupt:
                pass
            return F.gelu(h) * 2

    torch.manual_seed(0)
    net, x = Outer().eval(), torch.randn(3, 4)
    model = linearize.convert(copy.deepcopy(net), example_inputs=x)
    with torch.no_grad():
        for _, unit in linearize.units(model):  # slope 0.5 everywhere: the truth by hand
            unit.slope.fill_(0.5)
        blend = lambda h: 0.5 * F.gelu(h) + 0.5 * h  # noqa: E731
        for stop in (True, False, False):
            model.inner.stop = stop
            h = blend(net.fc(x))
            if not stop:
                h = net.inner.fc(h)
                h = torch.where(h >= 0, h, 0.5 * h)
            assert torch.allclose(model(x), blend(h) * 2, atol=1e-6), stop
            assert torch._C._len_torch_function_stack() == 0


def _swish_function(style: str = "ctx") -> type[torch.autograd.Function]:
    """A Swish Function made in a function (its qualified name cannot be looked up): ``forward(ctx, x)``
    (``style="ctx"``) or the new style, ``forward(x)`` with ``setup_context`` (``"setup_context"``)."""

    class Swish(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return F.silu(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            s = torch.sigmoid(x)
            return g * s * (1 + x * (1 - s))

    class NewSwish(Swish):
        @staticmethod
        def forward(x):
            return F.silu(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

    return Swish if style == "ctx" else NewSwish


@pytest.mark.parametrize("style", ["ctx", "setup_context"])
def test_a_call_inside_a_custom_function_defined_in_a_function_is_left_as_it_is(style):
    """A unit inside a custom autograd.Function's forward would blend in the forward and differentiate as the
    Function's own backward says: the call is left as it is (listed), however the class is named, defined or
    written (old style with ``ctx``, new style with ``setup_context``)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.swish = nn.Linear(6, 6), nn.Linear(6, 2), _swish_function(style).apply

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(F.relu(self.swish(self.a(x))))

    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 6, requires_grad=True)
    model = linearize.convert(copy.deepcopy(net), example_inputs=x.detach())
    assert len(linearize.units(model)) == 1  # the ReLU; the SiLU inside the Function is listed, not converted
    assert any("custom autograd.Function" in call for call in model.linearize_report.functional_calls)
    random_slopes(model)
    with torch.no_grad():
        slope = linearize.units(model)[0][1].slope.clone()
    out = model(x).sum()
    (grad,) = torch.autograd.grad(out, x)
    h = F.silu(net.a(x))  # the truth, by hand: the Function computes SiLU, then the ReLU unit
    want = net.b(torch.where(h >= 0, h, slope * h)).sum()
    (want_grad,) = torch.autograd.grad(want, x)
    assert torch.allclose(out, want, atol=1e-6) and torch.allclose(grad, want_grad, atol=1e-6)


def test_a_forward_with_functional_units_keeps_nothing_alive_after_it():
    """Its bookkeeping made a reference cycle that held each forward's input and output until the garbage
    collector ran (tens of MB per training step on a small CNN)."""
    import gc
    import weakref

    model = linearize.convert(Functional(), example_inputs=torch.randn(2, 6))
    gc.collect()
    gc.disable()
    try:
        x = torch.randn(5, 6)
        out = model(x)
        alive = weakref.ref(x), weakref.ref(out)
        del x, out
        assert [r() for r in alive] == [None, None]
    finally:
        gc.enable()


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("cls", [Functional, Reused])
def test_user_hooks_that_call_activations_are_not_counted(cls, when):
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    seen = []

    def monitor(module, args, output):
        seen.append(float(F.relu(output).mean()) + float(torch.sigmoid(F.gelu(output)).mean()))

    def pre(module, args):
        seen.append(float(F.relu(args[0]).sum()))

    model = cls().eval()
    handles = []
    if when == "before":
        handles = [model.register_forward_hook(monitor), model.register_forward_pre_hook(pre),
                   model.b.register_forward_hook(monitor)]
    model = linearize.convert(model, example_inputs=x)
    if when == "after":
        handles = [model.register_forward_hook(monitor), model.register_forward_pre_hook(pre),
                   model.b.register_forward_hook(monitor)]
    random_slopes(model)
    with torch.no_grad():
        expected = by_hand(model, x)
        for _ in range(3):
            assert torch.allclose(model(x), expected, atol=1e-6)
    assert len(seen) >= 9
    for h in handles:
        h.remove()


class CheckpointsAFunction(Functional):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: F.relu(self.a(t)), x, use_reentrant=self.reentrant)
        return self.c(F.gelu(self.b(h)))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_functional_call_inside_checkpoint_is_listed_or_refused_with_the_fix(reentrant):
    x = torch.randn(5, 6, requires_grad=True)
    with pytest.warns(UserWarning, match=r"relu \(inside torch.utils.checkpoint"):  # seen by the probe: listed
        model = linearize.convert(CheckpointsAFunction(reentrant), example_inputs=x.detach())
    assert [n for n, _ in linearize.units(model)] == ["linearize_functional.gelu_0"]
    plain = CheckpointsAFunction(reentrant)
    plain.load_state_dict(model.state_dict(), strict=False)
    assert torch.equal(model(x), plain(x))
    # checkpointing that starts after convert (only in training, say): refused, not silently mis-trained
    model = linearize.convert(Functional(), example_inputs=x.detach())
    model.forward = lambda t: model.c(F.gelu(model.b(checkpoint(lambda u: F.relu(model.a(u)), t,
                                                                  use_reentrant=reentrant))))
    with pytest.raises(FunctionalSiteError, match=r"torch.utils.checkpoint.*Fix: checkpoint a module"):
        model(x).sum().backward()


@pytest.mark.parametrize("layout", ["sequential", "two_names"])
def test_a_module_registered_under_two_names_runs_one_unit_per_call(layout):
    """``act`` twice in an ``nn.Sequential`` (or ``self.a1 = self.a2``): both names dispatch to the units, so
    the model is the hand-written PReLU network of those slopes, affine at slope 1, and both slopes train."""
    torch.manual_seed(0)
    act = nn.ReLU()
    l0, l1, l2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
    if layout == "sequential":
        model = nn.Sequential(l0, act, l1, act, l2)
    else:
        model = nn.Module()
        model.l0, model.a1, model.l1, model.a2, model.l2 = l0, act, l1, act, l2
        model.forward = lambda x: model.l2(model.a2(model.l1(model.a1(model.l0(x)))))
    model = linearize.convert(model, example_inputs=torch.randn(2, 8))
    units = dict(linearize.units(model))
    assert len(units) == 2
    random_slopes(model)
    a, b = (u.slope for u in units.values())
    x = torch.randn(16, 8)
    want = l2(F.prelu(l1(F.prelu(l0(x), a)), b))
    assert torch.allclose(model(x), want, atol=1e-6)
    model(x).square().sum().backward()
    assert a.grad.abs().sum() > 0 and b.grad.abs().sum() > 0
    with torch.no_grad():
        for u in units.values():
            u.slope.fill_(1.0)
    assert linearize.nonlinear_fraction(model) == 0.0
    assert torch.allclose(model(x), l2(l1(l0(x))), atol=1e-6)


class ReusesInsideCheckpoint(nn.Module):
    """One ReLU module called twice by its owner's forward, once inside torch.utils.checkpoint."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.act, self.out, self.reentrant = nn.Linear(6, 6), nn.Linear(6, 6), nn.ReLU(), nn.GELU(), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        return self.out(checkpoint(lambda t: self.act(self.b(t)), h, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_reused_module_called_inside_checkpoint_is_left_as_it_is_and_listed(reentrant):
    """Its units would be matched by call order, and the recomputation has no position: it stays the ReLU."""
    torch.manual_seed(0)
    x = torch.randn(5, 6, requires_grad=True)
    plain = ReusesInsideCheckpoint(reentrant)
    with pytest.warns(UserWarning, match=r"act: called 2 times .* inside torch.utils.checkpoint.*own activation module"):
        model = linearize.convert(copy.deepcopy(plain), example_inputs=x.detach())
    assert [n for n, _ in linearize.units(model)] == ["out"]
    assert isinstance(model.act, nn.ReLU)
    for m in (plain, model):  # forward and backward as the unconverted model, every time
        m(x).square().sum().backward()
    assert torch.equal(plain.a.weight.grad, model.a.weight.grad)
    with pytest.raises(ValueError, match=r"no convertible activation.*act: called 2 times"):
        linearize.convert(_without_gelu(reentrant), example_inputs=x.detach())


def _without_gelu(reentrant: bool) -> nn.Module:
    model = ReusesInsideCheckpoint(reentrant)
    model.out = nn.Identity()
    return model


class Outer(nn.Module):
    """Checkpoints its child owners (as Hugging Face's gradient checkpointing does with layers)."""

    def __init__(self, cls: type[nn.Module], use: bool, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.use, self.reentrant = cls(), use, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use:
            return checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return self.inner(x)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("cls", [Functional, Reused])
def test_checkpointing_an_owner_gives_the_gradients_of_the_plain_run(cls, reentrant):
    assert_checkpointing_gives_the_plain_gradients(cls, reentrant, torch.device("cpu"))


def assert_checkpointing_gives_the_plain_gradients(cls: type[nn.Module], reentrant: bool, device: torch.device) -> None:
    """A converted ``Outer(cls)`` with random slopes on ``device``: checkpointed, every gradient equals the plain
    run's, and the slopes get one."""
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    plain = linearize.convert(Outer(cls, False, reentrant), example_inputs=x)
    random_slopes(plain)
    plain, x = plain.to(device), x.to(device).requires_grad_(True)
    ckpt = copy.deepcopy(plain)
    ckpt.use = True
    grads = []
    for model in (plain, ckpt):
        model.zero_grad()
        out = model(x)
        out.square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n
    assert all(grads[1][n].abs().sum() > 0 for n in grads[1] if n.endswith("slope"))


class HoldsScript(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.c = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)
        self.block = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.block(self.act(self.a(x))))


def test_a_scripted_submodule_is_listed_and_never_counted_as_linear():
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"block: TorchScript module"):
        model = linearize.convert(HoldsScript(), example_inputs=x)
    assert "block" in model.linearize_report.unsupported
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.fill_(1.0)
    with pytest.warns(RuntimeWarning, match=r"TorchScript module\(s\) 'block'.*less linear than the counts say"):
        linearize.nonlinear_fraction(model)
    with pytest.raises(ValueError, match=r"TorchScript module\(s\) 'block'.*fold the Python model"):
        linearize.fold(model.eval(), x)


def _doubled(m: nn.Module, inp: tuple[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    return out * 2.0


def test_a_scripted_submodule_with_a_compiled_hook_is_listed_and_the_rest_converts():
    """TorchScript compiles a module's forward hooks in, and a ScriptModule takes no new ones: the probe leaves it
    alone, the ReLU outside it gets its unit, and the converted model computes the original's outputs."""
    inner = nn.Sequential(nn.Linear(8, 8))
    inner.register_forward_hook(_doubled)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), torch.jit.script(inner), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    want = net(x)
    with pytest.warns(UserWarning, match=r"2: TorchScript module"):
        model = linearize.convert(net, example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["1"] and "2" in model.linearize_report.unsupported
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [Functional, Reused])
def test_trace_and_export_compute_the_converted_function_and_script_is_refused_with_the_fix(cls):
    model, x, expected = converted(cls)
    with torch.no_grad():
        traced = torch.jit.trace(model, x, check_trace=False)
        assert torch.allclose(traced(x), expected, atol=1e-6)
        exported = torch.export.export(model, (x,)).module()
        assert torch.allclose(exported(x), expected, atol=1e-6)
    with pytest.raises(TypeError, match=r"torch.jit.script cannot compile.*Fix: linearize.fold"):
        torch.jit.script(model)


@pytest.mark.parametrize("kernel", ["kernel", "pytorch-ops"])
def test_a_traced_converted_model_saves_and_loads_with_the_converted_function(kernel, tmp_path, monkeypatch):
    """torch.jit.save of a traced converted model failed ("Could not export Python function call '_PReLU'"): the
    units recorded their autograd Functions. Traced, they record plain ops. Truth: the unconverted model at
    slopes 0 (bit for bit, -inf and NaN inputs included) and the model without its activations at slopes 1."""
    if kernel == "pytorch-ops":
        monkeypatch.setattr(linearize.kernels, "_state", {})
        monkeypatch.setenv(linearize.kernels.ENV_SWITCH, "0")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.act, self.fc = nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Linear(4 * 36, 2)

        def forward(self, x, linear=False):
            h = self.conv(x) if linear else self.act(self.conv(x))
            h = h.flatten(1) if linear else F.gelu(h.flatten(1))
            return self.fc(h)

    torch.manual_seed(0)
    original, x = Net().eval(), torch.randn(2, 3, 8, 8)
    x[0, :, 0, :3] = torch.tensor([-math.inf, math.nan, math.inf])
    model = linearize.convert(copy.deepcopy(original), example_inputs=x)
    for slope, want in ((0.0, original(x)), (1.0, original(x, linear=True))):
        for _, unit in linearize.units(model):
            with torch.no_grad():
                unit.slope.fill_(slope)
        with torch.no_grad():
            torch.jit.save(torch.jit.trace(model, x, check_trace=False), tmp_path / "traced.pt")
            got = torch.jit.load(tmp_path / "traced.pt")(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_a_zero_width_activation_is_refused_naming_it_and_the_fix():
    model = nn.Sequential(nn.Linear(4, 0), nn.ReLU(), nn.Linear(0, 2))
    with pytest.raises(ValueError, match=r"activation '1' runs on zero channels.*exclude_modules=\['1'\]"):
        linearize.convert(model, example_inputs=torch.randn(2, 4))
    converted = linearize.convert(nn.Sequential(nn.Linear(4, 0), nn.ReLU(), nn.Linear(0, 2), nn.ReLU()),
                                  example_inputs=torch.randn(2, 4), exclude_modules=["1"])
    assert [n for n, _ in linearize.units(converted)] == ["3"]


@pytest.mark.parametrize("cls", [Functional, Reused])
def test_torch_func_transforms_are_refused_with_the_fix(cls):
    x = torch.randn(5, 6)
    model = linearize.convert(cls().eval(), example_inputs=x)
    for transform in (lambda: torch.func.vmap(model)(x), lambda: torch.func.jacrev(model)(x[0])):
        with pytest.raises(RuntimeError, match=r"do not run under torch.func transforms.*Fix: linearize.fold"):
            transform()


class _VmapInside(nn.Module):
    """torch.vmap inside its own forward: a functional relu and an activation module under it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.inner = nn.Linear(6, 6), nn.GELU(), nn.ReLU()
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        return torch.vmap(lambda r: self.inner(F.relu(self.w @ r)))(h)


def test_activations_under_torch_vmap_in_the_forward_are_refused_at_convert_naming_them():
    """Converted, every forward (and fold) raised an error naming neither the call nor a fix that works. Truth:
    the unconverted model, which the convert refused leaves as given, and which the suggested exclusion keeps."""
    torch.manual_seed(0)
    model, x = _VmapInside(), torch.randn(4, 6)
    want = model(x)
    with pytest.raises(ValueError, match=r"linearize_functional.relu_0 \(functional call _VmapInside: relu\), inner "
                                         r"\(ReLU called by _VmapInside\): called under a torch.func transform.*Fix: "
                                         r"convert with exclude_modules=\['linearize_functional.relu_0', 'inner'\]"):
        linearize.convert(model, example_inputs=x)
    assert torch.equal(model(x), want)
    linearize.convert(model, example_inputs=x, exclude_modules=["linearize_functional.relu_0", "inner"])
    assert [n for n, _ in linearize.units(model)] == ["act"]
    assert torch.equal(model(x), want)
    with torch.no_grad():
        linearize.units(model)[0][1].slope.fill_(1.0)
        torch.testing.assert_close(model(x), torch.vmap(lambda r: F.relu(model.w @ r).relu())(model.fc(x)))


@pytest.mark.parametrize("act", [nn.ReLU(), nn.GELU()])
@pytest.mark.parametrize("over", ["act.slope", "l.weight"])
def test_torch_func_over_the_parameters_is_refused_with_the_fix(act, over):
    """functional_call under torch.func.grad over the slopes, or over other parameters only (the unit's input
    and slopes are then plain tensors): the same refusal, not an error deep in autograd."""
    model = linearize.convert(nn.Sequential(OrderedDict(act=act, l=nn.Linear(6, 2))), example_inputs=torch.randn(2, 6))
    x, params = torch.randn(5, 6), {over: dict(model.named_parameters())[over].detach()}
    with pytest.raises(RuntimeError, match=r"do not run under torch.func transforms.*Fix: linearize.fold"):
        torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)
    model(x).sum().backward()  # outside the transform the model still runs


def test_script_of_a_model_with_module_units_only_is_refused_with_the_fix():
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU()),
                              example_inputs=torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"cannot compile linearize's LinearizableActivation.*Fix: linearize.fold"):
        torch.jit.script(model)
    folded = linearize.fold(model.eval(), torch.randn(2, 4), latency=False)
    scripted = torch.jit.script(folded)
    x = torch.randn(3, 4)
    assert torch.allclose(scripted(x), model(x), atol=1e-5)


class OwnerWithModuleUnits(nn.Module):
    """An owner (its F.relu) whose module units run while its site mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.act, self.tanh, self.lin = nn.ReLU(), nn.Tanh(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.lin(self.act(x) + self.tanh(x)))


def test_module_units_inside_an_owner_stay_exact_at_infinities():
    x = torch.tensor([[-float("inf"), -1.0, 0.5, float("inf")], [0.0, -0.0, 3.0, -2.0]])
    original = OwnerWithModuleUnits().eval()
    model = linearize.convert(copy.deepcopy(original), example_inputs=x)
    with torch.no_grad():
        got, want = model(x), original(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def _decorated_hook(module, args, output):
    seen = F.relu(output).sum()  # monitoring
    return None if seen is None else None


class DecoratedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(self.act(x))))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_decorated_forward_with_a_decorated_hook_keeps_its_own_calls(when):
    hook = torch.no_grad()(_decorated_hook)
    original = DecoratedForward().eval()
    model = copy.deepcopy(original)
    if when == "before":
        model.register_forward_hook(hook)
    x = torch.randn(3, 4)
    model = linearize.convert(model, example_inputs=x)
    if when == "after":
        model.register_forward_hook(hook)
    assert len(linearize.units(model)) == 2  # act and the F.relu of the forward, not the hook's
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.fill_(1.0)
        assert torch.allclose(model(x), original.b(original.a(x)), atol=1e-6)  # every unit linear: the F.relu too


class MishFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.mul(torch.tanh(F.softplus(x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        fx = F.softplus(x).tanh()
        return g * (fx + x * torch.sigmoid(x) * (1 - fx * fx))


class MemoryEfficientMish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MishFunction.apply(x)


def test_calls_inside_a_custom_autograd_function_are_listed_not_converted():
    original = nn.Sequential(nn.Linear(4, 8), MemoryEfficientMish(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 4, requires_grad=True)
    with pytest.warns(UserWarning, match=r"softplus \(inside a custom autograd.Function's forward"):
        model = linearize.convert(copy.deepcopy(original), example_inputs=x.detach())
    assert [n for n, _ in linearize.units(model)] == ["3"]
    assert torch.equal(model(x), original(x))
    model(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


class ArgumentsByMode(nn.Module):
    """A functional call whose arguments change with the mode (a unit can hold only one function)."""

    def __init__(self, by_keyword: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.by_keyword = by_keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.by_keyword:  # the probe's argument, given another way
            h = F.leaky_relu(h, negative_slope=0.2)
        else:
            h = F.leaky_relu(h, 0.2 if self.training else 0.01)
        return self.fc2(h)


def test_a_functional_call_with_other_arguments_than_the_probe_is_refused_with_the_fix():
    torch.manual_seed(0)
    model = ArgumentsByMode()
    x = torch.randn(5, 6)
    reference = model.eval()(x)
    linearize.convert(model.train(), example_inputs=x)  # its probe forward runs in eval mode
    torch.testing.assert_close(model.eval()(x), reference, rtol=0, atol=0)  # the probe's arguments: the original
    with pytest.raises(FunctionalSiteError, match=r"negative_slope=0\.2.*negative_slope=0\.01.*exclude_modules"):
        model.train()(x)
    torch.testing.assert_close(model.eval()(x), reference, rtol=0, atol=0)  # nothing stale after the refusal


def test_the_same_arguments_given_by_keyword_match_the_probe():
    torch.manual_seed(0)
    model = ArgumentsByMode(by_keyword=True)
    x = torch.randn(5, 6)
    reference = F.leaky_relu(model.fc1(x), 0.2) @ model.fc2.weight.T + model.fc2.bias
    linearize.convert(model, example_inputs=x)
    assert len(linearize.units(model)) == 1
    torch.testing.assert_close(model.eval()(x), reference)


class ClipsBy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bound = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardtanh(self.fc(x), -self.bound, self.bound)


def test_a_changed_clipping_bound_is_refused_not_silently_kept():
    model = ClipsBy()
    x = torch.randn(3, 4) * 4
    linearize.convert(model, example_inputs=x)
    model.bound = 2.0
    with pytest.raises(FunctionalSiteError, match=r"max_val=2\.0.*max_val=1\.0"):
        model(x)


class TanhInto(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(0)
        y = torch.tanh(self.fc(x), out=out)
        assert y is out
        return out * 2


def test_a_call_with_out_writes_the_units_result_into_out():
    torch.manual_seed(0)
    model = TanhInto()
    x = torch.randn(3, 4)
    with torch.no_grad():
        reference = model(x)
        linearize.convert(model, example_inputs=x)
        torch.testing.assert_close(model(x), reference, rtol=0, atol=0)
        (_, unit), = linearize.units(model)
        unit.slope.fill_(1.0)  # exactly linear: out holds fc(x)
        torch.testing.assert_close(model(x), 2 * model.fc(x))


def test_a_folded_model_loaded_from_disk_still_refuses_other_arguments_than_the_probe(tmp_path):
    torch.manual_seed(0)
    model = ArgumentsByMode()
    x = torch.randn(5, 6)
    linearize.convert(model, example_inputs=x)
    with torch.no_grad():
        linearize.units(model)[0][1].slope.fill_(0.5)
    folded = linearize.fold(model.eval(), x)
    linearize.save_folded(folded, tmp_path)
    loaded = linearize.load_folded(tmp_path, base=ArgumentsByMode())
    torch.testing.assert_close(loaded.eval()(x), folded(x), rtol=0, atol=0)
    with pytest.raises(FunctionalSiteError, match=r"negative_slope=0\.2.*negative_slope=0\.01"):
        loaded.train()(x)


class LeaksByNaN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(self.fc(x), float("nan"))


def test_a_call_with_the_probes_nan_argument_is_not_refused():
    torch.manual_seed(0)
    model = LeaksByNaN()
    x = torch.randn(3, 4)
    reference = model(x)
    linearize.convert(model, example_inputs=x)
    torch.testing.assert_close(model(x), reference, rtol=0, atol=0, equal_nan=True)


class WithLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.rnn = nn.Linear(4, 8), nn.ReLU(), nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.act(self.a(x)))[0]


def test_counts_warn_about_every_nonlinearity_convert_left_as_it_is():
    """Every unit linear, but the LSTM's gates are still there: the counts say so instead of a silent 0.0."""
    with pytest.warns(UserWarning, match="rnn"):
        model = linearize.convert(WithLSTM(), example_inputs=torch.randn(2, 3, 4))
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.fill_(1.0)
    with pytest.warns(RuntimeWarning, match=r"1 activation\(s\) that convert left as they are.*rnn: LSTM"):
        assert linearize.nonlinear_fraction(model) == 0.0


class LoopsOverShared(nn.Module):
    """A parent looping over a ModuleList that holds one activation module twice."""

    def __init__(self) -> None:
        super().__init__()
        act = nn.ReLU()
        self.layers = nn.ModuleList([nn.Linear(4, 4), act, nn.Linear(4, 4), act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_an_activation_its_holder_does_not_call_is_refused_with_the_reason_and_fix():
    with pytest.raises(ValueError, match=r"no convertible activation.*layers.1: called by a module that does not "
                                         r"own it.*fix: give each caller its own activation module"):
        linearize.convert(LoopsOverShared(), example_inputs=torch.randn(2, 4))


class Recursive(nn.Module):
    """A forward that calls the module itself ``depth`` times, then one activation (functional or registered)."""

    def __init__(self, registered: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU() if registered else None

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        if depth:
            x = self(x, depth - 1)
        return F.relu(self.lin(x)) if self.act is None else self.act(self.lin(x))


def test_a_recursive_modules_functional_call_is_left_with_the_reason_and_the_fix_works():
    """Nested invocations of one owner mix up the order its functional calls are matched by: the call is left
    as it is (the model computes the original) and the report says why and what to do; the fix it names (a
    registered activation module) converts, and at slope 1 gives three applications of the layer by hand."""
    x = torch.randn(3, 4)
    top = nn.Sequential(Recursive(), nn.ReLU())
    w, b = top[0].lin.weight.detach(), top[0].lin.bias.detach()
    with pytest.warns(UserWarning, match=r"functional call 0: relu \(3 call\(s\) per forward\): its owner Recursive "
                                         r"calls itself.*fix: call a registered activation module"):
        model = linearize.convert(top, example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["1"]
    for _, u in linearize.units(model):
        u.slope.data.fill_(1.0)
    # the recursive module's ReLUs still run as they were (the outer unit at slope 1 is the identity)
    torch.testing.assert_close(model(x), ((((x @ w.T + b).relu() @ w.T + b).relu()) @ w.T + b).relu())
    with pytest.raises(ValueError, match=r"no convertible activation.*Recursive calls itself.*fix:"):
        linearize.convert(Recursive(), example_inputs=x)
    fixed = Recursive(registered=True)
    ref = fixed(x)
    model = linearize.convert(fixed, example_inputs=x)
    assert torch.equal(model(x), ref)
    for _, u in linearize.units(model):
        u.slope.data.fill_(1.0)
    w, b = fixed.lin.weight.detach(), fixed.lin.bias.detach()
    by_hand = ((x @ w.T + b) @ w.T + b) @ w.T + b
    torch.testing.assert_close(model(x), by_hand)


class SkippedLayers(nn.Module):
    """Three layers sharing one activation module; ``skip`` leaves one out (LayerDrop, stochastic depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.act = nn.GELU()
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = self.act(layer(x))
        return x


@pytest.mark.parametrize("skip", [0, 2])
def test_a_reused_module_called_fewer_times_than_the_probe_is_refused_with_the_fix(skip):
    """With a layer skipped, call k ran the unit of call k (not of its own layer), silently; now the forward
    raises, naming the module and the fix, as the functional path does. All calls, or none, still run."""
    torch.manual_seed(0)
    model = linearize.convert(SkippedLayers(), example_inputs=torch.randn(2, 6))
    assert isinstance(model.act, linearize.injection.CallSites) and len(model.act.calls) == 3
    model.skip = skip
    with pytest.raises(FunctionalSiteError, match=r"SkippedLayers\.act was called 2 times.*saw 3 calls.*Fix"):
        model(torch.randn(2, 6))
    model.skip = None
    random_slopes(model)
    x = torch.randn(2, 6)
    want = x
    for layer, unit in zip(model.layers, model.act.calls):  # the truth by hand: each layer's own unit
        h = layer(want)
        want = (1 - unit.slope) * F.gelu(h) + unit.slope * h
    torch.testing.assert_close(model(x), want)


def test_an_activation_called_through_a_plain_list_is_left_as_it_is_and_listed():
    """A unit put at ``net.act`` that the forward never calls (it loops over a plain list holding the old
    module) would have slopes that do nothing, and ``nonlinear_fraction`` would call a GELU network linear:
    the module is put back and listed with the fix; the other activation converts."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act, self.b, self.out = nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.ReLU()
            self.pipeline = [self.a, self.act, self.b]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for m in self.pipeline:
                x = m(x)
            return self.out(x)

    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 4)
    with pytest.warns(UserWarning, match="act: called through a reference convert cannot replace"):
        model = linearize.convert(copy.deepcopy(net), example_inputs=x)
    assert type(model.act) is nn.GELU and [n for n, _ in linearize.units(model)] == ["out"]
    assert "act" in model.linearize_report.unreachable
    with torch.no_grad():
        linearize.units(model)[0][1].slope.fill_(1.0)
    assert linearize.nonlinear_fraction(model) == 0.0  # the ReLU unit is linear; the GELU is not counted as a unit
    torch.testing.assert_close(model(x), net.b(F.gelu(net.a(x))))  # the GELU still runs, as the report says


class _MaskFromInput(torch.autograd.Function):
    """A memory-efficient ReLU: the module's call in forward, the mask recomputed from the input in backward."""

    @staticmethod
    def forward(ctx, h, act):
        ctx.save_for_backward(h)
        return act(h)

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        return g * (h > 0), None


def test_an_activation_module_called_once_inside_a_custom_function_is_left_as_it_is_and_listed():
    """Its unit would blend in the forward while the Function's backward applies the plain mask (and the slope
    would never get a gradient): the module stays a ReLU, is listed, and the model's gradients are the original's."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
            self.act, self.out_act = nn.ReLU(), nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.out_act(self.b(_MaskFromInput.apply(self.a(x), self.act))))

    torch.manual_seed(0)
    net, x = Net(), torch.randn(5, 4)
    with pytest.warns(UserWarning, match="act: called inside a custom autograd.Function"):
        model = linearize.convert(copy.deepcopy(net), example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["out_act"]
    assert type(model.act) is nn.ReLU and "act" in model.linearize_report.unreachable
    with torch.no_grad():
        linearize.units(model)[0][1].slope.zero_()  # at slope 0 the model is the original, gradients too
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    net(xs[0]).sum().backward()
    model(xs[1]).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=0, atol=0)


class _ReentrantCheckpoint(torch.autograd.Function):
    """Reentrant activation checkpointing as fairscale / DeepSpeed write it: the forward under no_grad, and the
    backward runs it again under enable_grad and back-propagates through it with torch.autograd.backward."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run = run
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.run(x)
        torch.autograd.backward(out, g)
        return None, x.grad


class _Block(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.lin, self.act, self.checkpointed = nn.Linear(8, 8), nn.GELU(), checkpointed

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReentrantCheckpoint.apply(self._run, x) if self.checkpointed else self._run(x)


def test_an_activation_module_inside_a_reentrant_checkpoint_function_is_converted_and_trains():
    """A Function whose backward runs the forward again through autograd gives the module's unit its gradient:
    the unit is made, at slope 0 the gradients are the unconverted model's, and at another slope the slope's
    gradient is that of the same block run without the checkpoint."""
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(4, 8), _Block(checkpointed), nn.Linear(8, 2)) for checkpointed in (True, False)]
    nets[1].load_state_dict(nets[0].state_dict())
    x = torch.randn(16, 4)
    original = copy.deepcopy(nets[0])
    original(x).pow(2).sum().backward()
    models = [linearize.convert(copy.deepcopy(net), example_inputs=x) for net in nets]
    assert [n for n, _ in linearize.units(models[0])] == ["1.act"] and not models[0].linearize_report.unreachable
    models[0](x).pow(2).sum().backward()
    converted = dict(models[0].named_parameters())
    for n, p in original.named_parameters():
        torch.testing.assert_close(converted[n].grad, p.grad, msg=n)
    grads = []
    for model in models:
        model.zero_grad()
        with torch.no_grad():
            model[1].act.slope.fill_(0.3)
        model(x).pow(2).sum().backward()
        grads.append(model[1].act.slope.grad)
    assert grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1])


class WeightExperts(nn.Module):
    """A mixture of experts held as weights (HF MixtralExperts' eager loop): one GELU, a module or a functional
    call, once per expert the batch routes tokens to, from one line, with no module called in between."""

    def __init__(self, functional: bool, d: int = 6, h: int = 10, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.w1, self.w2 = nn.Parameter(torch.randn(experts, d, h)), nn.Parameter(torch.randn(experts, h, d))
        self.act = None if functional else nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route, out = self.router(x).argmax(-1), torch.zeros_like(x)
        for e in route.unique().tolist():
            h = x[route == e] @ self.w1[e]
            out[route == e] = (F.gelu(h) if self.act is None else self.act(h)) @ self.w2[e]
        return out


class Expert(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)


class ModuleExperts(WeightExperts):
    """A mixture of experts held as modules, the activation applied by the owner's loop after each expert's w1."""

    def __init__(self, functional: bool, d: int = 6, h: int = 10, experts: int = 4) -> None:
        super().__init__(functional, d, h, experts)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route, out = self.router(x).argmax(-1), torch.zeros_like(x)
        for e in route.unique().tolist():
            h = self.experts[e].w1(x[route == e])
            out[route == e] = self.experts[e].w2(F.gelu(h) if self.act is None else self.act(h))
        return out


def routed_batches(model: WeightExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A probe routed to experts {0, 1, 2} and two batches of one token each for experts {0, 1, 2} and {1, 2, 3}."""
    pool = torch.randn(2000, 6)
    route = model.router(pool).argmax(-1)
    by = [pool[route == e][:2] for e in range(4)]
    assert all(len(b) == 2 for b in by)
    return torch.cat(by[:3]), torch.cat([by[0][:1], by[1][:1], by[2][:1]]), torch.cat([by[1][:1], by[2][:1], by[3][:1]])


@pytest.mark.parametrize("functional", [False, True])
def test_an_expert_loop_over_weights_shares_one_unit_whatever_experts_a_batch_hits(functional):
    """Units by call order gave the k-th expert *hit* unit k, so a token's output depended on the other tokens of
    its batch; now the loop's calls share one unit, and every token's output is its expert's, written out."""
    torch.manual_seed(0)
    model = WeightExperts(functional).eval()
    probe, *batches = routed_batches(model)
    linearize.convert(model, example_inputs=probe)
    (name, unit), = linearize.units(model)
    assert name == ("linearize_functional.gelu_0" if functional else "act")
    random_slopes(model)
    with torch.no_grad():
        for x in batches + [probe, probe[:1]]:
            want = torch.stack([(1 - unit.slope) * F.gelu(t @ w1) + unit.slope * (t @ w1) for t, w1 in
                                zip(x, model.w1[model.router(x).argmax(-1)])])
            want = torch.einsum("nh,nhd->nd", want, model.w2[model.router(x).argmax(-1)])
            torch.testing.assert_close(model(x), want)


@pytest.mark.parametrize("functional", [False, True])
def test_an_expert_loop_over_modules_refuses_another_subset_than_the_probes(functional):
    """One unit per iteration, matched by order, ran expert 1's tokens through the unit of the probe's expert 0
    when a batch hit {1, 2, 3}; now that forward raises, naming the loop, the modules and the fix. The probe's
    subset still runs each iteration's unit."""
    torch.manual_seed(0)
    model = ModuleExperts(functional).eval()
    probe, same, other = routed_batches(model)
    linearize.convert(model, example_inputs=probe)
    assert len(linearize.units(model)) == 3
    random_slopes(model)
    with pytest.raises(FunctionalSiteError, match=r"loop of the forward of ModuleExperts.*after 'experts\.1\.w1'"
                                                  r".*saw it after 'experts\.0\.w1'.*Fix"):
        model(other)
    units = [u for _, u in linearize.units(model)]
    with torch.no_grad():
        want = torch.stack([model.experts[e].w2((1 - units[e].slope) * F.gelu(h) + units[e].slope * h)
                            for e, h in enumerate(model.experts[e].w1(t) for e, t in enumerate(same))])
        torch.testing.assert_close(model(same), want)


class OrderedLayers(SkippedLayers):
    """Three layers sharing one activation module, run in the order ``order`` (the probe's: 0, 1, 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.order = [0, 1, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.act(self.layers[i](x))
        return x


def test_a_layer_loop_keeps_one_unit_per_layer_and_its_copies_check_their_layers(tmp_path):
    """``for layer in self.layers: x = self.act(layer(x))`` keeps one unit per layer, also in a deep copy and in
    a folded model loaded from disk, which refuse a forward over the layers in another order than the probe's."""
    torch.manual_seed(0)
    model = OrderedLayers()
    x = torch.randn(2, 6)
    linearize.convert(model, example_inputs=x)
    random_slopes(model)
    with torch.no_grad():
        folded = linearize.fold(model.eval(), x)
    linearize.save_folded(folded, tmp_path)
    for m in (model, copy.deepcopy(model), linearize.load_folded(tmp_path, base=OrderedLayers())):
        want = x
        for layer, slope in zip(m.layers, [u.slope for u in model.act.calls]):
            h = layer(want)
            want = (1 - slope) * F.gelu(h) + slope * h
        torch.testing.assert_close(m(x), want)
        m.order = [2, 1, 0]
        with pytest.raises(FunctionalSiteError, match=r"after 'layers\.2'.*saw it after 'layers\.0'"):
            m(x)


def test_mixtral_eager_experts_share_one_unit_whatever_experts_a_batch_hits():
    """Hugging Face MixtralExperts with experts_implementation="eager" calls ``act_fn`` once per expert hit: one
    unit, so a token's output (a sparse MoE maps tokens independently) does not depend on the rest of its batch."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral

    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4,
                                        num_experts_per_tok=1, experts_implementation="eager")
    block = modeling_mixtral.MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    pool = torch.randn(400, 16)
    route = block.gate(pool)[2][:, 0]
    by = [pool[route == e][:1] for e in range(4)]
    linearize.convert(block, example_inputs=torch.cat(by[:3])[None])
    assert [name for name, _ in linearize.units(block)] == ["experts.act_fn"]
    random_slopes(block)
    with torch.no_grad():
        alone = block(by[1][None])[0, 0]
        for others in ([0, 2], [2, 3]):
            torch.testing.assert_close(block(torch.cat([by[1]] + [by[e] for e in others])[None])[0, 0], alone)


class LoopAndMore(WeightExperts):
    """The expert loop's activation module is also called once more, after the loop."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(F.relu(x)))


def test_an_expert_loop_among_other_calls_is_left_as_it_is_with_the_reason_and_the_fix():
    """Its iterations shift the order the other call is matched by: the module is listed with the reason and the
    fix, not converted (units by order ran the other call through an iteration's unit)."""
    torch.manual_seed(0)
    model = LoopAndMore(functional=False).eval()
    probe, *batches = routed_batches(model)
    with pytest.warns(UserWarning, match="unconverted"):
        linearize.convert(model, example_inputs=probe)
    assert isinstance(model.act, nn.GELU) and [name for name, _ in linearize.units(model)] == [
        "linearize_functional.relu_0"]
    why = model.linearize_report.unreachable["act"]
    assert "of them in a loop" in why and "fix: move the loop into a module of its own" in why


class StemThenLoop(nn.Module):
    """One activation (a module or a functional call) after a stem layer, then in a fixed-count loop over layers
    held as one weight: ``self.depth`` iterations."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.fc, self.ws = nn.Linear(8, 8), nn.Parameter(torch.randn(3, 8, 8) / 3)
        self.act = None if functional else nn.ReLU()
        self.depth = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.relu if self.act is None else self.act
        x = act(self.fc(x))
        for i in range(self.depth):
            x = act(x @ self.ws[i])
        return x


@pytest.mark.parametrize("functional", [False, True])
def test_an_activation_called_before_a_fixed_count_loop_and_in_it_keeps_one_unit_per_call(functional):
    """Refused whole as a loop among other calls, though the calls before the loop cannot be shifted by its count:
    one unit per call again, matched by order, each with its own slopes (written out by hand), and another loop
    count is refused."""
    torch.manual_seed(0)
    model, x = StemThenLoop(functional), torch.randn(4, 8)
    linearize.convert(model, example_inputs=x)
    units = [u for _, u in linearize.units(model)]
    assert len(units) == 4
    random_slopes(model)
    with torch.no_grad():
        want = model.fc(x)
        for k, unit in enumerate(units):
            h = want if k == 0 else want @ model.ws[k - 1]
            want = (1 - unit.slope) * h.clamp(min=0) + unit.slope * h
        torch.testing.assert_close(model(x), want)
        model.depth = 2
        with pytest.raises(FunctionalSiteError):
            model(x)


class Branches(nn.Module):
    """Two activation call sites (functional, or one activation module reused) that the forward makes in the
    input's order: ``a`` first when the input's sum is positive, ``b`` first otherwise."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.a, self.b, self.o = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(16, 2)
        self.act = None if functional else nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.relu if self.act is None else self.act
        if x.sum() > 0:
            u = act(self.a(x))
            v = act(self.b(x))
        else:
            v = act(self.b(x))
            u = act(self.a(x))
        return self.o(torch.cat([u, v], -1))


@pytest.mark.parametrize("functional", [False, True])
def test_call_sites_made_in_another_order_than_the_probes_are_refused_not_swapped(functional):
    """Units are matched by call order: the branch the probe did not take makes the same calls (kinds, widths) in
    the other order, and each ran the other site's unit, silently. Now the probe's branch computes each site with
    its own unit (written out by hand) and the other branch raises, naming the place and the fix."""
    torch.manual_seed(0)
    model, positive, negative = Branches(functional), torch.ones(2, 4), -torch.ones(2, 4)
    linearize.convert(model, example_inputs=positive)
    (_, unit_a), (_, unit_b) = linearize.units(model)
    with torch.no_grad():
        unit_a.slope.fill_(1.0)  # the site relu(a(x)): linear
        unit_b.slope.fill_(0.0)  # the site relu(b(x)): ReLU
        by_hand = lambda x: model.o(torch.cat([model.a(x), model.b(x).clamp(min=0)], -1))  # noqa: E731
        torch.testing.assert_close(model(positive), by_hand(positive))
        with pytest.raises(FunctionalSiteError, match=r"Call 0 of this forward is made at Branches.forward, line \d+, "
                                                      r"where the probe .* made call 0 at Branches.forward.*Fix: \w+ "
                                                      r"each (call|of these calls)"):
            model(negative)
        torch.testing.assert_close(model(positive), by_hand(positive))  # nothing left behind
        torch.testing.assert_close(copy.deepcopy(model)(positive), by_hand(positive))
        with pytest.raises(FunctionalSiteError):
            copy.deepcopy(model)(negative)


class CallOverride(nn.Module):
    """A block whose ``__call__`` runs its forward directly (no module hooks run), one ReLU module used twice."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.act = nn.Linear(d, d), nn.Linear(d, d), nn.ReLU()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.b(self.act(self.a(x))))


def test_a_block_overriding_call_is_refused_naming_the_override_and_the_fix():
    """Its activation looked called by another module, and the refusal said "give each caller its own activation
    module", which it has; now it names the __call__ override and its fix, and leaves the model as given."""
    torch.manual_seed(0)
    model, x = nn.Sequential(CallOverride(), CallOverride()), torch.randn(3, 8)
    original = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"0\.act: its owner CallOverride overrides __call__ "
                                         r"\(CallOverride\.__call__\).*fix: remove CallOverride\.__call__"):
        linearize.convert(model, example_inputs=x)
    torch.testing.assert_close(model(x), original(x))
    assert not linearize.units(model)


class NormedExperts(nn.Module):
    """A routed loop whose iterations each call one shared LayerNorm right before the activation (a functional
    call, or one activation module): experts held as weights (``norm(x) @ w[e]``) or as modules
    (``norm(experts[e](x))``); ``self.routing`` is the experts a batch is routed to, in order."""

    def __init__(self, as_modules: bool, functional: bool, experts: int = 4, d: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, d, d) / 3)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts)) if as_modules else None
        self.norm, self.act = nn.LayerNorm(d), None if functional else nn.ReLU()
        self.routing = [1, 3]

    def pre(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return self.norm(self.experts[e](x)) if self.experts is not None else self.norm(x) @ self.w[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.relu if self.act is None else self.act
        out = 0
        for e in self.routing:
            out = out + act(self.pre(x, e))
        return out


@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("as_modules", [False, True])
def test_a_routed_loop_through_a_shared_norm_never_matches_experts_by_iteration(as_modules, functional):
    """Each iteration got its own unit, matched by the bare iteration index (the module right before each call is
    the shared norm, so nothing was checked): another routing ran expert e on another expert's unit. Now experts
    held as weights share one unit (nothing but the order tells them apart), right for any routing, and experts
    held as modules keep one unit each, checked by the expert: the probe's routing computes each expert with its
    own slopes (written out by hand), another order raises."""
    torch.manual_seed(0)
    model, x = NormedExperts(as_modules, functional), torch.randn(6, 8)
    linearize.convert(model, example_inputs=x)
    units = [u for _, u in linearize.units(model)]
    assert len(units) == (2 if as_modules else 1)
    random_slopes(model)
    leaky = lambda h, unit: (1 - unit.slope) * h.clamp(min=0) + unit.slope * h  # noqa: E731
    with torch.no_grad():
        for routing in ([1, 3], [3, 1], [0, 2]):
            model.routing = routing
            if as_modules and routing != [1, 3]:
                with pytest.raises(FunctionalSiteError, match=r"loop of the forward of NormedExperts.*after "
                                                              r"'experts\.\d'"):
                    model(x)
                continue
            unit_of = dict(zip(routing, units)) if as_modules else dict.fromkeys(routing, units[0])
            torch.testing.assert_close(model(x), sum(leaky(model.pre(x, e), unit_of[e]) for e in routing))


class TiedSteps(nn.Module):
    """A weight-tied recurrence: one layer and one activation (a functional call or a module), ``steps`` times."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.lin, self.act, self.steps = nn.Linear(8, 8), None if functional else nn.ReLU(), 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.relu if self.act is None else self.act
        for _ in range(self.steps):
            x = act(self.lin(x))
        return x


@pytest.mark.parametrize("functional", [False, True])
def test_a_weight_tied_loop_shares_one_unit_for_any_number_of_steps(functional):
    """Its iterations are told apart by their order only (the same layer before each), so they share one unit
    (they got one unit each, matched by the iteration index): every step runs it, written out by hand."""
    torch.manual_seed(0)
    model, x = TiedSteps(functional), torch.randn(4, 8)
    linearize.convert(model, example_inputs=x)
    (_, unit), = linearize.units(model)
    random_slopes(model)
    with torch.no_grad():
        for steps in (3, 2, 5):
            model.steps, want = steps, x
            for _ in range(steps):
                h = model.lin(want)
                want = (1 - unit.slope) * h.clamp(min=0) + unit.slope * h
            torch.testing.assert_close(model(x), want)


def test_a_strided_nested_tensor_runs_through_functional_calls_as_through_the_original():
    """A strided nested tensor (the default torch.nested layout), which has no sizes of its own, crashed the call
    check of a functional call ("NestedTensorImpl doesn't support sizes"), in the converted and the folded model;
    activation modules took it. Truths: the unconverted model at slope 0, bit for bit, and each sequence run
    dense through the converted model at mixed slopes, converted and folded."""
    torch.manual_seed(0)
    original = Functional()
    model = linearize.convert(copy.deepcopy(original), example_inputs=torch.randn(2, 5, 6))
    seqs = [torch.randn(3, 6), torch.randn(5, 6)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the strided layout is a prototype
        nested = torch.nested.as_nested_tensor(seqs, layout=torch.strided)
        for got, want in zip(model(nested).unbind(), original(nested).unbind(), strict=True):
            assert torch.equal(got, want)
        random_slopes(model)
        folded = linearize.fold(model.eval(), torch.randn(2, 5, 6), latency=False)
        for net in (model, folded):
            for got, s in zip(net(nested).unbind(), seqs, strict=True):
                torch.testing.assert_close(got, model(s.unsqueeze(0))[0], rtol=1e-6, atol=1e-6)
