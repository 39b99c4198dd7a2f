"""linearize: find out how much of a trained network's nonlinearity is needed, and remove the rest.

The public names are imported lazily on first use (PEP 562), so ``import linearize`` stays
cheap and optional parts (transformers, accelerate, matplotlib) load only when used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # units and conversion
    "LinearizableActivation": "unit",
    "units": "unit",
    "count_units": "unit",
    "nonlinear_fraction": "unit",
    "project_slopes": "unit",
    "linear_masks": "unit",
    "NonFiniteSlopeError": "checks",
    "LinearizeConfig": "config",
    "BlendConfig": "config",
    "GatedConfig": "config",
    "convert": "conversion",
    "dry_run": "conversion",
    "ConversionReport": "conversion",
    "save_pretrained": "serialization",
    "from_pretrained": "serialization",
    "LoadError": "serialization",
    "save_folded": "deploy",
    "load_folded": "deploy",
    # sparsity pressure
    "Sparsifier": "sparsifier",
    "param_groups": "sparsifier",
    "distill_loss": "distill",
    # freeze, fold, compress
    "freeze": "freezing",
    "fold": "folding",
    "FoldSummary": "folding",
    "FoldVerificationError": "checks",
    "count_flops": "folding",
    "register_fold_rule": "folding",
    "FoldRule": "folding",
    "Objective": "folding",
    "stable_units": "stability",
    "fit_linear_ends": "calibration",
    "one_shot": "calibration",
    "RunningFit": "calibration",
    "Box": "stability",
    "compress": "compression",
    "prune": "pruning",
    # report
    "report": "reporting",
    "register_measure": "reporting",
    "compare": "comparison",
}
_SUBMODULES = {"schedules", "integrations", "measures", "gated"}

__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'linearize' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
