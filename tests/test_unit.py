"""The unit itself: exact endpoints, PReLU equivalence, channel checks, slope projection."""

import copy
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linearize
from linearize import LinearizableActivation, kernels
from linearize.unit import _PReLU, _flat

ACTS = [
    (nn.ReLU(), "relu"),
    (nn.LeakyReLU(0.2), "leaky_relu"),
    (nn.ReLU6(), "relu6"),
    (nn.GELU(), "gelu"),
    (nn.GELU(approximate="tanh"), "gelu"),
    (nn.SiLU(), "silu"),
    (nn.Hardswish(), "hardswish"),
    (nn.Tanh(), "tanh"),
    (nn.Sigmoid(), "sigmoid"),
    (F.gelu, "gelu"),
]


def computes_the_original_on_integers(module: nn.Module, cls: type, x: torch.Tensor) -> bool:
    """``module`` (a unit or its plain form) on the integer / bool ``x`` gives ``cls()(x)``, dtype and values; where
    ``cls()`` refuses the dtype, it raises the TypeError naming itself, the dtype and the fix (returns False)."""
    try:
        want = cls()(x.clone())
    except (RuntimeError, NotImplementedError):
        with pytest.raises(TypeError, match=rf"{type(module).__name__}\(.*got an input of dtype {x.dtype}.*"
                                             r"Fix: convert the input to a floating dtype"):
            module(x.clone())
        return False
    got = module(x.clone())
    assert got.dtype == want.dtype and torch.equal(got, want)
    return True


@pytest.mark.parametrize("shape,dim", [((4, 5, 3, 3), 1), ((2, 7, 5), -1), ((6, 5), -1)])
@pytest.mark.parametrize("act,kind", ACTS)
def test_blend_matches_formula_and_is_exact_at_the_ends(act, kind, shape, dim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen) * 3
    c = shape[dim]
    unit = LinearizableActivation(act, c, dim, kind=kind)
    reference = act(x)
    assert torch.equal(unit(x), reference)  # a = 0: the original activation, bit for bit
    with torch.no_grad():
        unit.slope.fill_(1.0)
    assert torch.equal(unit(x), x)  # a = 1: exactly the identity
    with torch.no_grad():
        unit.slope.copy_(torch.rand(c, generator=gen))
    bshape = [1] * x.ndim
    bshape[dim] = c
    a = unit.slope.detach().view(bshape)
    torch.testing.assert_close(unit(x), (1 - a) * reference + a * x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [cls for cls, _ in linearize.activations.MODULE_KINDS])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("granularity", ["channel", "element"])
def test_a_unit_on_an_integer_input_gives_the_original_or_names_the_dtype_and_the_fix(cls, dtype, granularity):
    """A unit called on an integer or bool tensor raised the kernels' raw error ("linearize_prelu_forward not
    implemented for 'Long'", "expected dtype float for `end`"), also where the original takes the dtype (torch.relu
    on int64, torch.tanh on int64 -> float). Truth: the original module, at slope 0 and at slope 1 (an integer
    input has no slope to learn, as a functional call on integers); where it raises, the unit raises TypeError
    naming itself, the dtype and the fix. An in-place ReLU unit writes into its input as the original does."""
    x = torch.tensor([[-3, -1, 0, 2, 7]]).to(dtype)
    for slope in (0.0, 1.0):
        unit = linearize.unit.make_unit(cls(), x.shape, -1, None, slope, granularity)
        if not computes_the_original_on_integers(unit, cls, x):
            continue
    if cls is nn.ReLU and dtype is torch.int64:
        unit = linearize.unit.make_unit(nn.ReLU(), x.shape, -1, None, 1.0, granularity)
        unit.inplace = True
        given = x.clone()
        assert unit(given) is given and torch.equal(given, torch.relu(x))


