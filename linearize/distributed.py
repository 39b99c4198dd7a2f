"""Slopes sharded across processes: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 replaces each parameter by a ``DTensor`` of which every rank holds one shard (dim 0 split
in rank order). The units' slopes are ``[C]`` parameters, so outside the forward pass a unit holds
only ``C / world`` of its slopes, while its ``frozen`` buffer stays whole on every rank.
Everything linearize decides from slopes (counts, the target's choice of channels, saliency,
freeze) reads their **global** value (:func:`full_value`: an all-gather every rank takes part
in, in the same order, so every rank takes the same decision) and writes the result back as
each rank's own shard (:func:`write_full`); elementwise updates (clamping) act on the local
shard alone (:func:`local`, :func:`shard_of`). Plain tensors pass through all of them
unchanged, so single-process and DDP code pays one ``isinstance`` check.

What stays refused, with the fix (:func:`refuse_unsupported`): FSDP1
(``FullyShardedDataParallel``, flat parameters that split a unit's slopes at arbitrary
offsets) and DeepSpeed ZeRO-3 (partitioned parameters). Folding and saving a sharded model
directly are refused too (:func:`refuse_sharded`): :func:`full_copy` gathers it first.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

__all__ = ["is_sharded", "full_value", "local", "shard_of", "write_full", "global_min", "refuse_sharded", "full_copy",
           "fsdp2_modules", "refuse_unsupported", "GATHER_FIX"]

GATHER_FIX = (
    "every rank calls plain = linearize.distributed.full_copy(model) (a collective: it gathers the weights into "
    "a copy that no process shares), then one rank uses plain (if rank == 0: ...); a model too large for each "
    "process's memory: gather a full state dict with cpu_offload=True and load it on rank 0 (docs/distributed.md)")


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter of a model sharded by FSDP2). Imports nothing: a DTensor
    exists only once ``torch.distributed.tensor`` is imported (seconds that a single process need not spend)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The global value of ``t``: a ``DTensor``'s ``full_tensor()`` (a collective: every rank must call it,
    in the same order), any other tensor itself. Differentiable.

    Example:
        >>> full_value(torch.ones(3))   # a plain tensor is its own full value
        tensor([1., 1., 1.])
    """
    return t.full_tensor() if is_sharded(t) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a ``DTensor``'s local shard (a view: writing into it writes the
    shard), any other tensor itself."""
    return t.to_local() if is_sharded(t) else t


def shard_of(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of the global ``value`` that this rank's shard of ``like`` holds (no communication):
    ``value`` itself when ``like`` is not sharded.

    Example:
        >>> shard_of(torch.arange(4), torch.zeros(4))
        tensor([0, 1, 2, 3])
    """
    if not is_sharded(like):
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(local(like).device)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None).to_local()


