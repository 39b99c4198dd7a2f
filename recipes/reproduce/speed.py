"""The speed study at full scale, for ``python recipes/reproduce --scale speed``: does linearizing a trained network
under a latency budget, then folding it, give a faster model than training a narrower one?

The plan (full CIFAR-10 train and test sets, one seed, every run ``--channels-last``):

* **MobileNet-V2 x0.5** with the CIFAR stem: a baseline (15 epochs), then late (6 epochs) linearization of it
  under CPU latency budgets (``--target-latency`` R of the original model folded, whole inverted-residual
  blocks at a time: ``--granularity block``), and the honest alternative: MobileNet-V2 x0.35 trained from
  scratch for the same CPU time as baseline + late run together (``NARROW_TIME``), and structured pruning of
  the baseline to the same latency budget with the same epochs and distillation (``--linearize none --prune
  taylor --target-latency``: ``PRUNE_BUDGETS``), timed BatchNorm-folded as the linearized models are folded.
* **ResNet-20 is not trained here**: with every site linear it folds to 0.95-0.96 of its BatchNorm-folded
  latency at batch 1 on an idle machine (``python recipes/benchmarks/fold_merges.py --arch resnet20 --linear
  all``; its 3x3 convs cannot merge into anything cheaper), so no budget buys more than 4-5%, less than
  the timing noise between processes; its linearized runs are those of the late-vs-early study
  (``recipes/reproduce/full.py``, ``recipes/results/full/``).

Equal time, not equal epochs: a training step of x0.35 takes 0.49-0.63x as long as one of x0.5 (three
measurements, ``python recipes/benchmarks/train_step.py``, one thread, other runs sharing the cores;
median 0.58), so x0.35 trains 21 / 0.58 = 36 epochs against x0.5's 15 + 6; the report shows each
pipeline's measured training time next to its accuracy.

Runs go to ``runs/reproduce/speed/<run>``, the small results of each finished run to
``recipes/results/<run>/`` (collected, parked and resumed as the late-vs-early runs are:
``full.collect / park / unpark``), tables and plots to ``recipes/results/speed/``: accuracy
against the CPU latency of the folded model at batch 1 and 64 (one thread, interleaved in one process),
each linearized model next to its baseline and the narrower network.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from linearize.checks import FoldVerificationError

from . import full as F
from . import measure as M
from . import sweep

FLAGS = ["--cpu", "--checkpointing_steps", "390", "--keep_checkpoints", "2", "--log_every", "390", "--channels-last"]
SCALES = {
    "speed": dict(base_epochs=15, late_epochs=6, extra=[]),
    # test only (tests/recipes/test_reproduce_speed.py): the same plan, 1 epoch of a few images (32x32: at 16x16 the
    # model folded with every block linear timed 0.83 of the original on a busy CPU, above budget 0.6)
    "speed-tiny": dict(base_epochs=1, late_epochs=1, extra=["--batch-size", "4", "--eval-batch-size", "10"]),
}
# latency budgets (fraction of the original model folded); 0.7 is SPEEDUP_GOAL's 1.4x at batch 1. Blocks chosen
# by slope gap (channel count: the slopes all start at 0) lost 15.2 points at 0.7, channel count ranks the
# blocks against what each costs (recipes/results/speed/block_sensitivity.txt), so 0.6 runs by saliency only
MNV2_BUDGETS = (0.8, 0.7)
# the same budgets with blocks chosen by saliency (the running mean of each slope's squared loss gradient, a
# Taylor estimate of what making it linear costs) instead of by channel count: the pressure starts after
# SALIENCY_START of the late run, once every block has had gradients
SALIENCY_BUDGETS, SALIENCY_START = (0.7, 0.6), 0.05
# budget 0.7 by saliency again, learning from the original model too (--distill ALPHA: knowledge distillation
# from the network before linearization): with labels alone budget 0.7 cost 2.67 points (1.38x, median of 5 measurements)
DISTILL_BUDGETS, DISTILL = (0.7,), 0.5
# the comparison a user would make instead: the baseline's channels pruned at step 0 (Taylor importance) to the
# same latency budget, then trained as the distilled linearized run of that budget is (epochs, LR, distillation)
PRUNE_BUDGETS, PRUNE_IMPORTANCE = (0.7,), "taylor"
FAMILIES = {"mnv2": "MobileNet-V2 (x0.5; narrower: x0.35)"}
# x0.35's step time over x0.5's (median of 3 measurements of recipes/benchmarks/train_step.py): the narrower
# network trains (base + late epochs) / NARROW_TIME epochs, the same CPU time as the linearized pipeline
NARROW_TIME = 0.58
SPEEDUP_GOAL, LOSS_GOAL = 1.4, 1.0  # the MobileNet goal: >= 1.4x at batch 1, <= 1.0 point lost


def _meta(family: str, arch: str, budget: float | None = None, narrow: bool = False, select: str = "slope",
          distill: float = 0.0, prune: str | None = None) -> dict:
    """What the analysis needs to know about a run (seed 0; a budget makes it a late run; ``select``: how
    its blocks were chosen; ``distill``: the weight of distillation from the original, 0 for labels alone;
    ``prune``: the importance of a pruned run, which has a budget but no blocks chosen)."""
    late = budget is not None
    return {"family": family, "arch": arch, "budget": budget, "narrow": narrow, "seed": 0,
            "schedule": "late" if late else "none", "select": select if late and not prune else None,
            "distill": distill if late else None, "prune": prune}


def _method(row: dict) -> str:
    """How a linearized run chose its blocks or a pruned run its channels, and whether it learned from the
    original too ("" for a baseline)."""
    distilled = ", distilled" if row.get("distill") else ""
    if row.get("prune"):
        return f"pruned ({row['prune']}{distilled})"
    return "" if row.get("select") is None else f"{row['select']}{distilled}"


def plan(scale: str, data: str | None, runs: Path) -> list[sweep.Job]:
    """Every run, most important first: the baseline (everything else but the narrower network waits on
    it), the budgets, then the narrower network."""
    s = SCALES[scale]

    def job(name: str, arch: str, argv: list[str], deps: tuple[str, ...] = (), budget: float | None = None,
            narrow: bool = False, select: str = "slope", distill: float = 0.0, prune: str | None = None) -> sweep.Job:
        argv = [str(M.RECIPES / "cifar.py")] + (["--data-dir", data] if data else []) + ["--arch", arch] + FLAGS \
            + s["extra"] + argv + ["--seed", "0", "--output_dir", str(runs / name)]
        return sweep.Job(name, argv, deps, _meta("mnv2", arch, budget, narrow, select, distill, prune))

    def late(budget: float, select: str, distill: float = 0.0) -> sweep.Job:
        name = f"mnv2_x0_5_lat_{round(100 * budget)}{'_sal' if select == 'saliency' else ''}{'_kd' if distill else ''}_s0"
        return job(name, "mobilenet_v2_x0_5", [*(["--distill", f"{distill:g}"] if distill else []),
            "--linearize", "prelu", "--target-latency", f"{budget:g}", "--granularity", "block", "--freeze",
            *(["--select", select] if select != "slope" else []), "--init-from", str(runs / base.name / "model"),
            "--schedule", "late", "--late-start", str(SALIENCY_START if select == "saliency" else 0), "--ramp-end",
            "0.67", "--epochs", str(s["late_epochs"]), "--lr", "0.02"], (base.name,), budget, select=select,
            distill=distill)

    def pruned(budget: float) -> sweep.Job:  # the flags of the distilled late run of the budget, pruning instead
        name = f"mnv2_x0_5_prune_{round(100 * budget)}_{PRUNE_IMPORTANCE}_kd_s0"
        return job(name, "mobilenet_v2_x0_5", ["--distill", f"{DISTILL:g}", "--linearize", "none", "--prune",
            PRUNE_IMPORTANCE, "--target-latency", f"{budget:g}", "--init-from", str(runs / base.name / "model"),
            "--epochs", str(s["late_epochs"]), "--lr", "0.02"], (base.name,), budget, distill=DISTILL,
            prune=PRUNE_IMPORTANCE)

    base = job("mnv2_x0_5_base_s0", "mobilenet_v2_x0_5", ["--linearize", "none", "--epochs", str(s["base_epochs"])])
    jobs = [base] + [late(b, "slope") for b in MNV2_BUDGETS]
    jobs.append(job("mnv2_x0_35_base_s0", "mobilenet_v2_x0_35", [
        "--linearize", "none", "--epochs", str(round((s["base_epochs"] + s["late_epochs"]) / NARROW_TIME))], narrow=True))
    return (jobs + [late(b, "saliency") for b in SALIENCY_BUDGETS] + [late(b, "saliency", DISTILL) for b in DISTILL_BUDGETS]
            + [pruned(b) for b in PRUNE_BUDGETS])


# ----------------------------------------------------------------------------- analysis


def analyze(results: Path, scale: str, jobs: list[sweep.Job], data: str | None, reps: int = 15,
            remeasure_latency: bool = False) -> dict:
    """``results/<scale>/results.md``, ``results.json`` and ``accuracy_vs_latency.png`` from the collected
    run folders ``results/<run>/`` only."""
    out, previous = F.analysis_folder(results, scale)
    skipped: list[str] = []
    runs: dict[str, dict] = {}
    unverified: dict[str, str] = {}  # run -> why its fold does not verify (reported, not hidden)
    for j in jobs:
        if sweep.is_done(results / j.name):
            try:
                runs[j.name] = {**F.measure_run(results / j.name, data, skipped), **j.meta}
            except FoldVerificationError as e:
                unverified[j.name] = str(e).split(" Decisions:")[0]
    latency = F.measure_latency(results, list(runs), runs, data, previous.get("latency", {}), reps, remeasure_latency,
                         skipped) if runs else {}
    table = _table(jobs, runs, latency)
    claims = _claims(table)
    res = {"scale": scale, "runs": runs, "table": table, "latency": latency, "claims": claims, "skipped": skipped,
           "unverified": unverified, "missing": [j.name for j in jobs if j.name not in runs and j.name not in unverified]}
    md = _report(res)
    if table:
        M.plot(out / "accuracy_vs_latency.png", lambda ax: _draw(ax, table, "b1"), lambda ax: _draw(ax, table, "b64"))
    sweep.write_json(out / "results.json", res)
    (out / "results.md").write_text("\n".join(md) + "\n")
    if skipped:
        print(f"skipped (no CIFAR data: pass --cifar or set LINEARIZE_CIFAR10): {', '.join(skipped)}")
    return res


def _table(jobs: list[sweep.Job], runs: dict, latency: dict) -> list[dict]:
    """One row per finished run: accuracy, nonlinear fraction, latency (folded; baselines also as trained),
    speed-up over its family's baseline folded, accuracy against that baseline, fold error, training time."""
    ms = latency.get("ms", {})
    rounds = [r["ms"] for r in latency.get("rounds", [])] or [ms]
    base = {j.meta["family"]: j.name for j in jobs if j.meta["schedule"] == "none" and not j.meta["narrow"]}
    rows = []
    for j in jobs:
        if j.name not in runs:
            continue
        r, b = runs[j.name], runs.get(base[j.meta["family"]])
        key, ref = f"{j.name}/folded", f"{base[j.meta['family']]}/folded"
        lat = {k: ms.get(key, {}).get(k) for k in ("b1", "b64")}
        own = {k: [t for m in rounds if key in m and (t := m[key].get(k)) is not None and math.isfinite(t)]
               for k in ("b1", "b64")}
        # the speed-up within each measurement round (both timed in one process), then its median and range
        ups = {k: [u for m in rounds if key in m and ref in m
                   if (u := F.ratio(m[ref].get(k), m[key].get(k))) is not None and math.isfinite(u)]
               for k in ("b1", "b64")}
        fold = r.get("fold") or {}
        rows.append({
            "run": j.name, **{k: j.meta.get(k) for k in ("family", "arch", "budget", "narrow", "select", "distill",
                                                        "prune")},
            "accuracy": r["test_accuracy"], "nonlinear_fraction": r["nonlinear_fraction"],
            "vs_baseline_points": 100 * (r["test_accuracy"] - b["test_accuracy"]) if b else None,
            "latency_ms": lat,
            "latency_ms_range": {k: [min(v), max(v)] if v else None for k, v in own.items()},
            "latency_ms_as_trained": ({k: ms.get(f"{j.name}/as trained", {}).get(k) for k in ("b1", "b64")}
                                      if j.meta["schedule"] == "none" else None),
            "speedup": {k: statistics.median(u) if u else None for k, u in ups.items()},
            "speedup_range": {k: [min(u), max(u)] if u else None for k, u in ups.items()},
            "mflops_per_image": fold["flops_after"] / fold["images"] / 1e6 if fold else None,
            "params": fold.get("params_after"),
            "fold_max_rel_error": fold["max_abs_error"] / fold["output_scale"] if fold else None,
            "train_hours": _train_hours(j, runs),
        })
    return rows


