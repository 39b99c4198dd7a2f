"""Feed-forward blocks, found by shape: ``Linear|Conv1x1 -> (identity, eval dropout) -> unit ->
(identity, eval dropout) -> Linear|Conv1x1`` in a ``nn.Sequential`` or in any module whose forward
calls them in that order, the intermediate values used by nothing else (read from the probe
forward's data flow). timm ``Mlp`` (ViT, ConvNeXt, MLP-Mixer...), torchvision ``MLPBlock``, GPT-2,
T5 and Marian/BART FFNs and users' own blocks all have this shape.

The split: ``W2 act(W1 x + b1) + b2`` with ``k`` linear channels ``L`` out of ``m`` is
``W2[:, N] act(W1[N] x + b1[N]) + (W2[:, L] W1[L]) x + W2[:, L] b1[L] + b2``: a narrower FFN plus
one ``d x d_out`` linear path (:class:`LinearWithPassthrough` feeds ``x`` to it), and a fully
linear FFN is one layer; applied where the objective improves. With affine linear ends
``alpha * h + beta`` the path is ``W2[:, L] diag(alpha_L) W1[L]`` and the bias gains
``W2[:, L] (alpha_L b1[L] + beta_L)``. When every linear channel is a constant (``alpha_L = 0``: removed
channels) the path is zero and is not emitted: the FFN is narrowed to its ``n`` nonlinear channels
(``2 * d * n`` multiply-adds per position for ``d_out = d``) and the constants go into the bias.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from ..unit import LinearizableActivation
from .layers import dense_wb, get_path, is_dense, is_pointwise_conv, make_linear, set_path
from .modules import ConvWithPassthrough, LinearWithPassthrough, linear_end, snapped_slopes, units_of
from .rules import Cost, FoldContext, FoldRule

# Feed-forward modules whose layers sit in different submodules (not direct children of one
# forward, so not found by shape): (first linear, activation, second linear) attribute paths of one
# module whose forward computes second(act(first(x))). GPT-2 (c_fc, act, c_proj), T5 (wi, act, wo)
# and Marian/BART (fc1, activation_fn, fc2) are found by shape.
FFN_PATTERNS = (
    ("intermediate.dense", "intermediate.intermediate_act_fn", "output.dense"),  # BERT family
)
# gated FFNs, act on the gate branch only: (gate, up, activation) attributes of T5DenseGatedActDense and
# of the LLaMA family's MLP (LLaMA, Mistral, Qwen2, Gemma ...)
GATED_FFN_ATTRS = (("wi_0", "wi_1", "act"), ("gate_proj", "up_proj", "act_fn"))


def is_transparent(m: nn.Module) -> bool:
    """Layers that return their input unchanged in eval mode (``nn.Identity``, dropout)."""
    return type(m) is nn.Identity or (isinstance(m, _DropoutNd) and not m.training)


def _family(first: nn.Module, second: nn.Module) -> str | None:
    """``"dense"`` (Linear / HF Conv1D), ``"conv"`` (1x1 ``nn.Conv2d``) or ``None``."""
    if is_dense(first) and is_dense(second):
        return "dense"
    if all(type(m) is nn.Conv2d and is_pointwise_conv(m) for m in (first, second)):
        return "conv"
    return None


def _unit_fits(unit: nn.Module, family: str, out_shape: tuple[int, ...]) -> bool:
    """Whether ``unit`` acts on the features of ``first``'s output (last dim, or dim 1 of a conv map)."""
    if not isinstance(unit, LinearizableActivation) or not out_shape or unit.granularity == "element":
        return False  # element-level units merge only when the whole site is linear (a chain merge)
    dim = unit.channel_dim % len(out_shape)
    return dim == 1 if family == "conv" else dim == len(out_shape) - 1


