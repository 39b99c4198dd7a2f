"""Wall-clock timing shared by fold's latency report and the sparsifier's latency weights."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["median_ms"]


@torch.no_grad()
def median_ms(calls: Sequence[Callable[[], Any]], budget_s: float = 2.0, max_reps: int = 200) -> list[float]:
    """Median wall time (ms) of each call, repetitions interleaved (a, b, a, b, ...) after one warm-up.

    The number of repetitions fits ``budget_s`` seconds in all (at least 5, at most ``max_reps``).

    Example:
        >>> a, b = median_ms([lambda: torch.ones(10).sum(), lambda: torch.ones(10_000).sum()], budget_s=0.1)
        >>> a > 0 and b > 0
        True
    """
    if not calls:
        return []
    t0 = time.perf_counter()
    for call in calls:  # warm-up, and the cost of one round
        call()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max(budget_s / one, 5), max_reps))
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(reps):
        for i, call in enumerate(calls):
            t = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - t)
    return [1e3 * statistics.median(t) for t in times]