def test_relu_unit_is_a_prelu_with_negative_slope_a():
    x = torch.randn(8, 4, 5, 5)
    unit = LinearizableActivation("relu", 4)
    with torch.no_grad():
        unit.slope.copy_(torch.tensor([0.0, 0.25, 0.5, 1.0]))
    prelu = nn.PReLU(4)
    with torch.no_grad():
        prelu.weight.copy_(unit.slope)
    assert torch.equal(unit(x), prelu(x))
    assert unit.is_prelu


def test_inplace_activation_never_writes_into_its_input():
    x = torch.randn(3, 4, 2, 2)
    before = x.clone()
    unit = LinearizableActivation(nn.Hardswish(inplace=True), 4)
    unit(x)
    assert torch.equal(x, before)


def test_wrong_channel_count_raises_a_clear_error():
    unit = LinearizableActivation("relu", 3)
    with pytest.raises(ValueError, match="built for 3 channels at dim 1"):
        unit(torch.randn(2, 4, 5, 5))
    with pytest.raises(ValueError, match="num_channels"):
        LinearizableActivation("relu", 0)
    with pytest.raises(TypeError, match="act must be"):
        LinearizableActivation(3, 4)


def test_slopes_are_projected_after_any_optimizer_step_and_frozen_channels_stay():
    unit = LinearizableActivation("relu", 4)
    opt = torch.optim.SGD(unit.parameters(), lr=10.0, momentum=0.9)
    unit.freeze_(torch.tensor([True, False, False, False]), 1.0)
    x = torch.randn(16, 4)
    for sign in (1.0, -1.0, 1.0):
        opt.zero_grad()
        (sign * unit(x).sum()).backward()
        opt.step()
        assert unit.slope.min() >= 0 and unit.slope.max() <= 1
        assert unit.slope[0] == 1.0
    # the projection survives deepcopy (the copy's slope is registered with the hooks)
    twin = copy.deepcopy(unit)
    opt2 = torch.optim.SGD(twin.parameters(), lr=100.0)
    twin.slope.grad = torch.full((4,), -1.0)
    opt2.step()
    assert torch.equal(twin.slope.detach(), torch.ones(4))
    assert math.isnan(float(twin.frozen[1]))


def test_counters_on_a_hand_built_model():
    model = nn.Sequential(nn.Linear(3, 4), LinearizableActivation("relu", 4, -1), nn.Linear(4, 6),
                          LinearizableActivation(nn.GELU(), 6, -1))
    with torch.no_grad():
        model[1].slope.copy_(torch.tensor([1.0, 1.0, 0.5, 0.0]))
        model[3].slope.copy_(torch.tensor([0.9995, 0.0, 0.0, 0.0, 0.0, 1.0]))
    counts = linearize.count_units(model)
    assert (counts["total"], counts["nonlinear"], counts["linear"]) == (10, 7, 3)
    assert counts["sites"]["1"]["nonlinear"] == 2 and counts["sites"]["3"]["kind"] == "gelu"
    assert linearize.count_units(model, tol=1e-3)["nonlinear"] == 6
    assert linearize.nonlinear_fraction(model) == pytest.approx(0.7)
    assert [n for n, _ in linearize.units(model)] == ["1", "3"]
    with pytest.raises(ValueError, match="convert"):
        linearize.count_units(nn.Linear(2, 2))


@pytest.mark.parametrize("shape,dim", [((5, 3, 4, 4), 1), ((4, 5, 2, 2), 1), ((3, 4, 6, 6), 1), ((4, 6, 3), -1),
                                       ((7, 3), -1), ((2, 3, 4, 5), 2)])
