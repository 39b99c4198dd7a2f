"""Wall-clock timing: medians of interleaved repetitions, shared by fold (its latency report and
per-merge probe) and the sparsifier (latency weights and targets)."""

from __future__ import annotations

import functools
import os
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .inputs import call_model

__all__ = ["median_ms", "median_latency_ms", "busy_cpu"]

# warm-up before timing: at least this many rounds and this share of the budget (one round was not enough:
# the first timed rounds of two fresh models then differ by up to 2x on an idle model pair)
WARMUP_ROUNDS, WARMUP_SHARE = 3, 0.25
# a 1-minute load average this far above the cores this process may use means other processes preempt the
# timed calls: on 2 cores with 4 busy processes one pair of folded MobileNet-V2s timed 0.43 to 0.83 apart
LOAD_MARGIN = 1.0


@torch.no_grad()
def median_ms(calls: Sequence[Callable[[], Any]], budget_s: float = 2.0, max_reps: int = 200,
              threads: int | None = None) -> list[float]:
    """Median wall time (ms) of each call, repetitions interleaved (a, b, a, b, ...) after warm-up rounds
    (at least ``WARMUP_ROUNDS``, and ``WARMUP_SHARE`` of ``budget_s``).

    The number of timed repetitions fits ``budget_s`` seconds in all (at least 5, at most ``max_reps``);
    ``threads`` sets torch's intra-op threads while timing (``None``: leave them as they are).

    Example:
        >>> a, b = median_ms([lambda: torch.ones(10).sum(), lambda: torch.ones(10_000).sum()], budget_s=0.1)
        >>> a > 0 and b > 0
        True
    """
    if not calls:
        return []
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        t0, rounds = time.perf_counter(), 0
        while True:  # warm-up rounds (caches, allocator, kernels picked on first calls), and the cost of one
            for call in calls:
                call()
            rounds += 1
            spent = time.perf_counter() - t0
            if rounds >= WARMUP_ROUNDS and (spent >= WARMUP_SHARE * budget_s or rounds >= max_reps):
                break
        one = max(spent / rounds, 1e-6)
        reps = int(min(max(budget_s / one, 5), max_reps))
        times: list[list[float]] = [[] for _ in calls]
        for _ in range(reps):
            for i, call in enumerate(calls):
                t = time.perf_counter()
                call()
                times[i].append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return [1e3 * statistics.median(t) for t in times]


def median_latency_ms(models: Sequence[nn.Module], inputs: Any, budget_s: float = 2.0,
                      threads: int | None = None) -> list[float]:
    """:func:`median_ms` of each model called on ``inputs`` (:func:`linearize.inputs.call_model`).

    Example:
        >>> a, b = median_latency_ms([nn.Linear(8, 8), nn.Identity()], torch.randn(1, 8), budget_s=0.01)
        >>> a > 0 and b > 0
        True
    """
    return median_ms([functools.partial(call_model, m, inputs) for m in models], budget_s, threads=threads)


def busy_cpu() -> str | None:
    """Why times taken now would be noisy: the 1-minute load average at least ``LOAD_MARGIN`` above the
    cores this process may run on (so other processes preempt the timed calls), or ``None`` (also where
    the load is unknown).

    Example:
        >>> busy_cpu() is None or "load average" in busy_cpu()
        True
    """
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    except OSError:
        return None
    if load < cores + LOAD_MARGIN:
        return None
    return f"1-minute load average {load:.1f} on {cores} core(s)"
