"""CPU latency of modules: medians of interleaved repetitions (fold's summary and its per-merge probe)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from ..inputs import call_model

__all__ = ["median_latency_ms"]


@torch.no_grad()
def median_latency_ms(models: list[nn.Module], inputs: Any, budget_s: float = 2.0, threads: int | None = None) -> list[float]:
    """Median wall time (ms) of each model on ``inputs``, repetitions interleaved (a, b, a, b, ...).

    ``budget_s`` bounds the total time (5 to 200 repetitions); ``threads`` sets torch's intra-op
    threads while timing (``None``: leave them as they are).

    Example:
        >>> a, b = median_latency_ms([nn.Linear(8, 8), nn.Identity()], torch.randn(1, 8), budget_s=0.01)
        >>> a > 0 and b > 0
        True
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for m in models:  # warm-up
            call_model(m, inputs)
        t0 = time.perf_counter()
        call_model(models[0], inputs)
        one = max(time.perf_counter() - t0, 1e-6)
        reps = int(min(max(budget_s / (len(models) * one), 5), 200))
        times: list[list[float]] = [[] for _ in models]
        for _ in range(reps):
            for i, m in enumerate(models):
                t = time.perf_counter()
                call_model(m, inputs)
                times[i].append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return [1e3 * statistics.median(t) for t in times]
