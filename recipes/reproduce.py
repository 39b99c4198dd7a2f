"""Rerun the seed-paper reproductions of the README on real data, then tabulate and plot them.

Two sweeps (``--scale``):

* ``cpu-small`` (default): the reduced sweep whose tables and plots are ``recipes/results/*.md|json|png``
  (one seed, 5,000 training images, 5 epochs; CIFAR-10 and Multi30k)::

      python recipes/reproduce.py --cifar /path/cifar10-jpeg.tar.gz --multi30k /path/multi30k
      python recipes/reproduce.py --stage analyze       # only redo tables and plots from finished runs

* ``full``: issue 19 on the full CIFAR-10 train and test sets, on the CPU (``recipes/reproduce_full.py``:
  the run list and the analysis): ResNet-20 baselines (40 epochs, seeds 0 and 1), late linearization
  of each baseline (15 epochs) to 25 / 10 / 5 / 2 % nonlinear channels, early linearization from
  scratch (55 epochs) to 10 / 2 %, and late linearization to 5 % on 2- and 5-class subsets, two
  single-thread runs side by side. Runs go to ``runs/reproduce/full/<run>`` (git-ignored), the small
  results of each finished run (``model/``, ``metrics.json``, ``sparsifier_history.json``) to
  ``recipes/results/<run>/`` (committed), tables and plots to ``recipes/results/full/``::

      export LINEARIZE_CIFAR10=/path/cifar10-jpeg.tar.gz
      # once, optional: adopt runs started by hand with the planned arguments (finished or still
      # running): a symlink in the runs folder; the runner waits for them, or resumes them if they stop
      python recipes/reproduce.py --scale full --stage collect --adopt r20_base_s0=/work/runs/r20_base_s0 \\
          --adopt r20_base_s1=/work/runs/r20_base_s1
      # start, and resume after a crash, a reboot or a kill -9 of anything (the same command):
      mkdir -p runs && setsid nohup python recipes/reproduce.py --scale full --stage train >> runs/reproduce-full.log 2>&1 < /dev/null &
      python recipes/reproduce.py --scale full --stage collect   # copy finished runs to recipes/results/ (train does too)
      python recipes/reproduce.py --scale full --stage analyze   # tables + plots from recipes/results/<run>/ only
      git add recipes/results/r20_* recipes/results/full
      # before a session ends with runs unfinished: park their newest checkpoints (about 2 MB each) to commit;
      # on a fresh machine, --stage train links the runs collected in recipes/results/<run>/ as done (late
      # runs start from those baselines), puts parked checkpoints newer than the run folders' back and
      # resumes from them
      python recipes/reproduce.py --scale full --stage park && git add recipes/results/inflight

* ``speed``: issue 20 (``recipes/reproduce_speed.py``): MobileNet-V2 x0.5 linearized late under CPU
  latency budgets (whole blocks), folded, against MobileNet-V2 x0.35 trained for as many epochs; the same
  stages, runs in ``runs/reproduce/speed/``, collected runs in
  ``recipes/results/<run>/``, tables and the accuracy-vs-latency plot in ``recipes/results/speed/``::

      setsid nohup python recipes/reproduce.py --scale speed --stage train >> runs/reproduce-speed.log 2>&1 < /dev/null &

Stage ``train`` runs ``recipes/cifar.py`` (and ``recipes/wmt14.py``) ``--jobs`` at a time, each with
``--threads`` torch threads, logs appended to ``RUNS/<run>.log``, launches and exit codes to
``RUNS/jobs.json``. All its state comes from the run folders, so the runner can be killed (even
``kill -9``) and started again at any time: a run whose ``metrics.json`` is complete is done; a run
that another process works on (a runner's child, which holds ``RUNS/<run>.lock``, or any process
whose command line has ``--output_dir`` of that folder) is left alone and takes one of the ``--jobs``
slots; a run with a checkpoint but no ``metrics.json`` is resumed with ``--resume_from_checkpoint
latest``; a run whose dependency (the baseline of a late run) is not done waits without holding a
slot. A run that exits non-zero is reported with its log and not started again by this runner
(its dependents are reported as blocked); the next start of the runner tries it again.

Stage ``analyze`` measures the saved models with the library and writes ``results.json``,
``results.md`` and PNG plots (cpu-small: from the run folders, to ``--results-dir``; full: only
from ``recipes/results/<run>/``, to ``recipes/results/full/``). Measurements that need test images
(fold, latency) read ``--cifar``; without it the tables are rebuilt from the committed metrics and
the per-run ``analysis.json`` caches, and the report names what was skipped.

Data: ``--cifar`` (default ``$LINEARIZE_CIFAR10``) and ``--multi30k`` (a folder with
``{train,validation,test}.jsonl.gz``, default ``$LINEARIZE_MULTI30K``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

from sweep import Job, _read, _write_json, adopt, train

HERE = Path(__file__).resolve().parent
TARGETS = (0.5, 0.25, 0.10, 0.05, 0.02)
MT_TARGETS = (0.10, 0.25, 0.05)

SCALES = {
    # train images, test images, epochs; Multi30k train pairs, eval pairs, epochs, tokens per batch
    # (Multi30k: all 29k pairs, 6 epochs = 702 steps, ~28 min per run on one CPU thread; shorter runs
    # do not converge far enough to say anything about linearization)
    "cpu-small": dict(subset=5000, eval_subset=2000, epochs=5, mt_train=None, mt_eval=None, mt_epochs=6,
                      mt_tokens=4000, mt_warmup=250, mt_beams=4),
}


def cifar_jobs(s: dict, data: str, runs: Path) -> list[Job]:
    """Every CIFAR run of the cpu-small sweep, most important first."""
    base = [str(HERE / "cifar.py"), "--data-dir", data, "--arch", "resnet20", "--epochs", str(s["epochs"]),
            "--cpu", "--seed", "0"]
    if s["subset"]:
        base += ["--subset", str(s["subset"])]
    if s["eval_subset"]:
        base += ["--eval-subset", str(s["eval_subset"])]
    jobs = [("cifar_baseline", base + ["--linearize", "none"])]
    order = [0.10, 0.02, 0.5] + [t for t in TARGETS if t not in (0.10, 0.02, 0.5)]
    for i, t in enumerate(order):
        for sched in ("late", "early"):
            jobs.append((f"cifar_{sched}_{t:g}", base + ["--linearize", "prelu", "--schedule", sched,
                                                         "--target", f"{t:g}", "--freeze"]))
        if i == 2:  # the gated networks after the three most telling targets
            jobs += [(f"cifar_{m}", base + ["--linearize", m, "--schedule", "none"]) for m in ("dgn", "dlgn")]
    return [Job(n, a + ["--output_dir", str(runs / n)]) for n, a in jobs]


def mt_jobs(s: dict, data: str, runs: Path) -> list[Job]:
    """Every Multi30k run of the cpu-small sweep."""
    d = Path(data)
    base = [str(HERE / "wmt14.py"), "--train-file", str(d / "train.jsonl.gz"),
            "--validation-file", str(d / "validation.jsonl.gz"), "--test-file", str(d / "test.jsonl.gz"),
            "--source-lang", "en", "--target-lang", "de", "--model-size", "small", "--epochs", str(s["mt_epochs"]),
            "--max-tokens", str(s["mt_tokens"]), "--warmup-steps", str(s["mt_warmup"]),
            "--num-beams", str(s["mt_beams"]), "--cpu", "--seed", "0"]
    if s["mt_train"]:
        base += ["--max-train-samples", str(s["mt_train"])]
    if s["mt_eval"]:
        base += ["--max-eval-samples", str(s["mt_eval"])]
    jobs = [("mt_baseline", base + ["--linearize", "none"])]
    # --select slope --lam 0.001: the recorded runs (recipes/results/results.md) predate --rate and wmt14.py's
    # --select saliency default: they pushed the slopes by lr * 0.001, highest slope first
    jobs += [(f"mt_late_{t:g}", base + ["--linearize", "prelu", "--schedule", "late", "--target", f"{t:g}",
                                        "--select", "slope", "--lam", "0.001", "--freeze", "--fold"])
             for t in MT_TARGETS]
    return [Job(n, a + ["--output_dir", str(runs / n)]) for n, a in jobs]


# ----------------------------------------------------------------------------- analysis


def _cached(run: Path, key: str, fn: Callable[[], Any], replaces: str | None = None) -> Any:
    """``fn()``, memoized in ``run/analysis.json`` under ``key`` (analysis reruns are cheap); other
    entries whose key starts with ``replaces`` (stale versions of the same measure) are dropped."""
    path = run / "analysis.json"
    cache = _read(path)
    if key not in cache:
        t0 = time.time()
        value = fn()
        if replaces:
            cache = {k: v for k, v in cache.items() if not k.startswith(replaces)}
        cache[key] = value
        cache[key + "_seconds"] = round(time.time() - t0, 1)
        _write_json(path, cache)
    return cache[key]


def _cifar_inputs(run: Path, data: str | None, n: int):
    """The first ``n`` test images of the run's test set (its ``--eval-subset``, its ``--classes`` in
    their order), normalized as the run's model expects, and their labels (0..k-1)."""
    import cifar
    import torch

    meta = _read(run / "model" / "recipe.json")
    a = _read(run / "metrics.json")["args"]
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


