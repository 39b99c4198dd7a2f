"""Checkpoints written by the recipes themselves (safetensors, ``torch.load(weights_only=True)`` and JSON,
so that loading one executes no code), atomically, verified by size and sha256 before use, with a
fingerprint of the model so that a checkpoint folder of another model is refused; the run's arguments
recorded in them, so that a resume with others is refused."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from linearize._files import fsync_path

from .accelerator import is_sharded, state_dict_options
from .args import flag
from .files import TMP_PREFIX, file_sha256, follow_umask, pid_alive, writing
from .run import NONFINITE_ADVICE, Run


STATE_FILE = "recipe_state.json"


# OUTPUT_DIR/checkpoints/step_XXXXXXXX (the state after XXXXXXXX optimizer steps) holds
#   model.safetensors  the unwrapped model's state dict (tied tensors once)
#   optimizer.pt       the optimizer's state dict, read back with torch.load(weights_only=True)
#   recipe_state.json  written last: format, step, recipe, model fingerprint, the run's arguments
#                      (recorded_args: a resume with others is refused), the LR scheduler's, sparsifier's
#                      and grad scaler's state, and size + sha256 of the two files above.
# Only the main process writes, into .tmp-step_XXXXXXXX-<pid> beside it, renamed into place when
# complete; every process reads. No file of a checkpoint is unpickled with code execution. Under --fsdp
# both states are gathered whole onto the main process (the optimizer's keyed by parameter names, so such a
# checkpoint resumes only a --fsdp run: --fsdp is a recorded argument) and every process loads its shards.

CHECKPOINT_FORMAT = 2
# Arguments that do not change what a run computes (where it reads and writes, how it checkpoints and logs,
# when this process stops): a resume (recipe_state.json records the others) and sweep.adopt ignore them.
NEUTRAL_ARGS = frozenset({
    "output_dir", "data_dir", "cache_dir", "download", "train_file", "validation_file", "test_file", "cpu",
    "mixed_precision", "resume_from_checkpoint", "with_tracking", "log_every", "checkpointing_steps",
    "keep_checkpoints", "stop_after", "init_from"})
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


# The `frozen` buffer of a linearize unit holds NaN for free channels (0 or 1 for frozen ones).
NAN_SENTINEL_SUFFIX = ".frozen"


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used: incomplete, damaged, unsafe to load or non-finite."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclass
class Checkpoint:
    """A checkpoint read into CPU memory and verified (see :func:`read_checkpoint`)."""

    path: Path
    step: int
    recipe: str | None
    fingerprint: str | None
    model: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    sparsifier: dict | None
    scaler: dict | None
    total_steps: int | None = None  # the run length it was written by (None: before it was recorded)
    elapsed_s: float = 0.0  # wall time of the run up to this checkpoint (0: before it was recorded)
    args: dict | None = None  # recorded_args of the run that wrote it (None: before they were recorded)


def json_value(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, other objects their ``str``)."""
    return json.loads(json.dumps(value, default=str))


def recorded_args(args: argparse.Namespace) -> dict:
    """The arguments that change what a run computes (all but :data:`NEUTRAL_ARGS`), as JSON values."""
    return {k: json_value(v) for k, v in sorted(vars(args).items()) if k not in NEUTRAL_ARGS}


# Values a recipe adds to its arguments once it has read its inputs, recorded and compared like them: the name
# a difference is reported under.
DERIVED_ARGS = {"teacher_sha256": "the --distill teacher (the --init-from weights), sha256"}


def args_differences(stored: dict, args: argparse.Namespace) -> list[str]:
    """``--flag A (now B)`` for every argument of ``stored`` (:func:`recorded_args` of an earlier run) that
    ``args`` sets otherwise; arguments one side lacks (added or removed by another version) are not compared."""
    now = recorded_args(args)
    return [f"{DERIVED_ARGS.get(k, flag(k))} {stored[k]!r} (now {now[k]!r})" for k in sorted(stored.keys() & now.keys())
            if stored[k] != now[k]]


