"""Distillation from the original model: the natural teacher of a converted model (no labels needed).

A converted model with all slopes at 0 computes exactly the original function, so the original is the
teacher and :func:`distill_loss` is 0 at the first step; the sparsity pressure then moves slopes
towards 1 and the loss measures how far the student drifts from the original.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["distill_loss", "mean_pool", "KINDS"]

KINDS = ("hidden", "logits", "pooled")


def _field(out: Any, kind: str) -> torch.Tensor:
    """The tensor of a model output that ``kind`` compares (a tensor passes through)."""
    if isinstance(out, torch.Tensor):
        return out
    if kind == "logits":
        value = getattr(out, "logits", None) if not isinstance(out, dict) else out.get("logits")
    else:
        get = out.get if isinstance(out, dict) else lambda k: getattr(out, k, None)
        value = get("last_hidden_state")
        if value is None and get("hidden_states") is not None:
            value = get("hidden_states")[-1]
    if value is None:
        need = "logits" if kind == "logits" else "last_hidden_state (or hidden_states: output_hidden_states=True)"
        raise ValueError(f"distill_loss(kind={kind!r}) needs outputs with {need}, got {type(out).__name__}")
    return value


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``hidden [B, T, D]`` over the tokens where ``attention_mask [B, T]`` is 1 -> ``[B, D]`` (the
    padded tokens add nothing to it nor to its gradient, also where they hold NaN/inf).

    Example: ``mean_pool(torch.ones(2, 3, 4)).shape == (2, 4)``.
    """
    if attention_mask is None:
        return hidden.mean(dim=1)
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return torch.where(m != 0, hidden, 0.0).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


def _check_teacher(t: torch.Tensor, kind: str, attention_mask: torch.Tensor | None) -> None:
    """Refuse teacher outputs with NaN/inf where they count (unmasked positions; a ``-inf`` logit rules a class
    out and is fine): the loss would be NaN and the optimizer step would write NaN into every student weight."""
    bad = (torch.isnan(t) | (t == math.inf)) if kind == "logits" else ~torch.isfinite(t)
    if attention_mask is not None and t.ndim >= 3 and tuple(attention_mask.shape) == tuple(t.shape[:-1]):
        bad = bad & attention_mask.bool()[..., None]
    if bool(bad.any()):
        raise ValueError(f"the teacher's outputs ({kind}) hold {int(bad.sum())} NaN/inf value(s) on positions that "
                         "count: a damaged teacher (check torch.isfinite over its parameters) or one run in half "
                         "precision that overflowed (run it in float32); nothing was updated")


def distill_loss(
    student_out: Any,
    teacher_out: Any,
    kind: str = "hidden",
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """How far the student's outputs are from the teacher's (scalar; 0 when they are equal).

    Args:
        student_out, teacher_out: model outputs (``ModelOutput``/dict) or tensors.
        kind: ``"hidden"``: mean squared error of the last hidden states over the unmasked tokens,
            divided by the teacher's mean square over the same tokens (relative, so it means the same
            for any width and any padding); ``"logits"``: ``T^2 * KL(softmax(t / T) || softmax(s / T))``
            over the last dim (classes the teacher gives probability 0 add 0), averaged over the
            unmasked positions; ``"pooled"``: ``1 - cosine`` of the mean-pooled hidden states
            (sentence embeddings), averaged over the batch.
        attention_mask: ``[B, T]`` of 0 / 1 (1 = token); ``None``: every position counts. Padded positions
            add nothing to the loss nor to its gradient, also where student or teacher hold NaN/inf there. Outputs
            with one row per example (``[B, C]`` logits) take no mask (one of another shape is not used);
            ``[B, T', D]`` outputs need a mask of their positions.
        temperature: ``T`` of ``"logits"``.

    Example::

        with torch.no_grad():
            t = teacher(**batch)
        loss = linearize.distill_loss(student(**batch), t, "hidden", batch["attention_mask"])
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < 1e4:
        raise ValueError(f"temperature must be a number in (0, 1e4) (the softmax's T; 1 to 20 is usual), "
                         f"got {temperature!r}")
    s, t = _field(student_out, kind).float(), _field(teacher_out, kind).detach().float()
    if s.shape != t.shape:
        raise ValueError(f"student and teacher outputs differ in shape: {tuple(s.shape)} vs {tuple(t.shape)}")
    _check_teacher(t, kind, attention_mask)
    if kind == "pooled":
        if s.ndim == 3:
            s, t = mean_pool(s, attention_mask), mean_pool(t, attention_mask)
        return (1.0 - F.cosine_similarity(s, t, dim=-1)).mean()
    if attention_mask is not None and s.ndim >= 3 and tuple(attention_mask.shape) != tuple(s.shape[:-1]):
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} does not cover the outputs' "
                         f"positions {tuple(s.shape[:-1])}: pass the mask of these positions (shifted logits "
                         "need the shifted mask)")
    masked = attention_mask is not None and tuple(attention_mask.shape) == tuple(s.shape[:-1])
    if masked and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    keep = attention_mask.bool() if masked else torch.ones(s.shape[:-1], dtype=torch.bool, device=s.device)
    if masked:  # padding zeroed before any use: NaN there stays out of the loss and of the gradient (0 * NaN)
        s, t = torch.where(keep[..., None], s, 0.0), torch.where(keep[..., None], t, 0.0)

    def mean(per: torch.Tensor) -> torch.Tensor:  # over the unmasked positions
        return torch.where(keep, per, 0.0).sum() / keep.sum().clamp(min=1)

    if kind == "logits":
        log_t, log_s = F.log_softmax(t / temperature, -1), F.log_softmax(s / temperature, -1)
        p_t = log_t.exp()  # classes the teacher rules out (p = 0, e.g. a -inf logit) add 0, not 0 * (-inf + inf)
        per = (p_t * torch.where(p_t > 0, log_t - log_s, 0.0)).sum(-1) * temperature**2
    else:  # relative to the teacher's mean square over the same positions
        per = (s - t).pow(2).mean(-1) / mean(t.pow(2).mean(-1)).clamp(min=1e-12)
    return mean(per)
