"""The processes and devices of a run: the ``Accelerator`` (TensorBoard tracking under ``output_dir``) and,
under ``--fsdp``, the model sharded across the processes with FSDP2 and gathered back whole."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from linearize import distributed as sharding

from .files import hold_output_dir

if TYPE_CHECKING:
    from accelerate import Accelerator


def has_device() -> bool:
    """Whether an accelerator device (CUDA, MPS, XPU) is present. Without one, ``Accelerator(cpu=False)`` under
    torchrun gives N independent rank-0 processes (accelerate 1.x); ``cpu=True`` gives real DDP over gloo."""
    return torch.cuda.is_available() or torch.backends.mps.is_available() or (
        hasattr(torch, "xpu") and torch.xpu.is_available())


def make_accelerator(args: argparse.Namespace, split_batches: bool) -> "Accelerator":
    """``Accelerator`` with TensorBoard under ``output_dir`` when ``--with_tracking``; its main process takes
    the run lock of ``output_dir`` (:func:`hold_output_dir`: a second run into the folder is refused; the
    recipe releases it at its end with :func:`release_output_dir`)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    kwargs = {}
    if args.mixed_precision is not None:
        kwargs["mixed_precision"] = args.mixed_precision
    accelerator = Accelerator(
        cpu=args.cpu or not has_device(),
        log_with="tensorboard" if args.with_tracking else None,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=str(Path(args.output_dir) / "logs")),
        dataloader_config=DataLoaderConfiguration(split_batches=split_batches),
        **kwargs,
    )
    if accelerator.is_main_process:
        hold_output_dir(args.output_dir)
    return accelerator


def init_tracking(accelerator, args: argparse.Namespace, name: str) -> None:
    """Start TensorBoard tracking (hyper-parameters as scalars and strings only)."""
    if args.with_tracking:
        config = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items()}
        accelerator.init_trackers(name, config=config)


# Accelerate 1.15 runs FSDP only on accelerator devices (on a CPU an FSDP config gives independent single
# processes, or DDP with cpu=True), so under --fsdp the recipes shard the model themselves with
# torch.distributed.fsdp.fully_shard and let the Accelerator (DDP type, gloo or NCCL) handle the processes,
# the data and the optimizer only. Checkpoints hold the whole model and optimizer state, gathered onto the
# main process; evaluation and the final saves use the whole model, gathered onto every process.

FSDP_HELP = ("shard the model across the processes with FSDP2 (torch.distributed.fsdp.fully_shard: each block, "
             "then the rest); launch with torchrun --nproc_per_node N (gloo on a CPU, NCCL on GPUs), "
             "docs/distributed.md")


def check_fsdp(accelerator: "Accelerator", args: argparse.Namespace) -> None:
    """Refuse, with the fix, an Accelerate FSDP launch (``--use_fsdp`` or an FSDP config: on GPUs Accelerate
    would shard the model itself, which the recipes' checkpoints do not read; on a CPU it silently trains DDP),
    ``--fsdp`` on one process, and
    ``--fsdp`` with ``--select fit`` or ``--linear-end affine`` (affine fits of every unit's inputs, kept
    on the whole model: not on a sharded one)."""
    if accelerator.distributed_type == "FSDP" or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise ValueError("this run was launched with Accelerate's FSDP (accelerate launch --use_fsdp or an FSDP "
                         "config), which the recipes do not use: launch with torchrun --nproc_per_node N (or "
                         "accelerate launch --multi_gpu --num_processes N) and add --fsdp: the recipe then shards "
                         "the model itself with fully_shard")
    if args.fsdp and accelerator.num_processes < 2:
        raise ValueError("--fsdp shards the model across processes, but this run has one process: launch it with "
                         "torchrun --nproc_per_node N (N >= 2; gloo on a CPU, NCCL on GPUs), or drop --fsdp")
    fits = [f for f, on in (("--select fit", getattr(args, "select", None) == "fit"),
                            ("--linear-end affine", getattr(args, "linear_end", None) == "affine")) if on]
    if args.fsdp and fits:
        raise ValueError(f"{fits[0]} tracks affine fits of the units' inputs on the whole model, which --fsdp "
                         "shards: drop --fsdp (DDP: the whole model on every process), or use --select saliency or slope "
                         "with --linear-end identity")


def shard(model: nn.Module, blocks: Iterable[nn.Module], device: torch.device) -> None:
    """FSDP2 over all processes: ``fully_shard`` each of ``blocks`` (a group gathered for its forward), then
    the root (embeddings, head, what is left). After :func:`linearize.convert`, before the optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds parameters sharded by FSDP2 (``--fsdp``)."""
    return any(sharding.is_sharded(p) for p in model.parameters())


def state_dict_options(**kwargs):
    """``StateDictOptions(full_state_dict=True, **kwargs)``: the whole state of a sharded model (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gathered(model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """The whole of the sharded ``model`` on every process (a collective): ``build()`` makes the same model
    unsharded (converted alike), which gets the gathered weights, units included, on ``model``'s device."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=state_dict_options())
    plain = build().to(sharding.local(next(model.parameters())).device)
    plain.load_state_dict(state)
    return plain


def prepare(accelerator: "Accelerator", model: nn.Module, *others: Any) -> tuple:
    """``accelerator.prepare(model, *others)`` (the optimizer, data loaders); a model sharded by :func:`shard`
    is returned as it is (preparing it would wrap it in DDP)."""
    if not is_sharded(model):
        return accelerator.prepare(model, *others)
    prepared = accelerator.prepare(*others)
    return (model, *(prepared if len(others) > 1 else (prepared,)))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a Hugging Face model to shard one by one: its modules of the classes its
    ``_no_split_modules`` names (its layers), as Accelerate's ``TRANSFORMER_BASED_WRAP`` picks them."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]