def check_args(ckpt: Checkpoint, args: argparse.Namespace) -> None:
    """``ValueError`` naming every flag ``args`` sets otherwise than the run that wrote ``ckpt`` (its recorded
    arguments, :func:`args_differences`), with the fix; a recipe calls it before anything it does to resume
    from ``ckpt`` depends on those flags (:func:`load_checkpoint` calls it too)."""
    if ckpt.args is not None and (changed := args_differences(ckpt.args, args)):
        raise ValueError(f"checkpoint {ckpt.path} belongs to a run with other settings: {'; '.join(changed)}; "
                         f"resume with the flags the run was started with ({STATE_FILE} records them), or start "
                         "a fresh --output_dir")


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """First 16 hex digits of the sha256 of a state dict: names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def model_fingerprint(model: nn.Module) -> str:
    """Hash of parameter/buffer names and shapes: equal for the same architecture and conversion."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)};".encode())
    return h.hexdigest()[:16]


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """``OUTPUT_DIR/checkpoints/step_XXXXXXXX``: the checkpoint after ``step`` optimizer steps."""
    return Path(output_dir) / "checkpoints" / f"step_{step:08d}"


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """Name of the first floating tensor holding inf or NaN (NaN allowed in units' ``frozen`` buffers)."""
    for name, t in tensors:
        if not torch.is_floating_point(t):
            continue
        ok = ~torch.isinf(t).any() if name.endswith(NAN_SENTINEL_SUFFIX) else torch.isfinite(t).all()
        if not bool(ok):
            return name
    return None


def _optimizer_tensors(state: dict) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of an optimizer state dict's per-parameter state (momentum buffers, ...)."""
    return [(f"state.{i}.{k}", v) for i, s in state.get("state", {}).items() for k, v in s.items()
            if isinstance(v, torch.Tensor)]


