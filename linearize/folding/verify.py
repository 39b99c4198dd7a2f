"""fold's self-check: the folded model must reproduce the model's outputs on ``example_inputs``
within ``rtol * max|output|`` (or ``atol``). When that check is vacuous (the output is zero, or the same
for every sample although the samples differ: a zero-initialised head), the input of the last layer
that fold left untouched and that does vary (the features before the head) is verified too.

A model whose own rounding in its dtype is as large as the tolerance cannot be held to it. Where the
check in the model's dtype fails, fold measures how far each model is there from the model's float64
function: if the folded model is no further off than the model itself, plus the tolerance, rounding
explains the failure and both models are verified again in float64 (the folded weights keep their
rounding; in bfloat16 / float16 that rounding is ~1e-3, so there the bound itself is the check).
``summary.verify_dtype`` then names both checks; otherwise the refusal names both distances."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from ..checks import FoldVerificationError
from ..inputs import call_model, float_outputs, map_tensors, max_difference
from .probe import Probe
from .summary import FoldSummary

def _is_empty_batch(inputs: Any) -> bool:
    """Whether a tensor of ``inputs`` has no rows (batch dim 0)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.ndim > 0 and inputs.shape[0] == 0
    if isinstance(inputs, dict):
        return any(_is_empty_batch(v) for v in inputs.values())
    if isinstance(inputs, (tuple, list)):
        return any(_is_empty_batch(v) for v in inputs)
    return False


def _check_reference(ref_out: list[torch.Tensor], inputs: Any) -> None:
    """The model's own outputs must be non-empty and finite, or no tolerance can verify a fold."""
    if any(t.numel() == 0 for t in ref_out):
        raise ValueError(
            f"the model's output on example_inputs {_describe_inputs(inputs)} is empty: pass at least one sample"
        )
    if not all(bool(torch.isfinite(t).all()) for t in ref_out):
        raise ValueError(
            f"the model's own output on example_inputs {_describe_inputs(inputs)} has NaN/inf values: fold "
            "cannot verify against it (no tolerance helps); check the model's weights and the inputs"
        )


def _describe_inputs(inputs: Any) -> str:
    if isinstance(inputs, torch.Tensor):
        return f"Tensor{tuple(inputs.shape)}"
    if isinstance(inputs, dict):
        return "{" + ", ".join(f"{k}: {_describe_inputs(v)}" for k, v in inputs.items()) + "}"
    if isinstance(inputs, (tuple, list)):
        return "(" + ", ".join(_describe_inputs(v) for v in inputs) + ")"
    return type(inputs).__name__



class _WithinRounding(Exception):
    """A check in the model's own dtype failed, but the folded model there is no further from the model's
    float64 function than the model itself is, plus the tolerance (its message says by how much)."""


@torch.no_grad()
def _verify(
    model: nn.Module,
    folded: nn.Module,
    inputs: Any,
    ref_out: list[torch.Tensor],
    new_out: list[torch.Tensor],
    summary: FoldSummary,
    atol: float | None,
    rtol: float,
    dtype: torch.dtype | None,
    untouched: Callable[[], list[str]] = list,
) -> None:
    """Compare the models (:func:`_compare`); a check in the model's own dtype that fails within that
    dtype's rounding (:class:`_WithinRounding`) is redone in float64, where a wrong fold cannot hide (in
    bfloat16 / float16 the merged weights round by ~1e-3 themselves, so there that bound is the check)."""
    try:
        _compare(model, folded, inputs, ref_out, new_out, summary, atol, rtol, dtype, untouched)
    except _WithinRounding as first:
        if torch.finfo(ref_out[0].dtype).eps > torch.finfo(torch.float32).eps:
            summary.verify_dtype += f" (within its own rounding: {first})"
            return
        try:
            _compare(model, folded, inputs, ref_out, new_out, summary, atol, rtol, torch.float64, untouched)
        except FoldVerificationError as exc:
            raise FoldVerificationError(f"{first}, so fold re-verified in float64: {exc}") from None
        summary.verify_dtype += f" (re-verified: {first})"


