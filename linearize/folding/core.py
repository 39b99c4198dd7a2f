"""The fold driver: copy the model, run the probe forward, walk the copy bottom-up asking the fold
rules (:mod:`.rules`) at every module, make the remaining units plain, and verify (:mod:`.verify`)."""

from __future__ import annotations

import copy
import functools
import math
import warnings
from dataclasses import replace
from typing import Any, Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..checks import check_positive, check_tol
from ..dispatch import compiled_submodules, detach_owner
from ..distributed import refuse_sharded
from ..functional_sites import FunctionalSites
from ..injection import CallSites, settle_placed_modules
from ..hf import mark_folded
from ..inputs import describe_inputs, eval_mode, float_outputs, inputs_fit, is_empty_batch
from ..unit import ElementBlend, ElementPReLU, LinearizableActivation, check_finite_slopes, gated_error, units
from .flops import FlopCounterError
from .layers import ORIGIN, set_path
from .modules import plain_unit
from .probe import Probe, run_counting
from .rules import FoldContext, FoldRuleLike, Objective, check_rules, fold_rules, is_builtin
from .summary import FoldSummary
from ..timing import median_latency_ms
from .verify import check_reference, merged_hooks, untouched_layers, verify_fold

__all__ = ["fold", "fold_in_place"]


def _visit(module: nn.Module, ctx: FoldContext, rules: list[FoldRuleLike]) -> nn.Module:
    """Fold ``module``'s children, then ask ``rules`` in order for ``module`` itself (see :mod:`.rules`)."""
    for child_name, child in list(module.named_children()):
        new = _visit(child, ctx.at(ctx.site(child_name)), rules)
        if new is not child:
            setattr(module, child_name, new)
    for rule in rules:
        if not rule.matches(module, ctx):
            continue
        reported, merged = len(ctx.summary.skipped), len(ctx.summary.merged)
        new = rule.apply(module, replace(ctx, rule=rule.name))
        if new is None:
            if len(ctx.summary.skipped) == reported and not is_builtin(rule):  # built-ins say why themselves
                ctx.skipped(f"fold rule {rule.name!r} matched {type(module).__name__} but declined; left as is")
            continue
        if not isinstance(new, nn.Module):
            raise TypeError(
                f"fold rule {rule.name!r} returned {type(new).__name__} for {ctx.name or 'the model'}: "
                "apply must return an nn.Module (the replacement) or None (decline)"
            )
        if new is not module and len(ctx.summary.merged) == merged and not is_builtin(rule):
            ctx.merged(f"fold rule {rule.name!r} replaced {type(module).__name__} by {type(new).__name__}")
        if new is not module and id(new) not in ctx.probe.calls:
            ctx.probe.register(new, like=module)  # later rules see it as the layer it replaced
        return new
    return module


def _replace_units(model: nn.Module, tol: float, summary: FoldSummary) -> nn.Module:
    """Swap every remaining unit for its plain module; collapse per-call dispatchers.

    A ``CallSites`` dispatcher (one unit per call of a reused activation) whose calls all
    became the same stateless module (e.g. all ``nn.ReLU``) is replaced by that module, and its
    owner's dispatch hooks are removed; otherwise it stays, holding plain modules only.
    """
    for name, unit in [(n, m) for n, m in model.named_modules() if isinstance(m, LinearizableActivation)]:
        plain = plain_unit(unit, tol)
        if name == "":
            return plain
        set_path(model, name, plain)
        what = "identity (fully linear)" if isinstance(plain, nn.Identity) else type(plain).__name__
        summary.merged.append(f"{name}: unit replaced by {what}")
        if unit.granularity == "element" and isinstance(plain, (ElementPReLU, ElementBlend)):
            linear = int(unit.linear_mask(tol).sum())
            summary.skipped.append(
                f"{name}: element-level unit kept as {what} ({linear} of {unit.num_channels} positions linear): a "
                "slope per position cannot merge into the neighbouring layers; only a site whose positions are all "
                "linear folds")
    for name, m in list(model.named_modules()):
        if name and isinstance(m, CallSites):
            first = m.calls[0]
            stateless = all(
                type(c) is type(first) and repr(c) == repr(first) and not list(c.parameters()) and not list(c.buffers())
                for c in m.calls
            )
            if stateless:
                set_path(model, name, first)
    for m in model.modules():
        if not any(isinstance(c, (CallSites, FunctionalSites)) for c in m.children()):
            detach_owner(m)
    return model



