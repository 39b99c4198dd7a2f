"""linearize.timing: what a median of interleaved repetitions must not include."""

from __future__ import annotations

import time

from linearize.timing import WARMUP_ROUNDS, median_ms


def test_slow_first_calls_are_warm_up_not_timing():
    """A call whose first WARMUP_ROUNDS + 1 calls are slow (kernels picked, caches filled), next to a
    steady one: the medians are the steady times (with a single warm-up call, 3 of the 5 timed calls
    would be slow: a 10x ratio made by the first rounds)."""
    calls = {"n": 0}

    def first_slow() -> None:
        calls["n"] += 1
        time.sleep(0.02 if calls["n"] <= WARMUP_ROUNDS + 1 else 0.002)

    slow, steady = median_ms([first_slow, lambda: time.sleep(0.002)], budget_s=0.05)
    assert slow < 0.01 * 1e3 and steady < 0.01 * 1e3  # ms: both near 2 ms, far from 20
    assert calls["n"] >= WARMUP_ROUNDS + 5  # the warm-up rounds, then at least 5 timed ones


def test_warm_up_takes_a_share_of_the_budget_but_stops_at_max_reps():
    calls = {"n": 0}

    def count() -> None:
        calls["n"] += 1

    median_ms([count], budget_s=0.01, max_reps=7)
    assert calls["n"] <= 2 * 7  # warm-up bounded by max_reps, then at most max_reps timed


def test_busy_cpu_names_a_load_above_the_cores_and_nothing_else(monkeypatch):
    """Truth: the load average and the affinity set given to the function (monkeypatched ``os``)."""
    import os

    from linearize import timing

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.2, 1.0, 1.0))
    assert timing.busy_cpu() == "1-minute load average 3.2 on 2 core(s)"
    monkeypatch.setattr(os, "getloadavg", lambda: (2.9, 1.0, 1.0))  # two busy processes on two cores: fine
    assert timing.busy_cpu() is None

    def unknown():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", unknown)
    assert timing.busy_cpu() is None