def _compare(
    model: nn.Module,
    folded: nn.Module,
    inputs: Any,
    ref_out: list[torch.Tensor],
    new_out: list[torch.Tensor],
    summary: FoldSummary,
    atol: float | None,
    rtol: float,
    dtype: torch.dtype | None,
    untouched: Callable[[], list[str]],
) -> None:
    """Compare the outputs (raise :class:`FoldVerificationError` beyond the tolerance); when they
    cannot tell a wrong fold from a right one, compare an inner signal too (:func:`_verify_signal`)."""
    model_v, folded_v = model, folded
    if dtype is not None:
        model_v, folded_v = copy.deepcopy(model).to(dtype).eval(), copy.deepcopy(folded).to(dtype).eval()
        inputs = map_tensors(inputs, lambda t: t.to(dtype) if t.is_floating_point() else t)
        ref_out = float_outputs(call_model(model_v, inputs))
        new_out = float_outputs(call_model(folded_v, inputs))
    summary.verify_dtype = str(dtype or ref_out[0].dtype)
    _check_reference(ref_out, inputs)
    if len(new_out) != len(ref_out) or any(a.shape != b.shape for a, b in zip(ref_out, new_out)):
        raise FoldVerificationError(
            f"folded model returns shapes {[tuple(t.shape) for t in new_out]}, expected "
            f"{[tuple(t.shape) for t in ref_out]}"
        )
    if not all(bool(torch.isfinite(t).all()) for t in new_out):
        raise FoldVerificationError(
            f"the folded model outputs NaN/inf where the model's outputs are finite (verified in "
            f"{summary.verify_dtype}): not a tolerance problem but an overflow of merged weights in this "
            "dtype (try dtype=torch.float64) or a wrong fold rule (please report this model). "
            "Decisions:\n" + "\n".join(summary.merged)
        )
    err, scale = max_difference(ref_out, new_out)
    summary.max_abs_error, summary.output_scale = err, scale
    summary.tolerance = atol if atol is not None else rtol * max(scale, _ZERO)
    if not err <= summary.tolerance:
        rounding = _rounding(model, inputs, _outputs, ref_out, new_out, err, summary.tolerance) if dtype is None else ""
        raise FoldVerificationError(
            f"folded model differs by {err:.3g} (output scale {scale:.3g}, tolerance "
            f"{summary.tolerance:.3g}{rounding}); with tol={summary.tol} near-linear channels were snapped, "
            "lower tol or raise rtol/atol. Decisions:\n" + "\n".join(summary.merged)
        )
    why = _vacuous(ref_out, rtol, inputs)
    if why:
        _verify_signal(model_v, folded_v, inputs, untouched(), summary, rtol, why, own_dtype=dtype is None)


def _outputs(model: nn.Module, inputs: Any) -> list[torch.Tensor]:
    return float_outputs(call_model(model, inputs))


def _rounding(
    model: nn.Module,
    inputs: Any,
    signal: Callable[[nn.Module, Any], list[torch.Tensor]],
    ref: list[torch.Tensor],
    new: list[torch.Tensor],
    err: float,
    tolerance: float,
) -> str:
    """Why a failed check in the model's own dtype (``ref``, ``new``: the model's and the folded model's
    ``signal``) failed, for the refusal (``""`` in float64, or if the model cannot run in float64); raise
    :class:`_WithinRounding` when the folded model is no further from the model's float64 ``signal`` than
    the model itself is, plus ``tolerance``: that dtype's rounding, not the fold, explains ``err``."""
    if all(t.dtype == torch.float64 for t in ref):
        return ""
    try:
        exact = signal(copy.deepcopy(model).double().eval(),
                       map_tensors(inputs, lambda t: t.double() if t.is_floating_point() else t))
        own, off = max_difference(exact, ref)[0], max_difference(exact, new)[0]
    except Exception:  # a layer without float64 support: no rounding estimate, the check stands as it is
        return ""
    dt = str(ref[0].dtype)
    if off <= own + tolerance:
        raise _WithinRounding(f"{dt} check: error {err:.3g}; against the model's float64 function the folded "
                              f"model is off by {off:.3g}, the model itself by {own:.3g}")
    return f"; against the model's float64 function the folded model is off by {off:.3g} in {dt}, the model itself by {own:.3g}"


_ZERO = 1e-12  # an output scale at or below this is zero: it verifies nothing (the tolerance floor)


def _row_spread(t: torch.Tensor) -> float:
    """Largest difference between a sample (row) of ``t`` and the first one (0 for one row)."""
    if t.ndim == 0 or t.shape[0] < 2:
        return 0.0
    return float((t.double() - t[:1].double()).abs().max())