def _model(run: Path):
    import cifar

    return cifar.load_model(run / "model")


def _fold_summary(run: Path, x, latency: bool = True) -> dict:
    """``linearize.fold`` of the saved final model on ``x``: params, FLOPs, CPU latency (unless not
    ``latency``), error."""
    import linearize

    s = linearize.fold(_model(run), x, latency=latency).linearize_fold_summary
    out = {k: getattr(s, k) for k in ("params_before", "params_after", "flops_before", "flops_after",
                                      "latency_ms_before", "latency_ms_after", "max_abs_error", "output_scale",
                                      "units_before", "units_left", "skipped")}
    out["sites_to_identity"] = sum("replaced by identity" in m for m in s.merged)
    out["sites_total"] = len(linearize.units(_model(run)))
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


def _latencies(runs: Path, names: list[str], x, reps: int = 15) -> dict:
    """Latency (ms) of the saved model of every run in ``names`` and of its folded version, on ``x``."""
    import linearize

    models = {}
    for n in names:
        models[n] = _model(runs / n)
        models[n + "/folded"] = linearize.fold(models[n], x, latency=False)
    return {k: v["x"] for k, v in interleaved_latency(models, {"x": x}, reps).items()}


def path_lengths(model, x, tol: float = 0.0) -> dict:
    """Both average path lengths of ``model`` on inputs shaped like ``x``; a plain model counts as
    every activation nonlinear (through a fresh conversion)."""
    import linearize

    if not linearize.units(model):
        model = linearize.convert(model, example_inputs=x[:2])
    r = linearize.measures.average_path_length(model, x, tol=tol, detailed=True)
    return {"normalized": r.normalized, "unnormalized": r.unnormalized, "log10_paths": r.log10_paths,
            "method": r.method}


