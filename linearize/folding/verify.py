"""fold's self-check: the folded model must reproduce the model's outputs on ``example_inputs``
within ``rtol * max|output|`` (or ``atol``). When that check is vacuous (the output is zero, or the same
for every sample although the samples differ: a zero-initialised head), the input of the last layer
that fold left untouched and that does vary (the features before the head) is verified too.

A refusal says how far the model's own output in its dtype is from the same model run in float64: a
badly conditioned float32 model (or any bfloat16 / float16 one) can be further off than the tolerance
by itself. fold does not then pass the fold on its own: rounding on one output cannot vouch for
another, and a merge can round worse than its pieces. The user chooses: ``dtype=torch.float64``
verifies the fold's algebra without activation rounding (the merged weights keep the rounding of the model's
dtype: negligible in float32, of the dtype's eps in bfloat16 / float16, where the refusal names the ``rtol``
that accepts twice the model's own rounding), ``rtol=`` / ``atol=`` accept more."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
from torch import nn

from ..checks import FoldVerificationError
from ..dispatch import user_hooks, user_hooks_removed
from ..inputs import call_model, describe_inputs, eval_mode, float_outputs, map_tensors, max_difference, output_tensors
from .probe import Probe
from .summary import FoldSummary
from ..unit import units


def check_reference(ref_out: list[torch.Tensor], inputs: Any) -> None:
    """The model's own outputs must be non-empty and finite, or no tolerance can verify a fold."""
    if any(t.numel() == 0 for t in ref_out):
        raise ValueError(
            f"the model's output on example_inputs {describe_inputs(inputs)} is empty: pass at least one sample"
        )
    if not all(bool(torch.isfinite(t).all()) for t in ref_out):
        raise ValueError(
            f"the model's own output on example_inputs {describe_inputs(inputs)} has NaN/inf values: fold "
            "cannot verify against it (no tolerance helps); check the model's weights and the inputs"
        )


@torch.no_grad()
def verify_fold(
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
    hooked: Callable[[], list[str]] = list,
) -> None:
    """Compare the outputs (raise :class:`FoldVerificationError` beyond the tolerance); when they
    cannot tell a wrong fold from a right one, compare an inner signal too (:func:`_verify_signal`).
    ``hooked()`` names the modules with user forward hooks that the fold merged away (:func:`merged_hooks`):
    a difference is put down to their hooks when the model run without them differs beyond the tolerance
    (:func:`_hook_effects`), else to rounding."""
    model_v, folded_v, given, own_out = model, folded, inputs, ref_out
    if dtype is not None:
        model_v, folded_v = copy.deepcopy(model).to(dtype).eval(), copy.deepcopy(folded).to(dtype).eval()
        inputs = map_tensors(inputs, lambda t: t.to(dtype) if t.is_floating_point() else t)
        ref_out = float_outputs(call_model(model_v, inputs))
        new_out = float_outputs(call_model(folded_v, inputs))
    summary.verify_dtype = str(dtype or ref_out[0].dtype)
    check_reference(ref_out, inputs)
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
    summary.tolerance = atol if atol is not None else rtol * max(scale, _zero(ref_out))
    changing, hooks_off = _hook_effects(model_v, inputs, ref_out, hooked(), summary.tolerance) \
        if not err <= summary.tolerance else ([], 0.0)
    if changing:
        raise FoldVerificationError(
            f"folded model differs by {err:.3g} (output scale {scale:.3g}, tolerance {summary.tolerance:.3g}), "
            f"and fold merged away {', '.join(map(repr, changing))}, which had forward hooks that change the "
            f"model's output (by {hooks_off:.3g} when they do not run): a hook that changes its module's result "
            "is part of the model's function, and the folded model no longer runs it, so no tolerance makes this "
            "fold right. Fix: move what those hooks compute into forward code, or remove them before folding. "
            "Decisions:\n" + "\n".join(summary.merged)
        )
    if not err <= summary.tolerance:
        raise FoldVerificationError(
            f"folded model differs by {err:.3g} (output scale {scale:.3g}, tolerance {summary.tolerance:.3g})"
            f"{_rounding(model, given, _outputs, own_out, summary.tolerance, err, scale, dtype)}; "
            f"{_snapped(summary.tol)}{tf32_hint(ref_out)}raise rtol/atol to accept a larger error. Decisions:\n"
            + "\n".join(summary.merged)
        )
    why = _vacuous(ref_out, rtol, inputs)
    if why:
        _verify_signal(model_v, folded_v, inputs, untouched(), summary, rtol, why, hint=dtype is None)


def _outputs(model: nn.Module, inputs: Any) -> list[torch.Tensor]:
    return float_outputs(call_model(model, inputs))


