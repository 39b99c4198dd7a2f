"""The watch that warns when optimizers train a Sparsifier's slopes but nothing steps the Sparsifier.

A :class:`~linearize.Sparsifier` applies its pressure in ``step()``, which must follow every optimizer step
(or ``attach(optimizer)`` calls it). Forgotten, the run trains a model as nonlinear as it started, in silence.
One process-wide optimizer post-hook, registered when this module is imported (so it is never added while torch
iterates its hooks), counts for every live Sparsifier the steps of each optimizer that moved its slopes (a slope
with a gradient, in that optimizer) since a Sparsifier over those slopes last stepped. At :data:`STEPS` it warns
once, naming the optimizer and the fix. The watch holds Sparsifiers weakly, keyed by identity (a subclass's
``__eq__`` does not matter), reads their slopes when it runs (replaced slopes are seen) and takes a lock to
snapshot them (threads may build Sparsifiers while others step). It also remembers, per Sparsifier, the last
optimizer that moved its slopes (:func:`optimizer_of`): a Sparsifier stepped by hand settles its defaults by it.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import warnings
import weakref
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["STEPS", "watch", "stepped", "optimizer_of"]

# steps of one optimizer that move a Sparsifier's slopes, with no Sparsifier over them stepped in between
STEPS = 10


class _Entry:
    __slots__ = ("ref", "counts", "warned", "optimizer")

    def __init__(self, sparsifier: Any) -> None:
        self.ref = weakref.ref(sparsifier)
        self.counts: dict[int, int] = {}  # id(optimizer) -> its steps since a Sparsifier over these slopes stepped
        self.warned = False
        self.optimizer: weakref.ref | None = None  # the last optimizer that moved these slopes


_ENTRIES: dict[int, _Entry] = {}  # id(Sparsifier) -> its entry (dead ones are dropped when met)
_LOCK = threading.Lock()


def watch(sparsifier: Any) -> None:
    """Watch ``sparsifier`` (anything with a ``slopes()`` method) from now on, counting from zero (its
    construction, ``load_state_dict``, a copy)."""
    with _LOCK:
        _ENTRIES[id(sparsifier)] = _Entry(sparsifier)


def stepped(sparsifier: Any) -> None:
    """``sparsifier`` stepped: restart the counts of its watch and of every other watch sharing one of its slopes
    (an earlier Sparsifier of the model still alive, e.g. from a notebook cell run twice, stays silent)."""
    with _LOCK:
        entries = list(_ENTRIES.values())
    for entry in _over_same_slopes(entries, sparsifier):
        entry.counts.clear()


def optimizer_of(sparsifier: Any) -> torch.optim.Optimizer | None:
    """The last optimizer whose step moved a slope of ``sparsifier`` (a slope with a gradient, in that optimizer)
    since it was watched; ``None`` when none did (or it is gone)."""
    with _LOCK:
        entry = _ENTRIES.get(id(sparsifier))
    if entry is None or entry.ref() is not sparsifier or entry.optimizer is None:
        return None
    return entry.optimizer()


def _over_same_slopes(entries: list[_Entry], sparsifier: Any) -> list[_Entry]:
    """The entries of ``entries`` that watch ``sparsifier`` or another live Sparsifier sharing one of its slopes."""
    mine = {id(s) for s in sparsifier.slopes()}
    found = []
    for entry in entries:
        other = entry.ref()
        if other is sparsifier or (other is not None and any(id(s) in mine for s in other.slopes())):
            found.append(entry)
    return found


def _count(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _ENTRIES:
        return
    with _LOCK:
        entries = list(_ENTRIES.items())
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    due: list[tuple[_Entry, int]] = []
    sparsifier = None
    for key, entry in entries:
        sparsifier = entry.ref()
        if sparsifier is None:
            with _LOCK:
                if _ENTRIES.get(key) is entry:
                    del _ENTRIES[key]
            continue
        if not any(id(s) in params and s.grad is not None for s in sparsifier.slopes()):
            continue
        entry.optimizer = weakref.ref(optimizer)
        if entry.warned:
            continue
        n = entry.counts[id(optimizer)] = entry.counts.get(id(optimizer), 0) + 1
        if n >= STEPS:
            due.append((entry, n))
    del sparsifier
    for entry, n in due:
        gc.collect()  # a Sparsifier nobody holds but a reference cycle (a throwaway query) goes first
        sparsifier = entry.ref()
        if sparsifier is None or entry.warned:
            continue
        # before warning (a warning turned into an error is not raised again): this one and every other watch over
        # these slopes (an earlier Sparsifier of the model) are told once together
        for other in _over_same_slopes([e for _, e in entries], sparsifier):
            other.warned = True
        del sparsifier
        warnings.warn(
            f"{type(optimizer).__name__} stepped the unit slopes {n} times since a Sparsifier over them last "
            "stepped (or was built or loaded): its pressure applies only in Sparsifier.step(), which must follow "
            "every optimizer.step() (total_steps counts optimizer steps). Call sparsifier.step() after each "
            "optimizer.step(), or sparsifier.attach(optimizer) once, again after load_state_dict or for a new "
            "optimizer; to delay the pressure, give the schedule a later start, e.g. schedules.late(0.5)",
            UserWarning, stacklevel=_user_stacklevel())


def _package_dirs() -> tuple[str, ...]:
    """Folders whose frames a warning from the hook skips: torch, linearize, and accelerate's optimizer wrapper."""
    dirs = [Path(torch.__file__).parent, Path(__file__).parents[1]]
    spec = find_spec("accelerate")
    if spec is not None and spec.origin:
        dirs.append(Path(spec.origin).parent)
    return tuple(str(d) + os.sep for d in dirs)


_INTERNAL = _package_dirs()


def _user_stacklevel() -> int:
    """The ``stacklevel`` that names the first frame outside torch, linearize and accelerate: the user's
    ``optimizer.step()``, not torch's hook loop. Called by :func:`_count`."""
    level, frame = 2, sys._getframe(2)  # for warnings.warn in _count: 1 is _count, 2 its caller (torch)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


_HOOK = register_optimizer_step_post_hook(_count)
