"""Sparsifier histories (:meth:`linearize.Sparsifier.save_history`): read, check, summarize.

:func:`load_history` gives the nonlinear fraction over training that the report plots; every value is
checked (a fraction in ``[0, 1]``, integer steps) and errors name the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ._files import read_json

__all__ = ["load_history", "read_history", "summarize_history"]

Record = tuple[int, dict[str, float], "float | None"]
MAX_STEP = 2**63 - 1  # the largest step a history may hold: the sparsifier's step count is an int64


def load_history(history: str | Path | Mapping, counts: dict | None = None) -> dict:
    """Nonlinear fraction over training: ``{"steps", "total", "sites": {name: [fraction]}}``.

    Args:
        history: a JSON file or dict from :meth:`linearize.Sparsifier.save_history`
            (``{"history": [{"step", "sites": {...}, "nonlinear_fraction"}, ...]}``) or a dict
            ``{step: {site: fraction}}`` (steps may be strings, as after a JSON round trip).
        counts: :func:`linearize.count_units` of the model, to weight sites by their channels when
            the log has no total; without it the total is the unweighted mean over sites.

    Example:
        >>> load_history({"0": {"a": 1.0, "b": 1.0}, "10": {"a": 0.5, "b": 0.0}})["total"]
        [1.0, 0.25]
    """
    return summarize_history(read_history(history), counts)


def read_history(history: str | Path | Mapping) -> list[Record]:
    """Records ``(step, {site: fraction}, logged total or None)`` of a sparsifier history, by step.

    Every fraction must be a number in ``[0, 1]``, every step an integer of at most :data:`MAX_STEP`; errors name
    the file.
    """
    source = "the sparsifier history"
    if isinstance(history, (str, Path)):
        path = Path(history)
        source = f"sparsifier history {str(path)!r}"
        if not path.is_file():
            raise FileNotFoundError(f"{source} does not exist")
        history = read_json(path, "sparsifier history")
    if not isinstance(history, Mapping):
        raise TypeError(f"{source} must be a JSON path or a dict, got {type(history).__name__}")
    try:
        if "history" in history:
            if not isinstance(history["history"], list):
                raise ValueError("its 'history' is not a list of records")
            records = [(_step(r["step"]), _sites(r.get("sites", {})),
                        _fraction(r.get("nonlinear_fraction"), "nonlinear_fraction", optional=True))
                       for r in history["history"]]
        else:
            records = [(_step(step), _sites(sites), None) for step, sites in history.items()]
    except KeyError as err:
        raise ValueError(f"{source}: a record has no {err} key (expected the JSON of "
                         "Sparsifier.save_history or a {step: {site: fraction}} dict)") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err} (expected the JSON of Sparsifier.save_history or a "
                         "{step: {site: fraction}} dict)") from None
    if not records:
        raise ValueError(f"{source} is empty")
    return sorted(records, key=lambda r: r[0])


def _step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, str)) or not str(step).lstrip("-").isdigit():
        raise ValueError(f"step {step!r} is not an integer")
    text = str(step)
    digits = text.lstrip("-").lstrip("0")  # counted before converting: a long key is past Python's int limits
    if len(digits) > len(str(MAX_STEP)) or abs(int(step)) > MAX_STEP:
        shown = text if len(text) <= 24 else f"{text[:12]}... ({len(digits)} digits)"
        raise ValueError(f"step {shown} is out of range: a sparsifier counts at most {MAX_STEP:,} steps (an int64)")
    return int(step)


def _fraction(value: Any, what: str, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} is {value!r}, not a fraction in [0, 1]")  # NaN fails the range test too
    return float(value)


def _sites(sites: Any) -> dict[str, float]:
    if not isinstance(sites, Mapping):
        raise TypeError(f"sites {sites!r} is not a {{site: fraction}} dict")
    return {str(name): _fraction(f, f"the fraction of site {name!r}") for name, f in sites.items()}


def summarize_history(records: list[Record], counts: dict | None) -> dict:
    """:func:`load_history`'s result from checked records, sites weighted by ``counts`` channels."""
    names = list(dict.fromkeys(name for _, sites, _ in records for name in sites))
    widths = {n: s["total"] for n, s in (counts or {}).get("sites", {}).items()}
    total = []
    for _, sites, logged in records:
        if logged is not None:
            total.append(float(logged))
        elif sites and all(n in widths for n in sites):
            total.append(sum(f * widths[n] for n, f in sites.items()) / sum(widths[n] for n in sites))
        else:
            total.append(float(np.mean(list(sites.values()))) if sites else None)
    return {
        "steps": [r[0] for r in records],
        "total": total,
        "sites": {n: [r[1].get(n) for r in records] for n in names},
    }
