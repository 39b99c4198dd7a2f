"""Rerun the seed-paper reproductions of the README on real data, then tabulate and plot them.

Two sweeps (``--scale``):

* ``cpu-small`` (default): the reduced sweep whose tables and plots are ``recipes/results/*.md|json|png``
  (one seed, 5,000 training images, 5 epochs; CIFAR-10 and Multi30k)::

      python recipes/reproduce --cifar /path/cifar10-jpeg.tar.gz --multi30k /path/multi30k
      python recipes/reproduce --stage analyze       # only redo tables and plots from finished runs

* ``full``: the late-vs-early linearization study of ResNet-20 on the full CIFAR-10 train and test sets,
  on the CPU (``recipes/reproduce/full.py``: the run list and the analysis): ResNet-20 baselines (40 epochs, seeds 0 and 1), late linearization
  of each baseline (15 epochs) to 25 / 10 / 5 / 2 % nonlinear channels, early linearization from
  scratch (55 epochs) to 10 / 2 %, and late linearization to 5 % on 2- and 5-class subsets, two
  single-thread runs side by side. Runs go to ``runs/reproduce/full/<run>`` (git-ignored), the small
  results of each finished run (``model/``, ``metrics.json``, ``sparsifier_history.json``) to
  ``recipes/results/<run>/`` (committed), tables and plots to ``recipes/results/full/``::

      export LINEARIZE_CIFAR10=/path/cifar10-jpeg.tar.gz
      # once, optional: adopt runs started by hand with the planned arguments (finished or still
      # running): a symlink in the runs folder; the runner waits for them, or resumes them if they stop
      python recipes/reproduce --scale full --stage collect --adopt r20_base_s0=/work/runs/r20_base_s0 \\
          --adopt r20_base_s1=/work/runs/r20_base_s1
      # start, and resume after a crash, a reboot or a kill -9 of anything (the same command):
      mkdir -p runs && setsid nohup python recipes/reproduce --scale full --stage train >> runs/reproduce-full.log 2>&1 < /dev/null &
      python recipes/reproduce --scale full --stage collect   # copy finished runs to recipes/results/ (train does too)
      python recipes/reproduce --scale full --stage analyze   # tables + plots from recipes/results/<run>/ only
      git add recipes/results/r20_* recipes/results/full
      # before a session ends with runs unfinished: park their newest checkpoints (about 2 MB each) to commit;
      # on a fresh machine, --stage train links the runs collected in recipes/results/<run>/ as done (late
      # runs start from those baselines), puts parked checkpoints newer than the run folders' back and
      # resumes from them
      python recipes/reproduce --scale full --stage park && git add recipes/results/inflight

* ``speed``: the speed study (``recipes/reproduce/speed.py``): MobileNet-V2 x0.5 linearized late under CPU
  latency budgets (whole blocks), folded, against MobileNet-V2 x0.35 trained for as many epochs; the same
  stages, runs in ``runs/reproduce/speed/``, collected runs in
  ``recipes/results/<run>/``, tables and the accuracy-vs-latency plot in ``recipes/results/speed/``::

      setsid nohup python recipes/reproduce --scale speed --stage train >> runs/reproduce-speed.log 2>&1 < /dev/null &

Stage ``train`` runs ``recipes/cifar.py`` (and ``recipes/wmt14.py``) ``--jobs`` at a time, each with
``--threads`` torch threads, logs appended to ``RUNS/<run>.log``, launches and exit codes to
``RUNS/jobs.json`` (several runners on one RUNS folder share it: each record is written under the folder's
file lock ``RUNS/.linearize.lock``, so none erases another's; a damaged one stops the runner with an error
naming it, before anything is written over the records: repair it or move it aside). All its state comes from the run folders, so the runner can be killed (even
``kill -9``) and started again at any time: a run whose ``metrics.json`` is complete is done (a damaged
one, not UTF-8, a folder, a FIFO, a number too long or no JSON object, is named in a warning and the run taken as not done); a run
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
import os
import sys
from pathlib import Path
from typing import Any, Callable

from . import full, small, speed
from .measure import RECIPES, machine_name, on_one_thread
from .sweep import Job, adopt, train


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



def main(argv: list[str] | None = None) -> int:
    plans = {**{s: full for s in full.SCALES}, **{s: speed for s in speed.SCALES}}  # scale -> its plan and analysis
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=[*small.SCALES, *plans], default="cpu-small",
                   help="cpu-small, full (late vs early linearization of ResNet-20), speed (linearize MobileNet-V2 "
                        "for speed), or tiny / speed-tiny (their miniatures for the tests)")
    p.add_argument("--stage", choices=["all", "train", "collect", "analyze", "park"], default="all",
                   help="all = train, collect (full), analyze; park (full): copy the newest checkpoint of every "
                        "unfinished run to RESULTS_DIR/inflight/<run>/ to commit, which train resumes from on a "
                        "machine without the run folders")
    p.add_argument("--parts", default="cifar,mt", help="cpu-small: comma-separated: cifar, mt")
    p.add_argument("--cifar", default=os.environ.get("LINEARIZE_CIFAR10"), help="CIFAR-10 folder or .tar.gz")
    p.add_argument("--multi30k", default=os.environ.get("LINEARIZE_MULTI30K"), help="Multi30k folder")
    p.add_argument("--runs-dir", default=str(RECIPES.parent / "runs" / "reproduce"),
                   help="run outputs (git-ignored); runs go to RUNS_DIR/SCALE/<run>")
    p.add_argument("--results-dir", default=str(RECIPES / "results"),
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
        jobs = small.cifar_jobs(small.SCALES[args.scale], args.cifar, runs) if "cifar" in parts and args.cifar else []
        if "mt" in parts and args.stage in ("all", "train"):
            if not args.multi30k:
                sys.exit("Multi30k not found: pass --multi30k or set LINEARIZE_MULTI30K")
            jobs += small.mt_jobs(small.SCALES[args.scale], args.multi30k, runs)
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
            small.analyze(runs, results, args.scale, args.cifar, args.regions_images, args.regions_radius,
                    args.regions_runs.split(","), regions_pieces=args.regions_pieces,
                    remeasure_latency=args.remeasure_latency, machine=machine_name(args.threads, args.jobs))
    out = results / args.scale if planned else results
    print(f"runs: {runs}\nresults: {out}/results.md, results.json, *.png")
    return 1 if failures else 0
