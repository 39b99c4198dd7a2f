"""linearize.distill_loss: the logits and hidden-state losses against their definitions, padding masks,
classes the teacher rules out, and temperatures that must never give NaN."""

from __future__ import annotations

import math

import pytest
import torch

import linearize


@pytest.mark.parametrize("temperature", [float("inf"), 1e30])
def test_distill_loss_never_returns_nan_for_an_accepted_temperature(temperature):
    s, t = torch.randn(4, 5), torch.randn(4, 5)
    try:
        loss = linearize.distill_loss(s, t, "logits", temperature=temperature)
    except ValueError:
        return  # refusing the temperature is a fix too
    assert torch.isfinite(loss)


def test_distill_logits_with_classes_the_teacher_rules_out():
    """A class with logit -inf (masked vocabulary, banned class) contributes 0 to KL(teacher || student),
    as in the definition sum_c p_c log(p_c / q_c) over p_c > 0 (float64 by hand)."""
    t = torch.tensor([[1.0, 0.0, -math.inf]])
    s = torch.tensor([[0.5, 0.2, -math.inf]], requires_grad=True)
    p = torch.softmax(t[:, :2].double(), -1)
    q = torch.softmax(s.detach()[:, :2].double(), -1)
    want = float((p * (p / q).log()).sum())
    loss = linearize.distill_loss(s, t, "logits")
    assert loss.item() == pytest.approx(want, rel=1e-5)
    loss.backward()
    assert torch.isfinite(s.grad).all()
    assert linearize.distill_loss(t, t, "logits").item() == 0.0
    # the student ruling out a class the teacher allows: an infinite divergence, not NaN
    assert linearize.distill_loss(torch.tensor([[1.0, -math.inf]]), torch.tensor([[1.0, 0.0]]), "logits").item() == math.inf


def test_distill_hidden_does_not_depend_on_padding():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    want = linearize.distill_loss(s, t, "hidden")  # 4 real tokens each, no padding
    for pad, value in ((4, 0.0), (12, 0.0), (12, 3.0)):
        ps = torch.cat([s, torch.full((2, pad, 8), value)], 1)
        pt = torch.cat([t, torch.randn(2, pad, 8, generator=g) * value], 1)
        mask = torch.cat([torch.ones(2, 4), torch.zeros(2, pad)], 1)
        assert linearize.distill_loss(ps, pt, "hidden", mask).item() == pytest.approx(want.item(), rel=1e-6)


def test_distill_masks_keep_nan_at_padding_out_and_are_checked():
    s, t = torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    want = {k: linearize.distill_loss(s, t, k, mask).item() for k in ("logits", "hidden")}
    s2, t2 = s.clone(), t.clone()
    s2[0, 3], t2[1, 3] = float("nan"), -math.inf
    for k in ("logits", "hidden"):
        assert linearize.distill_loss(s2, t2, k, mask).item() == pytest.approx(want[k], rel=1e-6)
    with pytest.raises(ValueError, match="0 \\(padding\\) and 1"):
        linearize.distill_loss(s, t, "logits", mask * -1)
    with pytest.raises(ValueError, match="does not cover"):
        linearize.distill_loss(s[:, :3], t[:, :3], "logits", mask)  # shifted logits, unshifted mask


@pytest.mark.parametrize("kind", ["hidden", "pooled", "logits"])
def test_padding_holding_nan_adds_nothing_to_the_loss_nor_to_the_gradient(kind):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 8, generator=g, dtype=torch.float64), torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    keep = mask.bool()
    # the truth by hand, in float64, from the real tokens alone
    real = s.clone().requires_grad_(True)
    if kind == "hidden":
        want = (real[keep] - t[keep]).pow(2).mean(-1).mean() / t[keep].pow(2).mean(-1).mean()
    elif kind == "pooled":
        cos = [torch.nn.functional.cosine_similarity(real[b][keep[b]].mean(0), t[b][keep[b]].mean(0), dim=0)
               for b in range(2)]
        want = 1 - torch.stack(cos).mean()
    else:
        want = torch.nn.functional.kl_div(real[keep].log_softmax(-1), t[keep].log_softmax(-1), log_target=True,
                                          reduction="batchmean")
    want.backward()
    padded_s, padded_t = s.clone(), t.clone()
    padded_s[~keep], padded_t[~keep] = float("nan"), float("nan")  # e.g. a teacher whose padding is NaN
    student = padded_s.requires_grad_(True)
    loss = linearize.distill_loss(student, padded_t, kind, mask)
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert bool(torch.isfinite(student.grad).all()) and bool((student.grad[~keep] == 0).all())
    torch.testing.assert_close(student.grad[keep].double(), real.grad[keep], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", ["hidden", "logits", "pooled"])
def test_a_teacher_output_with_nan_where_it_counts_is_refused_before_anything_is_updated(kind):
    """A damaged teacher (one NaN weight) made the loss NaN; the optimizer step then wrote NaN into every student
    weight and the Sparsifier blamed the learning rate. Padding and a -inf logit (a class ruled out) still count
    for nothing."""
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 4, requires_grad=True), torch.randn(2, 5, 4)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    teacher[1, 4, 0] = float("nan")  # padding: fine
    if kind == "logits":
        teacher[0, 0, 2] = -math.inf  # a class the teacher rules out: fine
    assert torch.isfinite(linearize.distill_loss(student, teacher, kind, mask))
    teacher[0, 1, 1] = float("nan")  # a token
    with pytest.raises(ValueError, match=rf"teacher's outputs \({kind}\) hold 1 NaN/inf value\(s\).*nothing was updated"):
        linearize.distill_loss(student, teacher, kind, mask)
    assert student.grad is None