@torch.no_grad()
def write_full(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write the global ``value`` into ``param``: into this rank's shard of a ``DTensor``, else all of it.

    Example:
        >>> p = torch.zeros(3); write_full(p, torch.tensor([1.0, 2.0, 3.0])); p
        tensor([1., 2., 3.])
    """
    local(param).copy_(shard_of(value, param))


def global_min(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The elementwise minimum of ``t`` over the ranks that shard ``like`` (a collective), ``t`` itself when
    ``like`` is not sharded: what each rank measured on its own data, made one value every rank agrees on.

    Example:
        >>> global_min(torch.tensor([1.0, -2.0]), torch.zeros(2))
        tensor([ 1., -2.])
    """
    if not is_sharded(like):
        return t
    out = t.to(local(like).device).clone()
    for dim in range(like.device_mesh.ndim):
        torch.distributed.all_reduce(out, torch.distributed.ReduceOp.MIN, group=like.device_mesh.get_group(dim))
    return out.to(t.device)


def full_copy(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """A deep copy of ``model`` that no process shares: every FSDP2 ``DTensor`` parameter becomes a plain
    parameter holding its global value (a collective: every rank calls it, at the same point), and FSDP's
    wrapper classes, hooks and per-module state are left out. A model without FSDP2 modules is simply
    ``copy.deepcopy``-ed. The copy runs (and folds, and saves) on this process alone.

    FSDP2 modules are resharded first (``reshard()``: after a forward without backward, or with
    ``reshard_after_forward=False``, they hold unsharded compute copies, in the mixed-precision
    ``param_dtype`` if one is set), so the copy always holds the sharded master weights.
    ``device``: where the copy lives (each parameter is gathered and moved there one at a time, so
    ``"cpu"`` never holds the whole model on an accelerator); ``None`` keeps the model's devices.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> c = full_copy(m); c[0].weight is m[0].weight, torch.equal(c[0].weight, m[0].weight)
        (False, True)
    """
    refuse_unsupported(model, [])  # FSDP1: flat parameters, no copy of the model's own layout
    classes = {m: type(m) for m in fsdp2_modules(model)}
    if not classes:
        out = copy.deepcopy(model)
        return out if device is None else out.to(device)
    for m in classes:
        m.reshard()  # the sharded master parameters registered again (no communication)
    sharded = [p for p in model.parameters() if is_sharded(p)]
    memo: dict[int, object] = {
        id(p): nn.Parameter(_moved(full_value(p.detach()), device).clone(), requires_grad=p.requires_grad)
        for p in sharded}  # (in model.parameters() order: the same on every rank)
    drop = object()  # what FSDP's hooks and state become in the copy, then removed
    for m in model.modules():
        for key, value in vars(m).items():
            if key.startswith(_STATE_KEY):  # fully_shard's state and registry (torch's composable API)
                memo[id(value)] = drop
            elif key.endswith("hooks") and isinstance(value, dict):
                memo.update((id(h), drop) for h in value.values() if _is_fsdp(getattr(h, "hook", h)))
    try:
        for m, cls in classes.items():  # FSDP's class refuses deepcopy: copy as the module's own class
            m.__class__ = next(c for c in cls.__mro__ if not _is_fsdp(c))
        out = copy.deepcopy(model, memo)
    finally:
        for m, cls in classes.items():
            m.__class__ = cls
    for m in out.modules():
        for key, value in list(vars(m).items()):
            if value is drop:
                delattr(m, key)
            elif key.endswith("hooks") and isinstance(value, dict):
                for k in [k for k, h in value.items() if h is drop]:
                    del value[k]
    return out if device is None else out.to(device)


def _moved(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return t if device is None else t.to(device)


_STATE_KEY = "__composable_api_state_key"  # the prefix of the keys under which fully_shard keeps its state


def _is_fsdp(obj: object) -> bool:
    """Whether ``obj`` (a class or a hook function) comes from ``torch.distributed.fsdp``."""
    return (getattr(obj, "__module__", None) or "").startswith("torch.distributed.fsdp")


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` wrapped (their class derives from ``FSDPModule``)."""
    return [m for m in model.modules() if any(c.__name__ == "FSDPModule" and _is_fsdp(c) for c in type(m).__mro__)]


def refuse_sharded(model: nn.Module, what: str) -> None:
    """``ValueError`` naming the fix when ``model`` holds sharded (FSDP2) parameters, for ``what`` (a function
    that needs the whole model on one process: fold, save_pretrained, save_folded)."""
    if fsdp2_modules(model) or any(is_sharded(p) for p in model.parameters()):
        raise ValueError(f"{what} needs the whole model on one process, but its parameters are sharded across "
                         f"processes (FSDP2 fully_shard: DTensor parameters). Fix: {GATHER_FIX}")


def refuse_unsupported(model: nn.Module, slopes: list[torch.Tensor]) -> None:
    """``TypeError`` naming the fix when ``model`` is sharded in a way linearize cannot read slopes from:
    FSDP1 ``FullyShardedDataParallel`` (flat parameters) or DeepSpeed ZeRO-3 (partitioned ``slopes``)."""
    fsdp1 = next((n for n, m in model.named_modules() if any(
        c.__name__ == "FullyShardedDataParallel" and c.__module__.startswith("torch.distributed.fsdp")
        for c in type(m).__mro__)), None)
    if fsdp1 is not None:
        raise TypeError(
            f"module {fsdp1 or '<root>'!r} is wrapped by FSDP1 (FullyShardedDataParallel), whose flat parameters "
            "split the unit slopes at arbitrary offsets: linearize supports FSDP2. Fix: shard with "
            "torch.distributed.fsdp.fully_shard(module) instead (Accelerate: fsdp_version: 2 in the FSDP config; "
            "the Trainer: TrainingArguments(fsdp=..., fsdp_config={'fsdp_version': 2}); see docs/distributed.md), "
            "or use DDP")
    if any(hasattr(s, "ds_id") for s in slopes):
        raise TypeError(
            "the unit slopes are partitioned by DeepSpeed ZeRO-3, which linearize cannot read or write: use ZeRO "
            "stage 1 or 2 (slopes whole on every rank), or FSDP2 (torch.distributed.fsdp.fully_shard; Accelerate: "
            "docs/distributed.md)")