def test_prelu_gradients_and_tangents_match_pytorch_prelu(shape, dim):
    """The unit's own PReLU backward and jvp against PyTorch's F.prelu autograd (incl. the kink x = 0)."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    x.view(-1)[:3] = 0.0  # the kink: both use slope a there
    c = shape[dim]
    unit = LinearizableActivation("relu", c, dim).double()
    with torch.no_grad():
        unit.slope.copy_(torch.rand(c, generator=gen, dtype=torch.float64))
    g = torch.randn(*shape, generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    gx, ga = torch.autograd.grad(unit(xr), (xr, unit.slope), g)
    ref_x = x.movedim(dim, 1).clone().requires_grad_()
    ref_a = unit.slope.detach().clone().requires_grad_()
    rx, ra = torch.autograd.grad(F.prelu(ref_x, ref_a), (ref_x, ref_a), g.movedim(dim, 1))
    torch.testing.assert_close(gx, rx.movedim(1, dim), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ga, ra, rtol=1e-12, atol=1e-12)

    x_t = torch.randn(*shape, generator=gen, dtype=torch.float64)
    a_t = torch.randn(c, generator=gen, dtype=torch.float64)
    a, ab, at_b = unit.slope.detach(), unit.slope.detach().view(unit.broadcast_shape(x.ndim)), a_t.view(
        unit.broadcast_shape(x.ndim))
    with fwAD.dual_level():
        both = fwAD.unpack_dual(_PReLU.apply(fwAD.make_dual(x.movedim(dim, 1), x_t.movedim(dim, 1)),
                                             fwAD.make_dual(a, a_t))).tangent.movedim(1, dim)
        only_x = fwAD.unpack_dual(unit(fwAD.make_dual(x, x_t))).tangent
    # independent formula; at x = 0 the tangent uses slope a, as the backward does (PyTorch's own
    # F.prelu jvp uses 1 there and its backward a)
    expected_x = torch.where(x > 0, x_t, x_t * ab)
    torch.testing.assert_close(only_x, expected_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(both, expected_x + x.clamp(max=0) * at_b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(3, 4, 2), (2, 3, 5, 5), (2, 3, 2, 2)])
def test_prelu_function_passes_gradcheck_and_gradgradcheck(shape):
    fn = _PReLU.apply
    inputs = (torch.randn(*shape, dtype=torch.float64, requires_grad=True),
              torch.rand(shape[1], dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_small_maps_run_on_a_flat_view_and_others_as_given():
    w = torch.rand(3)
    flat_x, flat_w, inner = _flat(torch.randn(2, 3, 2, 2), w)
    assert inner == 4 and flat_x.shape == (2, 12) and torch.equal(flat_w, w.repeat_interleave(4))
    for x in (torch.randn(2, 3, 8, 8), torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last), torch.randn(2, 3)):
        assert _flat(x, w)[2] == 1 and _flat(x, w)[0] is x
    x = torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last).requires_grad_()  # the unflattened path
    a = torch.rand(3, requires_grad=True)
    g = torch.randn(2, 3, 2, 2)
    ours = torch.autograd.grad(_PReLU.apply(x, a), (x, a), g)
    ref = torch.autograd.grad(F.prelu(x, a), (x, a), g)
    torch.testing.assert_close(ours, ref)


def test_frozen_channels_loaded_from_a_state_dict_hold_through_optimizer_steps():
    src = LinearizableActivation("relu", 4)
    src.freeze_(torch.tensor([True, False, False, True]), 0.0)
    unit = LinearizableActivation("relu", 4)
    opt = torch.optim.SGD(unit.parameters(), lr=0.5)
    x = torch.randn(8, 4)
    unit(x).sum().backward(), opt.step()  # caches "nothing frozen"
    unit.load_state_dict(src.state_dict())  # in-place copy into the buffer: the cache must notice
    for _ in range(3):
        opt.zero_grad()
        (unit(x) * 5).sum().backward()
        opt.step()
    assert unit.slope[0].item() == 0.0 and unit.slope[3].item() == 0.0 and unit.slope[1].item() > 0.0
    assert 0.0 <= unit.slope[1].item() <= 1.0 and unit.has_frozen()
    unit.unfreeze_()
    assert not unit.has_frozen()


# ------------------------------------------------------------------ the compiled CPU kernel


@pytest.fixture(scope="module")
def kernel():
    if os.environ.get(kernels.ENV_SWITCH) == "0":
        pytest.skip(f"the compiled kernel is switched off ({kernels.ENV_SWITCH}=0)")
    fn = kernels.cpu_prelu()
    assert fn is not None, "the fused CPU PReLU kernel did not build: see the RuntimeWarning for why"
    return fn


@pytest.mark.parametrize("shape", [(5, 3, 4, 4), (4, 5, 2, 2), (3, 4, 9, 7), (6, 70), (2, 300, 1, 1), (3, 2, 4, 3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_matches_pytorch_prelu_values_and_gradients(kernel, shape, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen, dtype=dtype)
    x.view(-1)[:5] = 0.0  # the kink: slope a, as PyTorch's backward
    a = torch.rand(shape[1], generator=gen, dtype=dtype)
    a[0] = 0.0  # a = 0: the slope gradient still needs min(x, 0)
    g = torch.randn(*shape, generator=gen, dtype=dtype)
    xk, ak, xr, ar = (t.clone().requires_grad_() for t in (x, a, x, a))
    yk, yr = kernel(xk, ak), F.prelu(xr, ar)
    assert torch.equal(yk, yr)
    gk, gr = torch.autograd.grad(yk, (xk, ak), g), torch.autograd.grad(yr, (xr, ar), g)
    assert torch.equal(gk[0], gr[0])  # one multiply per element in both
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(gk[1], gr[1], rtol=tol, atol=tol * x.numel() ** 0.5)


def test_kernel_bfloat16_and_gradcheck_including_double_backward(kernel):
    x = torch.randn(8, 6, 3, 3, dtype=torch.bfloat16, requires_grad=True)
    a = torch.rand(6, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(8, 6, 3, 3, dtype=torch.bfloat16)
    ref_x, ref_a = x.detach().float().requires_grad_(), a.detach().float().requires_grad_()
    out = torch.autograd.grad(kernel(x, a), (x, a), g)
    ref = torch.autograd.grad(F.prelu(ref_x, ref_a), (ref_x, ref_a), g.float())
    torch.testing.assert_close(out[0].float(), ref[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[1].float(), ref[1], rtol=2e-2, atol=5e-2)
    for shape in [(3, 4, 2), (2, 3, 5, 5), (4, 3)]:
        inputs = (torch.randn(*shape, dtype=torch.float64, requires_grad=True),
                  torch.rand(shape[1], dtype=torch.float64, requires_grad=True))
        assert torch.autograd.gradcheck(kernel, inputs)
        assert torch.autograd.gradgradcheck(kernel, inputs)


def test_kernel_slope_gradient_does_not_depend_on_the_thread_count(kernel):
    x = torch.randn(64, 40, 6, 6, requires_grad=True)
    a = torch.rand(40, requires_grad=True)
    g = torch.randn(64, 40, 6, 6)
    threads = torch.get_num_threads()
    try:
        grads = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            grads.append(torch.autograd.grad(kernel(x, a), (x, a), g))
    finally:
        torch.set_num_threads(threads)
    for other in grads[1:]:
        assert torch.equal(other[0], grads[0][0]) and torch.equal(other[1], grads[0][1])


def test_units_route_to_the_kernel_or_the_pytorch_ops_path_with_equal_results(kernel, monkeypatch):
    """Contiguous CPU inputs go through the kernel, channels-last maps too (as the [N*H*W, C] matrix they
    are in memory, the result channels-last again); forward AD and a switched-off or failed build take the
    PyTorch-ops path; all give the same values and gradients as F.prelu."""
    unit = LinearizableActivation("relu", 6)
    with torch.no_grad():
        unit.slope.uniform_(0, 1)
    calls = []
    monkeypatch.setitem(kernels._state, "prelu", lambda x, w: calls.append(x.shape) or kernel(x, w))
    x = torch.randn(4, 6, 5, 5, requires_grad=True)
    g = torch.randn(4, 6, 5, 5)
    via_kernel = torch.autograd.grad(unit(x), (x, unit.slope), g)
    assert calls == [x.shape]
    x_cl = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    out_cl = unit(x_cl)
    assert calls == [x.shape, (4 * 5 * 5, 6)] and out_cl.is_contiguous(memory_format=torch.channels_last)
    via_cl = torch.autograd.grad(out_cl, (x_cl, unit.slope), g)
    ref = torch.autograd.grad(F.prelu(x, unit.slope), (x, unit.slope), g)
    torch.testing.assert_close(out_cl, F.prelu(x, unit.slope), rtol=0, atol=0)
    torch.testing.assert_close(via_cl, ref, rtol=1e-5, atol=1e-5)
    empty = torch.zeros(0, 6, 5, 5).to(memory_format=torch.channels_last)
    assert unit(empty).shape == empty.shape
    monkeypatch.setitem(kernels._state, "prelu", None)  # switched off / build failed
    via_ops = torch.autograd.grad(unit(x), (x, unit.slope), g)
    assert torch.equal(via_kernel[0], via_ops[0])
    torch.testing.assert_close(via_kernel[1], via_ops[1], rtol=1e-5, atol=1e-5)


def test_switch_off_and_failed_build(monkeypatch):
    monkeypatch.delitem(kernels._state, "prelu", raising=False)
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(kernels, "_build", lambda: pytest.fail("switched off: must not build"))
    assert kernels.cpu_prelu() is None
    monkeypatch.delitem(kernels._state, "prelu")
    monkeypatch.setenv(kernels.ENV_SWITCH, "1")

    def broken():
        raise OSError("no C++ compiler\nc++: command not found")

    monkeypatch.setattr(kernels, "_build", broken)
    with pytest.warns(RuntimeWarning, match="c\\+\\+: command not found.*PyTorch ops instead"):
        assert kernels.cpu_prelu() is None
    unit = LinearizableActivation("relu", 3)
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(unit(x), F.relu(x))  # the fallback path, still exact at a = 0


@pytest.mark.parametrize("act, attr, value", [
    (nn.LeakyReLU(0.01), "negative_slope", 0.3), (nn.GELU(), "approximate", "tanh"), (nn.Hardtanh(), "max_val", 0.5),
    (nn.ELU(), "alpha", 0.2), (nn.Softplus(), "beta", 3.0)], ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else None)
def test_an_activation_setting_changed_after_convert_applies_as_in_the_unconverted_model(act, attr, value):
    """An annealed LeakyReLU slope, GELU's approximation for export, a Hardtanh bound: set on the activation after
    convert (a reference the user kept, or ``unit.act``), the converted model computes what the unconverted one
    does with the same setting; set through the unit it is the activation's too, except ``alpha`` / ``beta``,
    the unit's affine end, which are refused naming ``unit.act``. LeakyReLU's slope was copied at conversion."""
    torch.manual_seed(0)
    x = torch.randn(6, 4) * 3
    for via in ("activation", "unit"):
        model = nn.Sequential(nn.Linear(4, 8), copy.deepcopy(act), nn.Linear(8, 2))
        kept, reference = model[1], copy.deepcopy(model)
        linearize.convert(model, example_inputs=x)
        setattr(reference[1], attr, value)
        if via == "unit" and attr in ("alpha", "beta"):
            with pytest.raises(AttributeError, match=rf"unit\.{attr} is this .* affine linear end.*unit\.act\.{attr}"):
                setattr(model[1], attr, value)
            continue
        setattr(kept if via == "activation" else model[1], attr, value)
        assert getattr(model[1].act, attr) == value
        assert attr in ("alpha", "beta") or getattr(model[1], attr) == value  # read through the unit too
        with torch.no_grad():
            assert torch.equal(model(x), reference(x)), via


class _InPlaceAfterAct(nn.Module):
    """``head(act(lin(x)))`` with in-place ops on the activation's output (``mul_``, ``+=``, an in-place
    ``relu_``), or, with ``inplace=False``, the same ops out of place: the same values, the truth to compare
    with (the original ReLU itself refuses a backward after them: its backward reads its output)."""

    def __init__(self, act: nn.Module, map_size: int | None, inplace: bool = True) -> None:
        super().__init__()
        self.lin = nn.Conv2d(3, 6, 1) if map_size else nn.Linear(3, 6)
        self.act, self.head, self.inplace = act, nn.Linear(6, 2), inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x))
        if self.inplace:
            h.mul_(2)
            h += 1.5
            h.add_(3).relu_()
        else:
            h = (h * 2 + 1.5).add(3).relu()
        return self.head(h.flatten(2).mean(2) if h.ndim > 2 else h)


@pytest.mark.parametrize("path", ["kernel", "ops"])
@pytest.mark.parametrize("act", [nn.ReLU(), nn.LeakyReLU(0.1), nn.GELU(), nn.SiLU(), nn.Tanh()],
                         ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("map_size", [None, 2, 5], ids=["features", "map2x2", "map5x5"])
def test_an_in_place_op_on_a_units_output_runs_and_trains_as_after_the_original(path, act, map_size, monkeypatch):
    """``h = act(z); h.mul_(2); h += r`` (also ``nn.Dropout(inplace=True)`` after an activation) runs with
    gradients on, as in the original model: the unit's output is no view made inside its autograd Function
    (which autograd refuses to modify in place), on the compiled kernels' path and the PyTorch-ops one, for
    features and for maps of both PReLU paths (flat view, as given). The truth: the original activation (slope
    0, bit for bit) or the blend's formula (random slopes, float64), with the same ops out of place."""
    if path == "kernel" and (kernels.cpu_prelu() is None or kernels.cpu_blend() is None):
        pytest.skip("the compiled kernels are switched off or unavailable")
    if path == "ops":
        monkeypatch.setitem(kernels._state, "prelu", None)
        monkeypatch.setitem(kernels._state, "blend", None)
    torch.manual_seed(0)
    shape = (4, 3, map_size, map_size) if map_size else (4, 3)
    x = torch.randn(*shape, dtype=torch.float64) * 2
    for slopes in ("zero", "random"):
        model = _InPlaceAfterAct(copy.deepcopy(act), map_size).double()
        truth = copy.deepcopy(model)
        truth.inplace = False
        linearize.convert(model, example_inputs=x)
        if slopes == "random":
            unit = model.act
            with torch.no_grad():
                unit.slope.uniform_(0.1, 0.9)
            a = unit.slope.detach().view(unit.broadcast_shape(x.ndim))
            truth.act = _Formula(act, a)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        out, ref = model(xs[0]), truth(xs[1])
        out.backward(torch.ones_like(out))
        ref.backward(torch.ones_like(ref))
        got = [out, xs[0].grad] + [p.grad for n, p in model.named_parameters() if "slope" not in n]
        want = [ref, xs[1].grad] + [p.grad for p in truth.parameters()]
        for g, w in zip(got, want, strict=True):
            if slopes == "zero":
                assert torch.equal(g, w)
            else:
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        assert model.act.slope.grad is not None and model.act.slope.grad.isfinite().all()


