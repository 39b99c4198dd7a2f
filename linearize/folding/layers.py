"""What fold treats as a linear layer: dense maps (``nn.Linear``, Hugging Face ``Conv1D``), plain
zero-padded convs, and BatchNorm folded into the layer before it. Float64 algebra on their weights."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

# set by fold on every module of its result: the module's path in the model folded; save_folded takes a
# module a merge moved (a timm SqueezeExcite into a Sequential) from the base at that path
ORIGIN = "_linearize_origin"

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_BY_DIM = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def is_hf_conv1d(m: nn.Module) -> bool:
    """Hugging Face ``Conv1D`` (GPT-2): a linear layer with weight ``[in, out]``."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None


def is_dense(m: nn.Module) -> bool:
    """``nn.Linear`` (exactly, no subclass) or HF ``Conv1D``."""
    return type(m) is nn.Linear or is_hf_conv1d(m)


def is_plain_conv(m: nn.Module) -> bool:
    """An ``nn.Conv1d/2d/3d`` (exactly) with zero padding given as numbers."""
    return type(m) in CONVS and m.padding_mode == "zeros" and not isinstance(m.padding, str)


def is_pointwise_conv(m: nn.Module) -> bool:
    """A plain 1x1 conv (no padding, stride 1, dilation 1, one group): a dense map per position."""
    return (
        is_plain_conv(m) and all(k == 1 for k in m.kernel_size) and not any(m.padding)
        and all(s == 1 for s in m.stride) and m.groups == 1
    )


def dense_shape(m: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of nn.Linear / HF Conv1D / a pointwise conv."""
    if isinstance(m, CONVS):
        return m.out_channels, m.in_channels
    out, inp = m.weight.shape
    return (inp, out) if is_hf_conv1d(m) else (out, inp)


def dense_wb(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight ``[out, in]`` and bias of nn.Linear / HF Conv1D / a pointwise conv, in float64."""
    w = m.weight.detach().double()
    if is_hf_conv1d(m):
        w = w.t()
    elif isinstance(m, CONVS):
        w = w.reshape(w.shape[0], w.shape[1])
    b = None if m.bias is None else m.bias.detach().double()
    return w, b


def make_linear(w: torch.Tensor, b: torch.Tensor | None, like: nn.Module, cls: type = nn.Linear) -> nn.Module:
    """``cls`` (a Linear, or a pointwise conv class) holding ``w [out, in]`` / ``b`` in ``like``'s dtype and device."""
    p = like.weight
    if issubclass(cls, nn.Linear):
        layer = cls(w.shape[1], w.shape[0], bias=b is not None, device=p.device, dtype=p.dtype)
        shape = w.shape
    else:
        dims = p.ndim - 2
        layer = cls(w.shape[1], w.shape[0], 1, bias=b is not None, device=p.device, dtype=p.dtype)
        shape = (*w.shape, *([1] * dims))
    with torch.no_grad():
        layer.weight.copy_(w.reshape(shape))
        if b is not None:
            layer.bias.copy_(b)
    return layer


def bn_foldable(layer: nn.Module, bn: nn.Module) -> str | None:
    """``None`` if ``bn`` can fold into ``layer``, else the reason."""
    if not bn.track_running_stats or bn.running_mean is None:
        return "BatchNorm without running statistics uses batch statistics"
    if isinstance(layer, CONVS):
        dims = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}.get(type(bn))
        ok = layer.out_channels == bn.num_features and dims == len(layer.kernel_size)
        return None if ok else "shape mismatch"
    if type(layer) is nn.Linear and type(bn) is nn.BatchNorm1d:
        return None if layer.out_features == bn.num_features else "shape mismatch"
    return "not after a conv or linear layer"


@torch.no_grad()
def fold_bn(layer: nn.Module, bn: _BatchNorm) -> None:
    """Fold eval-mode ``bn`` into ``layer`` (in place): ``W' = W s``, ``b' = (b - mean) s + beta``."""
    scale = (bn.running_var.double() + bn.eps).rsqrt()
    if bn.affine:
        scale = scale * bn.weight.double()
    shift = -bn.running_mean.double() * scale + (bn.bias.double() if bn.affine else 0.0)
    w = layer.weight.double()
    b = layer.bias.double() if layer.bias is not None else torch.zeros_like(shift)
    layer.weight.copy_(w * scale.view(-1, *([1] * (w.ndim - 1))))
    new_b = b * scale + shift
    if layer.bias is None:
        layer.bias = nn.Parameter(new_b.to(layer.weight.dtype))
    else:
        layer.bias.copy_(new_b)


@torch.no_grad()
def absorb_linear_end(layer: nn.Module, unit: nn.Module, channel_axis_ok: bool, tol: float) -> int:
    """Move the affine linear ends ``alpha * x + beta`` of ``unit``'s linear channels into ``layer``, the
    dense or conv layer whose output (channels on ``channel_axis_ok``'s axis) the unit takes: output
    channel ``c`` of the layer becomes ``alpha_c (W_c x + b_c) + beta_c`` and the unit's end there the
    identity, so fold can drop or merge the unit as any linear one. Returns how many channels moved (0:
    nothing to move, or the layer does not fit)."""
    end = unit.linear_end
    if end is None or not channel_axis_ok or not (is_dense(layer) or type(layer) in CONVS):
        return 0
    if (layer.out_channels if isinstance(layer, CONVS) else dense_shape(layer)[0]) != unit.num_channels:
        return 0
    move = unit.linear_mask(tol) & ~unit.identity_end_mask()
    if not bool(move.any()):
        return 0
    alpha, beta = (t.detach().double() for t in end)
    scale = torch.where(move, alpha, torch.ones_like(alpha))
    shift = torch.where(move, beta, torch.zeros_like(beta))
    w = layer.weight.double()
    b = layer.bias.double() if layer.bias is not None else torch.zeros_like(shift)
    if is_hf_conv1d(layer):  # weight [in, out]
        layer.weight.copy_(w * scale)
    else:
        layer.weight.copy_(w * scale.view(-1, *([1] * (w.ndim - 1))))
    if layer.bias is None:
        layer.bias = nn.Parameter((b * scale + shift).to(layer.weight.dtype))
    else:
        layer.bias.copy_(b * scale + shift)
    unit.set_linear_end(torch.where(move, torch.ones_like(alpha), alpha), torch.where(move, torch.zeros_like(beta), beta))
    if bool(unit.identity_end_mask().all()):
        unit.set_linear_end(None)
    return int(move.sum())


def get_path(root: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted ``path`` (``None`` if any part is missing)."""
    m = root
    for part in path.split("."):
        m = m._modules.get(part) if isinstance(m, nn.Module) else None
        if m is None:
            return None
    return m


def set_path(root: nn.Module, path: str, value: nn.Module) -> None:
    """Replace the submodule at dotted ``path`` by ``value``."""
    parent, _, name = path.rpartition(".")
    setattr(get_path(root, parent) if parent else root, name, value)
