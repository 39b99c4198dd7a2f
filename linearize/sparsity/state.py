"""Checks of a saved :meth:`Sparsifier.state_dict <linearize.Sparsifier.state_dict>` before it is loaded.

The selection and the cost planner check their own parts (:meth:`Importance.read_state
<linearize.sparsity.selection.Importance.read_state>`, :func:`~linearize.sparsity.planning.check_plan`);
this module checks the rest: the keys, their types and ranges, the sites and the run length.
"""

from __future__ import annotations

import math
from typing import Mapping

from ..checks import finite_nonnegative, is_real
from ..unit import LinearizableActivation

__all__ = ["check_state_values"]


def check_state_values(state: Mapping, channels: int, units: list[tuple[str, LinearizableActivation]],
                       total_steps: int) -> None:
    """``ValueError`` naming the key for a state that is not a :meth:`Sparsifier.state_dict` of this run:
    missing keys, values of the wrong type or range, other sites (names, widths) or run length (the schedule
    is compared last, after the more specific checks of :meth:`Sparsifier.load_state_dict`).

    Example:
        >>> check_state_values({"step_count": 0}, 8, [], 10)
        Traceback (most recent call last):
        ValueError: state lacks ['channels', 'initial_fraction', 'lam', 'history']: not a Sparsifier.state_dict()
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping (Sparsifier.state_dict()), got {type(state).__name__}")
    missing = [k for k in ("channels", "step_count", "initial_fraction", "lam", "history") if k not in state]
    if missing:
        raise ValueError(f"state lacks {missing}: not a Sparsifier.state_dict()")

    def bad(key: str, what: str) -> ValueError:
        return ValueError(f"state's {key} must be {what}, got {state[key]!r:.80}")

    def count(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    def fraction(v: object) -> bool:
        return is_real(v) and 0 <= v <= 1

    if not count(state["step_count"]):
        raise bad("step_count", "an int >= 0")
    # a cost target's is the folded cost at its start: above 1 where a site frozen partly linear costs more
    start = state["initial_fraction"]
    if start is not None and not (fraction(start) or state.get("cost") and finite_nonnegative([start], 1)):
        raise bad("initial_fraction", "null or a number in [0, 1] (a cost target's: a finite number >= 0)")
    if state["lam"] is not None and not (is_real(state["lam"]) and math.isfinite(state["lam"])):
        raise bad("lam", "null or a finite number")
    if "rate" in state and not (is_real(state["rate"]) and 0 <= state["rate"] < math.inf):
        raise bad("rate", "a finite number >= 0")
    if not (isinstance(state["history"], list) and all(isinstance(h, dict) for h in state["history"])):
        raise bad("history", "a list of records (mappings)")
    for key in ("selected", "seen"):
        ids = state.get(key)
        if ids is not None and not (isinstance(ids, list) and all(count(i) and i < channels for i in ids)
                                    and len(set(ids)) == len(ids)):
            raise bad(key, f"null or distinct channel indices in [0, {channels})")
    peaks = state.get("lr_peak")
    if peaks is not None and not (isinstance(peaks, list) and len(peaks) == len(units) and all(
            p is None or (is_real(p) and 0 < p < math.inf) for p in peaks)):
        raise bad("lr_peak", f"null or {len(units)} entries, each null or a finite number > 0")
    sites = [[name, u.num_channels] for name, u in units]
    if state.get("sites") is not None and state["sites"] != sites:
        theirs = state["sites"] if isinstance(state["sites"], list) else []
        diff = next((f"{a} there, {b} here" for a, b in zip(theirs, sites) if a != b),
                    f"{len(theirs)} sites there, {len(sites)} here")
        raise ValueError(f"state is for other sites ({diff}): it belongs to another model")
    if state.get("total_steps") is not None and state["total_steps"] != total_steps:
        raise ValueError(f"state was saved in a run of total_steps={state['total_steps']!r}, this Sparsifier has "
                         f"{total_steps}: its schedule would jump; build it with the same total_steps")