def tf32_hint(outputs: list[torch.Tensor]) -> str:
    """For a refusal on CUDA while TF32 is allowed: convolutions and matmuls there round their inputs to 10-bit
    mantissas, so the model and its fold each differ from float32 by about 1e-3 relative."""
    on_cuda = any(t.device.type == "cuda" for t in outputs)
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    return ("TF32 is on (torch.backends.cudnn.allow_tf32 / torch.backends.cuda.matmul.allow_tf32): its rounding, "
            "not the fold, may make this difference; set both to False while folding, or verify with "
            "dtype=torch.float64, or ") if on_cuda and tf32 else ""


def _snapped(tol: float) -> str:
    return f"with tol={tol} near-linear channels were snapped, lower tol or " if tol > 0 else ""


def _rounding(model: nn.Module, inputs: Any, signal: Callable[[nn.Module, Any], list[torch.Tensor]],
              ref: list[torch.Tensor], tolerance: float, error: float, scale: float,
              dtype: torch.dtype | None = None) -> str:
    """For a refusal (the fold off by ``error`` at a signal of ``scale``, verified in ``dtype``; ``None``: the model's
    own): how far ``ref`` (the model's ``signal`` in its dtype) is from the same model's ``signal`` in float64, and
    what to do when that rounding alone reaches the ``tolerance``: ``dtype=torch.float64`` where the merged weights
    round far below the tolerance in the model's dtype (float32), else (bfloat16, float16: the merged weights keep
    that rounding in any verification) the ``rtol`` that accepts twice that rounding, when the error is within it.
    ``""`` in float64, and verified in ``dtype`` where the merged weights' rounding is negligible; why it is unknown
    when the float64 run fails or is not finite."""
    if all(t.dtype == torch.float64 for t in ref):
        return ""
    dt = ref[0].dtype
    eps = torch.finfo(dt).eps
    merged_exact = 10 * eps <= tolerance / max(scale, _zero(ref))  # the merged weights' rounding is far below it
    if dtype is not None and merged_exact:
        return ""
    try:
        exact = signal(copy.deepcopy(model).double().eval(),
                       map_tensors(inputs, lambda t: t.double() if t.is_floating_point() else t))
        own = max_difference(exact, ref)[0]
    except Exception as exc:  # e.g. a layer without float64 support: the refusal stands, saying why no number
        return f"; the model's own rounding is unknown (its float64 run failed: {type(exc).__name__})"
    if not math.isfinite(own):
        return f"; the model's own rounding is unknown (its float64 output is not finite where its {dt} one is)"
    text = f"; the model's own {dt} output is {own:.3g} from its float64 output"
    if 2 * own >= tolerance:  # two roundings this large can differ by the tolerance
        text += ", so rounding alone can fail this tolerance"
        if merged_exact:
            text += " (a badly conditioned model): verify the fold's algebra with dtype=torch.float64"
        else:
            rtol = _round_up(2 * own / max(scale, _zero(ref)))
            text += (f" (the merged weights are rounded to {dt}, eps {eps:.2g}, in any verification dtype: "
                     "dtype=torch.float64 does not remove that)")
            if error <= rtol * scale:
                text += f": rtol={rtol:g} (twice that rounding, of the scale) accepts rounding of this size"
    return text


def _round_up(value: float) -> float:
    """``value`` (> 0) rounded up to one significant digit (0.0143 -> 0.02)."""
    unit = 10.0 ** math.floor(math.log10(value))
    return math.ceil(value / unit * (1 - 1e-9)) * unit


def _zero(signal: list[torch.Tensor]) -> float:
    """The scale at or below which ``signal`` counts as zero and verifies nothing (the tolerance floor): the
    smallest normal number of its dtype (below it a value has lost relative precision), so that any scale of a
    model's inputs or weights that its dtype represents is verified relative to it."""
    return max(torch.finfo(t.dtype).tiny for t in signal)


def _row_spread(t: torch.Tensor) -> float:
    """Largest difference between a sample (row) of ``t`` and the first one (0 for one row)."""
    if t.ndim == 0 or t.shape[0] < 2:
        return 0.0
    return float((t.double() - t[:1].double()).abs().max())


def _samples_differ(inputs: Any) -> bool:
    """Whether some input tensor has two different samples (rows)."""
    return any(_row_spread(t) > 0 for t in output_tensors(inputs))