def _baseline_path_length(run: Path, x) -> float:
    """Average path length (normalized) of the plain baseline: every activation nonlinear."""
    return float(path_lengths(_model(run), x)["normalized"])


def _site_counts(run: Path, tol: float = 1e-3) -> dict:
    """``{site: {"nonlinear": k, "total": C}}`` of the saved model (slope < 1 - tol is nonlinear)."""
    import linearize

    return {n: {"nonlinear": s["nonlinear"], "total": s["total"]}
            for n, s in linearize.count_units(_model(run), tol)["sites"].items()}


def _sites(run: Path) -> dict:
    return {n: s["nonlinear"] / s["total"] for n, s in _site_counts(run).items()}


def _affinity(run: Path, x) -> list:
    import linearize

    return [[n, float(v)] for n, v in linearize.measures.affinity_signature(_model(run), x, progress=False)]


def _regions(run: Path, x, radius: float, segments: int | None, pieces: int, n_anchors: int = 8) -> dict:
    """Linear regions and exact absolute deviation along the closed translation loops of ``x``
    (``n_anchors`` shifts on a circle of ``radius`` pixels), on the first ``segments`` segments,
    each walked as ``pieces`` sub-segments in parallel (same result, faster)."""
    import linearize

    m = linearize.measures
    x0, x1 = m.translation_loops(x.double(), n_anchors=n_anchors, radius=radius)
    x0, x1 = x0[:segments], x1[:segments]
    res = m.linear_regions(_model(run), x0, x1, pieces=pieces, batch_size=max(256, pieces * x0.shape[0]))
    dev = res.deviation().mean(1)  # [S]: integral over arc length, mean over the logits
    length = (x1 - x0).flatten(1).norm(dim=1)
    return {"segment_regions": res.count.tolist(), "segment_length": length.tolist(), "segment_deviation": dev.tolist()}


