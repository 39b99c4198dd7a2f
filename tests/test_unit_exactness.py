"""A unit at slope 0 is its original activation bit for bit, and at slope 1 the identity, for every input.

The truth is the original activation module itself (torch's, Hugging Face's, timm's: every class of the
activation table) on a tensor holding -inf, inf, NaN, +-0, the dtype's largest and smallest numbers and
ordinary values, in float32, float64, float16 and bfloat16, in train and eval mode, with and without
autograd, on the compiled kernels and on the PyTorch-ops paths. ``0 * x`` in ``a * x`` or in ``torch.lerp``
gave NaN where ReLU gives 0 for -inf (and -0 for +0), so a half-precision pre-activation that overflowed
turned finite logits into NaN.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import linearize
from linearize import LinearizableActivation, kernels
from linearize.activations import FUNCTIONS_BY_NAME, HF_KINDS, MODULE_KINDS, TIMM_KINDS, activation_kind
from linearize.unit import ChannelBlend

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ARGUMENTS = {"ClippedGELUActivation": (-3.0, 3.0)}  # HF classes that take arguments


def activation_table() -> list[tuple[str, object]]:
    """One instance of every activation of the table: torch's modules, HF's and timm's classes (where
    installed), the out-of-place functions, and LeakyReLU / GELU with their other arguments."""
    acts: list[tuple[str, object]] = [(cls.__name__, cls()) for cls, _ in MODULE_KINDS]
    acts += [("LeakyReLU(0.2)", nn.LeakyReLU(0.2)), ("GELU(tanh)", nn.GELU(approximate="tanh")),
             ("Hardtanh(-2, 3)", nn.Hardtanh(-2.0, 3.0)), ("ELU(0.5)", nn.ELU(0.5))]
    acts += [(name, fn) for name, fn in FUNCTIONS_BY_NAME.items()]
    for module_name, names in (("transformers.activations", HF_KINDS),
                               ("timm.layers.activations", TIMM_KINDS), ("timm.layers.activations_me", TIMM_KINDS)):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            cls = getattr(module, name, None)
            if cls is not None:
                act = cls(*ARGUMENTS.get(name, ()))
                assert activation_kind(act) is not None, f"{module_name}.{name} is not in the activation table"
                acts.append((f"{module_name}.{name}", act))
    return acts


ACTS = activation_table()


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """-inf, inf, NaN, +-0, +-max, +-tiny (normal), +-smallest subnormal and ordinary values, in ``dtype``."""
    info = torch.finfo(dtype)
    subnormal = float(torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)))
    values = [-math.inf, math.inf, math.nan, 0.0, -0.0, info.max, -info.max, info.tiny, -info.tiny, subnormal,
              -subnormal, -1e4, 3e4, -7.5, -1.0, -0.3, 0.25, 1.0, 2.5, 60.0]
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bit for bit (the sign of zero included), NaN where ``want`` is NaN (any NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    got, want = got.flatten(), want.flatten()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN at {torch.isnan(got).nonzero().flatten().tolist()}, " \
                                               f"want at {nan.nonzero().flatten().tolist()}"
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    same = got.view(bits) == want.view(bits)
    bad = (~same & ~nan).nonzero().flatten().tolist()
    assert not bad, f"{what}: got {got[bad].tolist()}, want {want[bad].tolist()} at {bad}"


@pytest.fixture(params=["kernel", "pytorch-ops"])
def path(request, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The compiled kernels (each call counted), or the PyTorch-ops paths (kernels switched off)."""
    monkeypatch.setattr(kernels, "_state", {})
    if request.param == "pytorch-ops":
        monkeypatch.setenv(kernels.ENV_SWITCH, "0")
        assert kernels.cpu_prelu() is None and kernels.cpu_blend() is None
        return {}
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    calls = {"prelu": 0, "blend": 0}
    for name, kernel in (("prelu", kernels.cpu_prelu()), ("blend", kernels.cpu_blend())):
        assert kernel is not None, "the compiled kernels did not build: see the RuntimeWarning for why"

        def counted(*args, name=name, kernel=kernel):
            calls[name] += 1
            return kernel(*args)

        kernels._state[name] = counted
    return calls


