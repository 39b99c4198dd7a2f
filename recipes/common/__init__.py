"""Plumbing shared by the Accelerate recipes (``recipes/cifar.py``, ``recipes/wmt14.py``); the calls of
linearize itself (convert, Sparsifier, freeze, fold, report) are in the recipes.

- argument groups: linearization flags (checked, defaults filled in) and run flags (output, checkpoints,
  tracking);
- the ``Accelerator`` and the training loop (:func:`train`), which checks every step's loss for inf/NaN;
- checkpoints written by the recipes themselves (safetensors, ``torch.load(weights_only=True)`` and
  JSON, so that loading one executes no code), atomically, verified by size and sha256 before use,
  with a fingerprint of the model so a checkpoint directory of another model is refused;
- per-step seeding, so that augmentation and dropout depend only on (seed, step, process),
  which makes a resumed run repeat the uninterrupted one;
- ``metrics.json`` writing (final metrics, unit counts, fold summary, command, versions, wall time).

Everything here is plain Python around ``accelerate.Accelerator``; the recipes stay runnable with
``python recipes/x.py`` (one process) and ``accelerate launch recipes/x.py`` (N processes); with
``--fsdp`` (``recipes/wmt14.py``, ``recipes/distill.py``) :func:`shard` shards the model across the
processes with FSDP2 and the checkpoints gather it onto the main process.

The modules, one concept each (this package re-exports the names the recipes and their tests use):
``args`` (flags and their checks), ``accelerator`` (the Accelerator, whose main process locks the
OUTPUT_DIR; FSDP2 sharding), ``run`` (the :class:`Run` record), ``files`` (sha256 of a file; folders replaced
whole; a failed write named; the run lock of an OUTPUT_DIR), ``checkpoints`` (write, verify, resume), ``outputs`` (the model
folder's ``recipe.json``; ``metrics.json``; the channels a ``--prune`` run kept) and ``training`` (the loop).
Imports go one way: ``training`` -> ``checkpoints``, ``outputs`` -> ``args``, ``accelerator``, ``run``,
``files``.
"""

from __future__ import annotations

from .accelerator import FSDP_HELP, blocks, check_fsdp, gathered, has_device, make_accelerator, prepare, shard
from .args import (LINEARIZE_MODES, PRESSURE_FLAGS, add_linearize_args, add_run_args, check_linearize_args,
                   check_run_args, flag, schedule_start)
from .checkpoints import (MODEL_FILE, NEUTRAL_ARGS, OPTIMIZER_FILE, STATE_FILE, Checkpoint, CheckpointError,
                          check_args, checkpoint_dir, find_checkpoint, first_nonfinite, json_value, load_checkpoint,
                          model_fingerprint, read_checkpoint, remove_partial_checkpoints, resume_checkpoint,
                          save_checkpoint, state_digest, state_problem, state_sha256)
from .files import (RUN_LOCK, TMP_PREFIX, file_sha256, hold_output_dir, release_output_dir, replaced_dir,
                    restore_aside, writing)
from .outputs import (KEPT_FILE, PRUNE_IMPORTANCES, check_files, file_records, fold_metrics, read_kept, read_record,
                      read_recipe_json, remove_earlier_outputs, unit_stats, write_kept, write_metrics)
from .run import Run
from .training import EpochSampler, LossWatch, run_length, start, train

__all__ = [
    "FSDP_HELP", "blocks", "check_fsdp", "gathered", "has_device", "make_accelerator", "prepare", "shard",
    "LINEARIZE_MODES", "PRESSURE_FLAGS", "add_linearize_args", "add_run_args", "check_linearize_args",
    "check_run_args", "flag", "schedule_start",
    "MODEL_FILE", "NEUTRAL_ARGS", "OPTIMIZER_FILE", "STATE_FILE", "Checkpoint", "CheckpointError", "check_args",
    "checkpoint_dir", "find_checkpoint", "first_nonfinite", "json_value", "load_checkpoint", "model_fingerprint",
    "read_checkpoint", "remove_partial_checkpoints", "resume_checkpoint", "save_checkpoint", "state_digest",
    "state_problem",
    "state_sha256",
    "RUN_LOCK", "TMP_PREFIX", "file_sha256", "hold_output_dir", "release_output_dir", "replaced_dir", "restore_aside",
    "writing",
    "KEPT_FILE", "PRUNE_IMPORTANCES", "check_files", "file_records", "fold_metrics", "read_kept", "read_record",
    "read_recipe_json", "remove_earlier_outputs", "unit_stats", "write_kept", "write_metrics",
    "Run",
    "EpochSampler", "LossWatch", "run_length", "start", "train",
]