class _Formula(nn.Module):
    """``(1 - a) * act(x) + a * x``, the blend's definition (the truth at slopes between 0 and 1)."""

    def __init__(self, act: nn.Module, a: torch.Tensor) -> None:
        super().__init__()
        self.act, self.a = act, a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 - self.a) * self.act(x) + self.a * x


@pytest.mark.parametrize("path", ["kernel", "ops"])
def test_an_in_place_dropout_after_a_unit_trains_as_after_the_original(path, monkeypatch):
    """``Sequential(Linear, GELU, Dropout(inplace=True), Linear)`` in training: the same output and gradients as
    the original (the same dropout mask from the same seed)."""
    if path == "kernel" and kernels.cpu_blend() is None:
        pytest.skip("the compiled kernels are switched off or unavailable")
    if path == "ops":
        monkeypatch.setitem(kernels._state, "blend", None)
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.5, inplace=True), nn.Linear(8, 2)).train()
    original = copy.deepcopy(model)
    linearize.convert(model, example_inputs=x)
    results = []
    for m in (model, original):
        torch.manual_seed(1)
        out = m(x)
        out.sum().backward()
        results.append([out] + [p.grad for n, p in m.named_parameters() if "slope" not in n])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("where", ["built_on_meta", "moved_to_meta"])