def on_one_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with torch on one thread (latencies are timed on one), the thread count restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _plot(path: Path, *draws: Callable[[Any], None]) -> None:
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


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def analyze(runs: Path, out: Path, scale: str, data: str | None, regions_images: int, regions_radius: float,
            regions_runs: list[str], machine: str, regions_pieces: int = 32, remeasure_latency: bool = False) -> dict:
    """Tables (``results.json``, ``results.md``) and PNG plots from the finished runs in ``runs``.

    Parts whose runs are missing here keep their entry of the previous ``results.json`` (e.g.
    the translation runs on a machine that only has the CIFAR runs), and the interleaved
    latencies of the previous ``results.json`` are reused for the same set of models unless
    ``remeasure_latency`` (they are only comparable when measured on an otherwise idle machine).
    """
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    previous = _read(out / "results.json")
    jobs = _read(runs / "jobs.json")
    runs_info = {}
    for d in sorted(p for p in runs.iterdir() if (p / "metrics.json").exists()):
        m = _read(d / "metrics.json")
        root = str(HERE.parent) + "/"
        runs_info[d.name] = {k: v for k, v in m.items() if not isinstance(v, dict) and k != "command"}
        runs_info[d.name]["command"] = jobs.get(d.name, {}).get("command", m.get("command", "")).replace(root, "")
        runs_info[d.name]["runner_wall_s"] = jobs.get(d.name, {}).get("wall_s")
        if "fold" in m:
            runs_info[d.name]["recipe_fold"] = m["fold"]
    res: dict = {"scale": scale, "machine": machine, "runs": runs_info}
    md = [f"# Reproduction results ({scale})", "", f"Machine: {machine}. Every run: one seed (0).", ""]
    acc = lambda n: runs_info.get(n, {}).get("test_accuracy")  # noqa: E731
    base = runs / "cifar_baseline"
    have = lambda n: n in runs_info and (runs / n / "model").exists()  # noqa: E731

    # 1-2. late vs early, path length
    if runs_info:
        first = next(iter(runs_info.values()))
        md += [f"CIFAR-10 runs: ResNet-20 (width 16), {first.get('train_images')} training images, "
               f"{first.get('test_images')} test images, {first.get('total_steps')} steps of batch 128.", ""]
    if have("cifar_baseline"):
        x64 = _cifar_inputs(base, data, 64)[0]
        runs_info["cifar_baseline"]["average_path_length"] = _cached(base, "apl", lambda: _baseline_path_length(base, x64))
    rows = []
    for t in TARGETS:
        r = {"target": t}
        for s in ("late", "early"):
            info = runs_info.get(f"cifar_{s}_{t:g}", {})
            r[s] = {k: info.get(k) for k in ("test_accuracy", "nonlinear_fraction", "average_path_length",
                                               "wall_time_s")}
        if r["late"]["test_accuracy"] is not None and r["early"]["test_accuracy"] is not None:
            r["late_minus_early"] = r["late"]["test_accuracy"] - r["early"]["test_accuracy"]
        rows.append(r)
    res["late_vs_early"] = {"baseline_accuracy": acc("cifar_baseline"), "rows": rows}
    md += ["## Late vs early linearization (seed 000)", "",
           f"Baseline (no linearization): test accuracy {_pct(acc('cifar_baseline'))}, average path length "
           f"{runs_info.get('cifar_baseline', {}).get('average_path_length', '-')}.", "",
           "| target | late acc | late nonlinear | late APL | early acc | early nonlinear | early APL | late - early |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        la, ea = r["late"], r["early"]
        gap = r.get("late_minus_early")
        md.append(f"| {r['target']:g} | {_pct(la['test_accuracy'])} | {_pct(la['nonlinear_fraction'])} | "
                  f"{_num(la['average_path_length'])} | {_pct(ea['test_accuracy'])} | {_pct(ea['nonlinear_fraction'])} | "
                  f"{_num(ea['average_path_length'])} | {'-' if gap is None else f'{100 * gap:+.1f} pts'} |")
    md += ["", "![accuracy vs nonlinear fraction](accuracy_vs_fraction.png) ![path length](path_length_vs_accuracy.png)", ""]

    def draw_acc(ax):
        for s, mk in (("late", "o-"), ("early", "s--")):
            pts = sorted((r[s]["nonlinear_fraction"], r[s]["test_accuracy"]) for r in rows
                         if r[s]["test_accuracy"] is not None)
            if pts:
                ax.plot(*zip(*pts), mk, label=s)
        if acc("cifar_baseline") is not None:
            ax.axhline(acc("cifar_baseline"), color="k", lw=1, label="baseline (no linearization)")
        ax.set_xscale("log")
        ax.set_xticks([*TARGETS, 1.0], [f"{t:g}" for t in (*TARGETS, 1.0)])
        ax.minorticks_off()
        ax.margins(y=0.1)
        ax.set_xlabel("nonlinear fraction of channels (final; 1 = baseline)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"ResNet-20, CIFAR-10 ({scale})")
        ax.legend()

    _plot(out / "accuracy_vs_fraction.png", draw_acc)

    def draw_apl(ax):
        for s, mk in (("late", "o"), ("early", "s")):
            pts = [(r[s]["average_path_length"], r[s]["test_accuracy"]) for r in rows
                   if r[s]["test_accuracy"] is not None and r[s]["average_path_length"] is not None]
            if pts:
                ax.plot(*zip(*pts), mk, label=s)
        b = runs_info.get("cifar_baseline", {})
        if b.get("average_path_length") is not None:
            ax.plot([b["average_path_length"]], [b["test_accuracy"]], "k*", ms=12, label="baseline")
        ax.set_xlabel("average path length (nonlinear units met from input to output)")
        ax.set_ylabel("test accuracy")
        ax.legend()

    _plot(out / "path_length_vs_accuracy.png", draw_apl)

    # 2b. where the nonlinear units sit
    site_runs = [n for n in ("cifar_late_0.1", "cifar_early_0.1", "cifar_late_0.02", "cifar_early_0.02") if have(n)]
    res["sites"] = {n: _cached(runs / n, "sites", lambda n=n: _sites(runs / n)) for n in site_runs}
    if site_runs:
        def draw_sites(ax):
            names = list(res["sites"][site_runs[0]])
            w = 0.8 / len(site_runs)
            for i, n in enumerate(site_runs):
                ax.bar(np.arange(len(names)) + i * w, [res["sites"][n].get(k, 0) for k in names], w, label=n[6:])
            ax.set_xticks(np.arange(len(names)) + 0.4 - w / 2, [k.replace(".calls.", "#") for k in names],
                          rotation=90, fontsize=6)
            ax.set_ylabel("nonlinear fraction at the site")
            ax.legend(fontsize=7)

        _plot(out / "nonlinear_sites.png", draw_sites)
        md += ["## Where the nonlinear channels survive", "", "![sites](nonlinear_sites.png)", "",
               "| site | " + " | ".join(n[6:] for n in site_runs) + " |", "|---|" + "---|" * len(site_runs)]
        for k in res["sites"][site_runs[0]]:
            md.append(f"| {k} | " + " | ".join(_pct(res["sites"][n].get(k)) for n in site_runs) + " |")
        md.append("")

    # 3. freeze + fold
    fold_runs = [n for n in ["cifar_baseline"] + [f"cifar_{s}_{t:g}" for t in TARGETS for s in ("late", "early")]
                 if have(n)]
    if fold_runs:
        x64 = _cifar_inputs(runs / fold_runs[0], data, 64)[0]
        res["fold"] = {n: _cached(runs / n, "fold_v2", lambda n=n: _fold_summary(runs / n, x64)) for n in fold_runs}
        md += ["## After freeze + fold (`linearize.freeze`, `linearize.fold`)", "",
               "FLOPs and CPU latency for a batch of 64 test images (latency: before -> after folding, median of 15 "
               "repetitions of all models interleaved in one process, 1 thread, on the shared machine; "
               "'vs baseline' compares with the plain baseline model). Error: max |folded - model| over the logits.", "",
               "| run | test acc | sites folded to identity | params | FLOPs (batch 64) | FLOPs vs baseline | latency ms | latency vs baseline | max abs error | conv merges refused |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        lat_ms = previous.get("latency_ms_interleaved", {})
        if remeasure_latency or set(lat_ms) != {k for n in fold_runs for k in (n, n + "/folded")}:
            lat_ms = _latencies(runs, fold_runs, x64)
        res["latency_ms_interleaved"] = lat_ms
        fb = res["fold"].get("cifar_baseline")
        for n, f in res["fold"].items():
            rel = f"{f['flops_after'] / fb['flops_after']:.3f}x" if fb else "-"
            f = {**f, "latency_ms_before": lat_ms[n], "latency_ms_after": lat_ms[n + "/folded"]}
            lat = (f"{f['latency_ms_after'] / lat_ms['cifar_baseline']:.2f}x" if fb else "-")
            md.append(f"| {n[6:]} | {_pct(acc(n))} | "
                      f"{f['sites_to_identity']} of {f['sites_total']} | "
                      f"{f['params_before']:,} -> {f['params_after']:,} | "
                      f"{f['flops_before'] / 1e6:.0f}M -> {f['flops_after'] / 1e6:.0f}M | {rel} | "
                      f"{f['latency_ms_before']:.1f} -> {f['latency_ms_after']:.1f} | {lat} | "
                      f"{f['max_abs_error']:.2g} (scale {f['output_scale']:.2g}) | {len(f['skipped'])} |")
        reasons = sorted({r.split(": ", 1)[-1] for f in res["fold"].values() for r in f["skipped"]})
        md += ["", "Why conv merges were refused: " + ("; ".join(f"`{r}`" for r in reasons) or "none") + "."]
        md.append("")

    # 5. DNN vs DGN vs DLGN
    gated = [n for n in ("cifar_baseline", "cifar_dgn", "cifar_dlgn") if n in runs_info]
    if len(gated) > 1:
        res["gated"] = {n: {"test_accuracy": acc(n), "wall_time_s": runs_info[n].get("wall_time_s")} for n in gated}
        md += ["## DNN vs DGN vs DLGN (seed 003)", "", "| network | test acc | wall time |", "|---|---|---|"]
        md += [f"| {n[6:].replace('baseline', 'DNN (ReLU)').upper() if n != 'cifar_baseline' else 'DNN (ReLU)'} | "
               f"{_pct(acc(n))} | {runs_info[n].get('wall_time_s', 0):.0f} s |" for n in gated]
        md.append("")

    # 6. translation
    mt = [n for n in ["mt_baseline"] + [f"mt_late_{t:g}" for t in MT_TARGETS] if n in runs_info]
    if mt:
        res["translation"] = {n: {k: runs_info[n].get(k) for k in ("bleu", "bleu_signature", "nonlinear_fraction",
                                                                    "train_pairs", "eval_pairs", "total_steps",
                                                                    "wall_time_s")} | {"fold": runs_info[n].get("recipe_fold")}
                              for n in mt}
    elif previous.get("translation"):
        res["translation"] = previous["translation"]
        for n, v in previous.get("runs", {}).items():
            if n.startswith("mt_"):
                runs_info.setdefault(n, v)
    if res.get("translation"):
        sig = next((v["bleu_signature"] for v in res["translation"].values() if v.get("bleu_signature")), "")
        md += ["## Translation: Multi30k En->De (small Transformer)", "", f"sacreBLEU signature: `{sig}`", "",
               "| run | BLEU | nonlinear FFN channels | params after fold | steps | wall time |", "|---|---|---|---|---|---|"]
        for n, v in res["translation"].items():
            f = v.get("fold") or {}
            md.append(f"| {n[3:]} | {v['bleu']} | {_pct(v['nonlinear_fraction'])} | "
                      f"{f.get('params_after', '-'):,} of {f.get('params_before', 0):,} | {v['total_steps']} | "
                      f"{v['wall_time_s']:.0f} s |" if f else
                      f"| {n[3:]} | {v['bleu']} | {_pct(v['nonlinear_fraction'])} | - | {v['total_steps']} | "
                      f"{v['wall_time_s']:.0f} s |")
        md.append("")

    # 4. affinity signature, linear regions along translation loops
    aff_runs = [n for n in ["cifar_baseline"] + [f"cifar_late_{t:g}" for t in TARGETS] if have(n)]
    if aff_runs:
        x512 = _cifar_inputs(runs / aff_runs[0], data, 512)[0]
        res["affinity"] = {n: _cached(runs / n, "affinity", lambda n=n: _affinity(runs / n, x512)) for n in aff_runs}

        def draw_aff(ax):
            for n in aff_runs:
                ax.plot([v for _, v in res["affinity"][n]], "o-", ms=3, label=n[6:])
            ax.set_xlabel("activation call site (forward order)")
            ax.set_ylabel("affinity score (1 = affine)")
            ax.legend(fontsize=7)

        _plot(out / "affinity_signature.png", draw_aff)
        md += ["## Affinity signature (seed 002), 512 test images", "", "![affinity](affinity_signature.png)", "",
               "| run | mean affinity | min affinity |", "|---|---|---|"]
        md += [f"| {n[6:]} | {np.mean([v for _, v in res['affinity'][n]]):.3f} | "
               f"{min(v for _, v in res['affinity'][n]):.3f} |" for n in aff_runs]
        md.append("")
    reg = [(n.split(":")[0], int(n.split(":")[1]) if ":" in n else None) for n in regions_runs]
    reg = [(n, k) for n, k in reg if have(n)]
    if reg and regions_images > 0:
        xr = _cifar_inputs(runs / reg[0][0], data, regions_images)[0]
        res["regions"] = {n: _cached(runs / n, f"regions_{regions_images}_r{regions_radius:g}" + (f"_s{k}" if k else ""),
                                     lambda n=n, k=k: _regions(runs / n, xr, regions_radius, k, regions_pieces))
                          for n, k in reg}

        def draw_reg(ax):
            for n, _ in reg:
                r = res["regions"][n]
                length = np.array(r["segment_length"])
                ax.plot(np.array(r["segment_regions"]) / length, np.array(r["segment_deviation"]) / length, "o", ms=5,
                        label=n[6:])
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("linear regions per unit input distance")
            ax.set_ylabel("absolute deviation from the chord per unit distance")
            ax.set_title("one point per segment of a closed translation loop", fontsize=9)
            ax.legend(fontsize=7)

        _plot(out / "regions_vs_deviation.png", draw_reg)
        md += ["## Linear regions and absolute deviation along closed translation loops (seed 001)", "",
               f"{regions_images} test image(s), loop of 8 translations on a circle of radius {regions_radius:g} px, "
               "exact regions (`linearize.measures.linear_regions`) and exact absolute deviation from the chord "
               "(mean over the 10 logits; distances in normalized-input L2 units).", "",
               "![regions](regions_vs_deviation.png)", "",
               "| run | nonlinear | segments | regions per segment | regions per unit distance | deviation per unit distance |",
               "|---|---|---|---|---|---|"]
        for n, _ in reg:
            r = res["regions"][n]
            length = np.array(r["segment_length"])
            md.append(f"| {n[6:]} | {_pct(runs_info[n].get('nonlinear_fraction', 1.0))} | {len(length)} | "
                      f"{np.mean(r['segment_regions']):.0f} | {np.sum(r['segment_regions']) / length.sum():.2f} | "
                      f"{np.sum(r['segment_deviation']) / length.sum():.3g} |")
        md.append("")

    md += ["## Runs", "", "| run | test acc / BLEU | steps | wall time | command |", "|---|---|---|---|---|"]
    for n, v in runs_info.items():
        score = _pct(v.get("test_accuracy")) if "test_accuracy" in v else f"BLEU {v.get('bleu')}"
        md.append(f"| {n} | {score} | {v.get('total_steps')} | {v.get('wall_time_s', 0):.0f} s | `{v['command']}` |")
    (out / "results.json").write_text(json.dumps(res, indent=2))
    (out / "results.md").write_text("\n".join(md) + "\n")
    return res


def _each(jobs: list[Job], fn: Callable[[str], Any], what: str) -> int:
    """``fn(name)`` for every job; an ``OSError`` (a full disk, a checkpoint pruned under the copy) is
    reported and the next job goes on. Returns the number of jobs that failed."""
    failed = 0
    for j in jobs:
        try:
            fn(j.name)
        except OSError as e:
            print(f"{what} {j.name} FAILED: {type(e).__name__}: {e}", flush=True)
            failed += 1
    return failed


def machine_name(threads: int | None = None, jobs: int | None = None) -> str:
    s = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    return s + (f", {threads} torch thread(s) per run, {jobs} runs at a time" if threads else "")


def main(argv: list[str] | None = None) -> int:
    import reproduce_full as full
    import reproduce_speed as speed

    plans = {**{s: full for s in full.SCALES}, **{s: speed for s in speed.SCALES}}  # scale -> its plan and analysis
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=[*SCALES, *plans], default="cpu-small",
                   help="cpu-small, full (issue 19), speed (issue 20), or tiny / speed-tiny (their miniatures for "
                        "the tests)")
    p.add_argument("--stage", choices=["all", "train", "collect", "analyze", "park"], default="all",
                   help="all = train, collect (full), analyze; park (full): copy the newest checkpoint of every "
                        "unfinished run to RESULTS_DIR/inflight/<run>/ to commit, which train resumes from on a "
                        "machine without the run folders")
    p.add_argument("--parts", default="cifar,mt", help="cpu-small: comma-separated: cifar, mt")
    p.add_argument("--cifar", default=os.environ.get("LINEARIZE_CIFAR10"), help="CIFAR-10 folder or .tar.gz")
    p.add_argument("--multi30k", default=os.environ.get("LINEARIZE_MULTI30K"), help="Multi30k folder")
    p.add_argument("--runs-dir", default=str(HERE.parent / "runs" / "reproduce"),
                   help="run outputs (git-ignored); runs go to RUNS_DIR/SCALE/<run>")
    p.add_argument("--results-dir", default=str(HERE / "results"),
                   help="cpu-small: tables and plots; full: collected runs in <run>/, tables and plots in full/")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--only", default=None, help="comma-separated run names: run just these, in this order")
    p.add_argument("--adopt", action="append", default=[], metavar="NAME=DIR",
                   help="full: link DIR, a run started by hand with the planned arguments of run NAME (finished or "
                        "still running), into the runs folder, so that the runner waits for it (or resumes it) "
                        "instead of starting it again; repeatable")
    p.add_argument("--max-hours", type=float, default=72.0, help="start no run after this many hours")
    p.add_argument("--poll", type=float, default=10.0, help="seconds between looks at the runs")
    p.add_argument("--latency-reps", type=int, default=15, help="full: interleaved latency repetitions")
    p.add_argument("--regions-images", type=int, default=0,
                   help="cpu-small: test images whose closed translation loops are searched for linear regions "
                        "(slow: 25,305 regions on the first segment of the 1-px loop of the unlinearized ResNet-20, "
                        "10 minutes on one CPU thread with --regions-pieces 32; 0 skips)")
    p.add_argument("--regions-radius", type=float, default=1.0, help="radius of the translation loops in pixels")
    p.add_argument("--regions-pieces", type=int, default=32,
                   help="sub-segments per segment walked in parallel (linear_regions(pieces=...)): the same "
                        "regions; on one CPU thread 1.18x faster on a segment of the baseline (README, "
                        "benchmarks/regions.py --trained), less with few regions per piece")
    p.add_argument("--remeasure-latency", action="store_true",
                   help="measure the latencies again instead of reusing those of the previous results.json; "
                        "--scale full and speed add the new measurement to the earlier ones of the same models "
                        "on the same machine and report medians over the last 9 (remove results.json to start "
                        "afresh)")
    p.add_argument("--regions-runs", default="cifar_late_0.02,cifar_late_0.1,cifar_baseline",
                   help="runs whose linear regions are counted, cheapest first; NAME:K uses only the first K "
                        "segments of each loop (the unlinearized baseline has far more regions)")
    args = p.parse_args(argv)
    for name in ("jobs", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.only is not None and not all(args.only.split(",")):
        p.error(f"--only takes comma-separated run names, got {args.only!r} (leave it out to run every run)")
    runs = Path(args.runs_dir) / args.scale
    results = Path(args.results_dir)
    planned = args.scale in plans  # a planned sweep: runs collected to RESULTS_DIR/<run>/, parked, resumed
    parts = {"cifar"} if planned else set(args.parts.split(","))
    if args.stage in ("all", "train") and "cifar" in parts and not args.cifar:
        sys.exit("CIFAR-10 not found: pass --cifar or set LINEARIZE_CIFAR10")
    if planned:
        jobs = plans[args.scale].plan(args.scale, args.cifar, runs)
    else:
        if args.stage == "collect" or args.adopt:
            sys.exit("--stage collect and --adopt are for the planned sweeps (--scale full, speed): cpu-small analyzes its run folders directly")
        jobs = cifar_jobs(SCALES[args.scale], args.cifar, runs) if "cifar" in parts and args.cifar else []
        if "mt" in parts and args.stage in ("all", "train"):
            if not args.multi30k:
                sys.exit("Multi30k not found: pass --multi30k or set LINEARIZE_MULTI30K")
            jobs += mt_jobs(SCALES[args.scale], args.multi30k, runs)
    by_name = {j.name: j for j in jobs}
    adopted: dict[str, tuple[str, Path]] = {}  # real folder -> (run, spec)
    for spec in args.adopt:
        name, _, directory = spec.partition("=")
        if name not in by_name or not directory:
            sys.exit(f"--adopt {spec}: give NAME=DIR with NAME one of {sorted(by_name)}")
        folder = str(Path(directory).resolve())
        twice = next((f"--adopt {s}" for n, s in adopted.values() if n == name), None) or (
            f"--adopt {adopted[folder][1]}" if folder in adopted else None)
        if twice:
            sys.exit(f"--adopt {spec} and {twice}: one run per folder and one folder per run")
        adopted[folder] = (name, spec)
    for name, spec in adopted.values():
        adopt(by_name[name], runs, Path(spec.partition("=")[2]))
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in by_name]
        if unknown:
            sys.exit(f"--only: unknown runs {unknown}; known: {sorted(by_name)}")
        jobs = [by_name[n] for n in args.only.split(",")]
    if args.stage == "park" and not planned:
        sys.exit("--stage park is for the planned sweeps (--scale full, speed)")
    failures = 0
    if args.stage == "park":
        failures += _each(jobs, lambda n: full.park(runs, results, n), "park")
    if args.stage in ("all", "train"):
        runs.mkdir(parents=True, exist_ok=True)
        if planned:  # on a fresh machine: collected runs count as done, parked ones resume
            needed = {n for j in jobs for n in (j.name, *j.deps)}
            failures += _each([j for j in by_name.values() if j.name in needed],
                              lambda n: full.link_collected(runs, results, n), "link")
            failures += _each(jobs, lambda n: full.unpark(runs, results, n), "unpark")
        on_done = (lambda n: full.collect(runs, results, n)) if planned else None
        failures += train(jobs, runs, args.jobs, args.threads, args.poll, args.max_hours, on_done)
    if planned and args.stage in ("all", "collect"):
        for j in jobs:
            full.collect(runs, results, j.name)
    if args.stage in ("all", "analyze"):
        if planned:
            plan = plans[args.scale]
            on_one_thread(plan.analyze, results, args.scale, plan.plan(args.scale, args.cifar, runs), args.cifar,
                          args.latency_reps, args.remeasure_latency)
        else:
            analyze(runs, results, args.scale, args.cifar, args.regions_images, args.regions_radius,
                    args.regions_runs.split(","), regions_pieces=args.regions_pieces,
                    remeasure_latency=args.remeasure_latency, machine=machine_name(args.threads, args.jobs))
    out = results / args.scale if planned else results
    print(f"runs: {runs}\nresults: {out}/results.md, results.json, *.png")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import reproduce  # as the module `reproduce`, which reproduce_full imports (not a second copy as __main__)

    sys.exit(reproduce.main())
