"""Rules for inverted-residual blocks (expand 1x1 -> depthwise kxk -> project 1x1): torchvision
MobileNet-V2 / V3 ``InvertedResidual`` and timm ``InvertedResidual`` / ``DepthwiseSeparableConv``
(EfficientNet, MobileNet-V2/V3 and others in timm). When the sites between the convs are linear the
convs compose into one dense kxk conv (DepthShrinker-style), exact at the border
(:class:`~.conv.BorderBiasConv` for the expansion's bias), where the cost model
(:func:`~.chains.plan_run`, :meth:`~.rules.FoldContext.keep_merge`) finds it cheaper; then the
identity skip goes into the merged conv's centre tap.

torchvision's bodies are ``nn.Sequential`` and merge through the ``sequential`` rule before the block
rule folds the skip; timm's blocks call their layers from ``forward``, so their rule lays the layers
out as a chain (``BatchNormAct2d`` split into BatchNorm, dropout and activation) and folds that.
Classes are looked up only if their module is already imported (fold never imports them)."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .blocks import fold_skip, imported, is_block
from .chains import chain_layers, fold_sequential
from .conv import BorderBiasConv, BorderExactConv
from .layers import CONVS
from .modules import Residual
from .rules import FoldContext, FoldRule

TORCHVISION = (("torchvision.models.mobilenetv2", "InvertedResidual", "conv"),
               ("torchvision.models.mobilenetv3", "InvertedResidual", "block"))
TIMM = (("timm.models._efficientnet_blocks", "InvertedResidual",
         ("conv_pw", "bn1", "conv_dw", "bn2", "aa", "se", "conv_pwl", "bn3")),
        ("timm.models._efficientnet_blocks", "DepthwiseSeparableConv", ("conv_dw", "bn1", "aa", "se", "conv_pw", "bn2")))


def _layout(m: nn.Module, table: tuple) -> str | tuple[str, ...] | None:
    """The layout (body attribute, or layer attributes in call order) of the ``table`` entry whose
    class (if its module is imported) ``m`` is, running that class's forward (:func:`is_block`)."""
    return next((layout for module, cls, layout in table if is_block(m, imported(module, cls))), None)


def _one_conv(body: nn.Module) -> nn.Module | None:
    """``body`` (or its only layer) when it is a single conv, else ``None``."""
    mods = chain_layers(body)
    return mods[0] if len(mods) == 1 and isinstance(mods[0], (*CONVS, BorderBiasConv, BorderExactConv)) else None


def fold_torchvision_inverted_residual(block: nn.Module, ctx: FoldContext) -> nn.Module:
    """MobileNet-V2 / V3 block whose body merged into one conv (``sequential`` rule): ``x + conv(x)``
    -> one conv (the skip in its centre tap); other blocks stay."""
    conv = _one_conv(getattr(block, _layout(block, TORCHVISION)))
    if conv is None:
        return block
    if getattr(block, "use_res_connect", False):
        return fold_skip(conv, None, ctx, "inverted residual")
    ctx.merged("inverted residual became one conv (DepthShrinker)")
    return conv


def _plain_bn(bn: _BatchNorm) -> nn.BatchNorm2d:
    """A plain ``nn.BatchNorm2d`` with ``bn``'s statistics and affine parameters (timm's norm-act layers)."""
    p = bn.running_mean
    plain = nn.BatchNorm2d(bn.num_features, eps=bn.eps, affine=bn.affine, device=p.device, dtype=p.dtype).eval()
    plain.running_mean.copy_(bn.running_mean)
    plain.running_var.copy_(bn.running_var)
    if bn.affine:
        plain.weight.data.copy_(bn.weight.detach())
        plain.bias.data.copy_(bn.bias.detach())
    return plain


def fold_timm_block(block: nn.Module, ctx: FoldContext) -> nn.Module | None:
    """timm inverted residual / depthwise-separable block as a folded chain (plus the skip)."""
    if getattr(block, "conv_s2d", None) is not None:
        ctx.skipped("space-to-depth stem of the block not folded; left as is")
        return None
    items: list[tuple[str, nn.Module]] = []
    for attr in _layout(block, TIMM):
        m = getattr(block, attr)
        if type(m).__name__ == "BatchNormAct2d" and m.running_mean is not None:  # BatchNorm, drop, act
            plain = _plain_bn(m)
            ctx.probe.register(plain, like=m)
            items += [(attr, plain), (f"{attr}_drop", m.drop), (f"{attr}_act", m.act)]
        else:
            items.append((attr, m))  # other norm-act layers stay whole: nothing merges across them
    seq = nn.Sequential(OrderedDict(items))
    body = fold_sequential(seq, ctx)
    if body is seq:
        return block
    if not getattr(block, "has_skip", False):
        return body
    conv = _one_conv(body)
    if conv is not None:
        return fold_skip(conv, None, ctx, type(block).__name__)
    return Residual(body, None)


TORCHVISION_INVERTED_RESIDUAL = FoldRule(
    "torchvision-inverted-residual", lambda m, ctx: _layout(m, TORCHVISION) is not None,
    fold_torchvision_inverted_residual,
)
TIMM_INVERTED_RESIDUAL = FoldRule("timm-inverted-residual", lambda m, ctx: _layout(m, TIMM) is not None, fold_timm_block)
