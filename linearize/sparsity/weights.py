"""Cost weights and groups of sites: what a channel made linear saves, and which sites go linear together.

- :func:`flops_weights` / :func:`latency_weights`: per unit, the multiply-adds or the measured CPU time of
  the layers next to it, per channel (``Sparsifier(weights="flops" | "latency")``);
- :func:`unit_weights`: those (or a dict) normalized to mean 1 over channels, one weight per unit;
- :func:`site_groups`: the sites of each residual block (``Sparsifier(granularity="block")``);
- :func:`param_groups`: optimizer parameter groups with no weight decay on the slopes.

These count layers as fold counts them and know fold's residual block classes, so they read two leaf
tables of :mod:`linearize.folding` (the multiply-add counter and the block registry); they never fold.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import torch
from torch import nn

from ..checks import check_positive
from ..folding.blocks import residual_block_types
from ..folding.flops import is_counted_layer, module_flops
from ..inputs import call_model, inputs_fit
from ..timing import median_ms
from ..unit import LinearizableActivation, require_units, units

__all__ = ["flops_weights", "latency_weights", "site_groups", "param_groups", "unit_weights"]


def unit_weights(model: nn.Module, units_: list[tuple[str, LinearizableActivation]],
                 weights: str | Mapping[str, float] | None, example_inputs) -> list[float]:
    """One weight per unit of ``units_`` (the Sparsifier's ``weights=``: ``None``, ``"flops"``,
    ``"latency"`` or a dict ``{unit_name: weight}``, missing names 1), normalized to mean 1 over channels.

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> unit_weights(net, linearize.units(net), {"1": 3.0}, None)
        [1.0]
    """
    names = [n for n, _ in units_]
    if weights is None:
        raw = {n: 1.0 for n in names}
    elif isinstance(weights, str):
        if weights not in ("flops", "latency"):
            raise ValueError(f"weights must be None, 'flops', 'latency' or a dict name -> weight, got {weights!r}")
        if example_inputs is None:
            raise ValueError(f"weights={weights!r} needs example_inputs (one batch) to measure the layers")
        raw = (flops_weights if weights == "flops" else latency_weights)(model, example_inputs)
    elif isinstance(weights, Mapping):
        unknown = set(weights) - set(names)
        if unknown:
            raise ValueError(
                f"weights name units the model does not have: {sorted(unknown)[:5]}; units: {names[:5]}..."
            )
        raw = {n: float(weights.get(n, 1.0)) for n in names}
    else:
        raise TypeError(f"weights must be None, 'flops', 'latency' or a dict, got {type(weights).__name__}")
    if any(not math.isfinite(w) or w < 0 for w in raw.values()):
        raise ValueError("unit weights must be finite and >= 0")
    channels = sum(u.num_channels for _, u in units_)
    mean = sum(raw[n] * u.num_channels for n, u in units_) / channels
    if not math.isfinite(mean):  # huge weights overflowed the sum: only their ratios matter
        top = max(raw.values())
        raw = {n: w / top for n, w in raw.items()}
        mean = sum(raw[n] * u.num_channels for n, u in units_) / channels
    if mean <= 0:
        raise ValueError("all unit weights are 0: no unit would get any pressure")
    return [raw[n] / mean for n in names]


def site_groups(model: nn.Module, blocks: Sequence[str] | None = None) -> dict[str, list[str]]:
    """The sites (unit names) of each residual block: ``{block_name: [unit names]}``, in unit order.

    A site belongs to its innermost ancestor module that is a block: one named in ``blocks``, or
    with ``blocks=None`` an instance of a residual block class fold knows
    (:func:`~linearize.folding.blocks.residual_block_types`: torchvision ``BasicBlock``,
    ``Bottleneck``, ``InvertedResidual``, timm's). A site outside every block is a group of its own,
    keyed by its own name. Fold merges a block's body only when all its inner sites are linear, so
    ``Sparsifier(granularity="block")`` makes them linear together.

    Raises:
        TypeError: ``blocks`` is a string (it would be read as one name per character) or holds
            something other than strings.
        ValueError: ``blocks`` names a module the model does not have, or ``blocks=None`` and the
            model has no block of a known class (pass ``blocks=[...]``).

    Example:
        >>> net = linearize.convert(torchvision.models.resnet18(), example_inputs=torch.randn(1, 3, 32, 32))
        >>> site_groups(net)["layer1.0"]
        ['layer1.0.relu.calls.0', 'layer1.0.relu.calls.1']
    """
    modules = dict(model.named_modules())
    if blocks is not None:
        if isinstance(blocks, (str, bytes)):
            raise TypeError(f"blocks must be a list of module names, got the string {blocks!r} (read as one name "
                            f"per character): pass blocks=[{blocks!r}]")
        blocks = list(blocks)
        odd = [b for b in blocks if not isinstance(b, str)]
        if odd:
            raise TypeError(f"blocks must hold module names (strings from model.named_modules()), got "
                            f"{type(odd[0]).__name__} {odd[0]!r}")
        unknown = [b for b in blocks if b not in modules]
        if unknown:
            raise ValueError(f"blocks names modules the model does not have: {unknown[:5]}; pass module names "
                             f"from model.named_modules(), e.g. {[n for n in modules if n][:3]}")
    kinds = residual_block_types()

    def is_block(name: str) -> bool:
        return name in blocks if blocks is not None else bool(kinds) and isinstance(modules[name], kinds)

    groups: dict[str, list[str]] = {}
    found = False
    for name, _ in require_units(model):
        parts = name.split(".")
        owner = next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)) if is_block(p)), None)
        found |= owner is not None
        groups.setdefault(name if owner is None else owner, []).append(name)
    if not found:
        raise ValueError("granularity='block' found no residual block around any site (known classes: torchvision "
                         "and timm BasicBlock, Bottleneck, InvertedResidual, ...): pass blocks=[module names]")
    return groups


def _neighbour_layers(model: nn.Module, example_inputs) -> tuple[dict[str, tuple], list[tuple]]:
    """For each unit, the indices of the linear layer calls just before and just after its first
    call (``None`` where there is none), and the layer calls ``(module, args, out)`` in execution order."""
    events: list[tuple[str, object]] = []
    calls: list[tuple] = []
    hooks = []
    names = {id(u): n for n, u in require_units(model)}

    def layer_hook(module, args, out):
        if isinstance(out, torch.Tensor):
            events.append(("layer", len(calls)))
            calls.append((module, args, out))

    def unit_hook(module, args, out):
        events.append(("unit", names[id(module)]))

    for module in model.modules():
        if is_counted_layer(module):
            hooks.append(module.register_forward_hook(layer_hook))
        elif id(module) in names:
            hooks.append(module.register_forward_hook(unit_hook))
    try:
        with torch.no_grad(), inputs_fit(example_inputs):
            call_model(model, example_inputs)
    finally:
        for h in hooks:
            h.remove()
    around: dict[str, tuple] = {}
    for i, (kind, value) in enumerate(events):
        if kind == "unit" and value not in around:
            before = next((v for k, v in reversed(events[:i]) if k == "layer"), None)
            after = next((v for k, v in events[i + 1 :] if k == "layer"), None)
            around[value] = (before, after)
    return around, calls


def _per_channel(model: nn.Module, around: dict[str, tuple], cost: dict[int, float]) -> dict[str, float]:
    """``(cost(prev) + cost(next)) / C`` per unit; units without a neighbouring layer get the mean."""
    out: dict[str, float] = {}
    for name, unit in require_units(model):
        layers = [j for j in around.get(name, ()) if j is not None]
        out[name] = sum(cost[j] for j in layers) / unit.num_channels
    known = [c for c in out.values() if c > 0]
    fill = sum(known) / len(known) if known else 1.0
    return {n: c or fill for n, c in out.items()}


def flops_weights(model: nn.Module, example_inputs) -> dict[str, float]:
    """Per-unit cost: multiply-adds of the linear layer call just before and just after it, per channel.

    Runs one forward pass on ``example_inputs`` (a tensor, a tuple of positional inputs or a
    dict of keyword inputs) and orders layer and unit calls by execution. A channel made linear
    lets these two layers fold, so its weight is ``(macs(prev) + macs(next)) / C`` per sample, the
    layers' multiply-adds counted as fold counts them (:func:`~linearize.folding.flops.module_flops`:
    ``nn.Linear``, HF ``Conv1D``, convs and transposed convs); units without a neighbouring layer get
    the mean weight.

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> flops_weights(net, torch.randn(3, 4))   # (4 * 8 + 8 * 2) / 8
        {'1': 6.0}
    """
    around, calls = _neighbour_layers(model, example_inputs)
    cost = {j: module_flops(m, args, out) / 2 / max(out.shape[0], 1) for j, (m, args, out) in enumerate(calls)}
    return _per_channel(model, around, cost)


def latency_weights(model: nn.Module, example_inputs, budget_s: float = 1.0) -> dict[str, float]:
    """Per-unit cost: measured CPU time (ms) of the layer calls just before and just after it, per channel.

    The same layers as :func:`flops_weights` (the ones a linear site lets fold), each timed alone on
    the inputs it received in one forward pass on ``example_inputs``: the median of interleaved
    repetitions that fit ``budget_s`` seconds in all (:func:`linearize.timing.median_ms`). The
    weight is ``(ms(prev) + ms(next)) / C``; units without a neighbouring layer get the mean.
    Timings vary from run to run by a few percent; their order between layers of clearly different
    size does not.

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> w = latency_weights(net, torch.randn(3, 4), budget_s=0.05)   # ms per channel
        >>> list(w), w["1"] > 0
        (['1'], True)
    """
    budget_s = check_positive(budget_s, "budget_s")
    around, calls = _neighbour_layers(model, example_inputs)
    needed = sorted({j for pair in around.values() for j in pair if j is not None})
    ms = median_ms([functools.partial(calls[j][0], *calls[j][1]) for j in needed], budget_s)
    return _per_channel(model, around, dict(zip(needed, ms)))


def param_groups(
    model: nn.Module,
    weight_decay: float = 5e-4,
    slope_lr: float | None = None,
    **kwargs,
) -> list[dict]:
    """Parameter groups for any torch optimizer: no weight decay on slopes, biases and norms.

    Weight decay pulls slopes towards 0 (back to the activation), against the sparsity
    pressure; biases and 1-d (norm) weights are excluded as is conventional.

    Returns up to three groups: ``decay`` (weights of ndim >= 2, ``weight_decay``), ``no_decay``
    (biases and 1-d parameters, 0) and ``slopes`` (0, and ``lr=slope_lr`` when given). Extra
    ``kwargs`` go into every group. Frozen (``requires_grad=False``) parameters are left out.
    """
    slope_ids = {id(u.slope) for _, u in units(model)}
    decay, no_decay, slopes = [], [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in slope_ids:
            slopes.append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, **kwargs},
        {"params": no_decay, "weight_decay": 0.0, **kwargs},
        {"params": slopes, "weight_decay": 0.0, **kwargs, **({"lr": slope_lr} if slope_lr is not None else {})},
    ]
    return [g for g in groups if g["params"]]
