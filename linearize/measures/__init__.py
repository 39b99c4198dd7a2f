"""Measures of where a network's nonlinearity sits (imported lazily, PEP 562).

- :func:`average_path_length` (seed 000), in :mod:`linearize.measures.paths`;
- :func:`affinity_score`, :func:`affinity_signature` (seed 002), in :mod:`linearize.measures.affinity`;
- :func:`linear_regions`, :func:`absolute_deviation`, :func:`translation_loops` (seed 001),
  in :mod:`linearize.measures.regions`;
- :func:`count_relus` (nonlinear activations per sample, the private-inference literature's count), in
  :mod:`linearize.measures.relus`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "average_path_length": "paths",
    "affinity_score": "affinity",
    "affinity_signature": "affinity",
    "linear_regions": "regions",
    "absolute_deviation": "regions",
    "translation_loops": "regions",
    "RegionsResult": "regions",
    "count_relus": "relus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'linearize.measures' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
