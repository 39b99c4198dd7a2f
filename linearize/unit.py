"""Linearizable units: the per-channel blend ``y = (1 - a) * act(x) + a * x``.

One module class, :class:`LinearizableActivation`, replaces every activation call site.
Its learnable ``slope`` ``a`` has shape ``[C]`` (one value per channel) and lives in
``[0, 1]``: ``a = 0`` computes the original activation bit for bit, ``a = 1`` is exactly the
identity, for every input (+-inf, NaN and -0 included) and floating dtype. For ReLU (and
LeakyReLU) the blend *is* a PReLU with negative slope ``a`` (the sparsified PReLU of seed 000) and
runs as one fused PReLU: on the CPU a compiled kernel whose backward is one pass
(:mod:`linearize.kernels`), with a PyTorch-ops fallback (:class:`_PReLU`); smooth units run the
compiled blend kernel, or :class:`_Blend`.

Range of the slopes: the stored parameter is **projected** onto ``[0, 1]`` after every step
of any ``torch.optim`` optimizer (projected gradient descent), by a global optimizer
step-post-hook that :func:`install_optimizer_hooks` registers once per process
(``linearize.convert`` calls it). The forward pass never clamps, so a slope inside the
interval gets its true gradient. Frozen channels (see :meth:`LinearizableActivation.freeze_`)
get a zero gradient before each step and are restored to their frozen value after it, so
momentum or weight decay cannot move them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .activations import FunctionalActivation, negative_slope
from .checks import NonFiniteSlopeError, check_channel_dim, check_tol
from .config import GRANULARITIES, GatedConfig
from .dispatch import compiled_submodules, foreign_torch_function, fx_leaf_call, refuse_scripting
from .distributed import full_value, local, refuse_unsupported, shard_of
from .kernels import cpu_blend, cpu_prelu

__all__ = [
    "LinearizableActivation",
    "ElementActivation",
    "ChannelPReLU",
    "ChannelBlend",
    "ElementPReLU",
    "ElementBlend",
    "make_unit",
    "units",
    "sites",
    "count_units",
    "nonlinear_fraction",
    "linear_masks",
    "count_channels",
    "check_finite_slopes",
    "NonFiniteSlopeError",
    "project_slopes",
    "fixed_values",
    "install_optimizer_hooks",
    "require_units",
]

# every unit alive, for the global optimizer hooks to find the owners of the slopes an optimizer holds (by the
# unit's current slope: FSDP2's fully_shard and user code may put a new Parameter there)
_UNITS: weakref.WeakSet = weakref.WeakSet()
# optimizer -> (ids of its parameters, the units among their owners)
_OWNED_BY_OPTIMIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOKS_INSTALLED = False


class _PReLU(torch.autograd.Function):
    """``F.prelu`` (channels at dim 1) with a cheaper backward, and forward-mode AD, from PyTorch ops.

    The path of :func:`_prelu` off the CPU and where the compiled kernel does not apply (forward AD,
    ``torch.compile``, empty inputs) or is switched off; it computes the kernel's values.

    Forward: ``F.prelu``, but ``F.relu`` in the channels with ``a = 0`` (``F.prelu``'s ``0 * x`` is
    ``-0`` for ``x < 0`` and NaN for ``x = -inf``, where ReLU gives 0), so a unit at slope 0 is ReLU
    bit for bit. Backward: ``grad_x`` is ``g`` where ``x > 0``, else ``a * g`` (0 at ``a = 0``, also for an
    infinite ``g``: ReLU's gradient bit for bit, :func:`_prelu_grad`); with ``neg``, ``g`` where ``x <= 0``,
    ``grad_a = sum(neg * x)`` over every dim but 1. These are PyTorch's PReLU gradients (at ``x = 0``
    too: slope ``a``), except that an infinite ``x`` adds nothing to ``grad_a`` (:func:`_finite_part`),
    from vectorized passes; PyTorch's CPU PReLU backward broadcasts ``a`` inside
    one kernel whose inner loop runs over the (small) spatial dims and takes about 2x as long on
    ResNet-sized maps. Maps of at most 16 elements per channel (4x4, 2x2) run on a flat view
    (:func:`_flat`); the output is a tensor of its own, never a view made inside the Function (autograd would
    refuse an in-place op after the unit, which the original activation allows). ``jvp`` gives the tangent
    ``where(x > 0, x_t, a x_t) + min(x, 0) a_t`` for ``torch.autograd.forward_ad`` (linear regions).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.save_for_forward(x, weight)
        flat_x, flat_w, _ = _flat(x, weight)
        with _input_precision(x):
            relu, prelu = F.relu(flat_x), F.prelu(flat_x, flat_w.to(x.dtype))
            zero = _channels(flat_w == 0, flat_x.ndim)
            if flat_x is x:
                return torch.where(zero, relu, prelu)
            # the output itself, not a view made here: autograd refuses in-place ops on those (h.mul_(2), h += r)
            y = torch.empty_like(x)
            torch.where(zero, relu, prelu, out=y.view(flat_x.shape))
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        # recomputed, not saved from forward: double backward needs repeat_interleave's graph to ``weight``
        flat_x, flat_w, inner = _flat(x, weight)
        grad = grad.reshape(flat_x.shape)
        grad_x = _prelu_grad(grad, flat_x, _channels(flat_w, flat_x.ndim))
        grad_w = None
        if ctx.needs_input_grad[1]:
            neg = grad.masked_fill(flat_x > 0, 0)
            prod = neg * flat_x if torch.is_grad_enabled() else neg.mul_(flat_x)  # double backward: no in-place
            prod = _finite_part(prod, flat_x)  # -inf: g * -inf; +inf: 0 * inf
            grad_w = prod.sum([d for d in range(prod.ndim) if d != 1])
            grad_w = grad_w.view(-1, inner).sum(1) if inner > 1 else grad_w
        return grad_x.view(x.shape), grad_w

    @staticmethod
    def jvp(ctx, x_t: torch.Tensor | None, weight_t: torch.Tensor | None) -> torch.Tensor:
        x, weight = ctx.saved_tensors
        out = None
        if x_t is not None:
            out = _prelu_grad(x_t, x, _channels(weight, x.ndim))
        if weight_t is not None:
            neg, w_t = _finite_part(x.clamp(max=0), x), _channels(weight_t, x.ndim)
            out = neg * w_t if out is None else torch.addcmul(out, neg, w_t)
        return torch.zeros_like(x) if out is None else out


