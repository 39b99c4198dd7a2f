"""Save and load converted models as a sidecar: the config as JSON plus the unit tensors.

``from_pretrained`` of a Hugging Face model (or a torchvision builder) rebuilds the original
activations, so the units cannot live in the base model's own checkpoint. The sidecar holds:

- ``linearize_config.json``: the :class:`LinearizeConfig`, the site list (name, kind, channels,
  channel dim) and the format version;
- ``linearize_units.safetensors``: in ``"prelu"`` mode only the unit tensors (``<site>.slope``,
  ``<site>.frozen``); in gated modes the whole gated model (its feature network is new weights).

Loading re-converts a freshly built base model with the saved config and copies the tensors in,
so outputs are bit-identical. Files are written to a temporary name and moved into place, so an
interrupted save never leaves a half-written sidecar behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import LinearizeConfig
from .unit import units

__all__ = ["save_pretrained", "from_pretrained", "unwrap_model"]

CONFIG_NAME = "linearize_config.json"
WEIGHTS_NAME = "linearize_units.safetensors"
FORMAT_VERSION = 1
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip ``torch.compile`` (``_orig_mod``) and DDP/DataParallel (``module``) wrappers."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _sites(model: nn.Module) -> list[dict]:
    return [
        {"name": _clean(n), "kind": u.kind, "num_channels": u.num_channels, "channel_dim": u.channel_dim}
        for n, u in units(model)
    ]


def _tensors(model: nn.Module, gated: bool) -> dict[str, torch.Tensor]:
    if gated:
        items = model.state_dict().items()
    else:
        items = ((f"{n}.{k}", t) for n, u in units(model) for k, t in (("slope", u.slope), ("frozen", u.frozen)))
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in items:
        if t.data_ptr() in seen and t.numel():  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[_clean(name)] = t.detach().cpu().contiguous()
    return tensors


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_pretrained(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write the linearize sidecar of a converted ``model`` into ``directory`` (created if needed).

    Returns the directory. Raises ``ValueError`` for a model that was never converted.
    """
    model = unwrap_model(model)
    config = getattr(model, "linearize_config", None)
    if not isinstance(config, LinearizeConfig):
        raise ValueError("save_pretrained needs a model converted with linearize.convert")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gated = config.mode != "prelu"
    meta = {"format": FORMAT_VERSION, "config": config.to_dict(), "sites": _sites(model)}
    _atomic_write(directory / WEIGHTS_NAME, lambda p: save_file(_tensors(model, gated), str(p), {"format": "pt"}))
    _atomic_write(directory / CONFIG_NAME, lambda p: p.write_text(json.dumps(meta, indent=2)))
    return directory


def from_pretrained(model: nn.Module, directory: str | os.PathLike, example_inputs: Any = None) -> nn.Module:
    """Re-convert a freshly built base ``model`` with the saved config and load the saved units.

    Args:
        model: the same architecture the sidecar was saved from, *not* converted.
        directory: a folder written by :func:`save_pretrained`.
        example_inputs: the probe input for ``convert`` (needed for models whose input
            ``convert`` cannot guess).

    Returns the converted model (the same object in ``"prelu"`` mode). Raises ``FileNotFoundError``
    when the sidecar is missing and ``ValueError`` when its sites do not match the model.
    """
    from .conversion import convert

    directory = Path(directory)
    if not (directory / CONFIG_NAME).is_file() or not (directory / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(
            f"{directory} has no linearize sidecar ({CONFIG_NAME} + {WEIGHTS_NAME}); "
            "write one with linearize.save_pretrained(model, directory)"
        )
    meta = json.loads((directory / CONFIG_NAME).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported sidecar format {meta.get('format')!r} (expected {FORMAT_VERSION})")
    config = LinearizeConfig.from_dict(meta["config"])
    model = convert(model, config, example_inputs=example_inputs)
    found = _sites(model)
    if found != meta["sites"]:
        saved = {s["name"]: s for s in meta["sites"]}
        diff = [s["name"] for s in found if saved.get(s["name"]) != s] + sorted(
            set(saved) - {s["name"] for s in found}
        )
        raise ValueError(
            f"the model does not match the saved one: {len(diff)} site(s) differ, e.g. {diff[:5]}. "
            "Build the same architecture (same config) before loading."
        )
    tensors = load_file(str(directory / WEIGHTS_NAME))
    if config.mode != "prelu":
        model.load_state_dict(tensors, strict=True)
        return model
    with torch.no_grad():
        for name, unit in units(model):
            unit.slope.copy_(tensors[f"{_clean(name)}.slope"])
            unit.frozen.copy_(tensors[f"{_clean(name)}.frozen"])
    return model