def split_ffn(
    first: nn.Module, unit: LinearizableActivation, second: nn.Module, site: str, ctx: FoldContext
) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """Fold the linear channels of ``second(unit(first(x)))`` (Linear / HF Conv1D, or 1x1 convs).

    Returns ``(first', unit', second')``: ``first'`` a :class:`LinearWithPassthrough` /
    :class:`ConvWithPassthrough` (``nn.Identity`` with the unit when all channels are linear), or
    ``None`` if there is no linear channel or the split would not improve the objective (reported).
    """
    family = _family(first, second)
    w1, b1 = dense_wb(first)
    w2, b2 = dense_wb(second)
    m, d = w1.shape
    d_out = w2.shape[0]
    if family is None or unit.num_channels != m or w2.shape[1] != m:
        ctx.skipped("unit width does not match the FFN, not folded", site)
        return None
    a = snapped_slopes(unit, ctx.tol)
    lin = unit.linear_mask(ctx.tol)
    k = int(lin.sum())
    if k == 0:
        return None
    n = m - k
    # a linear channel computes its linear end alpha * h + beta (the identity: 1, 0): alpha scales its
    # column of the passthrough, beta goes into the bias (a removed channel, alpha = 0, is a constant)
    alpha, beta = linear_end(unit, w1)
    # the d x d_out path exists only if a linear channel's input row, through its end, is not exactly zero (a
    # Sequential's ends may already sit in the rows of ``first``); a zero conv path is kept only for a constant
    # conv FFN (n = 0: a 1x1 conv cannot have 0 channels)
    passthrough = bool((alpha[lin, None] * w1[lin] != 0).any()) or (n == 0 and family == "conv")
    path = d * d_out if passthrough else 0
    rows = math.prod(ctx.probe.out_shape.get(id(first), (1, m))) // m
    before = 2 * rows * (d * m + m * d_out)
    after = 2 * rows * (d * n + n * d_out + path)
    params_before = d * m + m * d_out + m + d_out
    params_after = path + d_out if n == 0 else d * n + n + n * d_out + path + d_out
    if not ctx.better(Cost(after, 1 if n == 0 else 2, params_after), Cost(before, 2, params_before)):
        ctx.skipped(
            f"{k}/{m} linear channels not folded (FLOPs {before:,} -> {after:,} would not lower the {ctx.objective})",
            site,
        )
        return None
    b1 = b1 if b1 is not None else w1.new_zeros(m)
    w_lin = (w2[:, lin] * alpha[lin]) @ w1[lin]
    b_lin = w2[:, lin] @ (alpha[lin] * b1[lin] + beta[lin]) + (b2 if b2 is not None else 0.0)
    second_cls, first_cls = (nn.Linear, LinearWithPassthrough) if family == "dense" else (nn.Conv2d, ConvWithPassthrough)
    kind = f"Linear({d}, {d_out})" if family == "dense" else f"1x1 Conv2d({d}, {d_out})"
    keep = ~lin
    if not passthrough:  # removed channels only: a narrower FFN, no d x d_out path (n = 0: a constant, 0 FLOPs)
        with warnings.catch_warnings():  # n = 0: torch warns that initializing its zero-element weights is a no-op
            warnings.filterwarnings("ignore", "Initializing zero-element tensors", UserWarning)
            new_first = make_linear(w1[keep], b1[keep], first, cls=second_cls)
            new_second = make_linear(w2[:, keep], b_lin, second, cls=second_cls)
        # the narrowed input keeps its rank and channel axis: the unit's channel_dim holds
        new_unit = nn.Identity() if n == 0 else unit.plain_activation(a[keep], (alpha[keep], beta[keep]))
        ctx.merged(
            f"{k}/{m} linear channels are constants (alpha = 0), removed into the bias; FFN narrowed to {n} channels, "
            f"no passthrough (FLOPs {before:,} -> {after:,})",
            site,
        )
        return new_first, new_unit, new_second
    if n == 0:
        ctx.merged(f"fully linear FFN merged into one {kind} (FLOPs {before:,} -> {after:,})", site)
        return nn.Identity(), nn.Identity(), make_linear(w_lin, b_lin, second, cls=second_cls)
    new_first = make_linear(w1[keep], b1[keep], first, cls=first_cls)
    new_second = make_linear(torch.cat([w2[:, keep], w_lin], 1), b_lin, second, cls=second_cls)
    new_unit = unit.plain_activation(  # identity on the d
        torch.cat([a[keep], a.new_ones(d)]),
        (torch.cat([alpha[keep], alpha.new_ones(d)]), torch.cat([beta[keep], beta.new_zeros(d)])))
    new_unit.channel_dim = -1 if family == "dense" else 1  # ChannelPReLU / ChannelBlend
    ctx.merged(
        f"{k}/{m} linear channels folded into a parallel {kind}; FFN narrowed to {n} channels "
        f"(FLOPs {before:,} -> {after:,})",
        site,
    )
    return new_first, new_unit, new_second


