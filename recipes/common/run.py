"""The record of a training run (:class:`Run`): the objects a checkpoint saves and restores, the run's
identity and its wall time; and the advice given when the run's numbers become inf or NaN."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

import linearize

if TYPE_CHECKING:
    from accelerate import Accelerator


@dataclass
class Run:
    """The objects of a training run that a checkpoint saves and restores, and the run's identity.

    ``model`` and ``optimizer`` as returned by ``accelerator.prepare``; ``scheduler`` steps once per
    optimizer step; ``sparsifier`` is ``None`` without sparsity pressure; ``fingerprint`` identifies
    the model (and whatever else must match on resume), ``recipe`` the script.
    """

    accelerator: Accelerator
    args: argparse.Namespace
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sparsifier: linearize.Sparsifier | None
    out_dir: Path
    fingerprint: str
    recipe: str
    total_steps: int | None = None  # the run's length (set by :func:`start`); must match on resume
    started: float = field(default_factory=time.time)  # when this process began the run
    earlier_s: float = 0.0  # wall time of the earlier processes up to the checkpoint resumed from

    def elapsed_s(self) -> float:
        """Wall time of the run so far: earlier processes up to the checkpoint it resumed from (time
        after their last checkpoint, redone here, is not counted twice) plus this process's."""
        return self.earlier_s + max(0.0, time.time() - self.started)  # a wall clock stepped back counts 0


NONFINITE_ADVICE = ("Lower --lr (or add warm-up or gradient clipping) and start again in a fresh --output_dir: "
                    "resuming from a checkpoint with the same flags repeats the same steps exactly")