def _train_hours(job: sweep.Job, runs: dict) -> float | None:
    """Wall time of the whole pipeline in hours: a late run's own plus its baseline's."""
    times = [runs.get(n, {}).get("wall_time_s") for n in (job.name, *job.deps)]
    return None if None in times else sum(times) / 3600


def _claims(table: list[dict]) -> list[str]:
    """The goals (``SPEEDUP_GOAL``, ``LOSS_GOAL``), from the numbers (nothing claimed for missing runs)."""
    out = []
    for family, label in FAMILIES.items():
        rows = [r for r in table if r["family"] == family]
        measured = [r for r in rows if r["budget"] is not None and r["speedup"]["b1"] and r["vs_baseline_points"] is not None]
        late = [r for r in measured if not r.get("prune")]
        narrow = next((r for r in rows if r["narrow"] and r["latency_ms"]["b1"]), None)
        if not late:
            out.append(f"**{label}**: no linearized run measured yet.")
            continue
        ok = [r for r in late if r["speedup"]["b1"] >= SPEEDUP_GOAL and r["vs_baseline_points"] >= -LOSS_GOAL]
        best = max(late, key=lambda r: (r["vs_baseline_points"] >= -LOSS_GOAL, r["speedup"]["b1"]))
        speed = (f"{len(ok)} of {len(late)} linearized runs reach >= {SPEEDUP_GOAL}x at batch 1 with <= {LOSS_GOAL} point "
                 f"lost" + (f" (best: {best['run']}, {best['speedup']['b1']:.2f}x, {best['vs_baseline_points']:+.2f})"
                            if best else "")) + ": the goal " + ("**is met**" if ok else "**is missed**")
        if narrow is None:
            vs = "the narrower network is not measured yet"
        else:
            faster = [r for r in late if r["latency_ms"]["b1"] <= narrow["latency_ms"]["b1"]]
            better = [r for r in faster if r["accuracy"] > narrow["accuracy"]]
            vs = (f"the narrower {narrow['arch']} ({100 * narrow['accuracy']:.2f}%, {narrow['latency_ms']['b1']:.2f} ms) "
                  + (f"is beaten at equal or lower latency by {', '.join(r['run'] for r in better)}" if better else
                     f"is not beaten: no linearized run is at least as fast and more accurate"
                     + ("" if faster else " (none is as fast)")))
        out.append(f"**{label}** (one seed): {speed}; {vs}{_against_pruning(measured)}.")
    return out