def split_in_chain(items: list[tuple[str, nn.Module]], ctx: FoldContext) -> bool:
    """Split ``first, [identity/dropout...], unit, [identity/dropout...], second`` in a flattened
    ``nn.Sequential`` (``items`` changed in place)."""
    changed = False
    solid = [i for i, (_, m) in enumerate(items) if not is_transparent(m)]
    for i, j, k in zip(solid, solid[1:], solid[2:]):
        (_, a), (nu, u), (_, b) = items[i], items[j], items[k]
        family = _family(a, b)
        if family is None or not all(ctx.once(x) for x in (a, u, b)):
            continue
        if not _unit_fits(u, family, ctx.probe.out_shape.get(id(a), ())):
            continue
        new = split_ffn(a, u, b, nu, ctx)
        if new is not None:
            for idx, m in zip((i, j, k), new):
                items[idx] = (items[idx][0], m)
            changed = True
    return changed


def find_ffns(module: nn.Module, ctx: FoldContext) -> list[tuple[str, str, str]]:
    """``(first, unit, second)`` child names of the FFNs directly in ``module``'s forward: the
    first's output feeds only the unit and the unit's output only the second (through identities
    and eval dropouts), each called once."""
    if not ctx.once(module):
        return []
    names = {id(c): n for n, c in module.named_children()}
    if not any(isinstance(c, LinearizableActivation) for c in module.children()):
        return []
    flow = ctx.probe.flow(module)
    found = []
    for node in flow.nodes:
        first = node.module
        if first is None or id(first) not in names or not (is_dense(first) or is_pointwise_conv(first)):
            continue
        if len(node.outputs) != 1 or not ctx.once(first):
            continue
        act = flow.only_consumer(node.outputs[0])
        if act is None or act.module is None or id(act.module) not in names or len(act.outputs) != 1:
            continue
        nxt = flow.only_consumer(act.outputs[0])
        if nxt is None or nxt.module is None or id(nxt.module) not in names:
            continue
        second, unit = nxt.module, act.module
        family = _family(first, second)
        if family is None or not all(ctx.once(x) for x in (unit, second)):
            continue
        if [flow.value(v) for v in act.inputs] != [flow.value(node.outputs[0])] or \
                [flow.value(v) for v in nxt.inputs] != [flow.value(act.outputs[0])]:
            continue
        if _unit_fits(unit, family, ctx.probe.out_shape.get(id(first), ())):
            found.append((names[id(first)], names[id(unit)], names[id(second)]))
    return found


def _apply_by_shape(module: nn.Module, ctx: FoldContext) -> nn.Module | None:
    changed = False
    for first, unit, second in find_ffns(module, ctx):
        new = split_ffn(*(getattr(module, n) for n in (first, unit, second)), ctx.site(unit), ctx)
        if new is not None:
            for attr, m in zip((first, unit, second), new):
                setattr(module, attr, m)
            changed = True
    return module if changed else None


def _pattern_matches(module: nn.Module, ctx: FoldContext) -> bool:
    return any(isinstance(get_path(module, p[1]), LinearizableActivation) and
               all(get_path(module, x) is not None for x in p) for p in FFN_PATTERNS)


def _apply_patterns(module: nn.Module, ctx: FoldContext) -> nn.Module | None:
    for pattern in FFN_PATTERNS:
        first, unit, second = (get_path(module, p) for p in pattern)
        if not isinstance(unit, LinearizableActivation) or first is None or second is None:
            continue
        site = ctx.site(pattern[1])
        if not (is_dense(first) and is_dense(second)):
            ctx.skipped("FFN layers are not Linear/Conv1D, units made plain", site)
            continue
        if not all(ctx.once(m) for m in (first, unit, second)):
            ctx.skipped("FFN not called exactly once on example_inputs", site)
            continue
        new = split_ffn(first, unit, second, site, ctx)
        if new is not None:
            for path, m in zip(pattern, new):
                set_path(module, path, m)
    return module


def _gated_attrs(module: nn.Module) -> tuple[str, str, str] | None:
    """The (gate, up, activation) attributes of a gated FFN whose activation has units, else ``None``."""
    for gate, up, act in GATED_FFN_ATTRS:
        if hasattr(module, gate) and hasattr(module, up) and units_of(getattr(module, act, nn.Identity())):
            return gate, up, act
    return None


def _gated_note(module: nn.Module, ctx: FoldContext) -> nn.Module:
    gate, up, act = _gated_attrs(module)
    ctx.skipped(
        f"gated FFN {act}({gate} x) * ({up} x): a linear gate channel is still a product of two linear maps "
        "(quadratic), nothing to fold; units made plain"
    )
    return module


FFN_BY_SHAPE = FoldRule("ffn-by-shape", lambda m, ctx: bool(find_ffns(m, ctx)), _apply_by_shape)
FFN_BY_PATH = FoldRule("ffn-by-path", _pattern_matches, _apply_patterns)
GATED_FFN = FoldRule("gated-ffn", lambda m, ctx: _gated_attrs(m) is not None, _gated_note)
