"""The late-vs-early linearization study of ResNet-20 on CIFAR-10 at full scale, for ``python recipes/reproduce
--scale full``: the run plan, the collection of each finished run's small results into ``recipes/results/<run>/``
and the analysis of those folders (tables and plots in ``recipes/results/full/``). How to start, resume, collect and
analyze: see the docstring of ``recipes/reproduce/cli.py``.

Class subsets (``--classes``): the first 2 and the first 5 classes of CIFAR-10's label order
(airplane, automobile | + bird, cat, deer). Nested, so every smaller task is part of the bigger one
and difficulty rises with the number of classes (chance 50 / 20 / 10 %), and not picked by how
hard a pair is (cat/dog would be the hardest pair, airplane/automobile is among the easiest).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from . import measure as M
from . import sweep

# every run: the full train and test sets, checkpoints every 390 steps (one epoch of batch 128)
FLAGS = ["--arch", "resnet20", "--cpu", "--checkpointing_steps", "390", "--keep_checkpoints", "2", "--log_every", "390"]
SCALES = {
    "full": dict(base_epochs=40, late_epochs=15, extra=[]),
    # test only (tests/test_reproduce.py): the same plan, 1-2 epochs of a few 8x8 images
    "tiny": dict(base_epochs=1, late_epochs=1, extra=["--image-size", "8", "--batch-size", "4",
                                                      "--eval-batch-size", "10"]),
}
TASKS = {"c10": None, "c5": "airplane,automobile,bird,cat,deer", "c2": "airplane,automobile"}
LATE_TARGETS = (0.25, 0.10, 0.05, 0.02)
EARLY_TARGETS = (0.10, 0.02)
SEEDS = (0, 1)
DIFFICULTY_TARGET = 0.05
# other ways to reach the late 10% goal, from the same baselines, each changing one thing of the plain late
# run (name suffix: extra arguments, label): the saliency selection, distillation from the unlinearized
# baseline, and a longer schedule (20 epochs instead of 15, target reached at 40% of them: 12 epochs held)
VARIANTS = {"sal": (["--select", "saliency"], "--select saliency"),
            "kd": (["--distill", "0.9", "--distill-temperature", "4"], "distilled from the baseline"),
            "long": (["--epochs", "20", "--ramp-end", "0.4"], "20 epochs, target at 40%")}
FOLD_IMAGES = 64
LATENCY_ROUNDS = 9  # latency measurements (one per --remeasure-latency of unchanged models) kept, medians reported
# the runs started before cifar.py had --channels-last (2026-11-27): their checkpoints resume only without it.
# Every other run uses it: the same values up to float rounding, training steps about 1.4x faster on the CPU.
STARTED_CONTIGUOUS = frozenset({"r20_base_s0", "r20_base_s1", "r20_late_10_s0", "r20_late_10_s1", "r20_late_25_s0",
                                "r20_late_25_s1", "r20_late_5_s0", "r20_late_10_sal_s0", "r20_late_10_kd_s0",
                                "r20_late_10_long_s0"})


def run_name(task: str, schedule: str, target: float | None, seed: int, variant: str | None = None) -> str:
    """``r20[_c2|_c5]_{base|late_T|early_T}[_V]_sS`` with T the target in percent, V a :data:`VARIANTS` key."""
    kind = "base" if schedule == "none" else f"{schedule}_{round(100 * target)}"
    return "r20_" + ("" if task == "c10" else task + "_") + kind + (f"_{variant}" if variant else "") + f"_s{seed}"


def plan(scale: str, data: str | None, runs: Path) -> list[sweep.Job]:
    """Every run of the sweep, most important first (the order in which free slots take them)."""
    s = SCALES[scale]
    base_ep, late_ep = s["base_epochs"], s["late_epochs"]

    def job(task: str, schedule: str, target: float | None, seed: int, variant: str | None = None) -> sweep.Job:
        name = run_name(task, schedule, target, seed, variant)
        argv = [str(M.RECIPES / "cifar.py")] + (["--data-dir", data] if data else []) + FLAGS + s["extra"]
        argv += ["--classes", TASKS[task]] if TASKS[task] else []
        deps: tuple[str, ...] = ()
        if schedule == "none":
            argv += ["--linearize", "none", "--epochs", str(base_ep), "--seed", str(seed)]
        else:
            argv += ["--linearize", "prelu", "--target", f"{target:g}", "--freeze", "--seed", str(seed)]
            if schedule == "late":  # from the converged baseline of the same task and seed
                deps = (run_name(task, "none", None, seed),)
                argv += ["--init-from", str(runs / deps[0] / "model"), "--schedule", "late", "--late-start", "0",
                         "--ramp-end", "0.67", "--epochs", str(late_ep), "--lr", "0.02"]
            else:  # from scratch, the same total number of epochs as baseline + late
                argv += ["--schedule", "early", "--ramp-end", "0.8", "--epochs", str(base_ep + late_ep)]
        argv += VARIANTS[variant][0] if variant else []
        argv += [] if name in STARTED_CONTIGUOUS else ["--channels-last"]
        meta = {"task": task, "schedule": schedule, "target": target, "seed": seed, "variant": variant,
                "config": name[4:].rsplit("_s", 1)[0]}
        return sweep.Job(name, argv + ["--output_dir", str(runs / name)], deps, meta)

    jobs = [job("c10", "none", None, s) for s in SEEDS]
    jobs += [job("c10", "late", t, s) for t in (0.10, 0.02) for s in SEEDS]
    jobs += [job("c10", "early", t, 0) for t in EARLY_TARGETS]
    jobs += [job("c10", "late", t, s) for t in (0.25, 0.05) for s in SEEDS]
    jobs += [job(task, "none", None, 0) for task in ("c2", "c5")]
    jobs += [job(task, "late", DIFFICULTY_TARGET, 0) for task in ("c2", "c5")]
    jobs += [job("c10", "early", t, 1) for t in EARLY_TARGETS]
    jobs += [job("c10", "late", 0.10, s, v) for v in VARIANTS for s in SEEDS]
    return jobs


# ----------------------------------------------------------------------------- collect

SMALL_FILES = ("metrics.json", "sparsifier_history.json")


def _small_files(run: Path) -> dict[str, Path]:
    """``{relative path: file}`` of what gets committed: ``model/*`` (not hidden files: the save lock),
    metrics, sparsifier history."""
    files = {f"model/{p.name}": p for p in sorted((run / "model").iterdir()) if p.is_file() and not p.name.startswith(".")}
    return files | {f: run / f for f in SMALL_FILES if (run / f).is_file()}


def collect(runs: Path, results: Path, name: str) -> bool:
    """Copy the small results of the finished run ``runs/name`` to ``results/name`` (a temporary
    folder, then renamed into place; the ``analysis.json`` cache there is kept). Never copies
    checkpoints, logs or ``folded/``. ``False`` when the run is not done or already collected."""
    src, dst = runs / name, results / name
    if not sweep.is_done(src):
        return False
    files = _small_files(src)
    if dst.is_dir() and set(_small_files(dst)) == set(files) and all(
            filecmp.cmp(p, dst / rel, shallow=False) for rel, p in files.items()):
        return False
    results.mkdir(parents=True, exist_ok=True)
    tmp, old = results / f".{name}.tmp{os.getpid()}", results / f".{name}.old{os.getpid()}"
    for d in [*results.glob(f".{name}.tmp*"), *results.glob(f".{name}.old*")]:  # left by a killed collect
        shutil.rmtree(d, ignore_errors=True)
    (tmp / "model").mkdir(parents=True)
    for rel, p in files.items():
        shutil.copy2(p, tmp / rel)
    if (dst / "analysis.json").is_file():  # keyed by the model's digest: stale entries never match
        shutil.copy2(dst / "analysis.json", tmp / "analysis.json")
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(results / INFLIGHT / name, ignore_errors=True)  # finished: its parked checkpoint is done with
    print(f"collected {name} -> {dst}", flush=True)
    return True


# ----------------------------------------------------------------------------- park and unpark

INFLIGHT = "inflight"  # results/inflight/<run>/step_N: the parked checkpoint of an unfinished run


def _copy_dir(src: Path, dst: Path) -> None:
    """Copy the files of ``src`` to ``dst`` as a whole (``common.replaced_dir``: a temporary sibling renamed
    into place, deleted on any failure, which leaves an existing ``dst`` as it was)."""
    import common

    with common.replaced_dir(dst) as stage:
        for f in sorted(src.iterdir()):
            if f.is_file():
                shutil.copy2(f, stage / f.name)


def _parked(results: Path, name: str) -> list[Path]:
    """The parked checkpoints of ``name`` (``results/inflight/name/step_N``), oldest first."""
    return sorted(p for p in (results / INFLIGHT / name).glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def _local_step(run: Path) -> int | None:
    """The step of the newest intact checkpoint of the run folder ``run`` (None: it has none)."""
    import common

    try:
        return common.find_checkpoint("latest", run)[0].step
    except (FileNotFoundError, common.CheckpointError):
        return None


def park(runs: Path, results: Path, name: str) -> Path | None:
    """Copy the newest intact checkpoint of the unfinished run ``runs/name`` to ``results/inflight/name/``
    (small enough to commit), replacing older parked ones, so that a later session on a fresh machine
    resumes the run there (:func:`unpark`) instead of starting it over. ``None`` when the run is done, has
    no intact checkpoint, or one parked already is newer (parked from another machine: kept)."""
    import common

    run = runs / name
    if sweep.is_done(run) or not sweep.has_checkpoint(run):
        return None
    try:
        ckpt, _ = common.find_checkpoint("latest", run)
    except (FileNotFoundError, common.CheckpointError):
        return None
    home = results / INFLIGHT / name
    parked = _parked(results, name)
    if parked and int(parked[-1].name[5:]) > ckpt.step:
        print(f"not parking {name}: {parked[-1]} is newer than its checkpoint here ({ckpt.path.name})", flush=True)
        return None
    dst = home / ckpt.path.name
    if not dst.is_dir():
        _copy_dir(ckpt.path, dst)
    for old in home.iterdir():  # older steps and temporary folders of killed copies
        if old != dst:
            shutil.rmtree(old, ignore_errors=True)
    print(f"parked {name} at {ckpt.path.name} -> {dst}", flush=True)
    return dst


def unpark(runs: Path, results: Path, name: str) -> Path | None:
    """Put the parked checkpoint of ``name`` (:func:`park`) into ``runs/name/checkpoints/`` when it is newer
    than the newest intact checkpoint there (or there is none) and the run is neither finished there nor
    collected in ``results/name``: the runner then resumes from it (the recipe checks the checkpoint's
    files, hashes, model and arguments as for any resume). Returns the restored folder."""
    import common

    parked = _parked(results, name)
    run = runs / name
    if not parked or sweep.is_done(run):
        return None
    if sweep.is_done(results / name):
        print(f"not unparking {name}: it is finished and collected in {results / name} ({parked[-1]} is a stale "
              "copy)", flush=True)
        return None
    step = int(parked[-1].name[5:])
    local = _local_step(run)
    if local is not None and local >= step:
        return None
    dst = common.checkpoint_dir(run, step)
    _copy_dir(parked[-1], dst)
    print(f"unparked {name}: {parked[-1]} -> {dst}" + ("" if local is None else f" (newer than step {local} there)"),
          flush=True)
    return dst


def link_collected(runs: Path, results: Path, name: str) -> bool:
    """On a machine without the run folder ``runs/name`` of a run finished and collected in ``results/name``
    (a fresh checkout): link it there (``sweep.link_run``), so that it counts as done, runs that depend on it
    start from its model (``--init-from runs/name/model``) and it is not trained again. Returns whether it
    linked."""
    if (runs / name).exists() or (runs / name).is_symlink() or not sweep.is_done(results / name):
        return False
    sweep.link_run(runs, name, results / name)
    print(f"{name}: finished and collected in {results / name}; linked as {runs / name}", flush=True)
    return True


# ----------------------------------------------------------------------------- measurements


def _digest(model_dir: Path) -> str:
    """Short hash of the saved model's files: the key of every cached measurement of it."""
    import hashlib

    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


def _data_source(run: Path, data: str | None) -> str | None:
    src = data or sweep.read_json(run / "metrics.json", damaged_ok=True).get("args", {}).get("data_dir")
    return src if src and Path(src).exists() else None


def measure_run(run: Path, data: str | None, skipped: list[str]) -> dict:
    """Metrics of a collected run plus its cached measurements: both path lengths and the per-site
    channel counts (no data needed), the fold summary on its first 64 test images (needs data)."""
    import cifar
    import torch

    m = sweep.read_json(run / "metrics.json", damaged_ok=True)
    tol = m["args"].get("tol", 1e-3)
    digest = _digest(run / "model")
    size = cifar.read_meta(run / "model")["image_size"]  # checked (bounded) before the probe is allocated
    probe = torch.zeros(2, 3, size, size)  # the path length only needs the shapes of the graph
    info = {k: m.get(k) for k in ("test_accuracy", "nonlinear_fraction", "units_total", "units_nonlinear", "steps",
                                  "total_steps", "train_images", "test_images", "wall_time_s")}
    info["nonlinear_fraction"] = 1.0 if info["nonlinear_fraction"] is None else info["nonlinear_fraction"]
    info["model_digest"] = digest
    info["args"] = {k: m["args"].get(k) for k in ("batch_size", "epochs", "lr", "classes", "target", "schedule")}
    info["apl"] = M.cached(run, f"apl:{digest}:tol{tol:g}", lambda: M.path_lengths(M.run_model(run), probe, tol),
                            replaces="apl:")
    if m["args"].get("linearize") != "none":
        info["sites"] = M.cached(run, f"sites:{digest}:tol{tol:g}", lambda: M.site_counts(run, tol),
                                  replaces="sites:")
    key = f"fold:{digest}:test{FOLD_IMAGES}"
    src = _data_source(run, data)
    if key in sweep.read_json(run / "analysis.json") or src:
        info["fold"] = M.cached(run, key, lambda: _fold(run, src), replaces="fold:")
    else:
        skipped.append(f"fold of {run.name}")
    return info


def _fold(run: Path, data: str) -> dict:
    """The fold summary of the run's model on its first 64 test images (FLOPs over all of them)."""
    x = M.cifar_inputs(run, data, FOLD_IMAGES)[0]
    return {**M.fold_summary(run, x, latency=False), "images": len(x)}


def measure_latency(results: Path, names: list[str], runs: dict, data: str | None, previous: dict, reps: int,
             remeasure: bool, skipped: list[str]) -> dict:
    """Interleaved CPU latency at batch 1 and 64 (1 thread) of every run's folded model and of each
    baseline as trained, measured together in one process; reused from ``previous`` for unchanged
    models unless ``remeasure``, kept from it (for the models still there) when there is no data.

    Times move by up to 10% between processes on an idle machine, so a ``remeasure`` of unchanged models
    adds a round to the previous ones measured on the same machine (the last ``LATENCY_ROUNDS``): ``ms``
    is each time's median over the rounds, ``rounds`` holds every round's own times."""
    import linearize

    models = {n: runs[n]["model_digest"] for n in names}
    same = (previous.get("models") == models and previous.get("reps") == reps
            and previous.get("machine") == M.machine_name())
    if not remeasure and same:
        return previous
    src = next((s for n in names if (s := _data_source(results / n, data))), None)
    if src is None:
        keep = {n for n, d in models.items() if previous.get("models", {}).get(n) == d}
        skipped += [f"latency of {n}" for n in names if n not in keep]
        kept = lambda ms: {k: v for k, v in ms.items() if k.split("/")[0] in keep}  # noqa: E731
        return {**previous, "models": {n: models[n] for n in keep}, "ms": kept(previous.get("ms", {})),
                "rounds": [{**r, "ms": kept(r["ms"])} for r in _latency_rounds(previous)]}
    x = M.cifar_inputs(results / names[0], src, FOLD_IMAGES)[0]
    built = {}
    for n in names:
        model = M.run_model(results / n)
        built[n + "/folded"] = linearize.fold(model, x, latency=False)
        if runs[n]["schedule"] == "none":
            built[n + "/as trained"] = model
    now = {"ms": M.interleaved_latency(built, {"b1": x[:1], "b64": x}, reps),
           "measured": time.strftime("%Y-%m-%d %H:%M"),
           "load_average": round(os.getloadavg()[0], 2)}  # other processes on the cores make the ms noisy
    rounds = ((_latency_rounds(previous) if same else []) + [now])[-LATENCY_ROUNDS:]
    ms = {k: {b: statistics.median(r["ms"][k][b] for r in rounds) for b in now["ms"][k]} for k in now["ms"]}
    return {"models": models, "reps": reps, "batch": {"b1": 1, "b64": len(x)}, "ms": ms, "rounds": rounds,
            **{k: now[k] for k in ("measured", "load_average")}, "machine": M.machine_name()}


def _latency_rounds(previous: dict) -> list[dict]:
    """The measurement rounds (``{"ms", "measured", "load_average"}``) of a latency result; one written
    before rounds were kept counts as one round."""
    return previous.get("rounds") or ([{k: previous.get(k) for k in ("ms", "measured", "load_average")}]
                                      if previous.get("ms") else [])


def max_load(lat: dict) -> float:
    """The highest load average any of a latency result's measurements saw (0 when none was recorded)."""
    return max((r.get("load_average") or 0 for r in lat.get("rounds") or [lat]), default=0)


def measured(lat: dict) -> str:
    """When and under what load the latencies were measured: one round, or the medians of several."""
    rounds = lat.get("rounds") or [lat]
    when = [r.get("measured") or "?" for r in rounds]
    load = [r["load_average"] for r in rounds if r.get("load_average") is not None]
    if len(rounds) == 1:
        return when[0] + (f", load average {load[0]} when measured" if load else "")
    return (f"medians of {len(rounds)} measurements (each in a fresh process, `--remeasure-latency`) from {min(when)} "
            f"to {max(when)}" + (f", load average {min(load)}-{max(load)}" if load else ""))


# ----------------------------------------------------------------------------- aggregation


def _stats(values: list[float]) -> dict | None:
    """Mean, min, max, sample std (``None`` for one value) and count of ``values``; ``None`` if empty."""
    if not values:
        return None
    n, mean = len(values), sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else None
    return {"n": n, "mean": mean, "min": min(values), "max": max(values), "std": std, "values": values}


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _configs(jobs: list[sweep.Job], runs: dict, latency: dict) -> dict:
    """Per configuration (a schedule, target and task over seeds): accuracy statistics, means of the
    nonlinear fraction, both APLs, FLOPs per image and latency after fold, the largest fold error."""
    order = {"c10": 0, "c5": 1, "c2": 2}
    groups: dict[str, list[sweep.Job]] = {}
    for j in sorted(jobs, key=lambda j: (order[j.meta["task"]], ["none", "late", "early"].index(j.meta["schedule"]),
                                         -(j.meta["target"] or 1), [None, *VARIANTS].index(j.meta.get("variant")),
                                         j.meta["seed"])):
        groups.setdefault(j.meta["config"], []).append(j)
    ms = latency.get("ms", {})
    out: dict = {}
    for key, group in groups.items():
        done = [j.name for j in group if j.name in runs]
        r = [runs[n] for n in done]
        folds = [x["fold"] for x in r if x.get("fold")]
        c = {**{k: group[0].meta.get(k) for k in ("task", "schedule", "target", "variant")}, "runs": done,
             "missing": [j.name for j in group if j.name not in runs],
             "accuracy": _stats([x["test_accuracy"] for x in r]),
             "nonlinear_fraction": _mean([x["nonlinear_fraction"] for x in r]),
             "apl_normalized": _mean([x["apl"]["normalized"] for x in r]),
             "apl_unnormalized": _mean([x["apl"]["unnormalized"] for x in r]),
             "mflops_per_image_after_fold": _mean([f["flops_after"] / f["images"] / 1e6 for f in folds]),
             "params_after_fold": _mean([f["params_after"] for f in folds]),
             "fold_max_rel_error": max((f["max_abs_error"] / f["output_scale"] for f in folds), default=None),
             "latency_ms": {b: _mean([ms.get(f"{n}/folded", {}).get(b) for n in done]) for b in ("b1", "b64")}}
        if c["schedule"] == "none":
            c["latency_ms_as_trained"] = {b: _mean([ms.get(f"{n}/as trained", {}).get(b) for n in done])
                                          for b in ("b1", "b64")}
        out[key] = c
    for c in out.values():  # relative to the baseline of the same task
        b = out.get(("" if c["task"] == "c10" else c["task"] + "_") + "base", {})
        c["vs_baseline_points"] = (100 * (c["accuracy"]["mean"] - b["accuracy"]["mean"])
                                   if c["accuracy"] and b.get("accuracy") else None)
        c["flops_vs_baseline"] = ratio(c["mflops_per_image_after_fold"], b.get("mflops_per_image_after_fold"))
        c["params_vs_baseline"] = ratio(c["params_after_fold"], b.get("params_after_fold"))
        c["latency_vs_baseline"] = {k: ratio(v, b.get("latency_ms", {}).get(k)) for k, v in c["latency_ms"].items()}
    return out


def ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def _stage(site: str) -> str:
    return site.split(".")[0] if site.startswith("layer") else "stem"


def _claims(cfg: dict, runs: dict) -> list[str]:
    """The 'what reproduces' sentences, from the numbers (nothing is claimed for missing runs)."""
    out = []

    def acc(key: str) -> dict | None:
        return cfg.get(key, {}).get("accuracy")

    def seeds(key: str) -> str:
        a, planned = acc(key), len(cfg[key]["runs"]) + len(cfg[key]["missing"])
        return f"{a['n'] if a else 0} of {planned} seed(s)"

    base = acc("base")
    for key in ["late_10"] + [f"late_10_{v}" for v in VARIANTS]:
        late, how = acc(key), "" if key == "late_10" else f" ({VARIANTS[key.rsplit('_', 1)[1]][1]})"
        if base and late:
            d = 100 * (late["mean"] - base["mean"])
            pairs = [f"seed {s}: {100 * (runs[n]['test_accuracy'] - runs[b]['test_accuracy']):+.2f}" for n in
                     cfg[key]["runs"] if (b := run_name("c10", "none", None, s := runs[n]["seed"])) in runs]
            out.append(f"**Late linearization to 10% nonlinear channels{how}** (goal: within 1.0 point of the "
                       f"baseline seed mean): {100 * late['mean']:.2f}% ({seeds(key)}) vs {100 * base['mean']:.2f}% "
                       f"({seeds('base')}), {d:+.2f} points ({'; '.join(pairs)} against its own baseline): "
                       + ("**reproduces**" if d >= -1.0 else f"**does not reproduce** (missed by {-1.0 - d:.2f})")
                       + ("" if min(late["n"], base["n"]) >= 2 else " (fewer than the 2 seeds asked)") + ".")
        elif key == "late_10":
            out.append("**Late linearization to 10%**: not measured yet (missing: "
                       f"{', '.join(cfg['base']['missing'] + cfg[key]['missing'])}).")
    for t in (10, 2):
        la, ea = acc(f"late_{t}"), acc(f"early_{t}")
        if not (la and ea):
            out.append(f"**Late - early at {t}%**: not measured yet (missing: "
                       f"{', '.join(cfg[f'late_{t}']['missing'] + cfg[f'early_{t}']['missing'])}).")
            continue
        gap = 100 * (la["mean"] - ea["mean"])
        lo, hi = 100 * (la["min"] - ea["max"]), 100 * (la["max"] - ea["min"])
        if min(la["n"], ea["n"]) < 2:
            verdict = "one seed on a side, so no spread to judge the sign by"
        elif lo > 0 or hi < 0:
            verdict = f"{'late' if lo > 0 else 'early'} is better on every pair of seeds"
        else:
            verdict = "the seed ranges overlap: no clear difference"
        out.append(f"**Late - early at {t}%**: {gap:+.2f} points (late {seeds(f'late_{t}')}, early "
                   f"{seeds(f'early_{t}')}; over all pairs of seeds [{lo:+.2f}, {hi:+.2f}]): {verdict}.")
    drops = {}
    for task, label in (("c2", 2), ("c5", 5), ("c10", 10)):
        p = "" if task == "c10" else task + "_"
        b, la = runs.get(f"r20_{p}base_s0"), runs.get(f"r20_{p}late_5_s0")
        if b and la:
            drops[label] = 100 * (b["test_accuracy"] - la["test_accuracy"])
    if len(drops) == 3:
        d = [drops[k] for k in (2, 5, 10)]
        trend = ("grows with the number of classes" if d[0] < d[1] < d[2] else
                 "shrinks with the number of classes" if d[0] > d[1] > d[2] else "is not monotonic in the number of classes")
        out.append("**Task difficulty** (late to 5%, seed 0): the accuracy lost against the task's own baseline is "
                   + ", ".join(f"{drops[k]:.2f} points with {k} classes" for k in (2, 5, 10))
                   + f": it {trend} (one seed each, so differences of a few tenths are within seed noise).")
    else:
        out.append("**Task difficulty**: not measured yet (needs r20_c2_*, r20_c5_* and r20_late_5_s0).")
    return out


# ----------------------------------------------------------------------------- report


def fmt(v: float | None, f: str = ".2f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{f}}{suffix}"


def _acc_cell(a: dict | None) -> str:
    if not a:
        return "missing"
    return (f"{100 * a['mean']:.2f}" + (f" [{100 * a['min']:.2f}, {100 * a['max']:.2f}]" if a["n"] > 1 else "")
            + f" (n={a['n']})")


def _label(c: dict) -> str:
    task = {"c10": "", "c5": "5-class ", "c2": "2-class "}[c["task"]]
    how = f" ({VARIANTS[c['variant']][1]})" if c.get("variant") else ""
    return task + ("baseline" if c["schedule"] == "none" else f"{c['schedule']} {100 * c['target']:g}%") + how


def analysis_folder(results: Path, scale: str) -> tuple[Path, dict]:
    """``results/<scale>`` (created) and the ``results.json`` an earlier analysis left there (``{}``: none);
    the warning of folding a model without units (a baseline: BatchNorm only) is silenced from now on."""
    import warnings

    warnings.filterwarnings("ignore", message="the model has no linearize units")
    out = results / scale
    out.mkdir(parents=True, exist_ok=True)
    return out, sweep.read_json(out / "results.json")


def analyze(results: Path, scale: str, jobs: list[sweep.Job], data: str | None, reps: int = 15,
            remeasure_latency: bool = False) -> dict:
    """Tables and plots (``results/<scale>/results.md``, ``results.json``, PNGs) from the collected
    run folders ``results/<run>/`` only."""
    out, previous = analysis_folder(results, scale)
    skipped: list[str] = []
    runs: dict[str, dict] = {}
    for j in jobs:
        if sweep.is_done(results / j.name):
            runs[j.name] = {**measure_run(results / j.name, data, skipped), **j.meta}
    latency = measure_latency(results, list(runs), runs, data, previous.get("latency", {}), reps, remeasure_latency,
                       skipped) if runs else {}
    cfg = _configs(jobs, runs, latency)
    claims = _claims(cfg, runs)
    res = {"scale": scale, "spread": "min and max over seeds (std: sample standard deviation)", "runs": runs,
           "configs": cfg, "latency": latency, "claims": claims, "skipped": skipped,
           "missing": [j.name for j in jobs if j.name not in runs]}
    md = _report(res, jobs)
    _plots(out, cfg, runs)
    sweep.write_json(out / "results.json", res)
    (out / "results.md").write_text("\n".join(md) + "\n")
    if skipped:
        print(f"skipped (no CIFAR data: pass --cifar or set LINEARIZE_CIFAR10): {', '.join(skipped)}")
    return res


def _report(res: dict, jobs: list[sweep.Job]) -> list[str]:
    cfg, runs, lat = res["configs"], res["runs"], res["latency"]
    first = next((r for r in runs.values() if r["task"] == "c10"), {})
    s = SCALES[res["scale"]]
    args = first.get("args", {})
    md = [f"# Late vs early linearization of ResNet-20 on CIFAR-10 ({res['scale']})", "",
          f"{first.get('train_images', '-')} training / {first.get('test_images', '-')} test images (10 classes), "
          f"batch {args.get('batch_size', '-')}, SGD with cosine decay, one CPU thread per run. Baselines "
          f"{s['base_epochs']} epochs (seeds {', '.join(map(str, SEEDS))}); late: {s['late_epochs']} epochs from the "
          "baseline of the same seed (lr 0.02, pressure from step 0, target reached at 67% of them, then held); "
          f"early: {s['base_epochs'] + s['late_epochs']} epochs from scratch (target reached at 80%). Channels with "
          "slope >= 1 - 1e-3 are frozen linear at the end. Spread: [min, max] over seeds, n = number of seeds done.", "",
          "## What reproduces", ""] + [f"- {c}" for c in res["claims"]] + [""]
    md += ["## Results", "",
           "APL: average path length (nonlinear units met from input to output), normalized (equal split at every "
           "merge) and unnormalized (every channel-level path equally likely); baseline: all units nonlinear. "
           "Parameters, FLOPs and latency after `linearize.fold` (BN merged, linear parts folded), relative to the baseline of "
           "the same task folded the same way; latency: medians of " + str(lat.get("reps", "-")) + " interleaved "
           "repetitions of all models in one process, 1 thread" + (f", on {lat['machine']}, {measured(lat)}"
                                                                 if lat.get("measured") else "")
           + (" (other runs shared the cores: the milliseconds and their ratios are noisy; equal FLOPs mean equal "
              "work)" if max_load(lat) > 1.5 else "")
           + ". Fold error: "
           "largest |folded - model| over the logits of 64 test images, relative to the largest |logit|.", "",
           "| configuration | test accuracy % | vs baseline | nonlinear | APL norm. | APL unnorm. | params (vs base) "
           "| MFLOPs/image (vs base) | latency b1 ms (vs base) | latency b64 ms (vs base) | fold error |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cfg.values():
        lv, l_ = c["latency_vs_baseline"], c["latency_ms"]
        md.append(f"| {_label(c)} | {_acc_cell(c['accuracy'])} | {fmt(c['vs_baseline_points'], '+.2f')} | "
                  f"{fmt(c['nonlinear_fraction'] and 100 * c['nonlinear_fraction'], '.1f', '%')} | "
                  f"{fmt(c['apl_normalized'])} | {fmt(c['apl_unnormalized'])} | "
                  f"{fmt(c['params_after_fold'], ',.0f')} ({fmt(c['params_vs_baseline'], '.3f', 'x')}) | "
                  f"{fmt(c['mflops_per_image_after_fold'], '.1f')} ({fmt(c['flops_vs_baseline'], '.3f', 'x')}) | "
                  f"{fmt(l_['b1'])} ({fmt(lv['b1'], '.2f', 'x')}) | {fmt(l_['b64'], '.1f')} "
                  f"({fmt(lv['b64'], '.2f', 'x')}) | {fmt(c['fold_max_rel_error'], '.1e')} |")
    base = [c for c in cfg.values() if c["schedule"] == "none" and c.get("latency_ms_as_trained", {}).get("b64")]
    md += ["", "Baselines as trained (BN not merged): " + ("; ".join(
        f"{_label(c)} {fmt(c['latency_ms_as_trained']['b1'])} ms (b1), {fmt(c['latency_ms_as_trained']['b64'], '.1f')}"
        " ms (b64)" for c in base) or "not measured") + ".", "",
           "![accuracy vs nonlinear fraction](accuracy_vs_fraction.png) ![APL vs accuracy](path_length_vs_accuracy.png)", ""]
    md += _difficulty_md(runs)
    md += ["## Runs", "", "| run | test acc | nonlinear | APL norm. | steps | wall time of the last session |",
           "|---|---|---|---|---|---|"]
    md += [f"| {n} | {100 * r['test_accuracy']:.2f}% | {100 * r['nonlinear_fraction']:.1f}% | "
           f"{r['apl']['normalized']:.2f} | {r['steps']} | {fmt(r['wall_time_s'], '.0f', ' s')} |" for n, r in runs.items()]
    if res["missing"]:
        md += ["", "Missing (not run or not collected yet): " + ", ".join(res["missing"]) + "."]
    if res["skipped"]:
        md += ["", "Skipped for want of the CIFAR-10 test images (`--cifar`): " + ", ".join(res["skipped"]) + "."]
    md += ["", "Every run's command and arguments are in its `metrics.json` (`command`, `args`). "
           "`python recipes/reproduce --scale full` reruns all of it; `--stage analyze` rebuilds this page."]
    return md


DIFFICULTY_RUNS = {"2 classes": "r20_c2_late_5_s0", "5 classes": "r20_c5_late_5_s0", "10 classes": "r20_late_5_s0"}


def _difficulty_md(runs: dict) -> list[str]:
    have = {k: runs[n] for k, n in DIFFICULTY_RUNS.items() if n in runs}
    md = ["## Core network vs task difficulty (late to 5%, seed 0)", ""]
    if not have:
        return md + ["Not measured yet: " + ", ".join(DIFFICULTY_RUNS.values()) + ".", ""]
    md += ["| task | test acc | baseline | nonlinear channels | APL norm. | APL unnorm. | share of nonlinear "
           "channels: stem / layer1 / layer2 / layer3 |", "|---|---|---|---|---|---|---|"]
    for k, r in have.items():
        b = runs.get(DIFFICULTY_RUNS[k].replace("late_5", "base"))
        nl = sum(s["nonlinear"] for s in r["sites"].values())
        share = {st: sum(s["nonlinear"] for n, s in r["sites"].items() if _stage(n) == st) / max(nl, 1)
                 for st in ("stem", "layer1", "layer2", "layer3")}
        md.append(f"| {k} | {100 * r['test_accuracy']:.2f}% | {fmt(b and 100 * b['test_accuracy'], '.2f', '%')} | "
                  f"{nl} of {sum(s['total'] for s in r['sites'].values())} | {r['apl']['normalized']:.2f} | "
                  f"{r['apl']['unnormalized']:.2f} | " + " / ".join(f"{100 * v:.0f}%" for v in share.values()) + " |")
    sites = list(next(iter(have.values()))["sites"])
    md += ["", "Nonlinear channels per site (of the site's channels):", "", "![sites](nonlinear_sites.png)", "",
           "| site | channels | " + " | ".join(have) + " |", "|---|---|" + "---|" * len(have)]
    for s in sites:
        md.append(f"| {s} | {next(iter(have.values()))['sites'][s]['total']} | "
                  + " | ".join(str(r["sites"].get(s, {}).get("nonlinear", "-")) for r in have.values()) + " |")
    missing = [n for n in DIFFICULTY_RUNS.values() if n not in runs]
    return md + (["", "Missing: " + ", ".join(missing) + "."] if missing else []) + [""]


def legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _plots(out: Path, cfg: dict, runs: dict) -> None:
    import numpy as np

    def draw_acc(ax: Any) -> None:
        b = cfg.get("base", {}).get("accuracy")
        if b:
            ax.axhspan(b["min"], b["max"], color="0.85", label=f"baseline, min-max over {b['n']} seed(s)")
            ax.axhline(b["mean"], color="k", lw=1, label="baseline mean")
        for sched, mk in (("late", "o-"), ("early", "s--")):
            pts = sorted((c["nonlinear_fraction"], c["accuracy"]) for c in cfg.values()
                         if c["task"] == "c10" and c["schedule"] == sched and not c.get("variant") and c["accuracy"])
            if pts:
                a = [p[1] for p in pts]
                ax.errorbar([p[0] for p in pts], [x["mean"] for x in a], capsize=4, fmt=mk, label=f"{sched} (mean, "
                            "min-max over seeds)", yerr=[[x["mean"] - x["min"] for x in a], [x["max"] - x["mean"] for x in a]])
        for i, c in enumerate(c for c in cfg.values() if c.get("variant") and c["accuracy"]):
            a = c["accuracy"]
            ax.errorbar([c["nonlinear_fraction"]], [a["mean"]], yerr=[[a["mean"] - a["min"]], [a["max"] - a["mean"]]],
                        fmt="Dv^"[i % 3], color=f"C{i + 2}", capsize=4, label=_label(c))
        ticks = sorted({*LATE_TARGETS, *EARLY_TARGETS})
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("nonlinear fraction of channels")
        ax.set_ylabel("test accuracy")
        ax.set_title("ResNet-20, CIFAR-10: late vs early linearization")
        legend(ax)

    def draw_apl(ax: Any) -> None:
        for (task, sched), mk in {("c10", "none"): "k*", ("c10", "late"): "o", ("c10", "early"): "s",
                                  ("c5", "none"): "C3*", ("c5", "late"): "C3^", ("c2", "none"): "C4*",
                                  ("c2", "late"): "C4v"}.items():
            pts = [(r["apl"]["normalized"], r["test_accuracy"]) for r in runs.values()
                   if (r["task"], r["schedule"]) == (task, sched) and not r.get("variant")]
            if pts:
                ax.plot(*zip(*pts), mk, ms=9 if "*" in mk else 6,
                        label=f"{ {'c10': '10', 'c5': '5', 'c2': '2'}[task]} classes, "
                              f"{'baseline' if sched == 'none' else sched}")
        for i, v in enumerate(VARIANTS):  # each variant its own series
            pts = [(r["apl"]["normalized"], r["test_accuracy"]) for r in runs.values() if r.get("variant") == v]
            if pts:
                ax.plot(*zip(*pts), "Dv^"[i % 3], color=f"C{i + 5}", label=f"10 classes, late ({VARIANTS[v][1]})")
        ax.set_xlabel("average path length (normalized)")
        ax.set_ylabel("test accuracy")
        ax.set_title("one point per run")
        legend(ax)

    def draw_sites(ax: Any) -> None:
        have = {k: runs[n] for k, n in DIFFICULTY_RUNS.items() if n in runs}
        sites = list(next(iter(have.values()))["sites"])
        w = 0.8 / len(have)
        for i, (k, r) in enumerate(have.items()):
            ax.bar(np.arange(len(sites)) + i * w, [r["sites"].get(s, {}).get("nonlinear", 0) for s in sites], w,
                   label=k)
        ax.set_xticks(np.arange(len(sites)) + 0.4 - w / 2, [s.replace(".calls.", "#") for s in sites],
                      rotation=90, fontsize=6)
        ax.set_ylabel("nonlinear channels at the site")
        ax.set_title("late to 5%, seed 0")
        ax.legend(fontsize=7)

    M.plot(out / "accuracy_vs_fraction.png", draw_acc)
    M.plot(out / "path_length_vs_accuracy.png", draw_apl)
    if any(n in runs for n in DIFFICULTY_RUNS.values()):
        M.plot(out / "nonlinear_sites.png", draw_sites)