def _without_jvp(cls: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """``cls`` without its ``jvp``: the Function a unit applies under ``torch.compile`` when no forward-mode AD
    runs, as TorchDynamo cannot trace a Function that defines one (a graph break at every unit, an error under
    ``fullgraph=True``); with forward-mode AD on, ``cls`` itself runs (eagerly, past a graph break)."""
    return type(f"{cls.__name__}Compiled", (cls,), {"jvp": staticmethod(torch.autograd.Function.jvp),
                                                   "__module__": cls.__module__})


def _compiled(cls: type[torch.autograd.Function], compiled: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """``compiled`` (``cls`` without its ``jvp``) inside ``torch.compile`` when no forward-mode AD runs, else ``cls``."""
    return compiled if torch.compiler.is_compiling() and fwAD._current_level < 0 else cls


def _prelu_grad(g: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``g`` where ``x > 0`` (and NaN, as ReLU's ``threshold_backward``), else ``a * g``, 0 where ``a = 0``:
    ReLU's and LeakyReLU's gradients bit for bit, also for ``g = +-inf`` or NaN (``0 * inf`` is NaN) and -0;
    differentiated as ``a * g`` (:func:`_filled`)."""
    return torch.where(x <= 0, _filled(g * a, a == 0, 0.0), g)


def _times_slope(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``g * a`` with -0 where ``a`` is 0: the gradient a slope-0 branch adds is nothing (-0 is the additive
    identity of IEEE floats), also where ``g`` is +-inf or NaN (``0 * inf`` is NaN; ReLU's backward gives 0);
    differentiated as ``g * a`` (:func:`_filled`). Outside a double backward the fresh product is filled in place:
    ``masked_fill`` with a broadcast mask returns a contiguous tensor, and a channels_last gradient made contiguous
    changes the last bits of the original activation's backward (``gelu_backward``) after it."""
    if torch.is_grad_enabled():
        return _filled(g * a, a == 0, -0.0)
    return (g * a).masked_fill_(a == 0, -0.0)


def _act_grad(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The blend's gradient to ``act``, ``g * (1 - w)`` (:func:`_times_slope`); ``g`` itself where every slope is 0
    on the CPU outside a double backward: the original activation's backward then gets the very gradient it got
    in the original, in its layout (torch's CPU gelu / silu / mish backward round differently on a copy of a strided
    or expanded gradient, such as ``y.sum()``'s, in another layout). On other devices ``g * 1`` has ``g``'s values,
    and a look at the slopes would cost a device sync per unit and step; slopes without data (``FakeTensorMode``)
    cannot be looked at."""
    if g.device.type == "cpu" and not torch.is_grad_enabled() and _has_data(w) and not bool(w.any()):
        return g
    return _times_slope(g, 1 - w)


class _Fill(torch.autograd.Function):
    """``v.masked_fill(mask, value)`` whose derivatives are ``v``'s: see :func:`_filled`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(v: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
        return v.masked_fill(mask, value)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        return grad, None, None

    @staticmethod
    def jvp(ctx, v_t: torch.Tensor | None, mask_t: None, value_t: None) -> torch.Tensor | None:
        return v_t


def _filled(v: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``v.masked_fill(mask, value)``, for a backward's ``v = g * a`` where ``a`` is 0 (``value`` is the zero the
    original's backward gives there, also for an infinite or NaN ``g``). When a graph is being built (double
    backward: ``create_graph=True``, a gradient penalty) its derivatives are ``v``'s: ``masked_fill`` would make
    them 0 at the filled elements, and the slopes start at 0 and end at 1, where the penalty's gradient to
    them (``d(g * a)/da = g``) would be lost."""
    if torch.is_grad_enabled():
        return _Fill.apply(v, mask, value)
    return v.clone(memory_format=torch.preserve_format).masked_fill_(mask, value)  # v's layout (see _times_slope)


def _refuse_functorch() -> None:
    """``RuntimeError`` with the fix for a unit called under a ``torch.func`` transform (``vmap``, ``grad``,
    ``jacrev``), whether over its input, its slopes (``functional_call`` over the parameters) or other
    parameters only: its autograd functions define their own backward, which those transforms cannot take."""
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        raise RuntimeError(
            "linearize units do not run under torch.func transforms (vmap, grad, jacrev, ...): their custom "
            "backward cannot be transformed. Fix: linearize.fold(model, example_inputs) gives a plain PyTorch "
            "model that can; or torch.autograd.functional.jacobian / a batched forward on the converted model")


def _input_precision(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on ``x``'s device while a unit runs ``F.prelu``, which autocast lists as a lower-precision
    op: the ReLU a unit replaces keeps its input's dtype (an fp32 input after a LayerNorm stays fp32). Devices
    without autocast (``meta``: shape-only forwards, models built under ``torch.device("meta")``) have none to
    turn off (torch's query raises for them; asking ``torch.amp.is_autocast_available`` first doubled the cost)."""
    device = x.device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # unknown device type for autocast
        enabled = False
    return torch.autocast(device, enabled=False) if enabled else contextlib.nullcontext()


def _has_data(*tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` hold data of their own to read: none is a tensor that handles its own ops or has no
    storage (a ``FakeTensor`` of ``torch.export``, compile tracing and memory estimators; a functionalization
    wrapper; every tensor while ``torch.compile`` traces, which cannot trace the check either)."""
    if torch.compiler.is_compiling():
        return False
    return all(type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__ and not torch._is_functional_tensor(t)
               for t in tensors)


def _kernel_can_read(*tensors: torch.Tensor) -> bool:
    """Whether the compiled CPU kernel can run on ``tensors``: they hold data (:func:`_has_data`) and no
    ``FakeTensorMode`` is on, which would make the kernel's results data-less. The rest runs the PyTorch ops."""
    return _has_data(*tensors) and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None


def _prelu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.prelu(x, weight)``; on the CPU through the compiled kernel of :mod:`linearize.kernels`.

    That kernel (autograd in C++, one fused backward pass) takes contiguous non-empty inputs outside
    ``torch.compile``, forward-mode AD (it has no ``jvp``) and tensors without data of their own
    (:func:`_kernel_can_read`: ``FakeTensorMode``), and channels_last maps as the
    ``[N * H * W, C]`` matrix they are in memory (the result stays channels_last); the rest (other
    devices too), and every call when it is switched off or cannot be built, runs :class:`_PReLU`,
    which computes the same values: ``F.prelu``'s, but ReLU's exactly where ``weight`` is 0 (``F.prelu``
    gives NaN there for ``x = -inf``). Under a torch-function mode or with tensor subclasses the call
    is dispatched as a plain ``F.prelu``, so tools that intercept functions (linear regions, FLOP
    counting, graph recording) see the same call as before. Under ``torch.jit.trace`` it runs as plain ops
    (``torch.where`` of ``F.relu`` and ``F.prelu``), which ``torch.jit.save`` can keep.
    """
    if foreign_torch_function(x, weight):
        with _input_precision(x):
            y = handle_torch_function(F.prelu, (x, weight), x, weight)
        return _exact_ends(y, _channels(weight == 0, x.ndim), F.relu, x)
    if torch.jit.is_tracing():  # plain ops: a Python autograd Function or the kernel would make the trace unsavable
        with _input_precision(x):
            return torch.where(_channels(weight == 0, x.ndim), F.relu(x), F.prelu(x, weight.to(x.dtype)))
    _refuse_functorch()
    if x.device.type != "cpu":
        return _compiled(_PReLU, _PReLUCompiled).apply(x, weight)
    if x.ndim == 4 and x.numel() and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        # channels_last: the same memory as a contiguous [N*H*W, C], channels innermost; the result keeps the layout
        n, c, h, w = x.shape
        return _prelu(x.permute(0, 2, 3, 1).view(-1, c), weight).view(n, h, w, c).permute(0, 3, 1, 2)
    if (x.ndim >= 2 and x.is_contiguous() and x.numel() and weight.dtype == x.dtype and fwAD._current_level < 0
            and not torch.compiler.is_compiling() and _kernel_can_read(x, weight)):
        kernel = cpu_prelu()
        if kernel is not None:
            return kernel(x, weight)
    return _compiled(_PReLU, _PReLUCompiled).apply(x, weight)


def _exact_ends(y: torch.Tensor, ends: torch.Tensor, exact: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``y``, the result of the plain call a unit makes for another tool (``F.prelu``, ``torch.lerp``), with the
    values ``exact(*args)`` wherever ``ends`` (broadcast to ``y``) is True: the slopes at which the unit is the
    original activation or the identity, bit for bit, where the plain call gives NaN for +-inf inputs
    (``-inf * 0``, ``act + 0 * (x - act)``) and 0 of the other sign: there the plain call differs from the
    unit only in those two ways. Only those elements are written, into ``y``, out of the tool's sight and out
    of autograd: the tool sees the call it knows and keeps its result elsewhere (linear regions' tracer gives
    the values of the region ahead near a kink), and the gradients stay those of that call (a ``torch.where``
    would give the slopes no gradient at the ends, where they start)."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        want = exact(*args)
        nan = y.isnan() & ~want.isnan()
        zero_sign = (y == 0) & (want == 0) & (y.signbit() != want.signbit())
        return y.copy_(torch.where(ends & (nan | zero_sign), want, y))


_FLAT_MAX = 16  # channel blocks of at most this many elements run on a flat view


def _flat(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(x, weight, inner)`` as the PReLU kernels should see them.

    A contiguous ``[N, C, *S]`` input whose channel blocks hold ``1 < inner = prod(S) <= 16``
    elements is viewed as ``[N, C * inner]`` with each slope repeated ``inner`` times: PyTorch's
    broadcasting kernels loop innermost over ``S``, and on 2x2 maps they take 20x as long as on the
    flat view, whose inner loop runs over contiguous channels. Other inputs come back as given
    (``inner = 1``).
    """
    inner = math.prod(x.shape[2:])
    if x.ndim <= 2 or not 1 < inner <= _FLAT_MAX or not x.is_contiguous():
        return x, weight, 1
    return x.view(x.shape[0], x.shape[1] * inner), weight.repeat_interleave(inner), inner  # no -1: N may be 0


def _channels(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """A ``[C]`` vector viewed to broadcast along dim 1 of an ``ndim`` tensor."""
    return v.view([1, -1] + [1] * (ndim - 2)) if ndim > 1 else v


def _zero_safe_prelu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.prelu(x, weight)`` (``weight`` ``[C]`` along dim 1 of ``x``, or one element for every element), but a zero,
    not NaN, where ``weight`` is 0 and ``x`` is -inf (``F.prelu`` computes ``0 * -inf``; ReLU and a unit at slope 0
    give 0): the plain forms' PReLU. ``x`` is first raised to the lowest finite value of its dtype in the channels
    whose weight is 0, by ``torch.maximum`` with a bound computed from ``weight`` at every call (no device sync, a
    changed weight applies; one more elementwise pass). Every other value (-inf where the weight is not 0, NaN, the
    -0 of a negative input at weight 0) and every gradient of a finite input are ``F.prelu``'s."""
    if not x.is_floating_point():
        return F.prelu(x, weight)  # torch's own error for the dtype
    lowest = torch.finfo(x.dtype).min
    floor = torch.full_like(weight, -math.inf, dtype=x.dtype).masked_fill_(weight.logical_not(), lowest)
    floor = floor.reshape(()) if weight.numel() == 1 else _channels(floor, x.ndim)
    return F.prelu(torch.maximum(x, floor), weight)


def exact_lerp(act: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.lerp(act, x, weight)``, exact at both ends for every input: ``act`` where ``weight`` is 0
    and ``x`` where it is 1, +-inf, NaN and -0 included (``lerp`` computes ``act + 0 * (x - act)``: NaN
    wherever ``x - act`` is infinite, e.g. ``tanh`` at ``x = -inf``, and +0 for ``act = -0``); between the
    ends, where ``x - act`` is not finite (an infinite ``x``, an activation that overflowed to +-inf on a finite
    ``x``, a difference that overflows) the value is the definition's ``(1 - weight) * act + weight * x`` (+-inf
    where ``lerp`` computes inf - inf).

    Example:
        >>> x = torch.tensor([-math.inf, -0.0, 2.0])
        >>> exact_lerp(torch.tanh(x), x, torch.tensor(0.0)), exact_lerp(torch.tanh(x), x, torch.tensor(1.0))
        (tensor([-1.0000, -0.0000,  0.9640]), tensor([-inf, -0., 2.]))
    """
    mixed = torch.lerp(act, x, weight)
    mixed = torch.where((x - act).isfinite(), mixed, torch.addcmul(act * (1 - weight), x, weight))  # lerp: inf - inf
    return torch.where(weight == 0, act, torch.where(weight == 1, x, mixed))


class _Blend(torch.autograd.Function):
    """``(1 - w) * act + w * x`` with the values of :func:`exact_lerp` and the blend's gradients.

    A ``torch.where`` in autograd would give the slope no gradient where it is 0 or 1 (the selected
    branch does not depend on it), and slopes start at 0: here ``d/dw = sum(g * (x - act))`` at every
    slope, ``d/dact = g * (1 - w)`` (``g`` itself at ``w = 0``, so the gradient through the original
    activation is the original's), ``d/dx = g * w``. ``w`` broadcasts against ``x`` (``[1, C, 1, 1]``);
    its gradient is summed to its shape. Forward-mode AD and ``torch.func`` transforms are supported.
    An infinite ``x`` adds nothing to the slope's gradient, as in the PReLU units (:func:`_finite_part`).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(act: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return exact_lerp(act, x, w)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        act, x, w = ctx.saved_tensors
        need_act, need_x, need_w = ctx.needs_input_grad
        return (_act_grad(g, w) if need_act else None, _times_slope(g, w) if need_x else None,
                _finite_part(g * (x - act), x).sum_to_size(w.shape) if need_w else None)

    @staticmethod
    def jvp(ctx, act_t: torch.Tensor | None, x_t: torch.Tensor | None, w_t: torch.Tensor | None) -> torch.Tensor:
        act, x, w = ctx.saved_tensors
        out = torch.zeros_like(act)
        if act_t is not None:
            out = out + _times_slope(act_t, 1 - w)
        if x_t is not None:
            out = out + _times_slope(x_t, w)
        if w_t is not None:
            out = out + _finite_part(w_t * (x - act), x)
        return out


_PReLUCompiled, _BlendCompiled = _without_jvp(_PReLU), _without_jvp(_Blend)


def _finite_part(slope_term: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``slope_term`` with 0 where ``x`` is infinite: an infinite (overflowed) input carries no slope gradient.

    A unit's output there is infinite for every slope above 0, and its slope term (``g * x``, or
    ``g * (x - act)``) is +-inf or NaN: at every step it would make the slope gradient non-finite, and
    an fp16 ``GradScaler`` skip every step, though the original activation trains on such inputs.
    """
    return slope_term.masked_fill(x.isinf(), 0)


class _AffineEnd(torch.autograd.Function):
    """A unit's affine linear end ``beta + alpha * x`` (``torch.addcmul``; ``alpha``, ``beta`` broadcast along the
    channels) whose ``alpha`` and ``beta`` gradients leave out infinite inputs (:func:`_finite_part`), as the
    slope's do: ``g * x`` would be +-inf or NaN there (``-0 * inf``: also in channels at slope 0, whose blend
    passes the end -0, and whose output does not depend on the end). ``x`` gets ``g * alpha``, as from
    ``addcmul``. Forward-mode AD is supported.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, alpha)
        ctx.save_for_forward(x, alpha)
        return torch.addcmul(beta, alpha, x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, alpha = ctx.saved_tensors
        need_x, need_alpha, need_beta = ctx.needs_input_grad
        return (g * alpha if need_x else None,
                _finite_part(g * x, x).sum_to_size(alpha.shape) if need_alpha else None,
                _finite_part(g, x).sum_to_size(alpha.shape) if need_beta else None)

    @staticmethod
    def jvp(ctx, x_t: torch.Tensor | None, alpha_t: torch.Tensor | None, beta_t: torch.Tensor | None) -> torch.Tensor:
        x, alpha = ctx.saved_tensors
        out = torch.zeros_like(x) if x_t is None else x_t * alpha
        if alpha_t is not None:
            out = out + _finite_part(alpha_t * x, x)
        if beta_t is not None:
            out = out + _finite_part(beta_t.expand_as(x), x)
        return out


_AffineEndCompiled = _without_jvp(_AffineEnd)


def _affine_end(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``beta + alpha * x`` with the gradients of :class:`_AffineEnd`; under a torch-function mode or with tensor
    subclasses the plain ``torch.addcmul``, the call that tools intercepting functions know."""
    if foreign_torch_function(x, alpha, beta) or torch.jit.is_tracing():  # traced: a savable op
        return torch.addcmul(beta, alpha, x)
    return _compiled(_AffineEnd, _AffineEndCompiled).apply(x, alpha, beta)


def _blend(act: torch.Tensor, x: torch.Tensor, slope: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The blend ``(1 - a) * act + a * x`` of a smooth unit, ``a = slope [C]`` along ``dim`` of ``x`` (``None``: one
    slope per position of the map ``x.shape[1:]``, an element unit's), exact at ``a`` 0 and 1
    (:func:`exact_lerp`), with the slope gradients of :class:`_Blend`.

    On the CPU, contiguous inputs with channels at dim 1 or last, or one slope per position, run the compiled
    kernel (:func:`linearize.kernels.cpu_blend`: one pass forward, one backward; ``torch.where`` passes made the
    PyTorch-ops path 2x as slow as the old ``torch.lerp``) on ``act`` and ``x`` themselves, no view of them (a
    view's backward would copy a strided gradient before the activation's backward gets it), outside
    ``torch.compile``, forward-mode AD and tensors without data of their own (:func:`_kernel_can_read`); the rest,
    and every call when it is switched off or cannot be built,
    runs :class:`_Blend`. Under a torch-function mode or with tensor subclasses it is dispatched as a plain
    ``torch.lerp``, so tools that intercept functions see the call they know; under ``torch.jit.trace`` it is
    :func:`exact_lerp`'s plain ops, which ``torch.jit.save`` can keep.
    """
    if dim is None:
        weight = slope.view(1, *x.shape[1:])
    else:
        shape = [1] * x.ndim
        shape[dim] = slope.numel()
        weight = slope.view(shape)
    if foreign_torch_function(act, x, weight):
        return _exact_ends(torch.lerp(act, x, weight), (weight == 0) | (weight == 1), torch.where, weight == 0, act, x)
    if torch.jit.is_tracing():  # plain ops: a Python autograd Function or the kernel would make the trace unsavable
        return exact_lerp(act, x, weight)
    _refuse_functorch()
    if (x.device.type == "cpu" and dim in (None, 1, x.ndim - 1) and x.numel() and act.dtype == x.dtype == slope.dtype
            and fwAD._current_level < 0 and not torch.compiler.is_compiling() and _kernel_can_read(act, x, slope)):
        kernel = cpu_blend()
        if kernel is not None and x.is_contiguous() and act.is_contiguous():
            # each slope for the `inner` elements after it in memory: the map at dim 1, else 1
            return kernel(act, x, slope, math.prod(x.shape[2:]) if dim == 1 else 1)
        order = _memory_order(x) if kernel is not None and dim is None and act.stride() == x.stride() else None
        if order is not None:  # a strided map (x.permute(0, 2, 3, 1)): the kernel in its memory order, the slopes
            # in that order too; permutes are views both ways, so the gradients keep their layouts
            back = sorted(range(x.ndim), key=order.__getitem__)
            w = slope.view(x.shape[1:]).permute([d - 1 for d in order[1:]]).reshape(-1)
            return kernel(act.permute(order), x.permute(order), w, 1).permute(back)
    if dim is None and x.numel() and not x.is_contiguous():  # the slopes in x's layout: the result keeps it
        weight = torch.empty_like(x[:1], dtype=slope.dtype).copy_(weight)
    return _compiled(_Blend, _BlendCompiled).apply(act, x, weight)


def _memory_order(x: torch.Tensor) -> list[int] | None:
    """The dims of ``x`` in the order of its memory, the batch dim first (``x.permute(order)`` is contiguous), or
    ``None`` when there is none such (gaps, overlaps, the batch dim inside a sample)."""
    order = sorted(range(x.ndim), key=lambda d: -x.stride(d))
    return order if order[0] == 0 and x.permute(order).is_contiguous() else None


def _channel_axis(x: torch.Tensor, channel_dim: int, channels: int, owner: str, ndim: int | None = None) -> int:
    """The non-negative axis of ``x`` at ``channel_dim``; ``ValueError`` naming ``owner`` unless ``x`` has
    ``channels`` there (a 0-d input, or one of another width, would broadcast or mix channels), or, with
    ``ndim`` and a ``channel_dim`` counted from the batch dim, when ``x`` has fewer than ``ndim`` dims (an
    unbatched ``[C, H, W]`` map would get its slopes along H)."""
    if ndim is not None and channel_dim >= 0 and x.ndim < ndim:
        raise ValueError(
            f"{owner} was built on inputs of {ndim} dims, a batch dim first and the {channels} channels at dim "
            f"{channel_dim}, got an input of shape {tuple(x.shape)}: an unbatched input (a [C, H, W] image) "
            "would get its slopes along another axis. Fix: add the batch dim, model(x.unsqueeze(0))[0]")
    dim = channel_dim if channel_dim >= 0 else x.ndim + channel_dim
    if not 0 <= dim < x.ndim or x.shape[dim] != channels:
        raise ValueError(
            f"{owner} was built for {channels} channels at dim {channel_dim}, got an input of shape "
            f"{tuple(x.shape)}. A module reused on inputs of different widths needs one unit per call "
            "site: convert the model with linearize.convert, which finds each call."
        )
    return dim


def _relu_family(x: torch.Tensor, leak: float) -> torch.Tensor:
    """ReLU (``leak`` 0) or LeakyReLU of negative slope ``leak``: the original activation of a ReLU-family unit."""
    return F.leaky_relu(x, leak) if leak else F.relu(x)


def _owner(module: nn.Module) -> str:
    """How errors name a unit (``LinearizableActivation(relu)``) or a plain form (``ChannelBlend(channels=3, ...)``)."""
    kind = getattr(module, "kind", None)
    return f"{type(module).__name__}({module.extra_repr() if kind is None else kind})"


def _integer_call(module: nn.Module, x: torch.Tensor, original: Callable[[torch.Tensor], torch.Tensor] | None
                  ) -> torch.Tensor:
    """``original(x)`` on an integer or bool ``x`` (written into ``x`` for an in-place ``module``); ``TypeError``
    naming ``module``, the dtype and the fix where it refuses the dtype (a raw error of the kernels otherwise),
    or where ``module`` records no original activation (``None``)."""
    fix = "Fix: convert the input to a floating dtype (x.float(), or the model's dtype) before the activation"
    if original is None:
        raise TypeError(f"linearize: a {_owner(module)} got an input of dtype {x.dtype}, and it records no original "
                        f"activation to compute on one (made by hand, or saved before plain forms recorded it). {fix}")
    try:
        return write_into(x, original) if module.inplace else original(x)
    except (RuntimeError, NotImplementedError) as e:
        raise TypeError(f"linearize: a {_owner(module)} got an input of dtype {x.dtype}, which the original "
                        f"activation does not take either ({str(e).splitlines()[0]}). {fix}") from e


def nested_parts(x: torch.Tensor, channel_dim: int | None) -> list[torch.Tensor] | None:
    """The dense tensors an elementwise activation, channels at ``channel_dim``, runs on for a nested tensor ``x``
    (``torch.nested``): a jagged one's values (``[1, T, ...]``, the batch and ragged dims merged), or a strided
    one's tensors (``[1, ...]``, in order); ``None`` where the channels cannot broadcast: at a ragged dim, or
    one slope per position of a fixed map (``channel_dim`` ``None``)."""
    if channel_dim is None:
        return None
    if x.layout == torch.strided:
        return [t.unsqueeze(0) for t in x.unbind()]
    ragged = [d for d, n in enumerate(x.shape) if not isinstance(n, int)]
    dim = channel_dim if channel_dim >= 0 else x.dim() + channel_dim
    return [x.values().unsqueeze(0)] if ragged == [1] and dim != 1 else None


def _nested_call(module: nn.Module, x: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor],
                 channel_dim: int | None) -> torch.Tensor:
    """``dense`` on a nested tensor, elementwise as the original activation, on its :func:`nested_parts`: a
    jagged result keeps ``x``'s offsets, so it combines with ``x`` again. ``ValueError`` naming ``module`` and
    the fix where those are ``None``."""
    parts = nested_parts(x, channel_dim)
    if parts is None:
        where = "one slope per position of a fixed map" if channel_dim is None else (
            f"its channels at dim {channel_dim}, next to a ragged dim")
        shape = tuple(x.shape) if x.layout == torch.jagged else [tuple(t.shape) for t in x.unbind()]  # strided: none
        raise ValueError(
            f"{_owner(module)} cannot run on a nested tensor of shape {shape} ({where}). Fix: pass a padded "
            "tensor (nt.to_padded_tensor(0.0)), or convert with exclude_modules=[...] naming this activation")
    if x.layout == torch.jagged:
        return torch.nested.nested_tensor_from_jagged(dense(parts[0])[0], x.offsets(), x.lengths())
    return torch.nested.as_nested_tensor([dense(t)[0] for t in parts], layout=torch.strided)


def _activation_forward(module: nn.Module, x: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor],
                       original: Callable[[torch.Tensor], torch.Tensor] | None, weights: Iterable[torch.Tensor],
                       channel_dim: int | None) -> torch.Tensor:
    """The forward of a unit and of its plain forms (``module``): ``dense``, the computation on a floating tensor,
    which uses ``weights``; written into ``x`` when ``module.inplace`` (:func:`write_into`).

    An integer or bool ``x`` gets ``original``, the activation the unit replaced, whatever the slopes (as a
    functional call on integers, which is no site: such an input has no slope to learn), or ``TypeError`` naming
    ``module``, the dtype and the fix. A nested tensor runs ``dense`` on its values, its channels at
    ``channel_dim`` (``None``: one slope per position of a fixed map, refused naming ``module`` and the fix).
    Units and plain forms share it, so a folded model takes the inputs the converted model takes, alike.
    """
    if not (x.is_floating_point() or x.is_complex()):
        return _integer_call(module, x, original)
    fn = functools.partial(_nested_call, module, dense=dense, channel_dim=channel_dim) if x.is_nested else dense
    return write_into(x, fn, weights) if module.inplace else fn(x)


class ChannelPReLU(nn.PReLU):
    """``nn.PReLU`` whose channels sit at ``channel_dim`` (``nn.PReLU`` assumes dim 1).

    ``weight`` ``[C]`` is the slope for negative inputs. Input ``[..., C, ...]`` with ``C`` at
    ``channel_dim``; output has the same shape. A ReLU-family unit's plain form
    (:meth:`LinearizableActivation.plain_activation`): where the weight is 0, an input of -inf gives 0 as the
    unit does, not ``F.prelu``'s NaN (:func:`_zero_safe_prelu`); nested and integer inputs as the unit
    (:func:`_activation_forward`): ``leak`` is the negative slope of the unit's original activation (0: ReLU),
    which integer and bool inputs get; ``None`` (the default) refuses them with ``TypeError``.
    """

    leak: float | None = None  # also for modules pickled before it was recorded

    def __init__(self, weight: torch.Tensor, channel_dim: int = 1, inplace: bool = False,
                 leak: float | None = None) -> None:
        super().__init__(num_parameters=weight.numel(), device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight.reshape(-1))
        self.channel_dim = channel_dim
        self.inplace = inplace  # write the result into the input (the plain form of an in-place unit)
        self.leak = leak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        original = None if self.leak is None else functools.partial(_relu_family, leak=self.leak)
        return _activation_forward(self, x, self._prelu, original, (self.weight,), self.channel_dim)

    def _prelu(self, x: torch.Tensor) -> torch.Tensor:
        if self.num_parameters == 1:  # one slope for every element, whatever the shape
            return _zero_safe_prelu(x, self.weight)
        dim = _channel_axis(x, self.channel_dim, self.num_parameters, "ChannelPReLU")
        if dim == 1:
            return _zero_safe_prelu(x, self.weight)
        if dim == x.ndim - 1:
            return _zero_safe_prelu(x.reshape(-1, self.num_parameters), self.weight).reshape(x.shape)
        return _zero_safe_prelu(x.movedim(dim, 1), self.weight).movedim(1, dim)

    def extra_repr(self) -> str:
        return (f"num_parameters={self.num_parameters}, channel_dim={self.channel_dim}"
                + (", inplace=True" if self.inplace else ""))


class ChannelBlend(nn.Module):
    """Fixed per-channel blend ``(1 - a) * act(x) + a * x`` (a frozen smooth unit's plain form), or
    ``(1 - a) * act(x) + a * (alpha * x + beta)`` with affine linear ends (a unit's plain form after
    :meth:`LinearizableActivation.set_linear_end`).

    ``slope`` ``[C]`` (a buffer) broadcast along ``channel_dim``; ``alpha`` and ``beta`` ``[C]`` buffers,
    or ``None`` (the identity end). Nested inputs run as the unit's, and integer and bool inputs get ``act``, as
    the unit's do (:func:`_activation_forward`).
    """

    def __init__(self, act: nn.Module, slope: torch.Tensor, channel_dim: int = 1, inplace: bool = False,
                 alpha: torch.Tensor | None = None, beta: torch.Tensor | None = None) -> None:
        super().__init__()
        self.act = act
        self.channel_dim = channel_dim
        self.inplace = inplace  # write the result into the input (the plain form of an in-place unit)
        self.register_buffer("slope", slope.detach().clone().reshape(-1))
        if (alpha is None) != (beta is None):
            raise ValueError("ChannelBlend takes both alpha and beta (an affine linear end) or neither")
        self.register_buffer("alpha", None if alpha is None else alpha.detach().clone().reshape(-1))
        self.register_buffer("beta", None if beta is None else beta.detach().clone().reshape(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _activation_forward(self, x, self._blend, self.act, self.act.parameters(), self.channel_dim)

    def _blend(self, x: torch.Tensor) -> torch.Tensor:
        shape = [1] * x.ndim
        shape[_channel_axis(x, self.channel_dim, self.slope.numel(), "ChannelBlend")] = self.slope.numel()
        alpha, beta = self._buffers.get("alpha"), self._buffers.get("beta")  # absent in older pickles
        end = x if alpha is None else torch.addcmul(beta.to(x.dtype).view(shape), alpha.to(x.dtype).view(shape), x)
        return exact_lerp(self.act(x), end, self.slope.to(x.dtype).view(shape))

    def extra_repr(self) -> str:
        return (f"channels={self.slope.numel()}, channel_dim={self.channel_dim}"
                + (", inplace=True" if self.inplace else ""))


class LinearizableActivation(nn.Module):
    """Per-channel blend of an activation with the identity.

    ``y = (1 - a) * act(x) + a * x`` with ``a = slope`` broadcast along ``channel_dim``.

    Args:
        act: the activation it replaces: a module (``nn.ReLU()``, an HF ``GELUActivation``...),
            a callable (``F.gelu``) or the name ``"relu"``. In-place modules are copied with
            ``inplace=False``: the unit does not write into its input, unless ``unit.inplace`` is set
            (``linearize.convert`` sets it for the units of in-place activation modules, so that every
            later read of their input sees what it saw in the original).
        num_channels: ``C``, the size of the input along ``channel_dim``.
        channel_dim: ``1`` for conv feature maps ``[N, C, H, W]``, ``-1`` for ``[B, T, D]`` hidden
            states and ``[N, D]`` features.
        kind: a short name of the activation (``"relu"``, ``"gelu"``...), for reports and filters.
        init_slope: initial value of every slope (0 keeps the original function).

    Shapes: input and output have the same shape; ``input.shape[channel_dim] == num_channels``,
    otherwise the forward raises ``ValueError``.
    """

    def __init__(
        self,
        act: nn.Module | Callable[[torch.Tensor], torch.Tensor] | str,
        num_channels: int,
        channel_dim: int = 1,
        kind: str | None = None,
        init_slope: float = 0.0,
    ) -> None:
        super().__init__()
        if not isinstance(num_channels, int) or num_channels < 1:
            raise ValueError(f"num_channels must be a positive int, got {num_channels!r}")
        if not 0.0 <= init_slope <= 1.0:
            raise ValueError(f"init_slope must lie in [0, 1], got {init_slope}")
        channel_dim = check_channel_dim(channel_dim)
        if act == "relu":
            act = nn.ReLU()
        if isinstance(act, nn.Module):
            act = _without_inplace(act)
            self.act = act
        elif callable(act):
            self.act_fn = act  # plain function (e.g. F.gelu taken from an HF config)
        else:
            raise TypeError(f"act must be an nn.Module, a callable or 'relu', got {act!r}")
        self.kind = kind or _kind_name(act)
        self.num_channels = num_channels
        self.channel_dim = channel_dim
        # the dims of the probe's input when channel_dim counts from the batch dim (set by make_unit): an input
        # with fewer (an unbatched map) is refused; None takes any
        self.input_ndim: int | None = None
        # ReLU / LeakyReLU(s): (1-a) * leaky_s(x) + a x is a PReLU with weight s + a (1 - s) (``leak``: s)
        self._prelu = _prelu_leak(act) is not None
        self.slope = nn.Parameter(torch.full((num_channels,), float(init_slope)))
        # NaN = free channel, 0. or 1. = frozen at that value.
        self.register_buffer("frozen", torch.full((num_channels,), math.nan))
        self._frozen_seen: tuple[int, int, int, torch.Tensor | None] | None = None  # (id, version, data_ptr, mask)
        # the affine linear end alpha * x + beta ([C] each); None: the identity (set_linear_end)
        self.register_parameter("alpha", None)
        self.register_parameter("beta", None)
        _UNITS.add(self)
        install_optimizer_hooks()

    @property
    def linear_end(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(alpha, beta)``, the ``[C]`` tensors of the affine linear end (learnable parameters, or fixed buffers:
        :meth:`set_linear_end`), or ``None`` for the identity end (the default: a unit computes
        ``(1 - a) * act(x) + a * x``)."""
        ends = self._parameters if self._parameters.get("alpha") is not None else self._buffers
        alpha, beta = ends.get("alpha"), ends.get("beta")  # absent in older pickles
        return None if alpha is None else (alpha, beta)

    @torch.no_grad()
    def set_linear_end(self, alpha: torch.Tensor | float | None, beta: torch.Tensor | float | None = 0.0,
                       trainable: bool | None = None) -> None:
        """Make the unit compute ``(1 - a) * act(x) + a * (alpha * x + beta)`` per channel (an affine linear end).

        ``alpha`` and ``beta``: ``[C]`` tensors or numbers (finite). They become ``unit.alpha`` and ``unit.beta``
        (existing ones are overwritten in place, so an optimizer holding them keeps them), saved by
        :func:`linearize.save_pretrained`, frozen into plain modules and folded exactly by :func:`linearize.fold`.
        ``alpha=None`` removes them: the identity end again. :func:`linearize.fit_linear_ends` fits them on data.
        A channel at ``a = 0`` ignores its end.

        ``trainable``: ``True`` makes them learnable ``nn.Parameter`` s, ``False`` fixed buffers, which are in no
        optimizer (the :class:`~linearize.Sparsifier`'s ends, which its running fit sets), with the 0-d buffer
        ``end_fixed`` that records it in the state dict: ``load_state_dict`` gives back the kind that was saved.
        ``None`` (default) keeps the kind of existing ends and makes new ones learnable.

        Example:
            >>> unit = LinearizableActivation(nn.ReLU(), 2, init_slope=1.0)
            >>> unit.set_linear_end(torch.tensor([0.5, 0.0]), torch.tensor([0.0, 3.0]))
            >>> unit(torch.tensor([[-2.0, 5.0]])).tolist()
            [[-1.0, 3.0]]
        """
        if alpha is None:
            self._drop_linear_end()
            return
        values = []
        for what, v in (("alpha", alpha), ("beta", beta)):
            t = torch.as_tensor(v, dtype=self.slope.dtype).to(self.slope.device)
            if t.ndim == 0:
                t = t.expand(self.num_channels)
            if tuple(t.shape) != (self.num_channels,):
                raise ValueError(f"{what} must be a number or a [{self.num_channels}] tensor (one per channel of this "
                                 f"{self.kind} unit), got shape {tuple(t.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{what} must be finite, got {int((~torch.isfinite(t)).sum())} non-finite value(s)")
            values.append(t)
        end = self.linear_end
        if end is not None and trainable in (None, isinstance(end[0], nn.Parameter)):
            for own, t in zip(end, values):
                own.copy_(t)
            return
        self._drop_linear_end()
        for name, t in zip(("alpha", "beta"), values):
            if trainable is False:
                del self._parameters[name]  # a name lives in one of the dicts (nn.Module looks in _parameters first)
                self._buffers[name] = t.clone()
            else:
                self._parameters[name] = nn.Parameter(t.clone())
        if trainable is False:
            self._buffers["end_fixed"] = torch.ones((), dtype=torch.bool, device=self.slope.device)

    def _drop_linear_end(self) -> None:
        """The identity end: no ``alpha``, ``beta`` (parameters or buffers), no ``end_fixed``."""
        for name in ("alpha", "beta", "end_fixed"):
            self._buffers.pop(name, None)
        self._parameters["alpha"] = self._parameters["beta"] = None

    def identity_end_mask(self) -> torch.Tensor:
        """Bool ``[C]``: channels whose linear end is the identity (``alpha = 1, beta = 0``, or no affine end)."""
        end = self.linear_end
        if end is None:
            return torch.ones(self.num_channels, dtype=torch.bool, device=self.slope.device)
        return (end[0].detach() == 1) & (end[1].detach() == 0)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # a saved affine end loads as it was saved, learnable or fixed (end_fixed), also into a unit that has none
        # yet (a freshly converted model): an optimizer built after the load holds the parameters the saved one did
        if prefix + "alpha" in state_dict and prefix + "beta" in state_dict:
            trainable = prefix + "end_fixed" not in state_dict
            end = self.linear_end
            if end is None or isinstance(end[0], nn.Parameter) != trainable:
                self.set_linear_end(1.0, 0.0, trainable)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def __setstate__(self, state: dict) -> None:  # deepcopy / pickle
        state.setdefault("input_ndim", None)  # pickled before units had it
        if "leak" in state:  # pickled when the unit kept its own copy of the negative slope
            state["_prelu"] = state.pop("leak") is not None
        super().__setstate__(state)
        _UNITS.add(self)

    @property
    def leak(self) -> float | None:
        """The negative slope of a ReLU (0.0) or LeakyReLU unit, read from its activation at every call (a
        ``negative_slope`` changed after :func:`linearize.convert` applies); ``None`` for the other kinds."""
        if not self._prelu:
            return None
        act = self._modules.get("act")
        return float(act.negative_slope) if isinstance(act, nn.LeakyReLU) else 0.0

    def __getattr__(self, name: str) -> Any:
        # nn.Module.__getattr__'s lookup written out (wrapping it cost a frame on every parameter access of a
        # forward), then the activation's hyper-parameters (unit.negative_slope, unit.max_val)
        d = self.__dict__
        if name in d.get("_parameters", ()):
            return d["_parameters"][name]
        if name in d.get("_buffers", ()):
            return d["_buffers"][name]
        modules = d.get("_modules", {})
        if name in modules:
            return modules[name]
        act = modules.get("act")
        if act is not None and not name.startswith("_") and name not in ("alpha", "beta") and hasattr(act, name):
            return getattr(act, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        act = self.__dict__.get("_modules", {}).get("act")
        if act is not None and not name.startswith("_") and name not in self.__dict__ and hasattr(act, name) \
                and not hasattr(type(self), name) and not isinstance(value, (torch.Tensor, nn.Module)):
            if name in ("alpha", "beta"):
                raise AttributeError(f"unit.{name} is this {self.kind} unit's affine linear end (set_linear_end); "
                                     f"the {type(act).__name__}'s own {name} is unit.act.{name}: set "
                                     f"unit.act.{name} = {value!r}")
            setattr(act, name, value)  # what the original model's activation would take: its hyper-parameter
            return
        super().__setattr__(name, value)

    @property
    def is_prelu(self) -> bool:
        """True when the unit runs as a fused PReLU (ReLU and LeakyReLU)."""
        return self.leak is not None

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """The original activation ``act(x)`` (what the unit computes at ``a = 0``)."""
        if self.leak is not None:
            return _relu_family(x, self.leak)
        return self.act(x) if "act" in self._modules else self.act_fn(x)

    def prelu_weight(self, slope: torch.Tensor | None = None) -> torch.Tensor:
        """The negative-side slope ``w = a + (1 - a) * leak`` (``a`` for a ReLU unit) of the PReLU this
        ReLU / LeakyReLU unit computes, ``[C]``: ``unit(x) == F.prelu(x, w)`` with channels at dim 1.

        Args:
            slope: slopes ``a`` to use instead of the unit's own (any shape, dtype and device; the
                unit's ``slope``, with its autograd graph, by default).

        Raises ``TypeError`` for a smooth unit (``is_prelu`` is False): it is no PReLU.

        Example:
            >>> LinearizableActivation(nn.LeakyReLU(0.1), 2).prelu_weight(torch.tensor([0.0, 0.5]))
            tensor([0.1000, 0.5500])
        """
        if self.leak is None:
            raise TypeError(f"a {self.kind} unit is a blend, not a PReLU: prelu_weight needs a relu or "
                            "leaky_relu unit (check unit.is_prelu)")
        a = self.slope if slope is None else slope
        return a if self.leak == 0 else a + (1 - a) * self.leak

    def plain_activation(self, slope: torch.Tensor | None = None,
                         end: tuple[torch.Tensor, torch.Tensor] | None = None) -> nn.Module:
        """A new plain module computing this unit at its slopes (or at ``slope``), holding its own copy of them.

        ``nn.Identity`` when every slope is 1; the original activation when every slope is 0
        (``nn.ReLU`` / ``nn.LeakyReLU`` for ReLU-family units, else a copy of ``act``, or a
        :class:`~linearize.activations.FunctionalActivation` of ``act_fn``); otherwise a
        :class:`ChannelPReLU` of :meth:`prelu_weight` (ReLU family) or a :class:`ChannelBlend`,
        with channels at ``channel_dim``. The unit is not modified. Where a channel with ``a > 0`` has an
        affine linear end (:meth:`set_linear_end`) other than the identity, a :class:`ChannelBlend` holding
        ``alpha`` and ``beta`` computes it.

        Args:
            slope: ``[C']`` slopes to use instead of the unit's own (fold passes snapped slopes, or
                more channels for a widened layer); the unit's current slopes by default.
            end: ``(alpha, beta)`` ``[C']`` to use instead of the unit's own linear end (which applies
                only when ``slope`` has ``C`` channels; another width gets the identity end by default).

        Example:
            >>> unit = LinearizableActivation(nn.ReLU(), 3)
            >>> unit.plain_activation(), unit.plain_activation(torch.ones(3))
            (ReLU(), Identity())
        """
        a = (self.slope if slope is None else slope).detach()
        if end is None and a.numel() == self.num_channels:
            end = self.linear_end
        if end is not None:
            alpha, beta = (t.detach().to(self.slope.dtype).reshape(-1) for t in end)
            if alpha.shape != a.shape or beta.shape != a.shape:
                raise ValueError(f"end must be two [{a.numel()}] tensors, like the slopes, got "
                                 f"{tuple(alpha.shape)} and {tuple(beta.shape)}")
            used = a > 0
            if not bool(((alpha[used] == 1) & (beta[used] == 0)).all()):  # an affine end in use: exact, as a blend
                return self._plain_blend(self._plain_act(), a.to(self.slope.dtype), self.inplace, alpha, beta)
        if bool((a >= 1).all()):
            return nn.Identity()
        if bool((a <= 0).all()):
            return self._plain_act(self.inplace)
        if self.is_prelu:
            return self._plain_prelu(self.prelu_weight(a).to(self.slope.dtype))
        return self._plain_blend(self._plain_act(), a.to(self.slope.dtype), self.inplace)

    def _plain_prelu(self, weight: torch.Tensor) -> nn.Module:
        """The plain PReLU module of negative-side slopes ``weight`` (:meth:`plain_activation`)."""
        return ChannelPReLU(weight, self.channel_dim, self.inplace, self.leak)

    def _plain_blend(self, act: nn.Module, slope: torch.Tensor, inplace: bool,
                     alpha: torch.Tensor | None = None, beta: torch.Tensor | None = None) -> nn.Module:
        """The plain blend module of ``act`` at ``slope`` (:meth:`plain_activation`)."""
        return ChannelBlend(act, slope, self.channel_dim, inplace, alpha, beta)

    def _plain_act(self, inplace: bool = False) -> nn.Module:
        if self.leak is not None:
            return nn.LeakyReLU(self.leak, inplace) if self.leak else nn.ReLU(inplace)
        act = copy.deepcopy(self.act) if "act" in self._modules else FunctionalActivation(self.act_fn, self.kind)
        if not inplace:
            return act
        if hasattr(act, "inplace"):  # nn.SiLU, nn.Hardswish, ...: their own in-place form
            act.inplace = True
            return act
        # no in-place form of its own: the write-back of a blend at slope 0 (exactly act(x))
        return self._plain_blend(act, torch.zeros(self.num_channels), True)

    inplace = False  # write the result into the input, as the replaced in-place activation did
    granularity = "channel"  # one slope per channel; ElementActivation: one per position of the input map

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (traced := fx_leaf_call(self, x)) is not None:  # torch.fx.symbolic_trace: one call_module node
            return traced
        # every parameter: an act module may hold its own (a learnable activation), beside the slopes
        return _activation_forward(self, x, self._blend, self.activation, self.parameters(),
                                  self.channel_dim if self.granularity == "channel" else None)

    def _blend(self, x: torch.Tensor) -> torch.Tensor:
        dim = _channel_axis(x, self.channel_dim, self.num_channels, _owner(self), self.input_ndim)
        return self._mix(x, dim)

    def _mix(self, x: torch.Tensor, dim: int | None) -> torch.Tensor:
        """The unit on ``x``, its slopes along ``dim`` (``None``: one per position of the map ``x.shape[1:]``, a smooth
        element unit's)."""
        a = self.slope  # one module attribute lookup: the forward runs at every call site, every step
        if a.dtype != x.dtype:
            a = a.to(x.dtype)
        end = self.linear_end
        if end is not None:  # affine end: (1 - a) act(x) + a (alpha x + beta), exact at a = 0 and 1
            shape = self.broadcast_shape(x.ndim)
            alpha, beta = (t.to(x.dtype).view(shape) for t in end)
            return _blend(self._act_of(x), _affine_end(x, alpha, beta), a, dim)
        if self.leak and x.dtype in (torch.float16, torch.bfloat16):
            # the PReLU weight a + (1 - a) * leak would round leak to 8 or 11 bits: leaky_relu keeps it exact
            return _blend(F.leaky_relu(x, self.leak), x, a, dim)
        if self.leak is not None:
            w = self.prelu_weight(a)
            if dim == 1 or x.ndim == 2:
                return _prelu(x, w)
            if dim == x.ndim - 1:
                return _prelu(x.reshape(-1, self.num_channels), w).reshape(x.shape)
            return _prelu(x.movedim(dim, 1), w).movedim(1, dim)
        return _blend(self._act_of(x), x, a, dim)  # exact at a = 0 and 1

    def _act_of(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x)`` for the blend. The unit of an in-place ELU / CELU / SELU module, where ``x`` (a copy of the input,
        :func:`write_into`) needs a gradient, runs that in-place form on a copy of ``x``: its backward computes from
        the result (torch's ``elu_backward(is_result=True)``), as the original's did, and rounds otherwise than the
        out-of-place form's, which computes from the input."""
        act = self._modules.get("act")
        if self.inplace and type(act) in _RESULT_BACKWARD and x.requires_grad and torch.is_grad_enabled():
            act = copy.copy(act)  # the module's own forward, in place: elu_(x, alpha), selu_(x), celu_(x, alpha)
            act.inplace = True
            return act(x.clone())
        return self.activation(x)

    def broadcast_shape(self, ndim: int) -> list[int]:
        """Shape that broadcasts a ``[C]`` vector along ``channel_dim`` of an ``ndim`` input."""
        shape = [1] * ndim
        shape[self.channel_dim] = self.num_channels
        return shape

    def frozen_mask(self) -> torch.Tensor | None:
        """Bool ``[C]`` of the frozen channels, or None when none is frozen. Cached on the ``frozen``
        buffer's identity and version, so the optimizer hooks do no mask work or sync per step; not
        cached for an inference tensor (made under ``torch.inference_mode``: it has no version)."""
        frozen, seen = self.frozen, getattr(self, "_frozen_seen", None)
        key = None if frozen.is_inference() else (id(frozen), frozen._version, frozen.data_ptr())
        if key is None or seen is None or seen[:3] != key:
            mask = ~torch.isnan(frozen)
            mask = mask if bool(mask.any()) else None
            if key is None:
                return mask
            seen = self._frozen_seen = (*key, mask)
        return seen[3]

    def has_frozen(self) -> bool:
        """Whether any channel is frozen."""
        return self.frozen_mask() is not None

    def project_(self) -> None:
        """Clamp slopes to ``[0, 1]`` and restore frozen channels to their frozen value."""
        project_slopes((self,))

    def _restore_frozen(self) -> None:  # callers hold no_grad (a decorator here costs more than the check)
        mask = self.frozen_mask()
        if mask is not None:  # FSDP2: this rank's shard of the slopes (linearize.distributed)
            mask, frozen = shard_of(mask, self.slope), shard_of(self.frozen, self.slope)
            local(self.slope)[mask] = frozen[mask].to(self.slope.dtype)

    @torch.no_grad()
    def freeze_(self, mask: torch.Tensor, value: float) -> None:
        """Set channels ``mask`` (bool ``[C]``) to ``value`` (0 or 1) and stop their training."""
        if value not in (0.0, 1.0):
            raise ValueError(f"frozen slopes are 0 or 1, got {value}")
        mask = mask.to(device=self.frozen.device, dtype=torch.bool)
        self.frozen[mask] = value
        self.project_()

    @torch.no_grad()
    def unfreeze_(self) -> None:
        """Let every channel train again."""
        self.frozen.fill_(math.nan)

    def linear_mask(self, tol: float = 0.0, name: str | None = None) -> torch.Tensor:
        """Bool ``[C]``: channels that count as linear (``a >= 1 - tol``, see :func:`linear_masks`).

        Raises :class:`NonFiniteSlopeError` (naming ``name``, or the unit's kind) on a NaN/inf slope.
        """
        return linear_masks([(name or f"<{self.kind} unit>", self)], tol, "linear_mask")[0]

    def extra_repr(self) -> str:
        return f"{self.kind}, channels={self.num_channels}, channel_dim={self.channel_dim}"

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_scripting(self)


def map_view(x: torch.Tensor, map_shape: tuple[int, ...], owner: str) -> torch.Tensor:
    """``x`` as ``[N, P]``: its batch dim, then the ``P = prod(map_shape)`` positions of its map. ``ValueError``
    naming ``owner``, the expected and the got shape and the fix unless ``x.shape[1:] == map_shape``."""
    _check_map(x, map_shape, owner)
    return x.reshape(x.shape[0], math.prod(map_shape))  # no -1: an empty batch has no size to infer


def _check_map(x: torch.Tensor, map_shape: tuple[int, ...], owner: str) -> None:
    """The ``ValueError`` of :func:`map_view` unless ``x.shape[1:] == map_shape``."""
    if tuple(x.shape[1:]) != map_shape:
        raise ValueError(
            f"{owner} holds one slope per position of a {list(map_shape)} map (granularity='element', the shape "
            f"of the probe forward of linearize.convert), but got an input of shape {tuple(x.shape)} (map "
            f"{list(x.shape[1:])}). Element units need every input of the probe's shape: feed "
            f"[batch, {', '.join(map(str, map_shape))}] maps (the image size / sequence length the model was "
            "converted at), or convert with granularity='channel' (one slope per channel) for inputs whose size varies"
        )


class ElementPReLU(nn.Module):
    """PReLU with one negative slope per position of a fixed-shape map: ``weight`` ``[*map_shape]``, input
    ``[N, *map_shape]``; other maps raise ``ValueError``. An element-level ReLU unit's plain form (0, not NaN, for
    an input of -inf where the weight is 0; ``leak``, integer and nested inputs as :class:`ChannelPReLU`'s,
    nested ones refused as by element units).

    Example:
        >>> ElementPReLU(torch.tensor([[0.0, 0.5]]))(torch.tensor([[[-2.0, -2.0]]])).tolist()
        [[[0.0, -1.0]]]
    """

    leak: float | None = None  # also for modules pickled before it was recorded

    def __init__(self, weight: torch.Tensor, inplace: bool = False, leak: float | None = None) -> None:
        super().__init__()
        self.map_shape = tuple(weight.shape)
        self.weight = nn.Parameter(weight.detach().clone())
        self.inplace = inplace  # write the result into the input (the plain form of an in-place unit)
        self.leak = leak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        original = None if self.leak is None else functools.partial(_relu_family, leak=self.leak)
        return _activation_forward(self, x, self._prelu, original, (self.weight,), None)

    def _prelu(self, x: torch.Tensor) -> torch.Tensor:
        flat = map_view(x, self.map_shape, "ElementPReLU")
        return _zero_safe_prelu(flat, self.weight.reshape(-1)).view(x.shape)

    def extra_repr(self) -> str:
        return f"map_shape={list(self.map_shape)}" + (", inplace=True" if self.inplace else "")


class ElementBlend(nn.Module):
    """Fixed blend ``(1 - a) * act(x) + a * x`` (or ``+ a * (alpha * x + beta)``, an affine end) with one ``a``
    per position of a fixed-shape map: ``slope``, ``alpha``, ``beta`` ``[*map_shape]`` buffers (the last two
    ``None`` for the identity end), input ``[N, *map_shape]``. An element-level smooth unit's plain form (integer
    and nested inputs as :class:`ChannelBlend`'s, nested ones refused as by element units).

    Example:
        >>> ElementBlend(nn.Tanh(), torch.tensor([0.0, 1.0]))(torch.tensor([[-9.0, -9.0]])).tolist()
        [[-1.0, -9.0]]
    """

    def __init__(self, act: nn.Module, slope: torch.Tensor, inplace: bool = False,
                 alpha: torch.Tensor | None = None, beta: torch.Tensor | None = None) -> None:
        super().__init__()
        if (alpha is None) != (beta is None):
            raise ValueError("ElementBlend takes both alpha and beta (an affine linear end) or neither")
        self.act = act
        self.map_shape = tuple(slope.shape)
        self.inplace = inplace  # write the result into the input (the plain form of an in-place unit)
        self.register_buffer("slope", slope.detach().clone())
        self.register_buffer("alpha", None if alpha is None else alpha.detach().clone().reshape(self.map_shape))
        self.register_buffer("beta", None if beta is None else beta.detach().clone().reshape(self.map_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _activation_forward(self, x, self._blend, self.act, self.act.parameters(), None)

    def _blend(self, x: torch.Tensor) -> torch.Tensor:
        flat = map_view(x, self.map_shape, "ElementBlend")
        end = flat if self.alpha is None else torch.addcmul(
            self.beta.to(x.dtype).reshape(-1), self.alpha.to(x.dtype).reshape(-1), flat)
        act = self.act(x).reshape(flat.shape)
        return exact_lerp(act, end, self.slope.to(x.dtype).reshape(-1)).view(x.shape)

    def extra_repr(self) -> str:
        return f"map_shape={list(self.map_shape)}" + (", inplace=True" if self.inplace else "")


class ElementActivation(LinearizableActivation):
    """A unit with one slope per *position* of its input map (``granularity="element"``), not per channel.

    ``y = (1 - a) * act(x) + a * x`` with ``a`` of shape ``map_shape`` (the input's shape without the batch
    dim, e.g. ``[C, H, W]``): one slope per ReLU of the private-inference literature (SNL, AutoReP). The
    slopes are stored flat, ``slope`` ``[P]`` with ``P = prod(map_shape)`` in row-major order of the map
    (``slope.view(map_shape)`` is the slope map), and ``num_channels`` is ``P``: counts, fractions, freezing,
    saving and the :class:`~linearize.Sparsifier` see every position as one channel. A ReLU-family unit
    runs on the ``[N, P]`` view of its input (channels at dim 1: the PReLU kernel of channel units); a smooth one
    calls its activation and blends on the input as it comes (a strided input keeps its layout: torch's CPU
    activations round otherwise on a contiguous copy), with the blend kernel on contiguous and dense strided inputs;
    ``channel_dim`` is 1. Inputs of another map shape raise ``ValueError`` (the size is fixed at conversion).

    Args:
        act: as for :class:`LinearizableActivation`.
        map_shape: the input's shape without its batch dim (one or more positive sizes).
        kind, init_slope: as for :class:`LinearizableActivation`.

    Example:
        >>> unit = ElementActivation(nn.ReLU(), (1, 2, 2))
        >>> with torch.no_grad():
        ...     unit.slope[1:] = 1.0  # 3 of 4 positions linear
        >>> unit(torch.full((1, 1, 2, 2), -1.0)).tolist()
        [[[[0.0, -1.0], [-1.0, -1.0]]]]
    """

    granularity = "element"

    def __init__(self, act: nn.Module | Callable[[torch.Tensor], torch.Tensor] | str, map_shape: Iterable[int],
                 kind: str | None = None, init_slope: float = 0.0) -> None:
        shape = tuple(map_shape)
        if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
            raise ValueError(f"map_shape must be one or more positive ints (the input shape without the batch dim), "
                             f"got {shape!r}")
        super().__init__(act, math.prod(shape), 1, kind, init_slope)
        self.map_shape = shape

    def _blend(self, x: torch.Tensor) -> torch.Tensor:
        owner = f"ElementActivation({self.kind})"
        if self.leak is not None:  # a PReLU, on the [N, P] view (its kernel): values and gradients are selections
            return LinearizableActivation._blend(self, map_view(x, self.map_shape, owner)).view(x.shape)
        # the activation and the blend on x as it comes: a strided input copied to a contiguous [N, P] made
        # torch's CPU GELU round otherwise than the original on x, and copied the gradient the activation gets
        _check_map(x, self.map_shape, owner)
        return self._mix(x, None)

    def broadcast_shape(self, ndim: int) -> list[int]:
        """``[1, *map_shape]``, the slopes against the unit's input; ``[1, P]`` against its ``[N, P]`` view (``ndim``
        2: a ReLU-family unit's PReLU)."""
        return [1, self.num_channels] if ndim == 2 else [1, *self.map_shape]

    def _plain_prelu(self, weight: torch.Tensor) -> nn.Module:
        return ElementPReLU(weight.reshape(self.map_shape), self.inplace, self.leak)

    def _plain_blend(self, act: nn.Module, slope: torch.Tensor, inplace: bool,
                     alpha: torch.Tensor | None = None, beta: torch.Tensor | None = None) -> nn.Module:
        return ElementBlend(act, slope.reshape(self.map_shape), inplace, alpha, beta)

    def extra_repr(self) -> str:
        return f"{self.kind}, map_shape={list(self.map_shape)}, positions={self.num_channels}"


def make_unit(act: nn.Module | Callable[[torch.Tensor], torch.Tensor], shape: Iterable[int], channel_dim: int,
              kind: str | None, init_slope: float, granularity: str, name: str = "") -> LinearizableActivation:
    """The unit of ``granularity`` for an activation call whose input has ``shape`` (batch dim first):
    :class:`LinearizableActivation` with ``shape[channel_dim]`` channels, or :class:`ElementActivation`
    with one slope per position of ``shape[1:]``. ``ValueError`` naming ``name`` for an input without
    a batch dim at element granularity.

    Example:
        >>> make_unit(nn.ReLU(), (8, 3, 4, 4), 1, "relu", 0.0, "element").num_channels
        48
    """
    shape = tuple(shape)
    if granularity == "channel":
        unit = LinearizableActivation(act, shape[channel_dim], channel_dim, kind, init_slope)
        if channel_dim >= 0:  # counted from the batch dim: an input without one (fewer dims) is refused
            unit.input_ndim = len(shape)
        return unit
    if granularity != "element":
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if len(shape) < 2:
        raise ValueError(f"granularity='element': activation {name!r} runs on an input of shape {list(shape)}, "
                         "which has no batch dim before its map: exclude it (exclude_modules=[...]) or convert "
                         "with granularity='channel'")
    return ElementActivation(act, shape[1:], kind, init_slope)


def refuse_element_units(named_units: Iterable[tuple[str, LinearizableActivation]], what: str, fix: str) -> None:
    """``ValueError`` naming ``what``, the element-level units among ``named_units`` and ``fix``: for functions
    that read slopes per channel (one slope broadcast along a channel axis)."""
    element = [name for name, unit in named_units if unit.granularity == "element"]
    if element:
        raise ValueError(
            f"{what} works on channel units (one slope per channel), but {len(element)} unit(s) are element-level "
            f"(granularity='element', one slope per position), e.g. {element[:3]}. {fix}")


def write_into(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
               weights: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """``x.copy_(fn(x))``: what an in-place activation does. When gradients flow (to ``x`` or to any of
    ``weights``, the parameters ``fn`` uses), ``fn`` gets a copy of ``x``: its backward needs the input
    as it was, and autograd refuses an input changed after use.

    Example:
        >>> x = torch.tensor([-1.0, 2.0])
        >>> write_into(x, torch.relu) is x, x
        (True, tensor([0., 2.]))
    """
    grads = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))
    return x.copy_(fn(x.clone() if grads else x))


# activation modules whose in-place form's backward computes from the result, not the input
_RESULT_BACKWARD = (nn.ELU, nn.CELU, nn.SELU)


def _without_inplace(act: nn.Module) -> nn.Module:
    if getattr(act, "inplace", False):
        act = copy.copy(act)
        act.inplace = False
    return act


def _prelu_leak(act: object) -> float | None:
    """The negative slope of a unit that computes as a PReLU: an exact ``nn.ReLU`` / ``nn.LeakyReLU``
    or the relu function (a subclass may change ``forward``); ``None`` for the others."""
    exact = type(act) in (nn.ReLU, nn.LeakyReLU) or act is F.relu or act is torch.relu
    return negative_slope(act) if exact else None


def _kind_name(act: object) -> str:
    name = type(act).__name__ if isinstance(act, nn.Module) else getattr(act, "__name__", "act")
    return name.lower()


def units(model: nn.Module) -> list[tuple[str, LinearizableActivation]]:
    """Every unit of ``model`` as ``(qualified_name, unit)``, in module registration order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LinearizableActivation)]


def sites(model: nn.Module, also: Callable[[nn.Module], bool] = lambda m: False) -> list[tuple[str, nn.Module]]:
    """The activation sites of ``model`` as ``(qualified_name, module)``, in registration order: its units,
    and the modules for which ``also(module)`` holds that are not inside a unit (a unit's own activation).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), LinearizableActivation(nn.ReLU(), 2, -1), nn.ReLU())
        >>> [(n, type(m).__name__) for n, m in sites(net, also=lambda m: isinstance(m, nn.ReLU))]
        [('1', 'LinearizableActivation'), ('2', 'ReLU')]
    """
    found: list[tuple[str, nn.Module]] = []
    inside: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if inside and name.startswith(inside):
            continue
        if isinstance(module, LinearizableActivation):
            found.append((name, module))
            inside += (f"{name}.",)
        elif also(module):
            found.append((name, module))
    return found


def gated_mode(model: nn.Module) -> str | None:
    """``"dgn"`` / ``"dlgn"`` when ``model`` is or holds a gated network (:mod:`linearize.gated`), else ``None``."""
    for m in model.modules():
        config = m.__dict__.get("linearize_config")
        if isinstance(config, GatedConfig):
            return config.mode
    return None


def gated_error(model: nn.Module, what: str) -> ValueError | None:
    """The error for ``what`` (a function needing PReLU units) on a gated network, else ``None``."""
    mode = gated_mode(model)
    if mode is None:
        return None
    return ValueError(
        f"{what} works on PReLU units (linearize.convert(model), mode='prelu'), but the model is a "
        f"{mode.upper()} gated network (linearize.convert(..., mode={mode!r})): its gates have no slopes. "
        "Use it on the original model converted with mode='prelu' instead"
    )


def require_units(model: nn.Module, why: str = "", what: str = "this") -> list[tuple[str, LinearizableActivation]]:
    """:func:`units`, raising ``ValueError`` (with ``why``; :func:`gated_error` naming ``what`` for a
    gated network) when the model has none."""
    found = units(model)
    if not found:
        raise gated_error(model, what) or ValueError(
            f"the model has no linearizable units{', so ' + why if why else ''}: call linearize.convert(model) first"
        )
    refuse_unsupported(model, [u.slope for _, u in found])  # FSDP1, DeepSpeed ZeRO-3
    return found


def check_finite_slopes(named_units: Iterable[tuple[str, LinearizableActivation]], where: str,
                        explain: Callable[[], str | None] | None = None) -> None:
    """Raise :class:`NonFiniteSlopeError` naming every unit with a NaN/inf slope; ``where`` names the caller;
    ``explain``, called only then, may name the cause and its fix in place of the divergence's (``None``: not known).

    After a divergence the slopes are NaN: they are neither linear nor nonlinear, so no count,
    fraction, history, projection or fold may turn them into a number. One device sync per
    device and dtype (the slopes are concatenated); frozen channels are not exempt: a frozen
    slope is restored to its frozen value (0 or 1) after every step, so it is finite unless the
    model itself was corrupted.
    """
    named = list(named_units)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, unit) in enumerate(named):
        groups.setdefault((unit.slope.device, unit.slope.dtype), []).append(i)
    slope = lambda i: full_value(named[i][1].slope.detach())  # noqa: E731  (FSDP2: the global slopes)
    bad: list[int] = []
    for idx in groups.values():
        if not bool(torch.isfinite(torch.cat([slope(i) for i in idx])).all()):
            bad += [i for i in idx if not bool(torch.isfinite(slope(i)).all())]
    if bad:
        sites = []
        for i in sorted(bad)[:5]:
            name, unit = named[i]
            a = full_value(unit.slope.detach())
            sites.append(f"{name!r} ({int(torch.isnan(a).sum())} NaN, {int(torch.isinf(a).sum())} inf "
                         f"of {unit.num_channels} channels)")
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        cause = None if explain is None else explain()
        raise NonFiniteSlopeError(
            f"{where}: non-finite slopes in {len(bad)} unit(s): {', '.join(sites)}{more}. " + (cause or (
                "Training diverged (a NaN/inf loss or gradient reached the slopes): a NaN slope is neither linear "
                "nor nonlinear, so nothing is counted. Restore a checkpoint and lower the learning rate or lam."))
        )


def linear_masks(
    named_units: Iterable[tuple[str, LinearizableActivation]], tol: float = 0.0, where: str = "linear_masks"
) -> list[torch.Tensor]:
    """The one definition of a linear channel: bool ``[C]`` per unit, True where ``a >= 1 - tol``.

    A channel is *nonlinear* exactly when it is not linear (its slope is below ``1 - tol``); every
    count, fraction, history, projection and fold in the package uses these masks. ``tol`` lies
    in ``[0, 1)`` (:func:`linearize.checks.check_tol`). A NaN/inf slope is neither:
    :class:`NonFiniteSlopeError` names the units (see :func:`check_finite_slopes`).
    """
    named = list(named_units)
    tol = check_tol(tol)
    check_finite_slopes(named, where)
    return [full_value(unit.slope.detach()) >= exact_threshold(1.0 - tol, unit.slope.dtype) for _, unit in named]


@functools.lru_cache(maxsize=64)
def exact_threshold(t: float, dtype: torch.dtype, above: bool = True) -> float:
    """The value of ``dtype`` nearest ``t`` on one side: with ``above``, the smallest ``>= t``, so that
    ``a >= it`` in ``dtype`` is ``a >= t`` exactly; otherwise the largest ``<= t`` (``a <= it`` is
    ``a <= t``).

    Comparing a tensor with a Python float rounds the float to the tensor's dtype: a threshold
    ``1 - tol`` rounded *down* onto a representable slope would count that slope as linear though
    it lies below ``1 - tol`` (e.g. bfloat16 slope 0.99609 with tol 0.0035), and ``tol`` rounded *up*
    would snap a slope above ``tol`` to 0.
    """
    r = torch.tensor(t, dtype=torch.float64).to(dtype)
    if (float(r) < t) if above else (float(r) > t):
        r = torch.nextafter(r, torch.tensor(2.0 if above else -2.0, dtype=dtype))
    return float(r)


def count_channels(
    named_units: Iterable[tuple[str, LinearizableActivation]], tol: float = 0.0, where: str = "count_units"
) -> dict:
    """:func:`count_units` of the given ``(name, unit)`` pairs (the :class:`~linearize.Sparsifier` counts its own)."""
    named = list(named_units)
    masks = linear_masks(named, tol, where)
    return _counts([(n, u.kind, u.num_channels, int(m.sum())) for (n, u), m in zip(named, masks)])


def _counts(per_site: list[tuple[str, str, int, int]]) -> dict:
    sites = {
        name: {"kind": kind, "total": total, "nonlinear": total - lin, "linear": lin,
               "fraction": (total - lin) / total}
        for name, kind, total, lin in per_site
    }
    total = sum(s["total"] for s in sites.values())
    nonlinear = sum(s["nonlinear"] for s in sites.values())
    return {"total": total, "nonlinear": nonlinear, "linear": total - nonlinear, "sites": sites}


def count_units(model: nn.Module, tol: float = 0.0) -> dict:
    """Channel counts: ``{"total", "nonlinear", "linear", "sites": {name: {...}}}``.

    A channel is linear when its slope ``a >= 1 - tol`` (``tol`` in ``[0, 1)``), nonlinear
    otherwise (:func:`linear_masks`); a NaN/inf slope raises :class:`NonFiniteSlopeError`; TorchScript submodules,
    whose activations linearize cannot see, give a warning. Each site entry holds ``total``,
    ``nonlinear``, ``linear``, ``fraction`` (nonlinear / total) and ``kind``. A gated model
    (DGN/DLGN, :mod:`linearize.gated`) has gates instead of slopes: every gate channel counts as
    nonlinear (see ``linearize.gated.gate_statistics`` for how often gates switch on data).
    """
    compiled = compiled_submodules(model)
    if compiled:
        warnings.warn(
            f"count_units: the TorchScript module(s) {', '.join(repr(n or '<root>') for n in compiled)} run compiled "
            "code that linearize cannot see; activations inside them are in no count, so the model may be less "
            "linear than the counts say. Fix: convert the Python module, then script the result", RuntimeWarning,
            stacklevel=2)
    report = getattr(model, "linearize_report", None)
    left = [p for p in report.problems() if not any(p.startswith(f"{n or '<root>'}: ") for n in compiled)] \
        if callable(getattr(report, "problems", None)) else []
    if left:  # nonlinearities convert saw and could not convert (a recurrent layer, a thread's call, ...)
        warnings.warn(f"count_units: {len(left)} activation(s) that convert left as they are (model.linearize_report) "
                      f"are in no count, so the model may be less linear than the counts say: {'; '.join(left)}",
                      RuntimeWarning, stacklevel=2)
    if not units(model) and callable(getattr(model, "gates", None)):
        check_tol(tol)
        return _counts([(n, g.kind, g.num_channels, 0) for n, g in model.gates()])
    return count_channels(require_units(model), tol, "count_units")


def nonlinear_fraction(model: nn.Module, tol: float = 0.0) -> float:
    """Fraction in ``[0, 1]`` of channels (over all units) whose slope is below ``1 - tol`` (see :func:`count_units`)."""
    counts = count_units(model, tol)
    return counts["nonlinear"] / counts["total"]


@torch.no_grad()
def fixed_values(unit: LinearizableActivation) -> torch.Tensor:
    """Every channel's fixed slope as the :class:`~linearize.Sparsifier` sees it, NaN where free: the unit's frozen
    values (:meth:`~LinearizableActivation.freeze_`), and where its slope has ``requires_grad=False`` every channel
    at its slope now: nothing trains such a slope, so the Sparsifier leaves it where it is.

    Example:
        >>> unit = LinearizableActivation("relu", 2, -1); _ = unit.slope.requires_grad_(False)
        >>> fixed_values(unit)
        tensor([0., 0.])
    """
    if unit.slope.requires_grad:
        return unit.frozen
    return torch.where(torch.isnan(unit.frozen), full_value(unit.slope.detach()).to(unit.frozen), unit.frozen)


@torch.no_grad()
def project_slopes(model_or_units: nn.Module | Iterable[LinearizableActivation]) -> None:
    """Clamp every slope to ``[0, 1]`` and restore frozen channels (what the optimizer hook does).

    A non-finite slope stays non-finite: NaN passes the clamp, and ``+-inf`` becomes NaN first
    (``lerp(a, a, 0) = a + 0 * (a - a)``: exact for finite ``a``, one kernel, no device sync), so a
    diverged slope is never projected to exactly 0 or 1 and the next count or
    :meth:`Sparsifier.step` reports it (:func:`check_finite_slopes`).
    """
    mods = (
        [u for _, u in units(model_or_units)]
        if isinstance(model_or_units, nn.Module)
        else list(model_or_units)
    )
    if mods:  # one kernel per operation for all units
        slopes = [local(unit.slope) for unit in mods]  # elementwise: each rank its own shard (FSDP2)
        torch._foreach_lerp_(slopes, slopes, 0.0)  # inf -> NaN, finite unchanged
        torch._foreach_clamp_min_(slopes, 0.0)
        torch._foreach_clamp_max_(slopes, 1.0)
        for unit in mods:
            unit._restore_frozen()


def _owned_units(optimizer: torch.optim.Optimizer) -> list[LinearizableActivation]:
    """The units whose slopes ``optimizer`` holds, cached until its parameter list changes."""
    ids = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
    cached = _OWNED_BY_OPTIMIZER.get(optimizer)
    if cached is None or cached[0] != ids:  # the held parameters are alive, so equal ids are the same ones
        held = set(ids)
        cached = _OWNED_BY_OPTIMIZER[optimizer] = (ids, [u for u in list(_UNITS) if id(u.slope) in held])
    return cached[1]


def _mask_frozen_grads(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for unit in _owned_units(optimizer):
        grad, mask = unit.slope.grad, unit.frozen_mask()
        if grad is not None and mask is not None:
            local(grad).masked_fill_(shard_of(mask, grad), 0.0)


def _project_after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    project_slopes(_owned_units(optimizer))


def install_optimizer_hooks() -> None:
    """Register (once per process) the global hooks that keep slopes in ``[0, 1]``.

    Applies to every ``torch.optim.Optimizer`` step, including optimizers built before the
    call, and only touches parameters that are unit slopes.
    """
    global _HOOKS_INSTALLED
    if not _HOOKS_INSTALLED:
        register_optimizer_step_pre_hook(_mask_frozen_grads)
        register_optimizer_step_post_hook(_project_after_step)
        _HOOKS_INSTALLED = True
