"""Rules for torchvision's residual blocks: BatchNorm folded into the convs of ``BasicBlock`` /
``Bottleneck`` (and the ``ResNet`` stem); convs joined by linear sites merged where the objective
improves (pieces of the body in place, e.g. a Bottleneck's 1x1 -> 3x3 stride 2); a whole body merged
into one conv with the skip (identity, or a 1x1 downsample conv with the merged stride) folded into
its centre tap. :func:`fold_skip` is shared with the inverted residuals (:mod:`.inverted`).

The classes are looked up only if torchvision's module is already imported: a model that holds
them has imported it, and fold never imports torchvision itself."""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .chains import chain_layers, is_map, merge_segment, plan_run, segment_cost
from .conv import BorderBiasConv, BorderExactConv, merge_convs
from .layers import CONVS, bn_foldable, fold_bn, is_plain_conv
from .modules import Residual, units_of
from .rules import FoldContext, FoldRule


def imported(module: str, *names: str) -> tuple[type, ...]:
    """Classes ``names`` of the module ``module`` if it is imported (and has them), else ``()``."""
    mod = sys.modules.get(module)
    return tuple(c for c in (getattr(mod, n, None) for n in names) if c is not None) if mod is not None else ()


def is_block(m: nn.Module, classes: tuple[type, ...]) -> bool:
    """``m`` is one of ``classes`` and runs that class's own ``forward``: a subclass that overrides it
    (timm's ``CondConvResidual`` of ``InvertedResidual``, a user's ``ResNet`` with another forward)
    computes something the class's fold rule does not know, so it does not match."""
    return any(isinstance(m, c) and type(m).forward is c.forward for c in classes)


def _torchvision(module: str, *names: str) -> tuple[type, ...]:
    """torchvision classes ``names`` of ``torchvision.models.<module>`` if it is imported, else ``()``."""
    return imported(f"torchvision.models.{module}", *names)


def residual_block_types() -> tuple[type, ...]:
    """The residual block classes of the libraries already imported: torchvision ``BasicBlock``,
    ``Bottleneck``, ``InvertedResidual`` (the blocks the fold rules merge) and timm's ``BasicBlock``,
    ``Bottleneck``, ``InvertedResidual``, ``DepthwiseSeparableConv``, ``EdgeResidual``.

    Example:
        >>> import torchvision
        >>> torchvision.models.resnet.BasicBlock in residual_block_types()
        True
    """
    timm = [sys.modules.get(m) for m in ("timm.models.resnet", "timm.models._efficientnet_blocks")]
    timm_names = ("BasicBlock", "Bottleneck", "InvertedResidual", "DepthwiseSeparableConv", "EdgeResidual")
    return (*_torchvision("resnet", "BasicBlock", "Bottleneck"), *_torchvision("mobilenetv2", "InvertedResidual"),
            *(getattr(m, n) for m in timm if m is not None for n in timm_names if hasattr(m, n)))


def fold_bn_attr(module: nn.Module, ctx: FoldContext, conv_attr: str, bn_attr: str) -> None:
    """Fold ``module.<bn_attr>`` into ``module.<conv_attr>`` (replaced by ``nn.Identity``)."""
    conv, bn = getattr(module, conv_attr), getattr(module, bn_attr)
    if not isinstance(bn, _BatchNorm):
        return
    reason = bn_foldable(conv, bn)
    if reason is None and not (ctx.once(conv) and ctx.once(bn)):
        reason = "layer called more than once"
    if reason:
        ctx.skipped(f"BatchNorm kept ({reason})", ctx.site(bn_attr))
        return
    fold_bn(conv, bn)
    setattr(module, bn_attr, nn.Identity())
    ctx.merged(f"BatchNorm folded into {ctx.site(conv_attr)}", ctx.site(bn_attr))


