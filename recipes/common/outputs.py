"""What a recipe leaves behind: the final model folder (``recipe.json`` with the size and sha256 of its
files, verified on load) and ``metrics.json`` (final metrics, unit counts, fold summary, command,
versions, wall time); the outputs an earlier run into the folder left removed first."""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

import linearize
from linearize._files import atomic_write, check_given_folder, check_regular, read_json

from .files import TMP_PREFIX, file_sha256, pid_alive, restore_aside


def read_recipe_json(directory: str | Path, required: Iterable[str] = ()) -> dict:
    """``directory/recipe.json`` of a model saved by a recipe (``OUTPUT_DIR/model``), after putting back
    a folder an interrupted save left aside (:func:`restore_aside`); a clear error when there is none,
    or when it lacks one of the ``required`` keys."""
    directory = Path(directory)
    restore_aside(directory)
    path = directory / "recipe.json"
    check_given_folder(directory, "a recipe's model")
    if not path.exists():
        raise FileNotFoundError(f"no recipe.json in {directory}: not a model folder written by a recipe "
                                "(OUTPUT_DIR/model, with recipe.json and model.safetensors)")
    check_regular(path, "recipe.json")  # a FIFO: refused by name (reading it would wait for a writer)
    try:
        meta = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep; ValueError: also an integer too long
        raise ValueError(f"{path} is not valid JSON ({e}); the save is damaged: train again or restore it") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds {type(meta).__name__}, not a JSON object; the save is damaged")
    missing = [k for k in required if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {missing}: the save is damaged or not of this recipe; train again or restore it")
    return meta


def file_records(directory: Path, exclude: Iterable[str] = ("recipe.json",)) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of the files directly in ``directory`` (less ``exclude`` and hidden files,
    such as the save lock of ``linearize.save_pretrained``): the ``files`` field of a saved model's
    ``recipe.json``, which :func:`check_files` verifies on load."""
    return {f.name: {"size": f.stat().st_size, "sha256": file_sha256(f)} for f in sorted(Path(directory).iterdir())
            if f.is_file() and f.name not in set(exclude) and not f.name.startswith(".")}


def check_files(directory: str | Path, meta: dict) -> None:
    """Verify the files ``recipe.json`` of ``directory`` records (``meta["files"]``: :func:`file_records`)
    by size and sha256; raise ``linearize.LoadError`` naming the file. Saves from before the field
    existed have no ``files``: nothing to check."""
    directory = Path(directory)
    path = directory / "recipe.json"
    files = meta.get("files")
    if files is None:
        return
    if not isinstance(files, dict) or not all(
            Path(n).name == n and isinstance(r, dict) and type(r.get("size")) is int and isinstance(r.get("sha256"), str)
            for n, r in files.items()):
        raise linearize.LoadError(f"{path}: field 'files' must map file names of this folder to {{size, sha256}}; "
                                  "the save is damaged or was edited: train again or restore it")
    for name, rec in files.items():
        f = directory / name
        if not f.is_file() or f.stat().st_size != rec["size"] or file_sha256(f) != rec["sha256"]:
            raise linearize.LoadError(f"{f}: missing, truncated or modified (its size or sha256 is not the one "
                                      f"{path} recorded); refusing to load it")


def unit_stats(model: nn.Module, tol: float) -> dict:
    """``{"nonlinear_fraction", "units_total", "units_nonlinear"}`` (``linearize.count_units``), or ``{}``
    for a model without units (``--linearize none``)."""
    if not linearize.units(model):
        return {}
    c = linearize.count_units(model, tol)
    return {"nonlinear_fraction": c["nonlinear"] / c["total"], "units_total": c["total"],
            "units_nonlinear": c["nonlinear"]}


PRUNE_IMPORTANCES = ("magnitude", "taylor")  # of linearize.prune for --prune (its "residual" ranks for linearizing)
KEPT_FILE = "pruned_channels.json"  # OUTPUT_DIR/: the channel indices each site a --prune run pruned kept


def write_kept(directory: str | Path, record: dict) -> Path:
    """Write ``record`` (what a ``--prune`` run kept: the channel indices by site, as ``linearize.prune``
    takes them back) to ``directory/pruned_channels.json``, atomically (a reader sees the old file or the new)."""
    return atomic_write(Path(directory) / KEPT_FILE, json.dumps(record))


def read_record(path: str | Path, why: str) -> dict:
    """The JSON object a run wrote at ``path`` for a later step (a resume, a load); ``ValueError`` naming the file,
    what went wrong and ``why`` (what wrote it, what needs it, the fix) when it is missing, damaged, or not a
    JSON object (read without blocking: a FIFO is refused, never waited on).

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "step.json"; _ = p.write_text('{"step": 3}')
        >>> read_record(p, "the step wrote it")
        {'step': 3}
    """
    path = Path(path)
    try:
        record = read_json(path, path.name)
    except (OSError, ValueError) as e:  # LoadError is a ValueError
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}): {why}") from e
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds a JSON {type(record).__name__}, not an object: {why}")
    return record


def read_kept(directory: str | Path) -> dict:
    """The record :func:`write_kept` wrote in ``directory``; ``ValueError`` naming the file when it is missing
    or damaged (a run resumed after its prune, or a pruned model loaded, needs it to rebuild the shapes)."""
    return read_record(Path(directory) / KEPT_FILE, "the --prune step wrote the kept channel indices there, and the "
                       "pruned shapes are rebuilt from them; restore the file, or start again in a fresh --output_dir")


def remove_earlier_outputs(output_dir: str | Path, names: Iterable[str]) -> list[Path]:
    """Remove the outputs ``names`` (files or folders directly in ``output_dir``: ``folded``, ``report``, ...)
    that an earlier run into the folder left, before this run writes its own: those this run does not write
    again must not be read as its own (``linearize report --compare`` reads ``report/``). A folder is renamed
    to a temp sibling ``.tmp-<name>-removed-<pid>`` first (never the name of :func:`replaced_dir`'s stage), so
    it is gone at once, never half removed; such temp folders of processes that no longer run (a removal or a
    save killed midway) are deleted with it, and a warning names what could not be deleted; a symlink
    loses the link only, never its target's contents. Pass only the outputs this run does not write again: a
    symlinked ``folded/`` that it writes must stay a link (:func:`replaced_dir` replaces its target). Returns the
    outputs removed."""
    removed = []
    for name in names:
        path = Path(output_dir) / name
        pattern = re.compile(rf"{re.escape(TMP_PREFIX + name)}-(?:removed-|old-)?(\d+)(?:-[0-9a-f]{{8}})?")
        for leftover in path.parent.glob(glob.escape(f"{TMP_PREFIX}{name}-") + "*"):  # of killed removals, saves
            match = pattern.fullmatch(leftover.name)
            if match and not pid_alive(int(match.group(1))) and leftover.is_dir() and not leftover.is_symlink():
                _delete(leftover)
        if path.is_dir() and not path.is_symlink():
            doomed = path.with_name(f"{TMP_PREFIX}{name}-removed-{os.getpid()}")
            shutil.rmtree(doomed, ignore_errors=True)  # left by an earlier removal under this pid
            path.rename(doomed)
            _delete(doomed)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(path)
    return removed


def _delete(folder: Path) -> None:
    """Delete ``folder``; warn, naming it, when some of it cannot be deleted (a read-only or open file)."""
    shutil.rmtree(folder, ignore_errors=True)
    if folder.exists():
        warnings.warn(f"{folder}: an earlier run's output that could not be deleted completely (a read-only file, "
                      "or one still open on NFS); this run goes on without it: delete the folder by hand",
                      RuntimeWarning, stacklevel=3)


FOLD_METRICS = ("params_before", "params_after", "flops_before", "flops_after", "max_abs_error", "output_scale")


def fold_metrics(folded: nn.Module, path: Path) -> dict:
    """The ``fold`` entry of ``metrics.json``: where the folded model was saved, and its
    ``linearize_fold_summary`` (parameters and FLOPs before and after, the largest error of the check)."""
    summary = folded.linearize_fold_summary
    return {"path": str(path), **{k: getattr(summary, k) for k in FOLD_METRICS}}


def versions() -> dict:
    import accelerate
    import torchvision
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
         "accelerate": accelerate.__version__, "transformers": transformers.__version__,
         "linearize": linearize.__version__}
    for name in ("tokenizers", "sacrebleu", "datasets"):
        try:
            v[name] = __import__(name).__version__
        except ImportError:
            pass
    return v


def command_line(num_processes: int) -> str:
    """The command that ran this recipe (``accelerate launch`` when under several processes)."""
    argv = " ".join(sys.argv)
    if num_processes > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ:
        return f"accelerate launch --num_processes {num_processes} {argv}"
    return f"python {argv}"


def write_metrics(output_dir: str | Path, metrics: dict, args: argparse.Namespace, start_time: float,
                  num_processes: int, device: str, earlier_s: float = 0.0) -> Path:
    """Write ``metrics.json``: metrics, wall time, command, arguments, versions.

    ``wall_time_s`` is the whole run's: ``earlier_s`` (the processes before a resume, up to the
    checkpoint resumed from: :attr:`Run.earlier_s`) plus this process's since ``start_time``
    (``wall_time_this_process_s``)."""
    this = max(0.0, time.time() - start_time)  # a wall clock stepped back (NTP) counts 0, never negative
    payload = {
        **metrics,
        "wall_time_s": round(earlier_s + this, 2),
        "wall_time_this_process_s": round(this, 2),
        "num_processes": num_processes,
        "device": device,
        "command": command_line(num_processes),
        "args": {k: v for k, v in vars(args).items()},
        "versions": versions(),
    }
    return atomic_write(Path(output_dir) / "metrics.json", json.dumps(payload, indent=2, default=str))