def _vacuous(signal: list[torch.Tensor], rtol: float, inputs: Any) -> str:
    """Why ``signal`` cannot tell a wrong fold from a right one ("" if it can): it is zero (at most
    :func:`_zero`, the smallest normal number of its dtype), or every sample gives the same values (within
    ``rtol`` times the scale) although the samples of ``inputs`` differ: the model ignores its input there (a
    zero-weight head)."""
    scale = max(float(t.double().abs().max()) for t in signal)
    if scale <= _zero(signal):
        return f"zero (its largest magnitude {scale:.3g} is at most {_zero(signal):.3g}, the smallest normal " \
               f"{signal[0].dtype})"
    if _samples_differ(inputs) and max(_row_spread(t) for t in signal) <= rtol * scale:
        return "the same for every sample of example_inputs"
    return ""


def _hook_effects(model: nn.Module, inputs: Any, ref: list[torch.Tensor], paths: list[str],
                  tolerance: float) -> tuple[list[str], float]:
    """How far the ``model`` run (in eval mode) on ``inputs`` without the user forward hooks of the modules at
    ``paths`` (merged away by fold) is from its outputs ``ref``, and, when that is beyond the ``tolerance``,
    those of the modules whose hooks alone change it (all of them when none does alone); else no module (the
    hooks do not explain the difference). One forward, and one per path after."""
    modules = dict(model.named_modules())
    hooked = {p: modules[p if p != "<root>" else ""] for p in paths}

    def without(names: list[str]) -> float:
        with user_hooks_removed(hooked[n] for n in names), eval_mode(model):
            return max_difference(ref, _outputs(model, inputs))[0]

    off = without(paths) if paths else 0.0
    if not off > tolerance:
        return [], off
    return [p for p in paths if without([p]) != 0.0] or paths, off


def merged_hooks(before: dict[str, nn.Module], folded: nn.Module) -> list[str]:
    """Paths (in ``before``: path -> module of the copy fold started from) of the modules with user forward
    hooks that the ``folded`` model no longer holds: merged away, their hooks with them."""
    kept = {id(m) for m in folded.modules()}
    return [path or "<root>" for path, m in before.items() if id(m) not in kept and user_hooks(m)]


def untouched_layers(model: nn.Module, folded: nn.Module, before: dict[str, nn.Module], probe: Probe) -> list[str]:
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
    hint: bool = False,
) -> None:
    """Verify the input of the last untouched layer (``paths``) whose input is not vacuous either
    (:func:`_vacuous` with ``rtol`` times its scale), the model in eval mode as its outputs were; raise
    :class:`FoldVerificationError` if none is (``hint``: a refusal names the model's own rounding)."""
    with eval_mode(model):
        ref = _layer_inputs(model, paths, inputs)
    new = _layer_inputs(folded, paths, inputs)
    for path in reversed(list(ref)):
        a, b = ref[path], new.get(path)
        if b is None or b.shape != a.shape or _vacuous([a], rtol, inputs):
            continue
        err, scale = max_difference([a], [b])  # the finite scale: an inf in the signal must not make any error pass
        summary.verified_on, summary.verified_why = f"input of {path!r}", f"the output is {why}"
        summary.signal_error, summary.signal_scale, summary.signal_tolerance = err, scale, rtol * scale
        if not err <= rtol * scale:
            signal = lambda m, i, path=path: [_layer_inputs(m, [path], i)[path]]  # noqa: E731
            rounding = _rounding(model, inputs, signal, [a], rtol * scale, err, scale) if hint else ""
            raise FoldVerificationError(
                f"folded model differs by {err:.3g} at the input of {path!r} (scale {scale:.3g}, tolerance "
                f"{rtol * scale:.3g}{rounding}), verified there because the output is {why} and cannot show it. "
                "Decisions:\n" + "\n".join(summary.merged)
            )
        return
    constant = [n for n, u in units(model) if bool(u.linear_mask().all()) and u.alpha is not None
                and not bool(u.alpha.detach().any())]
    if constant and _samples_differ(inputs):  # the samples differ and nothing of them passes these units
        fix = (f"The model computes a constant on these samples, which no fold can be checked against: units "
               f"{constant[:3]} have every channel linear with alpha = 0 (their mean output, as "
               "one_shot(end='hybrid', flops=0) leaves an FFN), so nothing of the input passes them. If that is "
               "the model you want, fold(..., verify=False); else give them a budget that passes the input")
    elif why.startswith("zero"):
        fix = ("If the model's output is meant to be 0 (a zero-initialised head), give it a head that is not zero "
               "(e.g. a random one) to verify the fold; if its values are merely that small, scale its inputs (or "
               "weights) up to verify it, or verify in dtype=torch.float64, whose smallest normal is 2.2e-308")
    else:
        fix = ("The model computes a constant on these samples: something cuts every path from the input (a "
               "zero-weight head?). If that is the model you want, fold(..., verify=False)")
    raise FoldVerificationError(
        f"fold cannot verify the folded model: its output on example_inputs {describe_inputs(inputs)} is {why}, "
        f"and no layer input that fold left untouched varies either. {fix}"
    )
