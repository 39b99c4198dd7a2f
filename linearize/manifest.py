"""The site records of a converted model's save manifest, shared by :mod:`linearize.serialization`
(``linearize_config.json``) and :mod:`linearize.hf` (``config.json`` of an HF save)."""

from __future__ import annotations

from torch import nn

from .unit import units

CONFIG_NAME = "linearize_config.json"  # the sidecar of save_pretrained
FOLDED_CONFIG = "folded.json"  # the description of a save_folded model

__all__ = ["FORMAT_VERSION", "clean_name", "site_records"]

FORMAT_VERSION = 2
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def clean_name(name: str) -> str:
    """A unit's name without the ``torch.compile`` / DDP wrappers' leading prefixes (``_orig_mod.``,
    ``module.``, in any order and number); a module merely named ``submodule`` keeps its name.

    Example:
        >>> clean_name("module._orig_mod.layer1.submodule.relu")
        'layer1.submodule.relu'
    """
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


def site_records(model: nn.Module) -> list[dict]:
    """One JSON record per unit of ``model``: name, kind, channels, channel dim, and for an element-level unit
    the shape of its map (``map_shape``; ``num_channels`` is then the number of positions)."""
    return [
        {"name": clean_name(n), "kind": u.kind, "num_channels": u.num_channels, "channel_dim": u.channel_dim,
         **({"map_shape": list(u.map_shape)} if u.granularity == "element" else {})}
        for n, u in units(model)
    ]