def save_checkpoint(run: Run, step: int) -> Path:
    """Write the checkpoint of ``step`` (main process; atomically) and prune old ones to
    ``--keep_checkpoints``. Raises ``FloatingPointError`` instead of writing non-finite tensors, and an
    ``OSError`` naming the file when a write fails (:func:`writing`: a full disk)."""
    from safetensors.torch import save_file, save_model

    acc = run.accelerator
    path = checkpoint_dir(run.out_dir, step)
    raw = acc.unwrap_model(run.model)
    if is_sharded(raw):  # --fsdp: the whole state gathered onto the main process ({} on the others)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(raw, run.optimizer.optimizer,
                                                      options=state_dict_options(cpu_offload=True))
    else:
        model_state, optimizer_state = raw.state_dict(), run.optimizer.state_dict()
    bad = first_nonfinite(chain(model_state.items(), _optimizer_tensors(optimizer_state)))
    if is_sharded(raw):  # the main process found it: every process stops
        from accelerate.utils import broadcast_object_list

        bad = broadcast_object_list([bad])[0]
    if bad is not None:
        raise FloatingPointError(f"{bad} holds inf or NaN after optimizer step {step}: not writing checkpoint "
                                 f"{path}. {NONFINITE_ADVICE}")
    if acc.is_main_process:
        state = {"format": CHECKPOINT_FORMAT, "step": step, "recipe": run.recipe, "fingerprint": run.fingerprint,
                 "total_steps": run.total_steps, "elapsed_s": round(run.elapsed_s(), 3),
                 "args": recorded_args(run.args),
                 "scheduler": run.scheduler.state_dict(),
                 "sparsifier": None if run.sparsifier is None else run.sparsifier.state_dict(),
                 "scaler": None if acc.scaler is None else acc.scaler.state_dict()}
        tmp = path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with writing(tmp / MODEL_FILE):  # a full disk: an error naming the file, not a bare I/O error
            if is_sharded(raw):
                save_file(model_state, str(tmp / MODEL_FILE))
            else:
                save_model(raw, str(tmp / MODEL_FILE))
        with writing(tmp / OPTIMIZER_FILE):
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        follow_umask(tmp)
        state["files"] = {}
        for name in (MODEL_FILE, OPTIMIZER_FILE):
            with writing(tmp / name):
                fsync_path(tmp / name)
            state["files"][name] = {"size": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
        try:
            state["state_sha256"] = state_digest(state)  # a flipped bit in the JSON itself is caught too
            text = json.dumps(state, indent=1)
        except TypeError as e:
            raise TypeError(f"checkpoint state of step {step} is not JSON ({e}): the LR scheduler's lambdas must be "
                            "plain functions, the sparsifier's state plain values") from e
        with writing(tmp / STATE_FILE):
            (tmp / STATE_FILE).write_text(text)
            fsync_path(tmp / STATE_FILE)
        if path.exists():  # a damaged folder of this step, or the final step written again
            _remove(path)
        tmp.rename(path)
        fsync_path(path.parent)
        if run.args.keep_checkpoints > 0:
            # The newest --keep_checkpoints of this run: the one just written and those before it.
            # Folders of later steps (left by a run resumed from an earlier checkpoint) are neither
            # counted nor removed: counting them would delete the checkpoint just written.
            older = sorted(p for p in path.parent.glob("step_*") if p.name < path.name)
            for p in older[:max(0, len(older) - (run.args.keep_checkpoints - 1))]:
                _remove(p)
    acc.wait_for_everyone()
    return path


def _remove(path: Path) -> None:
    """Delete a checkpoint folder: renamed to a temp name first, so that an interrupted delete leaves
    no half-deleted ``step_*`` folder (only a temp folder, removed at the next start)."""
    doomed = path.parent / f"{TMP_PREFIX}{path.name}-removed-{os.getpid()}"
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_partial_checkpoints(output_dir: str | Path) -> list[Path]:
    """Remove the temp folders that interrupted checkpoint writes left under ``OUTPUT_DIR/checkpoints``.

    One exception: a complete, verified write of a step whose folder is missing (a rewrite of the same
    step killed between removing the old folder and renaming the new one into place) is renamed into
    place instead. Folders of another process that still runs are its writes in progress, left alone
    (a second run into a live run's folder is refused earlier, by :func:`hold_output_dir`). Returns the
    temp folders removed."""
    root = Path(output_dir) / "checkpoints"
    removed = []
    for p in sorted(root.glob(f"{TMP_PREFIX}step_*")):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
            continue
        name = p.name[len(TMP_PREFIX):].split("-")[0]
        target = root / name
        if "-removed-" not in p.name and name[5:].isdigit() and not target.exists():
            try:
                complete = read_checkpoint(p).step == int(name[5:])
            except CheckpointError:
                complete = False
            if complete:
                p.rename(target)
                continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _absent(path: Path) -> str:
    """Why the file ``path`` of a checkpoint cannot be read: it is missing, or not a regular file."""
    if not path.exists():
        return "is missing"
    return "is not a regular file (a folder, FIFO, device or socket): the checkpoint is damaged or was edited"


def _load(path: Path, what: str, loader: Callable[[Path], Any]) -> Any:
    """``loader(path)``, with any failure (missing, truncated, refused by ``weights_only``) as a CheckpointError."""
    if not path.is_file():
        raise CheckpointError(path.parent, f"{path.name} ({what}) {_absent(path)}")
    try:
        return loader(path)
    except Exception as e:  # SafetensorError, RuntimeError (bad zip), UnpicklingError (weights_only), ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise CheckpointError(path.parent, f"{path.name} ({what}) cannot be read safely: "
                                           f"{type(e).__name__}: {first}") from e


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify one checkpoint folder; raise :class:`CheckpointError` saying what is wrong.

    Verified: the state JSON parses; every file it lists has its size and sha256; the tensors load
    without executing code (safetensors, ``torch.load(weights_only=True)``) and are finite.
    Folders written by ``accelerator.save_state`` (before format 2) are read by
    :func:`_read_accelerate_layout`.
    """
    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        if state_file.exists():
            raise CheckpointError(path, f"{STATE_FILE} {_absent(state_file)}")
        raise CheckpointError(path, f"no {STATE_FILE} (an interrupted or foreign checkpoint)")
    try:
        state = json.loads(state_file.read_text())
        step = state["step"]
    except (ValueError, TypeError, KeyError, OSError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise CheckpointError(path, f"{STATE_FILE} is empty or damaged ({type(e).__name__}: {e})") from e
    problem = state_problem(state, path)
    if problem:
        raise CheckpointError(path, f"{STATE_FILE} is damaged or was edited: {problem}")
    if "files" not in state:
        ckpt = _read_accelerate_layout(path, state)
    else:
        for name, meta in state["files"].items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(path, f"{name} {_absent(f)}")
            if f.stat().st_size != meta["size"]:
                raise CheckpointError(path, f"{name} has {f.stat().st_size} bytes, {STATE_FILE} says {meta['size']} "
                                            "(truncated)")
            if file_sha256(f) != meta["sha256"]:
                raise CheckpointError(path, f"{name} does not match its sha256 in {STATE_FILE} (modified or damaged)")
        ckpt = Checkpoint(path, step, state.get("recipe"), state.get("fingerprint"),
                          _load(path / MODEL_FILE, "model weights", _safetensors_load),
                          _load(path / OPTIMIZER_FILE, "optimizer state", _torch_load),
                          state["scheduler"], state.get("sparsifier"), state.get("scaler"),
                          total_steps=state.get("total_steps"), elapsed_s=float(state.get("elapsed_s", 0.0)),
                          args=state.get("args"))
    bad = first_nonfinite(chain(ckpt.model.items(), _optimizer_tensors(ckpt.optimizer)))
    if bad is not None:
        raise CheckpointError(path, f"{bad} holds inf or NaN")
    return ckpt


def state_digest(state: dict) -> str:
    """sha256 of ``state`` (less its own ``state_sha256``) as canonical JSON (floats round-trip exactly)."""
    rest = json.loads(json.dumps({k: v for k, v in state.items() if k != "state_sha256"}))  # as read back:
    # int keys become strings, tuples lists
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def state_problem(state: Any, path: Path) -> str | None:
    """What is wrong with the structure of a parsed ``recipe_state.json`` (None when nothing is)."""
    if not isinstance(state, dict):
        return f"expected a JSON object, got {type(state).__name__}"
    if "state_sha256" in state and state["state_sha256"] != state_digest(state):  # absent before it was added
        return "its contents do not match the sha256 recorded in it (a flipped bit, or edited)"
    step = state.get("step")
    if type(step) is not int or step < 0:
        return f"step {step!r} is not a non-negative integer"
    if path.name.startswith("step_") and path.name[5:].isdigit() and int(path.name[5:]) != step:
        return f"it says step {step}, the folder name says {int(path.name[5:])}"
    if "files" not in state:  # the accelerate layout: its own files are checked when read
        return None
    files = state["files"]
    if not isinstance(files, dict) or set(files) != {MODEL_FILE, OPTIMIZER_FILE}:
        return f"'files' must record exactly {MODEL_FILE} and {OPTIMIZER_FILE}"
    for name, meta in files.items():
        if not (isinstance(meta, dict) and type(meta.get("size")) is int and isinstance(meta.get("sha256"), str)):
            return f"'files' entry of {name} must be {{size, sha256}}"
    if not isinstance(state.get("scheduler"), dict):
        return "no LR scheduler state"
    if "args" in state and not isinstance(state["args"], dict):
        return "'args' is not a JSON object"
    for key in ("sparsifier", "scaler"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            return f"{key!r} is neither null nor a JSON object"
    elapsed = state.get("elapsed_s", 0.0)
    if type(elapsed) not in (int, float) or not math.isfinite(elapsed) or elapsed < 0:
        return f"elapsed_s {elapsed!r} is not a finite number of seconds >= 0"
    return None


def _read_accelerate_layout(path: Path, state: dict) -> Checkpoint:
    """A checkpoint of the recipes before format 2, written by ``accelerator.save_state``:
    ``model.safetensors``, ``optimizer.bin`` and the registered LR scheduler and sparsifier as
    ``custom_checkpoint_<i>.pkl`` (or ``scheduler.bin``), all read with ``torch.load(weights_only=True)``.
    ``random_states_*.pkl`` is not read: every step is re-seeded."""
    scheduler = sparsifier = None
    for f in sorted(path.glob("custom_checkpoint_*.pkl")) + sorted(path.glob("scheduler*.bin")):
        obj = _load(f, "registered state", _torch_load)
        if isinstance(obj, dict) and {"step_count", "channels", "history"} <= obj.keys():
            sparsifier = obj
        elif isinstance(obj, dict) and "base_lrs" in obj:
            scheduler = obj
        else:
            raise CheckpointError(path, f"{f.name} holds neither an LR scheduler's nor a sparsifier's state")
    if scheduler is None:
        raise CheckpointError(path, "no LR scheduler state (custom_checkpoint_*.pkl or scheduler.bin)")
    return Checkpoint(path, int(state["step"]), state.get("recipe"), state.get("fingerprint"),
                      _load(path / MODEL_FILE, "model weights", _safetensors_load),
                      _load(path / "optimizer.bin", "optimizer state", _torch_load), scheduler, sparsifier, None)


def find_checkpoint(arg: str, output_dir: str | Path) -> tuple[Checkpoint, list[str]]:
    """``--resume_from_checkpoint`` value -> ``(checkpoint, why newer folders were skipped)``.

    ``latest`` (or an output folder): the newest intact checkpoint under ``OUTPUT_DIR/checkpoints``,
    skipping damaged ones. A checkpoint folder: that one, or a :class:`CheckpointError`.
    """
    if arg != "latest":
        path = Path(arg)
        if (path / STATE_FILE).exists() or path.name.startswith("step_"):
            return read_checkpoint(path), []
        if not (path / "checkpoints").is_dir():
            raise FileNotFoundError(f"{path} is not a checkpoint of these recipes (no {STATE_FILE}); "
                                    "pass a directory like OUTPUT_DIR/checkpoints/step_00000100 or 'latest'")
        output_dir = path  # an output_dir was given
    root = Path(output_dir) / "checkpoints"
    found = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    if not found:
        raise FileNotFoundError(f"--resume_from_checkpoint {arg}: no checkpoint under {root}")
    skipped: list[str] = []
    for p in found:
        try:
            return read_checkpoint(p), skipped
        except CheckpointError as e:
            skipped.append(str(e))
    raise CheckpointError(root, "no intact checkpoint to resume from:\n  " + "\n  ".join(skipped) +
                          "\nstart again without --resume_from_checkpoint (in a fresh --output_dir)")


def resume_checkpoint(arg: str | None, output_dir: str | Path) -> tuple[Checkpoint | None, list[str]]:
    """The checkpoint that ``--resume_from_checkpoint arg`` resumes from and why newer folders were skipped
    (:func:`find_checkpoint`), or ``(None, [])``: start at step 0. ``None`` without the flag, and for ``latest``
    before the run's first checkpoint (no ``step_*`` folder under ``OUTPUT_DIR/checkpoints``: a run killed in its
    first steps or while writing its first checkpoint, started again with the same command, begins where the
    uninterrupted run began)."""
    if not arg or (arg == "latest" and not any(p.is_dir() for p in (Path(output_dir) / "checkpoints").glob("step_*"))):
        return None, []
    return find_checkpoint(arg, output_dir)


def _load_model_state(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """``load_state_dict`` that accepts tied tensors stored once (safetensors drops their aliases)."""
    own = model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded = {(own[k].data_ptr(), own[k].shape) for k in state if k in own}
    missing = [k for k in missing if (own[k].data_ptr(), own[k].shape) not in loaded]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit this model (missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}): resume with the same model and --linearize flags")


def load_checkpoint(run: Run, ckpt: Checkpoint) -> None:
    """Check that ``ckpt`` belongs to this run's model and load it into the run's objects."""
    if ckpt.recipe != run.recipe or ckpt.fingerprint != run.fingerprint:
        raise ValueError(
            f"checkpoint {ckpt.path} was written by another model ({ckpt.recipe}, fingerprint {ckpt.fingerprint}) "
            f"than this run ({run.recipe}, fingerprint {run.fingerprint}): resume with the same model, dataset "
            "and --linearize flags (and --channels-last where the recipe has it), or start a fresh --output_dir")
    if ckpt.total_steps is not None and run.total_steps is not None and ckpt.total_steps != run.total_steps:
        raise ValueError(
            f"checkpoint {ckpt.path} belongs to a run of {ckpt.total_steps} optimizer steps, this one has "
            f"{run.total_steps}: the LR and sparsity schedules span the run, so resume with the same --epochs and "
            "--max-steps (to stop early and resume later, use --stop-after)")
    check_args(ckpt, run.args)  # before the sparsifier's: a changed flag (--one-shot, say) is named
    if (ckpt.sparsifier is None) != (run.sparsifier is None):
        has = "no" if ckpt.sparsifier is None else "a"
        raise ValueError(f"checkpoint {ckpt.path} has {has} sparsifier state but this run "
                         f"{'uses' if run.sparsifier is not None else 'has no'} sparsity pressure: resume with the "
                         "same --linearize/--schedule flags")
    raw = run.accelerator.unwrap_model(run.model)
    if is_sharded(raw):  # --fsdp: every process takes its shards of the whole state
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(raw, run.optimizer.optimizer, model_state_dict=ckpt.model, optim_state_dict=ckpt.optimizer,
                       options=state_dict_options())
    else:
        _load_model_state(raw, ckpt.model, ckpt.path)
        run.optimizer.load_state_dict(ckpt.optimizer)
    run.scheduler.load_state_dict(ckpt.scheduler)
    if run.sparsifier is not None:
        run.sparsifier.load_state_dict(ckpt.sparsifier)
    if run.accelerator.scaler is not None and ckpt.scaler:
        run.accelerator.scaler.load_state_dict(ckpt.scaler)
    run.earlier_s = ckpt.elapsed_s
