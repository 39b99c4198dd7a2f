"""The sweep runner of ``recipes/reproduce``: runs recipe jobs a few at a time, with dependencies,
resuming from checkpoints, and safe to kill and restart at any time (all state comes from the run
folders; see the docstring of ``recipes/reproduce/cli.py``). ``adopt`` links runs started by hand into a sweep.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from linearize._files import atomic_write, save_lock
from linearize._files import read_json as read_regular_json


@dataclass
class Job:
    """One recipe run: ``argv`` (script and arguments, ``--output_dir RUNS/name`` included), the runs
    that must be done before it starts, and what the analysis needs to know about it."""

    name: str
    argv: list[str]
    deps: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)



def read_json(path: Path, damaged_ok: bool = False) -> dict:
    """The JSON object in the file ``path``; ``{}`` when absent. Read as the library reads its files
    (``linearize._files.read_json``: without blocking, so a FIFO is refused at once, never waited on). A damaged
    file (invalid JSON, not UTF-8, a folder, a FIFO, device or socket, nested too deep, a number too long, no JSON
    object) raises ``ValueError`` naming it and the fix, so that a shared record such as ``RUNS/jobs.json`` is
    never rewritten from nothing; with ``damaged_ok`` (a run's ``metrics.json``: one run's bad file never stops
    the sweep) it is taken as ``{}`` with a warning naming it."""
    try:
        data = read_regular_json(path, path.name)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # LoadError (a ValueError): not a file, not JSON; a >4300-digit number
        problem = f"cannot be read ({type(e).__name__}: {e})"
    else:
        if isinstance(data, dict):
            return data
        problem = f"holds a JSON {type(data).__name__}, not an object"
    if not damaged_ok:
        raise ValueError(f"{path} {problem}: it is damaged; repair it, or move it aside (its records are then "
                         "lost) and run again")
    warnings.warn(f"{path} {problem}; taken as absent: repair or remove it", RuntimeWarning, stacklevel=2)
    return {}


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (``linearize._files.atomic_write``: a fresh temporary file, then rename)."""
    atomic_write(path, json.dumps(obj, indent=2))


def is_done(run: Path) -> bool:
    """A run is done when its ``model/`` and a ``metrics.json`` of the whole schedule are there, with the
    entries of every output its arguments asked for (``fold`` for ``--fold``, ``report`` for ``--report``: a
    ``metrics.json`` of an older recipe, written before them, is not a finished run); a damaged
    ``metrics.json``: not done, with a warning naming it."""
    m = read_json(run / "metrics.json", damaged_ok=True)
    steps, total = m.get("steps", 0), m.get("total_steps", 0)
    if not all(isinstance(v, (int, float)) for v in (steps, total)):
        warnings.warn(f"{run / 'metrics.json'}: steps {steps!r} and total_steps {total!r} must be numbers; the run "
                      "is taken as not done: repair or remove the file", RuntimeWarning, stacklevel=2)
        return False
    args = m.get("args") if isinstance(m.get("args"), dict) else {}
    outputs = [k for k in ("fold", "report") if args.get(k)]
    return bool(m) and steps >= total and all(k in m for k in outputs) and (run / "model" / "recipe.json").is_file()


def has_checkpoint(run: Path) -> bool:
    """Any checkpoint folder: the run is resumed and the recipe judges it (a damaged or foreign one
    fails the run loudly, with the recipe's reasons, instead of silently starting it over)."""
    import common

    return run.is_dir() and any(p.is_dir() for p in common.checkpoint_dir(run, 0).parent.glob("step_*"))


def _output_dir_of(cmdline: list[str], cwd: str) -> str | None:
    for i, a in enumerate(cmdline):
        for flag in ("--output_dir", "--output-dir"):
            if a == flag and i + 1 < len(cmdline):
                return os.path.realpath(os.path.join(cwd, cmdline[i + 1]))
            if a.startswith(flag + "="):
                return os.path.realpath(os.path.join(cwd, a.split("=", 1)[1]))
    return None


