"""Nonlinear activations per input sample: the count the private-inference literature reports as "ReLUs".

SNL, AutoReP, DeepReDuce and others measure a network's nonlinearity by the number of activation elements
(ReLUs) one input passes through: a ResNet-20 on 32x32 images has 188,416. A linearize unit keeps a slope
per channel, so a channel that is nonlinear costs every position of its map: ``H x W`` for a conv map,
the sequence length for a transformer's hidden states. :func:`count_relus` runs one forward to see those
sizes and multiplies; the fraction of channels (:func:`linearize.count_units`) and the fraction of ReLUs
differ whenever the maps have different sizes (early, large maps weigh more).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..inputs import call_model, describe_inputs, eval_mode, hooks, inputs_fit, num_rows
from ..unit import linear_masks, require_units

__all__ = ["count_relus"]


def count_relus(model: nn.Module, example_inputs: Any, tol: float = 0.0) -> dict:
    """Activation elements per input sample, in all and nonlinear (slope below ``1 - tol``), from one forward.

    Args:
        model: a converted model (:func:`linearize.convert`).
        example_inputs: one batch as the model takes it (a tensor, a tuple of positional arguments or a
            mapping of keyword arguments); its first dim is the batch. The counts hold for inputs of this
            shape (a transformer's count grows with the sequence length).
        tol: a channel is linear when its slope is ``>= 1 - tol`` (:func:`linearize.count_units`).

    Returns:
        ``{"total", "nonlinear", "linear", "sites": {name: {"positions", "channels", "total", "nonlinear"}}}``:
        per sample; ``positions`` is the number of elements per channel (``H * W``, a sequence length, 1
        for a flat vector), summed over the calls of a unit if a forward calls it more than once.

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()))
        >>> with torch.no_grad():
        ...     linearize.units(net)[0][1].slope[:1] = 1.0  # one of 4 channels linear
        >>> c = count_relus(net, torch.zeros(2, 3, 8, 8))
        >>> c["total"], c["nonlinear"]  # 4 x 8 x 8 elements per image, 3 x 8 x 8 of them nonlinear
        (256, 192)
    """
    named = require_units(model, why="count_relus counts the elements of unit channels", what="count_relus")
    masks = linear_masks(named, tol, "count_relus")
    rows = num_rows(example_inputs)
    if rows < 1:
        raise ValueError(f"count_relus: example_inputs {describe_inputs(example_inputs)} hold no sample; pass a "
                         "batch of at least one input")
    positions: dict[str, int] = {}

    def hook_for(name: str, unit: nn.Module):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0]
            per_sample, rest = divmod(x.numel(), rows * unit.num_channels)
            if rest or not per_sample:
                raise ValueError(f"count_relus: unit {name!r} ({unit.num_channels} channels) got an input of shape "
                                 f"{tuple(x.shape)}, which is not {rows} samples of whole channels; pass "
                                 "example_inputs whose first dim is the batch")
            positions[name] = positions.get(name, 0) + per_sample

        return hook

    with hooks() as handles, eval_mode(model), torch.no_grad():
        handles += [unit.register_forward_pre_hook(hook_for(name, unit)) for name, unit in named]
        with inputs_fit(example_inputs):
            call_model(model, example_inputs)
    missing = [name for name, _ in named if name not in positions]
    if missing:
        raise ValueError(f"count_relus: unit(s) {', '.join(map(repr, missing))} were not called on example_inputs "
                         f"{describe_inputs(example_inputs)}: their cost per sample is unknown. Pass inputs that "
                         "take every path of the model")
    sites = {}
    for (name, unit), linear in zip(named, masks):
        nonlinear_channels = unit.num_channels - int(linear.sum())
        sites[name] = {"positions": positions[name], "channels": unit.num_channels,
                       "total": positions[name] * unit.num_channels, "nonlinear": positions[name] * nonlinear_channels}
    total = sum(s["total"] for s in sites.values())
    nonlinear = sum(s["nonlinear"] for s in sites.values())
    return {"total": total, "nonlinear": nonlinear, "linear": total - nonlinear, "sites": sites}