def _against_pruning(rows: list[dict]) -> str:
    """``; structured pruning (...) at budget B: ...`` for each measured pruned run of ``rows``, beside the
    linearized runs of the same budget and distillation ("" without pruned runs)."""
    out = ""
    for p in [r for r in rows if r.get("prune")]:
        same = [r for r in rows if not r.get("prune") and r["budget"] == p["budget"] and r["distill"] == p["distill"]]
        out += (f"; structured pruning ({_method(p)}) at budget {p['budget']:g}: {p['speedup']['b1']:.2f}x, "
                f"{p['vs_baseline_points']:+.2f} points"
                + (", linearized at the same budget and distillation: " + ", ".join(
                    f"{r['run']} {r['speedup']['b1']:.2f}x, {r['vs_baseline_points']:+.2f}" for r in same) if same else ""))
    return out


def _report(res: dict) -> list[str]:
    lat = res["latency"]
    md = ["# Linearize for speed (full CIFAR-10)", "",
          "Made by `python recipes/reproduce --scale speed --stage analyze` from `recipes/results/<run>/`. "
          "Latency: the folded model (baselines also as trained; a pruned model with its BatchNorms folded), median of interleaved repetitions on one "
          f"thread, batch 1 and {lat.get('batch', {}).get('b64', 64)} test images"
          + (f", {lat['machine']}, " + F.measured(lat) if lat.get("machine") else "")
          + ". Speed-up: against the family's baseline folded (BatchNorm folded into the convolutions: what a user "
          "deploys anyway), the median over measurements of the ratio within each (range in brackets; the bars in "
          "`accuracy_vs_latency.png`: the range of each latency). "
          "One seed per run.", "", *[f"- {c}" for c in res["claims"]],
          "", "| run | budget | test acc | vs baseline | nonlinear | ms b1 | ms b64 | speed-up b1 | speed-up b64 "
          "| MFLOPs | params | fold error (rel.) | training h |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["table"]:
        md.append(" | ".join([
            f"| {r['run']}", F.fmt(r["budget"], ".2f") + (f" ({_method(r)})" if _method(r) not in ("", "slope") else ""),
            F.fmt(100 * r["accuracy"], ".2f", "%"),
            F.fmt(r["vs_baseline_points"], "+.2f"), F.fmt(r["nonlinear_fraction"], ".3f"),
            F.fmt(r["latency_ms"]["b1"], ".3f"), F.fmt(r["latency_ms"]["b64"], ".1f"),
            _speedup(r, "b1"), _speedup(r, "b64"),
            F.fmt(r["mflops_per_image"], ".1f"), F.fmt(r["params"], ",.0f"), F.fmt(r["fold_max_rel_error"], ".1e"),
            F.fmt(r["train_hours"], ".2f")]) + " |")
    for name, why in res["unverified"].items():
        md += ["", f"**{name}: its fold does not verify** (not in the table): {why}."]
    if res["missing"]:
        md += ["", "Not finished yet: " + ", ".join(res["missing"]) + "."]
    if res["skipped"]:
        md += ["", "Skipped (no CIFAR data): " + ", ".join(res["skipped"]) + "."]
    return md


def _speedup(row: dict, batch: str) -> str:
    """``1.47x``, or ``1.47x (1.41-1.56)`` over several measurement rounds."""
    lo_hi = (row.get("speedup_range") or {}).get(batch)
    spread = f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})" if lo_hi and lo_hi[0] != lo_hi[1] else ""
    return F.fmt(row["speedup"][batch], ".2f", "x") + spread


