"""The site records of a converted model's save manifest, shared by :mod:`linearize.serialization`
(``linearize_config.json``) and :mod:`linearize.hf` (``config.json`` of an HF save)."""

from __future__ import annotations

from torch import nn

from .unit import units

__all__ = ["FORMAT_VERSION", "clean_name", "site_records"]

FORMAT_VERSION = 2
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def clean_name(name: str) -> str:
    """A unit's name without ``torch.compile`` / DDP wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def site_records(model: nn.Module) -> list[dict]:
    """One JSON record per unit of ``model``: name, kind, channels, channel dim."""
    return [
        {"name": clean_name(n), "kind": u.kind, "num_channels": u.num_channels, "channel_dim": u.channel_dim}
        for n, u in units(model)
    ]