def fold(
    model: nn.Module,
    example_inputs: Any,
    objective: str | Objective = "flops",
    tol: float = 0.0,
    atol: float | None = None,
    rtol: float = 1e-4,
    dtype: torch.dtype | None = None,
    latency: bool = True,
    rules: Iterable[FoldRuleLike] | None = None,
    merge_latency: bool = False,
    verify: bool = True,
) -> nn.Module:
    """Return a new plain PyTorch model computing ``model``'s function with linear parts folded.

    Args:
        model: a (linearized) model in eval mode; never modified.
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs, as
            the model's forward takes them (a small real batch); used to record shapes, count
            FLOPs, time both models and verify the result.
        objective: an :class:`~linearize.folding.rules.Objective` or its name: ``"flops"`` merges
            only where FLOPs drop; ``"depth"`` minimizes the number of sequential layers (FLOPs
            break ties), and also merges two zero-padded convs (e.g. a BasicBlock body) into a
            :class:`BorderExactConv`, unless the map is so small that its border correction would
            cost as much as the two convs; ``"params"`` minimizes parameters (FLOPs break ties).
        tol: in ``[0, 1)``: channels with slope ``a >= 1 - tol`` count as linear, the others with
            ``a <= tol`` as the plain activation (0 keeps the function exact; larger values
            approximate, and the verification tells by how much).
        atol: absolute tolerance of the verification (finite, > 0); default ``rtol * max|reference output|``.
        rtol: relative tolerance (finite, > 0; to the output scale) used when ``atol`` is ``None``.
        dtype: verify in this dtype instead (e.g. ``torch.float64``: copies of both models
            and the inputs are cast, so activation rounding does not blur the comparison; the
            folded weights keep the rounding of the model's own dtype); ``None`` verifies in the
            model's dtype. A refusal names the model's own distance from its float64 output there:
            a badly conditioned float32 model may not meet ``rtol`` by itself; ``dtype=torch.float64``
            then verifies the fold's algebra (not how its merged layers round in the model's dtype).
            A bfloat16 / float16 fold's merged weights round by about the dtype's eps in any
            verification dtype: its refusal names the ``rtol`` (twice the model's own rounding) that
            accepts rounding of that size.
        latency: measure CPU latency before and after (median of interleaved repetitions).
        rules: the fold rules for this call, in order (``None``: the registered ones,
            :func:`~linearize.folding.rules.fold_rules`; see :func:`linearize.register_fold_rule`).
        merge_latency: also time every merge the objective chose (its pieces against the merged
            layer, batch 1, one thread, about 0.2 s each) and keep it only where the merged layer is
            faster; ``summary.merges`` lists every merge with its rule, FLOPs and latency before / after.
        verify: compare the folded model with ``model`` on ``example_inputs`` (the default). ``False``
            skips it, for estimates of the folded structure alone (its FLOPs or latency, e.g. a cost
            target's planning on copies of a model whose own fold is verified later);
            ``summary.max_abs_error`` is then NaN and ``summary.verify_dtype`` says "not verified".

    Returns:
        The folded model (eval mode) with ``folded.linearize_fold_summary`` (:class:`FoldSummary`).

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> small = linearize.fold(net.eval(), torch.randn(16, 4), latency=False)
        >>> small.linearize_fold_summary.flops_after <= small.linearize_fold_summary.flops_before
        True

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a rule in ``rules`` lacks ``name`` /
            ``matches`` / ``apply`` (or its ``apply`` returned something that is not a module).
        ValueError: a gated (DGN / DLGN) network, a model holding TorchScript modules, bad ``objective`` / ``tol`` / ``rtol`` / ``atol``,
            BatchNorm in training mode, ``example_inputs`` that the model cannot run, an empty batch,
            or NaN/inf outputs of the model itself (:class:`~linearize.unit.NonFiniteSlopeError` for NaN/inf slopes).
        FlopCounterError: fold's own FLOP counter / probe failed on an op the model ran (a bug to report).
        FoldVerificationError: the folded model differs by more than the tolerance (at the output,
            or at the verified inner signal when the output is zero or the same for every sample;
            see ``FoldSummary.verified_on``), or no signal that varies can be verified.
    """
    return _fold(model, example_inputs, objective, tol, atol, rtol, dtype, latency, rules, merge_latency, verify)


def fold_in_place(model: nn.Module, example_inputs: Any, count_flops: bool = True) -> nn.Module:
    """``fold(model, example_inputs, latency=False, verify=False)`` that folds ``model`` itself, not a copy: for
    a throwaway copy whose folded structure alone is measured (a cost target's planning). ``model`` is taken
    apart: use only the result. ``count_flops=False`` does not run the folded model, for a caller that times
    it instead (``summary.flops_after`` stays 0: not counted)."""
    return _fold(model, example_inputs, latency=False, verify=False, in_place=True, count_flops=count_flops)