def _draw(ax: Any, table: list[dict], batch: str) -> None:
    for i, (family, label) in enumerate(FAMILIES.items()):
        rows = [r for r in table if r["family"] == family and r["latency_ms"][batch]]
        if not rows:
            continue
        color, name = f"C{i}", label.split(" (")[0]
        base = [r for r in rows if r["budget"] is None and not r["narrow"]]
        # one line per way of choosing the blocks (and of learning)
        for style, method in (("o-", "slope"), ("s--", "saliency"), ("^:", "saliency, distilled"),
                              ("v-.", f"pruned ({PRUNE_IMPORTANCE}, distilled)")):
            runs = [r for r in rows if r["budget"] is not None and _method(r) == method]
            if not runs:
                continue
            line = sorted(base + runs, key=lambda r: r["latency_ms"][batch])
            how = method if method.startswith("pruned") else f"blocks by {method}"
            ax.plot([r["latency_ms"][batch] for r in line], [r["accuracy"] for r in line], style, color=color,
                    mfc=color if method == "slope" else "none", label=f"{name}: latency budgets, {how}")
            for r in runs:
                ax.annotate(f"{r['budget']:g}", (r["latency_ms"][batch], r["accuracy"]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        for r in rows:  # the spread of the measurements the median latency comes from
            lo, hi = (r.get("latency_ms_range") or {}).get(batch) or (r["latency_ms"][batch],) * 2
            x = r["latency_ms"][batch]
            ax.errorbar([x], [r["accuracy"]], xerr=[[x - lo], [hi - x]], fmt="none", ecolor=color, elinewidth=0.8,
                        capsize=2)
        for r in base:
            ax.annotate("baseline", (r["latency_ms"][batch], r["accuracy"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        for r in rows:
            if r["narrow"]:
                ax.plot([r["latency_ms"][batch]], [r["accuracy"]], "*", ms=11, color=color, label=f"narrower {r['arch']}")
    ax.set_xlabel(f"CPU latency of the folded model, ms (batch {'1' if batch == 'b1' else '64'}, 1 thread)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"batch {'1' if batch == 'b1' else '64'}")
    F.legend(ax)
