"""Measurements and plots shared by the sweeps of ``recipes/reproduce`` (:mod:`small`, :mod:`full`,
:mod:`speed`): a run's saved model and test images, its fold summary, path lengths and per-site
counts (cached in ``RUN/analysis.json``), interleaved CPU latencies, and PNG panels."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

from .sweep import read_json, write_json

RECIPES = Path(__file__).resolve().parent.parent  # recipes/: cifar.py, wmt14.py, results/


def cached(run: Path, key: str, fn: Callable[[], Any], replaces: str | None = None) -> Any:
    """``fn()``, memoized in ``run/analysis.json`` under ``key`` (analysis reruns are cheap); other
    entries whose key starts with ``replaces`` (stale versions of the same measure) are dropped."""
    path = run / "analysis.json"
    cache = read_json(path)
    if key not in cache:
        t0 = time.time()
        value = fn()
        if replaces:
            cache = {k: v for k, v in cache.items() if not k.startswith(replaces)}
        cache[key] = value
        cache[key + "_seconds"] = round(time.time() - t0, 1)
        write_json(path, cache)
    return cache[key]


def cifar_inputs(run: Path, data: str | None, n: int):
    """The first ``n`` test images of the run's test set (its ``--eval-subset``, its ``--classes`` in
    their order), normalized as the run's model expects, and their labels (0..k-1)."""
    import cifar
    import torch

    meta = read_json(run / "model" / "recipe.json")
    a = read_json(run / "metrics.json", damaged_ok=True)["args"]
    cache = Path(os.environ.get("LINEARIZE_CACHE") or a["cache_dir"])
    test = cifar.load_split(data or a["data_dir"], a["dataset"], "test", a["eval_subset"], a["image_size"],
                            cache, show=False)
    x, y = test["x"], test["y"]
    if a.get("classes"):
        wanted = a["classes"].split(",") if isinstance(a["classes"], str) else list(a["classes"])
        unknown = [c for c in wanted if c not in test["classes"]]
        if unknown:
            raise ValueError(f"{run / 'metrics.json'}: classes {unknown} are not in the test set of "
                             f"{data} (it has {test['classes']}); pass the run's CIFAR data with --cifar")
        old = torch.tensor([test["classes"].index(c) for c in wanted])
        keep = (y[:, None] == old[None]).any(1)
        x, y = x[keep], (y[keep][:, None] == old[None]).int().argmax(1)
    return cifar.normalize(x[:n], torch.tensor(meta["mean"]), torch.tensor(meta["std"])), y[:n]


def run_model(run: Path):
    import cifar

    return cifar.load_model(run / "model")


def fold_summary(run: Path, x, latency: bool = True) -> dict:
    """``linearize.fold`` of the saved final model on ``x``: params, FLOPs, CPU latency (unless not
    ``latency``), error."""
    import linearize

    s = linearize.fold(run_model(run), x, latency=latency).linearize_fold_summary
    out = {k: getattr(s, k) for k in ("params_before", "params_after", "flops_before", "flops_after",
                                      "latency_ms_before", "latency_ms_after", "max_abs_error", "output_scale",
                                      "units_before", "units_left", "skipped")}
    out["sites_to_identity"] = sum("replaced by identity" in m for m in s.merged)
    out["sites_total"] = len(linearize.units(run_model(run)))
    return out


def interleaved_latency(models: dict[str, Any], inputs: dict[str, Any], reps: int = 15) -> dict[str, dict]:
    """CPU latency in ms, ``{model: {input: median}}``: every model on every input, ``reps``
    repetitions interleaved over all of them in this process, one torch thread (so that drifts of
    a shared machine hit every model alike; :func:`linearize.timing.median_ms`). An input of batch 1
    is timed over 10 calls per repetition."""
    from linearize.timing import median_ms

    def repeat(m: Any, x: Any, calls: int) -> None:
        for _ in range(calls):
            m(x)

    n_calls = {i: 10 if len(x) == 1 else 1 for i, x in inputs.items()}
    pairs = [(k, i) for k in models for i in inputs]
    calls = [lambda m=models[k], x=inputs[i], n=n_calls[i]: repeat(m, x, n) for k, i in pairs]
    ms = median_ms(calls, budget_s=float("inf"), max_reps=reps, threads=1)
    per_call = {(k, i): t / n_calls[i] for (k, i), t in zip(pairs, ms)}
    return {k: {i: per_call[k, i] for i in inputs} for k in models}


def path_lengths(model, x, tol: float = 0.0) -> dict:
    """Both average path lengths of ``model`` on inputs shaped like ``x``; a plain model counts as
    every activation nonlinear (through a fresh conversion)."""
    import linearize

    if not linearize.units(model):
        model = linearize.convert(model, example_inputs=x[:2])
    r = linearize.measures.average_path_length(model, x, tol=tol, detailed=True)
    return {"normalized": r.normalized, "unnormalized": r.unnormalized, "log10_paths": r.log10_paths,
            "method": r.method}


def site_counts(run: Path, tol: float = 1e-3) -> dict:
    """``{site: {"nonlinear": k, "total": C}}`` of the saved model (slope < 1 - tol is nonlinear)."""
    import linearize

    return {n: {"nonlinear": s["nonlinear"], "total": s["total"]}
            for n, s in linearize.count_units(run_model(run), tol)["sites"].items()}


def on_one_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with torch on one thread (latencies are timed on one), the thread count restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def plot(path: Path, *draws: Callable[[Any], None]) -> None:
    """A PNG of one panel per function of ``draws`` (each draws on its matplotlib axes), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(draws), figsize=(6.4 * len(draws), 4.2), squeeze=False)
    for draw, ax in zip(draws, axes[0]):
        draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_name(threads: int | None = None, jobs: int | None = None) -> str:
    s = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    return s + (f", {threads} torch thread(s) per run, {jobs} runs at a time" if threads else "")