def unit_and_input(act, dtype: torch.dtype, channel_dim: int,
                   slope: float) -> tuple[LinearizableActivation, torch.Tensor]:
    """A 3-channel unit at ``slope`` and an input [2, 3, 20] (channel_dim 1) or [2, 20, 3] (-1) whose every
    channel holds every special value."""
    v = special_values(dtype)
    x = v.expand(2, 3, v.numel()).contiguous()
    if channel_dim == -1:
        x = x.transpose(1, 2).contiguous()
    unit = LinearizableActivation(copy.deepcopy(act) if isinstance(act, nn.Module) else act, 3, channel_dim)
    with torch.no_grad():
        unit.slope.fill_(slope)
    return unit, x


@pytest.mark.parametrize("name,act", ACTS, ids=[n for n, _ in ACTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_slope_0_is_the_activation_and_slope_1_the_identity_bit_for_bit(name, act, dtype, path):
    for channel_dim in (1, -1):
        for training in (True, False):
            for grad in (False, True):
                unit, x = unit_and_input(act, dtype, channel_dim, 0.0)
                unit.train(training)
                x = x.requires_grad_(grad)
                with torch.no_grad():
                    want = act(x)
                where = f"{name} {dtype} channel_dim={channel_dim} training={training} grad={grad} a="
                with torch.set_grad_enabled(grad):
                    assert_same_bits(unit(x).detach(), want, where + "0")
                    with torch.no_grad():
                        unit.slope.fill_(1.0)
                    assert_same_bits(unit(x).detach(), x.detach(), where + "1")
    if path:  # the compiled kernels computed these (not the PyTorch-ops fallback)
        assert path["prelu" if unit.is_prelu and not (unit.leak and dtype.itemsize == 2) else "blend"] > 0


@pytest.mark.parametrize("name,act", ACTS, ids=[n for n, _ in ACTS])
def test_mixed_slopes_keep_each_channel_exact_and_the_input_gradient_is_the_activations(name, act, path):
    """Channels at slope 0, 1 and 0.25 in one unit: the first is act(x), the second x, bit for bit, the third
    the blend; at slope 0 the gradient reaching x is the activation's wherever that one is finite."""
    unit, x = unit_and_input(act, torch.float32, 1, 0.0)
    with torch.no_grad():
        unit.slope.copy_(torch.tensor([0.0, 1.0, 0.25]))
    y = unit(x)
    want = act(x)
    assert_same_bits(y[:, 0], want[:, 0], f"{name} a=0")
    assert_same_bits(y[:, 1], x[:, 1], f"{name} a=1")
    ok = torch.isfinite(want[:, 2]) & torch.isfinite(x[:, 2])
    torch.testing.assert_close(y[:, 2][ok], (0.75 * want[:, 2] + 0.25 * x[:, 2])[ok], rtol=1e-6, atol=1e-6)

    unit, x = unit_and_input(act, torch.float64, 1, 0.0)
    g = torch.linspace(-2, 3, x.numel(), dtype=x.dtype).view(x.shape)
    xa, xu = x.clone().requires_grad_(), x.clone().requires_grad_()
    (want_grad,) = torch.autograd.grad(act(xa), xa, g)
    (got_grad,) = torch.autograd.grad(unit(xu), xu, g)
    ok = torch.isfinite(want_grad) & ~torch.isnan(x)  # the derivative at a NaN input is a convention
    assert torch.equal(got_grad[ok], want_grad[ok]), name


@pytest.mark.parametrize("name,act", ACTS, ids=[n for n, _ in ACTS])
def test_between_the_ends_an_infinite_input_gives_the_definitions_value(name, act, path):
    """At slope 0.25 a unit is ``0.75 * act(x) + 0.25 * x``: at x = +-inf that is +-inf (NaN where act is), as
    float64 computes it; ``lerp``'s ``x - act`` made it inf - inf = NaN (an fp16 overflow became NaN)."""
    for dtype, channel_dim in ((d, c) for d in DTYPES for c in (1, -1)):
        unit, x = unit_and_input(act, dtype, channel_dim, 0.25)
        inf = x.isinf()
        with torch.no_grad():
            got = unit(x)[inf].double()
            want = (0.75 * act(x.double()) + 0.25 * x.double())[inf]
        assert_same_bits(got, want, f"{name} {dtype} channel_dim={channel_dim} a=0.25 at +-inf")


@pytest.mark.parametrize("mode", [False, True], ids=["plain", "torch-function-mode"])
def test_under_autocast_a_relu_unit_keeps_its_inputs_dtype_as_the_relu_does(mode, path):
    """Autocast lists ``prelu`` as a lower-precision op, ReLU not: a unit at slope 0 returns the fp32 input's
    ReLU in fp32, also when another tool's torch-function mode sends it through ``F.prelu``."""
    unit, x = unit_and_input(nn.ReLU(), torch.float32, 1, 0.0)
    x = x.nan_to_num() * 1.001  # values bfloat16 cannot hold
    with torch.autocast("cpu", dtype=torch.bfloat16), (torch.device("cpu") if mode else contextlib.nullcontext()):
        got, want = unit(x), F.relu(x)
    assert_same_bits(got, want, f"autocast, mode={mode}")


class _CallLogger(TorchFunctionMode):
    """Another tool's torch-function mode (a call logger, a FLOP counter): it passes every call through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Tagged(torch.Tensor):
    """A tensor subclass with its own (inherited) ``__torch_function__``."""


@pytest.mark.parametrize("name,act", ACTS, ids=[n for n, _ in ACTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tool", ["mode", "subclass"])
def test_under_another_tools_mode_or_on_a_subclass_slope_0_is_the_activation_and_slope_1_the_identity(
        name, act, dtype, tool):
    """Under another tool's torch-function mode, or on a tensor subclass, a unit runs the plain ``F.prelu`` /
    ``torch.lerp`` the tool knows; those gave NaN at slope 0 for +-inf (``-inf * 0``, ``act + 0 * (x - act)``).
    Truth: the activation itself and the input, bit for bit, channel by channel (slopes 0, 1, 0 in one unit)."""
    for channel_dim in (1, -1):
        unit, x = unit_and_input(act, dtype, channel_dim, 0.0)
        with torch.no_grad():
            unit.slope.copy_(torch.tensor([0.0, 1.0, 0.0]))
            want = act(x)
        channel = (slice(None), slice(None), 1) if channel_dim == -1 else (slice(None), 1)
        for grad in (False, True):
            xin = x.clone().requires_grad_(grad)
            with _CallLogger() if tool == "mode" else contextlib.nullcontext():
                got = unit(xin.as_subclass(_Tagged) if tool == "subclass" else xin)
            got = got.detach().as_subclass(torch.Tensor)
            where = f"{name} {dtype} {tool} channel_dim={channel_dim} grad={grad}"
            at_0 = torch.ones(3, dtype=torch.bool)
            at_0[1] = False
            index = (slice(None), slice(None), at_0) if channel_dim == -1 else (slice(None), at_0)
            assert_same_bits(got[index], want[index], where + " a=0")
            assert_same_bits(got[channel], x[channel], where + " a=1")


@pytest.mark.parametrize("act", [nn.ReLU(), nn.GELU()], ids=["relu", "gelu"])
def test_under_another_tools_mode_a_unit_at_slope_0_still_gets_its_slope_gradient(act):
    """The exact values at the ends do not cost the slopes their gradient under another tool's mode (a
    ``torch.where`` would give none at slope 0, where slopes start): ``sum(g * (x - act(x)))`` per channel,
    in float64, on finite inputs."""
    x = torch.linspace(-3, 3, 24, dtype=torch.float64).view(2, 3, 4)
    unit = LinearizableActivation(act, 3).double()
    g = torch.linspace(-1, 2, x.numel(), dtype=torch.float64).view(x.shape)
    with _CallLogger():
        (grad,) = torch.autograd.grad(unit(x), unit.slope, g)
    torch.testing.assert_close(grad, (g * (x - act(x))).sum((0, 2)))


def test_channel_blend_the_plain_form_is_exact_at_both_ends():
    x = special_values(torch.float32).expand(2, 3, -1).contiguous()
    blend = ChannelBlend(nn.Tanh(), torch.tensor([0.0, 1.0, 0.5]))
    y = blend(x)
    assert_same_bits(y[:, 0], torch.tanh(x[:, 0]), "ChannelBlend a=0")
    assert_same_bits(y[:, 1], x[:, 1], "ChannelBlend a=1")


@pytest.mark.parametrize("act", [nn.ReLU(), nn.GELU(), nn.Tanh()], ids=["relu", "gelu", "tanh"])
def test_an_infinite_input_adds_nothing_to_the_slope_gradient(act, path):
    """The slope's gradient is sum(g * (x - act(x))) over the finite inputs: at an infinite one the blend is
    infinite for every slope above 0 and the term +-inf or NaN (0 * inf where g = 0), which would make the
    gradient non-finite at every step. Truth: the sum over the finite inputs in float64. A NaN input still
    makes it NaN (a diverged run must show in the slopes)."""
    values = torch.tensor([-math.inf, math.inf, 0.0, -0.0, -7.5, -1.0, -0.3, 0.25, 1.0, 2.5])
    x = values.expand(2, 3, -1).contiguous()
    unit = LinearizableActivation(act, 3)
    with torch.no_grad():
        unit.slope.copy_(torch.tensor([0.0, 0.5, 1.0]))
    g = torch.linspace(-1, 1, x.numel()).view(x.shape)
    g[0, :, 1] = 0.0  # a zero gradient at x = +inf
    (grad,) = torch.autograd.grad(unit(x), unit.slope, g)
    truth = torch.where(torch.isfinite(x), g.double() * (x.double() - act(x).double()), 0.0).sum((0, 2))
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), truth, rtol=1e-5, atol=1e-6)
    x[1, 1, 3] = math.nan
    (grad,) = torch.autograd.grad(unit(x), unit.slope, g)
    assert torch.isnan(grad[1]) and torch.isfinite(grad[[0, 2]]).all()


def test_fp16_autocast_training_with_an_overflowing_pre_activation_steps_as_the_original(path):
    """A Linear whose first output overflows to -inf in float16 under autocast, then ReLU: the original trains
    (ReLU gives 0 there); the converted model gave NaN logits, and its GradScaler skipped every step. Now its
    first step updates the weights exactly as the original's (slopes 0: the same function and gradients)."""
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        original[0].weight[0] = torch.tensor([-6e4, -6e4, 0.0, 0.0])  # -6e4 * (x0 + x1) < -65504: -inf in float16
    x, y = torch.rand(16, 4) + 0.5, torch.randint(0, 2, (16,))
    converted = linearize.convert(copy.deepcopy(original), example_inputs=x)
    for model in (original, converted):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        with torch.autocast("cpu", dtype=torch.float16):
            hidden = model[0](x)
            loss = F.cross_entropy(model(x).float(), y)
        assert torch.isinf(hidden[:, 0]).all() and torch.isfinite(loss)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0**8  # no inf/NaN gradient: the step was taken
    for i in (0, 2):
        assert torch.equal(converted[i].weight, original[i].weight) and torch.equal(converted[i].bias, original[i].bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("leak", [0.01, 0.2])
def test_leaky_relu_units_are_exact_at_both_ends_in_low_precision(dtype, leak):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    unit = linearize.LinearizableActivation(nn.LeakyReLU(leak), 16)
    assert torch.equal(unit(x), F.leaky_relu(x, leak))
    with torch.no_grad():
        unit.slope.fill_(1.0)
    assert torch.equal(unit(x), x)
    with torch.no_grad():
        unit.slope.fill_(0.5)
    want = 0.5 * F.leaky_relu(x.double(), leak) + 0.5 * x.double()  # the blend's definition in float64
    torch.testing.assert_close(unit(x).double(), want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_linear_masks_are_exact_in_low_precision(dtype):
    """``a >= 1 - tol`` decided in exact arithmetic (the Python float of each slope against the
    Python float ``1 - tol``), for the 40 values of ``dtype`` just below 1 and tolerances that fall
    between them: comparing in ``dtype`` rounded ``1 - tol`` onto a slope below it."""
    from linearize.unit import count_channels, linear_masks

    values = [torch.tensor(1.0, dtype=dtype)]
    for _ in range(40):
        values.append(torch.nextafter(values[-1], torch.tensor(0.0, dtype=dtype)))
    slopes = torch.stack(values)
    unit = linearize.LinearizableActivation("relu", len(slopes), -1).to(dtype)
    with torch.no_grad():
        unit.slope.copy_(slopes)
    floats = [float(v) for v in slopes]
    tols = [0.0] + [1 - (a + b) / 2 for a, b in zip(floats, floats[1:])] + [1 - (0.3 * a + 0.7 * b)
                                                                             for a, b in zip(floats, floats[1:])]
    for tol in tols:
        truth = [f >= 1.0 - tol for f in floats]
        assert linear_masks([("u", unit)], tol)[0].tolist() == truth, (dtype, tol)
        assert count_channels([("u", unit)], tol)["linear"] == sum(truth)


@pytest.mark.parametrize("name,act", ACTS, ids=[n for n, _ in ACTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_at_slope_0_a_non_finite_upstream_gradient_reaches_x_as_through_the_activation(name, act, dtype, path):
    """The gradient a unit at slope 0 passes to x is the activation's, bit for bit, also where the incoming
    gradient is +-inf or NaN (a loss that overflowed): ``g - pos`` (inf - inf) or ``0 * g`` made NaN where
    ReLU's backward gives 0 or inf. Truth: the activation's own backward on the same ``g``."""
    v = special_values(dtype)
    v = v[torch.isfinite(v)]  # finite inputs: the derivative at +-inf and NaN inputs is a convention
    x = v.repeat_interleave(6).expand(2, 3, -1).contiguous()
    g = torch.tensor([math.inf, -math.inf, math.nan, -1.5, -0.0, 2.0], dtype=dtype).repeat(v.numel()).expand_as(x)
    unit = LinearizableActivation(copy.deepcopy(act) if isinstance(act, nn.Module) else act, 3)
    xa, xu = x.clone().requires_grad_(), x.clone().requires_grad_()
    (want,) = torch.autograd.grad(act(xa), xa, g)
    (got,) = torch.autograd.grad(unit(xu), xu, g)
    assert_same_bits(got, want, f"{name} {dtype} a=0, upstream +-inf/NaN")


@pytest.mark.parametrize("act", [nn.ReLU(), nn.LeakyReLU(0.2), nn.GELU(), nn.SiLU(), nn.Tanh()],
                         ids=["relu", "leaky_relu", "gelu", "silu", "tanh"])
def test_a_gradient_penalty_gives_slopes_at_0_and_1_the_formulas_gradient(act, path):
    """A loss on the input gradient (a gradient penalty: WGAN-GP, R1, double backprop) reaches each slope through
    d(dL/dx)/da. The backward's ``a * g`` was a constant 0 where ``a`` is 0 (and ``(1 - a) * g`` where it is 1),
    so slopes at 0 and 1, where every unit starts and the Sparsifier ends, got 0 or a wrong gradient there.
    Truth: the same penalty through ``(1 - a) * act(x) + a * x`` in plain autograd, float64."""
    from linearize.unit import _blend, _prelu

    gen = torch.Generator().manual_seed(0)
    slopes = torch.tensor([0.0, 1.0, 0.4, 0.0, 1.0], dtype=torch.float64)
    x = torch.randn(6, 5, 3, generator=gen, dtype=torch.float64)
    r = torch.randn(6, 5, 3, generator=gen, dtype=torch.float64)  # a weighted sum: the gradient differs per element
    unit = LinearizableActivation(copy.deepcopy(act), 5).double()
    with torch.no_grad():
        unit.slope.copy_(slopes)
    a = slopes.clone().requires_grad_()

    def penalty(fn, x, a):
        (gx,) = torch.autograd.grad((fn(x) * r).sum(), x, create_graph=True)
        return torch.autograd.grad(((gx - 1) ** 2).sum(), (x, a), materialize_grads=True)  # ReLU: none to x

    got = penalty(unit, x.clone().requires_grad_(), unit.slope)
    want = penalty(lambda x: (1 - a.view(5, 1)) * act(x) + a.view(5, 1) * x, x.clone().requires_grad_(), a)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if path:
        assert path["prelu" if unit.is_prelu else "blend"] > 0

    # the unit's two functions, as gradgradcheck sees them (slopes exactly 0 and 1 among the inputs)
    xs = x.clone().requires_grad_()
    if unit.is_prelu:
        leak = act.negative_slope if isinstance(act, nn.LeakyReLU) else 0.0
        assert torch.autograd.gradgradcheck(lambda x, a: _prelu(x, a + (1 - a) * leak), (xs, a))
    else:
        assert torch.autograd.gradgradcheck(lambda x, a: _blend(act(x), x, a, 1), (xs, a))


@pytest.mark.parametrize("name,act", ACTS, ids=[n for n, _ in ACTS])
def test_between_the_ends_an_activation_that_overflows_gives_the_definitions_value(name, act, path):
    """At slope 0.3 a unit is ``0.7 * act(x) + 0.3 * x``: where the activation overflows to +-inf on a finite input
    (torch's hardswish computes x * (x + 3): inf for float32 x >= ~1.9e19; SELU near the float16 maximum) that is
    +-inf, as the original's output; ``lerp``'s ``x - act`` made it inf - inf = NaN. Truth: the definition in
    float64 from the activation's value, rounded to the dtype; the folded forms (ChannelBlend, ElementBlend) too."""
    from linearize.unit import ElementBlend

    checked = 0
    for dtype, channel_dim in ((d, c) for d in DTYPES for c in (1, -1)):
        unit, x = unit_and_input(act, dtype, channel_dim, 0.3)
        x = torch.cat([x, x * 1e-2, x * 1e-4], 1 if channel_dim == -1 else 2)  # finite values near the overflow
        with torch.no_grad():
            a = torch.tensor(0.3, dtype=dtype).double()  # the slope as the unit holds it in this dtype
            want = ((1 - a) * act(x).double() + a * x.double()).to(dtype)
            got = {"unit": unit(x)}
            if channel_dim == 1 and isinstance(act, nn.Module):
                got["ChannelBlend"] = ChannelBlend(act, torch.full((3,), 0.3, dtype=dtype))(x)
                got["ElementBlend"] = ElementBlend(act, torch.full(x.shape[1:], 0.3, dtype=dtype))(x)
        overflow = act(x).isinf() & x.isfinite()
        checked += int(overflow.sum())
        for form, y in got.items():
            assert_same_bits(y[overflow], want[overflow], f"{name} {form} {dtype} channel_dim={channel_dim} a=0.3")
    if name in ("Hardswish", "SELU"):
        assert checked > 0


@pytest.mark.parametrize("act", [nn.GELU(), nn.SiLU(), nn.Hardswish(), nn.Tanh(), nn.ReLU()],
                         ids=lambda a: type(a).__name__)
def test_at_slope_0_gradients_on_channels_last_maps_are_the_originals_bit_for_bit(act, path):
    """``Conv -> act -> Conv`` on channels_last maps: at slope 0 the output, the input gradient and every parameter
    gradient are the original model's bit for bit. The gradient the unit passes to the activation keeps the
    channels_last layout (torch's GELU / SiLU backward round differently on a contiguous gradient, and the
    convolutions' gradients after them)."""
    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(8, 32, 1), act, nn.Conv2d(32, 8, 3, padding=1))
    model = copy.deepcopy(original)
    x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    linearize.convert(model, example_inputs=x)
    results = []
    for m in (model, original):
        xi = x.clone().requires_grad_()
        out = m(xi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out, xi.grad] + [p.grad for n, p in m.named_parameters() if "slope" not in n])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


UPSTREAM = {  # losses whose gradients reach the activation's output in different layouts
    "sum": lambda y: y.sum(),  # expanded: every stride 0
    "mean": lambda y: y.mean(),
    "dense": lambda y: (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)).sum(),  # contiguous
    "broadcast-last": lambda y: (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum(),  # strides (0, ..., 0, 1)
    "broadcast-batch": lambda y: (y * torch.linspace(-1, 1, y.shape[0], dtype=y.dtype).view(
        -1, *[1] * (y.ndim - 1))).sum(),
    "transposed": lambda y: (y.transpose(-1, -2) * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(
        y.transpose(-1, -2).shape)).sum(),
}


def outputs_and_input_grads(original: nn.Module, unit: nn.Module, x: torch.Tensor, loss) -> list[tuple]:
    """``(y, dloss/dx)`` of ``original`` and of ``unit`` on fresh copies of ``x`` in its own layout."""
    results = []
    for m in (original, unit):
        xi = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        y = m(xi)
        loss(y).backward()
        results.append((y, xi.grad))
    return results


SMOOTH = [("GELU", nn.GELU()), ("GELU(tanh)", nn.GELU(approximate="tanh")), ("SiLU", nn.SiLU()), ("Mish", nn.Mish()),
          ("ELU", nn.ELU()), ("Softplus", nn.Softplus()), ("Tanh", nn.Tanh())]


@pytest.mark.parametrize("name,act", SMOOTH, ids=[n for n, _ in SMOOTH])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "nhwc-view", "channels_last"])
def test_at_slope_0_the_input_gradient_is_the_originals_for_every_layout_of_the_upstream_gradient(name, act, dtype,
                                                                                                  layout, path):
    """A unit at slope 0 on ``[N, C, H, W]`` maps (channels at dim 1), on ``[N, H, W, C]`` ones (channels last,
    contiguous or the ``x.permute(0, 2, 3, 1)`` view of ConvNeXt / Swin) and on channels_last maps, with upstream
    gradients of every layout (``y.sum()``'s and ``y.mean()``'s expanded ones, broadcast ones, dense, transposed):
    the output and the input gradient are the original activation's on the same tensor, bit for bit. Torch's CPU
    gelu / silu / mish backward round differently when the gradient they get is a copy in another layout."""
    torch.manual_seed(0)
    base = (torch.randn(4, 16, 8, 8) * 3).to(dtype)
    x, dim = {"nchw": (base, 1), "nhwc": (base.permute(0, 2, 3, 1).contiguous(), -1),
              "nhwc-view": (base.permute(0, 2, 3, 1), -1),
              "channels_last": (base.contiguous(memory_format=torch.channels_last), 1)}[layout]
    unit = LinearizableActivation(copy.deepcopy(act), 16, dim)
    for what, loss in UPSTREAM.items():
        (y_want, g_want), (y_got, g_got) = outputs_and_input_grads(act, unit, x, loss)
        assert torch.equal(y_got, y_want) and y_got.stride() == y_want.stride(), what
        assert torch.equal(g_got, g_want), f"{what}: {int((g_got != g_want).sum())} input gradients differ"
    if path and layout in ("nchw", "nhwc"):
        assert path["blend"] > 0