def _samples_differ(inputs: Any) -> bool:
    """Whether some input tensor has two different samples (rows)."""
    tensors = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (tuple, list)) else [inputs]
    return any(isinstance(t, torch.Tensor) and _row_spread(t) > 0 for t in tensors)


def _vacuous(signal: list[torch.Tensor], rtol: float, inputs: Any) -> str:
    """Why ``signal`` cannot tell a wrong fold from a right one ("" if it can): it is zero (below
    ``_ZERO``), or every sample gives the same values (within ``rtol`` times the scale) although the
    samples of ``inputs`` differ: the model ignores its input there (a zero-weight head)."""
    scale = max(float(t.double().abs().max()) for t in signal)
    if scale <= _ZERO:
        return "zero"
    if _samples_differ(inputs) and max(_row_spread(t) for t in signal) <= rtol * scale:
        return "the same for every sample of example_inputs"
    return ""


def _untouched_layers(model: nn.Module, folded: nn.Module, before: dict[str, nn.Module], probe: Probe) -> list[str]:
    """Paths of the leaf layers that fold left alone: the same layer object at the same path, called
    once, with the same parameters and buffers as in ``model`` (their input is the same signal)."""
    original = dict(model.named_modules())
    paths = []
    for path, m in folded.named_modules():
        if next(m.children(), None) is not None or before.get(path) is not m or not probe.once(m):
            continue
        mine, theirs = m.state_dict(), original[path].state_dict() if path in original else None
        if theirs is not None and mine.keys() == theirs.keys() and all(
            mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k].to(mine[k].device)) for k in mine
        ):
            paths.append(path)
    return paths


def _layer_inputs(model: nn.Module, paths: list[str], inputs: Any) -> dict[str, torch.Tensor]:
    """The first floating-point input of each layer at ``paths`` in one forward, in call order; a
    layer fed one of ``inputs`` itself is left out (that signal verifies nothing)."""
    seen: dict[str, torch.Tensor] = {}
    given = {id(t) for t in float_outputs(inputs)}

    def hook_for(path: str):
        def hook(m: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            if path not in seen and isinstance(x, torch.Tensor) and x.is_floating_point() and id(x) not in given:
                seen[path] = x.detach().clone()
        return hook

    handles = [model.get_submodule(p).register_forward_pre_hook(hook_for(p)) for p in paths]
    try:
        call_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _verify_signal(
    model: nn.Module, folded: nn.Module, inputs: Any, paths: list[str], summary: FoldSummary, rtol: float, why: str,
    own_dtype: bool = False,
) -> None:
    """Verify the input of the last untouched layer (``paths``) whose input is not vacuous either
    (:func:`_vacuous` with ``rtol`` times its scale); raise :class:`FoldVerificationError` if none is
    (``own_dtype``: the models run in their own dtype, whose rounding may explain a failure, :func:`_rounding`)."""
    ref, new = _layer_inputs(model, paths, inputs), _layer_inputs(folded, paths, inputs)
    for path in reversed(list(ref)):
        a, b = ref[path], new.get(path)
        if b is None or b.shape != a.shape or _vacuous([a], rtol, inputs):
            continue
        err, scale = max_difference([a], [b])  # the finite scale: an inf in the signal must not make any error pass
        summary.verified_on, summary.verified_why = f"input of {path!r}", f"the output is {why}"
        summary.signal_error, summary.signal_scale, summary.signal_tolerance = err, scale, rtol * scale
        if not err <= rtol * scale:
            signal = lambda m, i, path=path: [_layer_inputs(m, [path], i)[path]]  # noqa: E731
            rounding = _rounding(model, inputs, signal, [a], [b], err, rtol * scale) if own_dtype else ""
            raise FoldVerificationError(
                f"folded model differs by {err:.3g} at the input of {path!r} (scale {scale:.3g}, tolerance "
                f"{rtol * scale:.3g}{rounding}), verified there because the output is {why} and cannot show it. "
                "Decisions:\n" + "\n".join(summary.merged)
            )
        return
    raise FoldVerificationError(
        f"fold cannot verify the folded model: its output on example_inputs {_describe_inputs(inputs)} is {why}, "
        "and no layer input that fold left untouched varies either. Pass example_inputs with at least 2 "
        "different samples, or give the model a head that is not zero (e.g. a random one) to verify the fold"
    )