def test_a_model_on_the_meta_device_converts_and_runs_shape_only_as_the_original(where):
    """A model built under ``torch.device("meta")`` (how big models are set up before their weights load)
    converts, and a converted model moved to meta runs: the units' autocast query skips a device autocast does
    not know. The truth: the original's meta output, in eval and in training (backward too), channels-last too."""

    def build() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Conv2d(8, 8, 1),
                             nn.LeakyReLU(0.1), nn.Conv2d(8, 8, 1), nn.GELU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))

    x = torch.empty(2, 3, 8, 8, device="meta")
    with torch.device("meta"):
        original = build()
    if where == "built_on_meta":
        with torch.device("meta"):
            model = build()
        linearize.convert(model, example_inputs=x)
    else:
        model = linearize.convert(build(), example_inputs=torch.randn(2, 3, 8, 8)).to("meta")
    assert len(linearize.units(model)) == 3
    for train in (False, True):
        for inputs in (x, x.to(memory_format=torch.channels_last)):
            want = original.train(train)(inputs)
            got = model.train(train)(inputs)
            assert got.is_meta and got.shape == want.shape and got.dtype == want.dtype
            if train:
                got.sum().backward()
                assert model[0].weight.grad.is_meta and model[2].slope.grad.shape == (8,)


def _nested_model() -> nn.Module:
    """``h + gelu(lin2(relu(lin1(x))))``: the residual adds a unit's output to its input's nested tensor."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1, self.relu, self.lin2, self.gelu = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin2(self.relu(self.lin1(x)))
            return h + self.gelu(h)

    return Residual()


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_units_take_nested_tensors_as_the_original_activations_do(layout):
    """A nested tensor (``torch.nested``, jagged or strided) through a converted model: at slope 0 the original's
    values and gradients, bit for bit; at other slopes each sequence's result is the dense model's on that
    sequence (the units are elementwise along the sequence)."""
    torch.manual_seed(0)
    model = _nested_model()
    original = copy.deepcopy(model)
    linearize.convert(model, example_inputs=torch.randn(2, 3, 8))
    seqs = [torch.randn(3, 8), torch.randn(5, 8)]

    def run(m: nn.Module) -> list[torch.Tensor]:
        parts = [s.clone().requires_grad_() for s in seqs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: the strided layout is a prototype
            out = m(torch.nested.as_nested_tensor(parts, layout=layout))
        values = list(out.unbind())
        torch.autograd.backward(values, [torch.linspace(-1, 1, v.numel()).view_as(v) for v in values])
        return values + [p.grad for p in parts] + [p.grad for n, p in m.named_parameters() if "slope" not in n]

    for got, want in zip(run(model), run(original), strict=True):
        assert torch.equal(got, want)
    with torch.no_grad():
        for unit in (model.relu, model.gelu):
            unit.slope.uniform_(0.2, 0.8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out = model(torch.nested.as_nested_tensor(seqs, layout=layout))
        for got, s in zip(out.unbind(), seqs, strict=True):
            torch.testing.assert_close(got, model(s.unsqueeze(0))[0], rtol=1e-6, atol=1e-6)


def test_a_unit_whose_channels_are_a_nested_tensors_ragged_dim_is_refused_naming_it_and_the_fix():
    """Channels at the ragged dim of a jagged tensor (or an element unit, one slope per position of a fixed map)
    cannot broadcast their slopes: a ValueError naming the unit and the fix, not an error from deep inside."""
    nt = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"LinearizableActivation\(relu\) cannot run on a nested tensor.*"
                                         r"to_padded_tensor\(0\.0\).*exclude_modules"):
        LinearizableActivation("relu", 3, channel_dim=1)(nt)
    with pytest.raises(ValueError, match=r"ElementActivation\(gelu\) cannot run on a nested tensor.*one slope per"):
        linearize.unit.ElementActivation(nn.GELU(), (3, 8))(nt)