def recipe_processes() -> dict[str, list[tuple[int, list[str]]]]:
    """``{real output dir: [(pid, command line)]}`` of the live processes (Linux ``/proc``) that have
    ``--output_dir`` on their command line; ``{}`` where ``/proc`` is missing."""
    found: dict[str, list[tuple[int, list[str]]]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            if int(proc.name) == os.getpid() or not any(a.startswith("--output") for a in cmd):
                continue
            out = _output_dir_of(cmd, os.readlink(proc / "cwd"))
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
        if out:
            found.setdefault(out, []).append((int(proc.name), cmd))
    return found


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive ``flock`` on ``path``, or ``None`` when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _record(runs: Path, name: str, entry: dict) -> None:
    """Merge ``entry`` into ``runs/jobs.json[name]``: re-read, merged and written back under the save lock of
    ``runs`` (``linearize._files.save_lock``), as other runners may share the file and would otherwise erase
    each other's records (where the filesystem cannot lock files: unlocked, with a warning naming the folder)."""
    path = runs / "jobs.json"
    with save_lock(runs):
        done = read_json(path)
        done[name] = {**done.get(name, {}), **entry}
        write_json(path, done)


def train(jobs: list[Job], runs: Path, n_jobs: int, threads: int, poll_s: float = 10.0,
          max_hours: float = 72.0, on_done: Callable[[str], None] | None = None) -> int:
    """Run ``jobs`` (most important first), ``n_jobs`` at a time, until none can start; see the module
    docstring for what is skipped, resumed, waited for. ``on_done(name)`` is called once for every run
    found done (e.g. to collect it). After ``max_hours`` no run is started any more and the runner
    returns (its children go on). Returns the number of runs that failed or could not start."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    names = {j.name for j in jobs}
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    failed: dict[str, str] = {}
    seen_done: set[str] = set()
    changed: set[str] = set()  # done, but with other arguments than planned now
    announced: set[str] = set()
    deadline = time.time() + 3600 * max_hours
    read_json(runs / "jobs.json")  # a damaged record of the runs stops the runner before any run starts
    conflicts = _shared_folders(jobs, runs)  # never started, collected or counted as done
    failed.update(conflicts)
    n_done = sum(is_done(runs / j.name) and not plan_changed(j, runs / j.name) for j in jobs)
    print(f"{n_done} of {len(jobs)} runs already done; {n_jobs} at a time, {threads} thread(s) each", flush=True)
    while True:
        for name, (proc, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            wall = time.time() - t0
            log = runs / f"{name}.log"
            _record(runs, name, {"returncode": proc.returncode, "ended": time.time(), "wall_s": round(wall, 1)})
            if proc.returncode != 0 or not is_done(runs / name):
                failed[name] = f"exit code {proc.returncode}, see {log}"
            print(f"done {name}: rc {proc.returncode}, {wall:.0f} s" + (f" (FAILED, see {log})" if name in failed
                                                                       else ""), flush=True)
        busy = recipe_processes()
        state: dict[str, str] = {}
        for j in jobs:
            run = runs / j.name
            if j.name in running:
                state[j.name] = "running"
            elif j.name in conflicts or j.name in changed:
                state[j.name] = "failed"
            elif is_done(run) and j.name not in changed and (why := plan_changed(j, run)):
                changed.add(j.name)  # checked once: a finished run's metrics.json no longer changes
                state[j.name] = "failed"
                failed[j.name] = why
            elif is_done(run) and j.name not in changed:
                state[j.name] = "done"
                if on_done and j.name not in seen_done:
                    try:
                        on_done(j.name)
                    except Exception as e:  # e.g. a full disk: report, keep the sweep going
                        print(f"after {j.name}: {type(e).__name__}: {e}", flush=True)
                seen_done.add(j.name)
            elif j.name in failed:
                state[j.name] = "failed"
            elif (pids := [pid for pid, _ in busy.get(os.path.realpath(run), [])]) or _locked(runs / f"{j.name}.lock"):
                state[j.name] = "busy"  # another runner's child, or a run started by hand
                if j.name not in announced:
                    print(f"{j.name} runs in another process ({f'pid {pids}' if pids else 'its lock is held'}): "
                          "waiting for it", flush=True)
                announced.add(j.name)
            elif bad := [d for d in j.deps if d in failed or state.get(d) == "blocked"]:
                state[j.name] = "blocked"
                failed.setdefault(j.name, f"dependency {bad[0]} failed")
            elif any(not is_done(runs / d) for d in j.deps):
                state[j.name] = "waiting"
            else:
                state[j.name] = "ready"
        slots = n_jobs - sum(s in ("running", "busy") for s in state.values())
        for j in jobs:
            if slots <= 0 or time.time() > deadline:
                break
            if state[j.name] == "ready" and _start(j, runs, env, threads, running):
                state[j.name] = "running"
                slots -= 1
        if time.time() > deadline or not any(s in ("running", "busy") for s in state.values()):
            break
        time.sleep(poll_s)
    waiting = [j for j in jobs if state[j.name] in ("waiting", "ready")]
    for j in waiting:
        missing = [d for d in j.deps if not is_done(runs / d)]
        why = f"waits for {', '.join(missing)}" + ("" if set(missing) <= names else " (not in this sweep: run or "
                                                   "--adopt it)") if missing else "time limit (--max-hours)"
        print(f"not started {j.name}: {why}")
    for name, why in failed.items():
        print(f"FAILED {name}: {why}")
    elsewhere = [n for n, s in state.items() if s == "busy"]
    if elsewhere:
        print(f"running in other processes (started by hand or by another runner): {', '.join(elsewhere)}")
    if time.time() > deadline and running:
        print(f"--max-hours {max_hours:g} reached; still running (resume by starting the runner again): "
              f"{', '.join(running)}")
    print(f"{sum(s == 'done' for s in state.values())} of {len(jobs)} runs done", flush=True)
    return len(failed)


def _shared_folders(jobs: list[Job], runs: Path) -> dict[str, str]:
    """``{run: why}`` for the runs whose folders ``runs/<run>`` lead to one real folder (adopted twice)."""
    folders: dict[str, list[str]] = {}
    for j in jobs:
        folders.setdefault(os.path.realpath(runs / j.name), []).append(j.name)
    return {name: f"runs {', '.join(shared)} all lead to the folder {folder}: remove the extra links from {runs} "
                  "(one folder holds one run)" for folder, shared in folders.items() if len(shared) > 1
            for name in shared}


def _locked(path: Path) -> bool:
    if not path.exists():
        return False
    fd = _try_lock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def _start(job: Job, runs: Path, env: dict, threads: int, running: dict) -> bool:
    """Start ``job`` (resuming from its latest checkpoint when it has one) with its lock held by the
    child; ``False`` if another process took the lock first."""
    fd = _try_lock(runs / f"{job.name}.lock")
    if fd is None:
        return False
    try:
        resume = has_checkpoint(runs / job.name)
        argv = job.argv + (["--resume_from_checkpoint", "latest"] if resume else [])
        command = f"OMP_NUM_THREADS={threads} " + shlex.join(["python"] + argv)
        with open(runs / f"{job.name}.log", "a") as log:
            log.write(f"\n=== reproduce.py (pid {os.getpid()}) {'resumes' if resume else 'starts'} {job.name} at "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {command}\n")
            log.flush()
            proc = subprocess.Popen([sys.executable] + argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    pass_fds=(fd,))  # the child holds the lock until it exits
    finally:
        os.close(fd)
    attempts = read_json(runs / "jobs.json").get(job.name, {}).get("attempts", 0) + 1
    _record(runs, job.name, {"command": command, "started": time.time(), "resumed": resume, "attempts": attempts,
                             "log": str(runs / f"{job.name}.log"), "returncode": None})
    running[job.name] = (proc, time.time())
    print(f"{'resume' if resume else 'start'} {job.name}: {command}", flush=True)
    return True


# ----------------------------------------------------------------------------- adopt


def link_run(runs: Path, name: str, source: Path) -> bool:
    """Make ``runs/name`` a symlink to the folder ``source`` (absolute), unless it is one already;
    ``SystemExit`` when ``runs/name`` is something else, or when another entry of ``runs`` leads to
    ``source`` already (two runs writing one folder). Returns whether a link was made."""
    source = source.resolve()
    runs.mkdir(parents=True, exist_ok=True)
    link = runs / name
    if link.is_symlink() and link.resolve() == source:
        return False
    if link.exists() or link.is_symlink():
        raise SystemExit(f"--adopt {name}: {link} exists already; move it away to adopt {source} instead")
    other = next((p.name for p in sorted(runs.iterdir()) if p.name != name and p.is_dir() and p.resolve() == source),
                 None)
    if other is not None:
        raise SystemExit(f"--adopt {name}={source}: that folder is run {other} already ({runs / other}); one folder "
                         f"holds one run: give {name} a folder of its own")
    link.symlink_to(source, target_is_directory=True)
    return True


def _differences(job: Job, theirs: dict) -> str:
    """The arguments (but ``common.NEUTRAL_ARGS``) in which a run's ``theirs`` differs from ``job``'s plan,
    as ``"name (theirs, planned ours)"``; "" when none."""
    import importlib

    from common import NEUTRAL_ARGS, json_value

    recipe = importlib.import_module(Path(job.argv[0]).stem)  # cifar / wmt14: their own parse_args
    ours = vars(recipe.parse_args(job.argv[1:]))
    return ", ".join(f"{k} ({json_value(theirs[k])!r}, planned {json_value(ours[k])!r})" for k in ours
                     if k in theirs and k not in NEUTRAL_ARGS and json_value(theirs[k]) != json_value(ours[k]))


def plan_changed(job: Job, run: Path) -> str:
    """Why the finished run in ``run`` is not ``job`` any more (its plan was edited since: another
    ``--target``, ``--epochs``, ...), or "" when its ``metrics.json`` arguments are the planned ones."""
    theirs = read_json(run / "metrics.json", damaged_ok=True).get("args")
    diff = _differences(job, theirs) if isinstance(theirs, dict) else ""
    return (f"{run} finished with other arguments than planned now: {diff}; its result is not this job's. Move "
            "the folder away (or delete it) to run the job as planned, or restore the plan") if diff else ""


def adopt(job: Job, runs: Path, source: Path) -> None:
    """Link ``source``, the output folder of a run of ``job`` started by hand (finished or still
    running), as ``runs/<job.name>`` (:func:`link_run`), after checking that its arguments (from its
    ``metrics.json`` or its live process) are the job's, except ``common.NEUTRAL_ARGS``."""
    import importlib

    source = source.resolve()
    if not source.is_dir():
        raise SystemExit(f"--adopt {job.name}={source}: no such folder")
    recipe = importlib.import_module(Path(job.argv[0]).stem)  # cifar / wmt14: their own parse_args
    theirs, origin = read_json(source / "metrics.json", damaged_ok=True).get("args"), f"{source / 'metrics.json'}"
    if theirs is None:
        for pid, cmd in recipe_processes().get(str(source), []):
            script = next((i for i, a in enumerate(cmd) if a.endswith(Path(job.argv[0]).name)), None)
            if script is not None:
                theirs, origin = vars(recipe.parse_args(cmd[script + 1:])), f"the command line of process {pid}"
    if theirs is None:
        print(f"--adopt {job.name}: {source} has no metrics.json and no live process: its arguments are not checked; "
              "the runner resumes it from its latest checkpoint with the planned arguments")
    elif diff := _differences(job, theirs):
        raise SystemExit(f"--adopt {job.name}={source}: {origin} differs from the planned run in {diff}; adopt a run "
                         f"of `{shlex.join(['python'] + job.argv)}`, or let the runner train it")
    if link_run(runs, job.name, source):
        print(f"adopted {source} as {runs / job.name}")