def centre_tap_reason(conv: nn.Module, shortcut: nn.Module | None) -> str:
    """Why the skip cannot be added to ``conv``'s centre tap ("" if it can)."""
    if not isinstance(conv, CONVS):
        return "not a conv"
    k, p = conv.kernel_size, conv.padding
    if any(ki % 2 == 0 or pi != ki // 2 for ki, pi in zip(k, p)) or any(d != 1 for d in conv.dilation):
        return "the kernel has no centre tap aligned with the input"
    if shortcut is None:
        if conv.in_channels != conv.out_channels or any(s != 1 for s in conv.stride):
            return "shapes change and there is no projection shortcut"
        return ""
    if not (is_plain_conv(shortcut) and all(kk == 1 for kk in shortcut.kernel_size) and not any(shortcut.padding)
            and shortcut.groups == 1 and tuple(shortcut.stride) == tuple(conv.stride)
            and shortcut.out_channels == conv.out_channels and conv.groups == 1):
        return "the shortcut is not a plain 1x1 conv with the same stride"
    if conv.bias is None:
        return "merged conv has no bias"
    return ""


def fold_skip(conv: nn.Module, shortcut: nn.Module | None, ctx: FoldContext, what: str) -> nn.Module:
    """``conv(x) + shortcut(x)`` as one conv (the skip added into the centre tap) if shapes allow,
    else a ``Residual`` (reported)."""
    inner = conv.conv if isinstance(conv, (BorderBiasConv, BorderExactConv)) else conv
    reason = centre_tap_reason(inner, shortcut)
    if reason:
        ctx.skipped(f"skip of the {what} not folded ({reason})")
        return Residual(conv, shortcut)
    centre = tuple(k // 2 for k in inner.kernel_size)
    with torch.no_grad():
        g, co = inner.groups, inner.out_channels
        ci_g = inner.in_channels // g
        if shortcut is None:
            skip = torch.eye(co, dtype=torch.float64)
        else:
            skip = shortcut.weight.detach().double().reshape(co, -1)
            if shortcut.bias is not None:
                inner.bias.add_(shortcut.bias.to(inner.bias.dtype))
        for o in range(co):
            grp = o // (co // g)
            cols = slice(grp * ci_g, (grp + 1) * ci_g)
            inner.weight[(o, slice(None)) + centre] += skip[o, cols].to(inner.weight.dtype)
    ctx.merged(f"{what} became one conv, skip folded into the centre tap")
    return conv


def _downsample_conv(block: nn.Module) -> tuple[nn.Module | None, str]:
    """The block's projection shortcut as one conv (``None`` for the identity), or why it is not one."""
    if block.downsample is None:
        return None, ""
    mods = chain_layers(block.downsample)
    if len(mods) != 1 or not is_plain_conv(mods[0]):
        return None, "downsample is not one conv"
    return mods[0], ""


def fold_resnet_block(block: nn.Module, ctx: FoldContext) -> nn.Module:
    """torchvision BasicBlock / Bottleneck: fold BNs; merge the convs between linear sites where the
    objective improves (pieces of the body in place; a whole body with its skip in the centre tap)."""
    n_convs = 3 if hasattr(block, "conv3") else 2
    for i in range(1, n_convs + 1):
        fold_bn_attr(block, ctx, f"conv{i}", f"bn{i}")
    if any(isinstance(getattr(block, f"bn{i}"), _BatchNorm) for i in range(1, n_convs + 1)):
        return block  # a BatchNorm that could not fold sits in the body (reason reported)
    calls = units_of(block.relu)
    if not calls:
        return block
    names = [f"conv{i}" for i in range(1, n_convs + 1)]
    convs = [getattr(block, n) for n in names]
    # a unit reused for every call (built by hand) shares its slopes between all sites
    joined = [ctx.is_linear(calls[0] if len(calls) == 1 else calls[i]) and is_map(convs[i], ctx)
              and is_map(convs[i + 1], ctx) for i in range(n_convs - 1)]
    runs = [[0]]
    for i, join in enumerate(joined):
        runs[-1].append(i + 1) if join else runs.append([i + 1])
    segments = [[run[k] for k in seg] for run in runs if len(run) > 1
                for seg in plan_run([(ctx.site(names[i]), convs[i]) for i in run], ctx) if len(seg) > 1]
    shortcut, why = _downsample_conv(block)
    if segments == [list(range(n_convs))] and not why:
        return _merge_body(block, convs, shortcut, calls, ctx)
    if segments == [list(range(n_convs))]:
        ctx.skipped(f"skip of the {type(block).__name__} not folded ({why})")
    for seg in segments:  # in place: the linear units between them become identities
        item = merge_segment([(ctx.site(names[i]), convs[i]) for i in seg], ctx)
        if item is not None:
            setattr(block, names[seg[0]], item[1])
            for i in seg[1:]:
                setattr(block, names[i], nn.Identity())
    return block


def _merge_body(
    block: nn.Module, convs: list[nn.Module], shortcut: nn.Module | None, calls: list[nn.Module], ctx: FoldContext
) -> nn.Module:
    """The whole body as one conv with the skip folded in, then the block's last activation."""
    conv, kind = merge_convs(convs, ctx.probe.in_shape.get(id(convs[0])))
    flops = (sum(ctx.flops(c) for c in convs), segment_cost(convs, ctx)[0].flops)
    n = len(convs)
    if not ctx.keep_merge(f"linear body conv1..conv{n} merged into one {kind}", convs, conv, flops):
        return block
    act = ctx.plain(calls[-1])
    body = fold_skip(conv, shortcut, ctx, type(block).__name__)
    return nn.Sequential(body, act) if not isinstance(act, nn.Identity) else body


def _fold_stem(model: nn.Module, ctx: FoldContext) -> nn.Module:
    fold_bn_attr(model, ctx, "conv1", "bn1")
    return model


RESNET_BLOCK = FoldRule(
    "torchvision-resnet-block",
    lambda m, ctx: is_block(m, _torchvision("resnet", "BasicBlock", "Bottleneck")),
    fold_resnet_block,
)
RESNET_STEM = FoldRule("torchvision-resnet-stem", lambda m, ctx: is_block(m, _torchvision("resnet", "ResNet")), _fold_stem)