def _fold(model: nn.Module, example_inputs: Any, objective: str | Objective = "flops", tol: float = 0.0,
          atol: float | None = None, rtol: float = 1e-4, dtype: torch.dtype | None = None, latency: bool = True,
          rules: Iterable[FoldRuleLike] | None = None, merge_latency: bool = False, verify: bool = True,
          in_place: bool = False, count_flops: bool = True) -> nn.Module:
    """:func:`fold`, of ``model`` itself with ``in_place`` (only unverified and untimed), not counting the folded
    model's FLOPs without ``count_flops`` (nor ``verify``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold expects an nn.Module, got {type(model).__name__}")
    refuse_sharded(model, "fold")  # FSDP2: gather first (the error names how)
    gated = gated_error(model, "fold")  # a gate is a product of two networks' signals: no linear part to fold
    if gated is not None:
        raise gated
    objective = Objective.of(objective)
    rules = fold_rules() if rules is None else check_rules(rules)
    tol = check_tol(tol)
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {verify!r}")
    rtol = check_positive(rtol, "rtol")
    atol = None if atol is None else check_positive(atol, "atol")
    training_bn = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if training_bn:
        raise ValueError(
            f"fold needs BatchNorm eval statistics, but {training_bn[0]!r} (and {len(training_bn) - 1} "
            "more) is in training mode: call model.eval() before linearize.fold"
        )
    if example_inputs is None:
        raise ValueError("fold needs example_inputs (a batch shaped like the model's real inputs)")
    if is_empty_batch(example_inputs):
        raise ValueError(
            f"example_inputs {describe_inputs(example_inputs)} is an empty batch: fold verifies the "
            "folded model on it, so pass at least one sample"
        )
    check_finite_slopes(units(model), "fold")
    compiled = compiled_submodules(model)
    if compiled:
        raise ValueError(
            f"fold cannot look inside the TorchScript module(s) {', '.join(repr(n or '<root>') for n in compiled)}: "
            "their code runs compiled, so their activations are unseen and their layers cannot be merged or "
            "verified. Fix: fold the Python model (before torch.jit.script / trace), then script the folded one")

    summary = FoldSummary(objective=objective.name, tol=tol)
    folded = model.eval() if in_place else copy.deepcopy(model).eval()
    for path, module in folded.named_modules():  # where each module was: save_folded finds moved ones in the base
        module.__dict__.setdefault(ORIGIN, path)
    probe = Probe(keep=list(folded.modules()))
    before_fold = dict(folded.named_modules())  # path -> layer, to find the layers fold left alone
    with inputs_fit(example_inputs):  # the untouched eval copy gives the reference output, shapes and FLOPs
        summary.flops_before, reference = run_counting(folded, example_inputs, probe)
    ref_out = float_outputs(reference)
    if not ref_out:
        raise ValueError("the model returned no floating-point tensor to verify against")
    check_reference(ref_out, example_inputs)
    summary.units_before = sum(isinstance(m, LinearizableActivation) for m in folded.modules())
    summary.params_before = sum(p.numel() for p in model.parameters())
    if summary.units_before == 0:
        msg = "the model has no linearize units (never converted): folded BatchNorm only"
        summary.skipped.append(msg)
        warnings.warn(msg + "; call linearize.convert(model) and train it to fold more", stacklevel=3)

    folded = _visit(folded, FoldContext(objective, tol, probe, summary, time_merges=merge_latency), rules)
    folded = _replace_units(folded, tol, summary)
    settle_placed_modules(folded)  # a ChannelPReLU where an encoder layer's fast path would run relu
    summary.skipped = list(dict.fromkeys(summary.skipped))
    folded.eval()
    for attr in ("linearize_config", "linearize_report"):  # the result has no units
        folded.__dict__.pop(attr, None)
    mark_folded(folded)  # no manifest (no units); a plain reload of its HF saves fails with the fix
    summary.units_left = sum(isinstance(m, LinearizableActivation) for m in folded.modules())
    summary.params_after = sum(p.numel() for p in folded.parameters())
    if count_flops or verify:
        summary.flops_after, output = run_counting(folded, example_inputs)

    untouched = functools.partial(untouched_layers, model, folded, before_fold, probe)
    if verify:
        verify_fold(model, folded, example_inputs, ref_out, float_outputs(output), summary, atol, rtol, dtype, untouched,
                    functools.partial(merged_hooks, before_fold, folded))
    else:
        summary.max_abs_error, summary.verify_dtype = math.nan, "not verified (verify=False)"
    if latency:
        with eval_mode(model):
            summary.latency_ms_before, summary.latency_ms_after = median_latency_ms([model, folded], example_inputs)
    folded.linearize_fold_summary = summary
    return folded

