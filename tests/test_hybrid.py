"""The hybrid one-shot (``one_shot(end="hybrid", flops=...)``) and the fold of FFNs whose linear channels are all
constants (removed: ``alpha = 0``, no passthrough). Truths: brute force over the budget, per-channel least squares
and output errors computed by hand in float64, and the unfolded model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import linearize
from linearize.folding import LinearWithPassthrough


class Block(nn.Module):
    """A residual FFN block: ``x + fc2(act(fc1(x)))`` (the residual add is not counted as FLOPs)."""

    def __init__(self, d: int, m: int, bias: float) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, m), nn.GELU(), nn.Linear(m, d)
        with torch.no_grad():
            self.fc1.bias.add_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def _two_blocks(seed: int = 0) -> nn.Module:
    """Two FFNs (d = 8, m = 16): the first's channels mostly off (near constants), the second's mostly on
    (near the identity), as the two regimes of a trained FFN."""
    torch.manual_seed(seed)
    return nn.Sequential(Block(8, 16, -3.5), Block(8, 16, 2.5)).double()


def _macs(d_in: int, n: int, d_out: int, passthrough: bool) -> int:
    return d_in * n + n * d_out + (d_in * d_out if passthrough else 0)


def _budget_truth(d_in: int, m: int, d_out: int, flops: float) -> dict[str, int]:
    """Per mode, the most nonlinear channels whose folded multiply-adds fit ``flops`` of the FFN's, by enumeration."""
    budget = flops * _macs(d_in, m, d_out, False)
    out = {}
    for mode, passthrough in (("linear", True), ("removed", False)):
        fits = [n for n in range(m + 1) if _macs(d_in, n, d_out, passthrough) <= budget * (1 + 1e-12)]
        if fits:
            out[mode] = max(fits)
    return out


def _mode_truth(block: Block, x: torch.Tensor, mode: str, keep: int) -> tuple[set[int], float]:
    """The nonlinear channels of a mode (per channel: numpy least squares of gelu(h) on [h, 1] for "linear", the mean
    for "removed"; score = residual mean square * outgoing norm, the ``keep`` highest stay nonlinear) and the mean
    over samples of the squared change of the FFN's output with all the other channels at their ends."""
    with torch.no_grad():
        h = block.fc1(x).double()
        y = block.act(h)
    w2 = block.fc2.weight.detach().double()
    ends = torch.empty_like(y)
    for c in range(h.shape[1]):
        if mode == "linear":
            a = np.stack([h[:, c].numpy(), np.ones(len(h))], 1)
            coef = np.linalg.lstsq(a, y[:, c].numpy(), rcond=None)[0]
            ends[:, c] = torch.from_numpy(a @ coef)
        else:
            ends[:, c] = y[:, c].mean()
    residual = ((y - ends) ** 2).mean(0)
    score = residual * (w2 ** 2).sum(0)
    nonlinear = set(score.argsort(descending=True)[:keep].tolist())
    linear = torch.tensor([c not in nonlinear for c in range(h.shape[1])])
    change = ((ends - y) * linear) @ w2.T
    return nonlinear, float((change ** 2).sum(1).mean())


def _block_inputs(net: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [x, net[0](x)]


@pytest.mark.parametrize("flops", [0.3, 0.5, 0.75])
def test_hybrid_picks_per_ffn_the_mode_with_the_lower_calibration_error(flops):
    base = _two_blocks()
    x = torch.randn(600, 8, dtype=torch.float64)
    inputs = _block_inputs(base, x)
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    sites = linearize.one_shot(net, x, end="hybrid", flops=flops)
    modes = []
    for i, name in enumerate(("0.act", "1.act")):
        plan, site, unit = sites[name].plan, sites[name], net[i].act
        widths = _budget_truth(8, 16, 8, flops)
        truth = {mode: _mode_truth(base[i], inputs[i], mode, keep) for mode, keep in widths.items()}
        assert set(plan.errors) == {"linear", "removed"}
        for mode, (_, error) in truth.items():
            assert plan.errors[mode] == pytest.approx(error, rel=1e-7, abs=1e-14), (name, mode)
        best = min(truth, key=lambda mode: (truth[mode][1], mode != "removed"))
        assert plan.mode == best
        assert set(torch.nonzero(~site.linear).flatten().tolist()) == truth[best][0]
        assert site.nonlinear == widths[best]
        assert plan.flops == 2 * _macs(8, widths[best], 8, best == "linear") <= flops * plan.flops_full
        # the unit computes the plan: linear channels frozen at a = 1, ends affine or constant (alpha = 0)
        assert bool((unit.slope[site.linear] == 1).all()) and bool((unit.frozen[site.linear] == 1).all())
        assert bool((unit.slope[~site.linear] == 0).all())
        alpha = unit.linear_end[0].detach()
        assert bool((alpha == 0).all()) == (best == "removed")
        modes.append(best)
    if flops == 0.5:  # the two regimes take the two modes: mostly-off channels are constants, mostly-on ones linear
        assert modes == ["removed", "linear"]


@pytest.mark.parametrize("flops", [0.0, 0.3, 0.5, 1.0])
def test_folded_hybrid_meets_the_budget_and_equals_the_unfolded_model(flops):
    x = torch.randn(300, 8, dtype=torch.float64)
    net = linearize.convert(_two_blocks(1), example_inputs=x[:2])
    sites = linearize.one_shot(net, x, end="hybrid", flops=flops)
    folded = linearize.fold(copy.deepcopy(net).eval(), x, latency=False)
    with torch.no_grad():
        assert torch.allclose(folded(x), net.eval()(x), rtol=0, atol=1e-12)
    rows = 5
    counted = linearize.count_flops(folded, x[:rows]) // rows  # the residual adds are not counted: FFNs only
    assert counted == sum(s.plan.flops for s in sites.values())
    assert counted <= flops * sum(s.plan.flops_full for s in sites.values())
    passthroughs = sum(isinstance(m, LinearWithPassthrough) for m in folded.modules())
    assert passthroughs == sum(s.plan.mode == "linear" and s.nonlinear > 0 for s in sites.values())


def test_fold_of_an_ffn_whose_linear_channels_are_constants_has_no_passthrough():
    torch.manual_seed(0)
    d, m, d_out, n = 6, 16, 5, 4
    x = torch.randn(64, d, dtype=torch.float64)
    for shape in ("sequential", "module"):
        base = (nn.Sequential(nn.Linear(d, m), nn.GELU(), nn.Linear(m, d_out)) if shape == "sequential"
                else Block(d, m, 0.0)).double()
        out_width = d_out if shape == "sequential" else d
        for alphas in ("zero", "one nonzero"):
            net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
            unit = next(u for _, u in linearize.units(net))
            linear = torch.arange(m) >= n
            alpha = torch.zeros(m, dtype=torch.float64)
            if alphas == "one nonzero":
                alpha[m - 1] = 0.5
            unit.set_linear_end(alpha, torch.randn(m, dtype=torch.float64))
            unit.freeze_(linear, 1.0)
            folded = linearize.fold(copy.deepcopy(net).eval(), x, latency=False)
            with torch.no_grad():
                assert torch.allclose(folded(x), net.eval()(x), rtol=0, atol=1e-12), (shape, alphas)
            passthrough = alphas == "one nonzero"
            assert any(isinstance(mod, LinearWithPassthrough) for mod in folded.modules()) == passthrough
            assert linearize.count_flops(folded, x[:1]) == 2 * _macs(d, n, out_width, passthrough), (shape, alphas)


def test_fold_of_a_wholly_constant_ffn_costs_nothing_and_of_a_conv_ffn_narrows_it():
    x = torch.randn(32, 6, dtype=torch.float64)
    net = linearize.convert(Block(6, 8, 0.0).double(), example_inputs=x[:2])  # x + a constant: fold can verify it
    net.act.set_linear_end(0.0, torch.randn(8, dtype=torch.float64))
    net.act.freeze_(torch.ones(8, dtype=torch.bool), 1.0)
    folded = linearize.fold(copy.deepcopy(net).eval(), x, latency=False)
    with torch.no_grad():
        assert torch.allclose(folded(x), net.eval()(x), rtol=0, atol=1e-12)
    assert linearize.count_flops(folded, x) == 0

    images = torch.randn(4, 6, 5, 5, dtype=torch.float64)
    conv = nn.Sequential(nn.Conv2d(6, 12, 1), nn.SiLU(), nn.Conv2d(12, 6, 1)).double()
    net = linearize.convert(conv, example_inputs=images[:2])
    net[1].set_linear_end(0.0, torch.randn(12, dtype=torch.float64))
    net[1].freeze_(torch.arange(12) >= 3, 1.0)
    folded = linearize.fold(copy.deepcopy(net).eval(), images, latency=False)
    with torch.no_grad():
        assert torch.allclose(folded(images), net.eval()(images), rtol=0, atol=1e-12)
    assert linearize.count_flops(folded, images[:1]) == 2 * 25 * _macs(6, 3, 6, False)


def test_fold_of_a_model_that_became_a_constant_names_the_unit_and_folds_unverified_on_request():
    # flops=0 removes the FFN: without a residual the model is a constant, which no fold can be checked against
    x = torch.randn(64, 4, dtype=torch.float64)
    net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).double(), example_inputs=x[:2])
    linearize.one_shot(net, x, end="hybrid", flops=0.0)
    with pytest.raises(linearize.FoldVerificationError, match=r"constant.*units \['1'\].*alpha = 0.*verify=False"):
        linearize.fold(copy.deepcopy(net).eval(), x[:4], latency=False)
    folded = linearize.fold(copy.deepcopy(net).eval(), x[:4], latency=False, verify=False)
    with torch.no_grad():
        want = net.eval()(x)
        assert torch.allclose(want, want[:1].expand_as(want), rtol=0, atol=1e-12)  # the model is a constant
        assert torch.allclose(folded(x), want, rtol=0, atol=1e-12)
        net[1].beta.zero_(), net[2].bias.zero_()  # a constant zero: the same diagnosis, not "pass other samples"
    with pytest.raises(linearize.FoldVerificationError, match=r"is zero.*constant.*units \['1'\].*verify=False"):
        linearize.fold(copy.deepcopy(net).eval(), x[:4], latency=False)


def test_a_fine_tune_keeps_a_removed_ffn_removed():
    x = torch.randn(300, 8, dtype=torch.float64)
    net = linearize.convert(_two_blocks(), example_inputs=x[:2])
    sites = linearize.one_shot(net, x, end="hybrid", flops=0.5)
    removed = [i for i, name in enumerate(("0.act", "1.act")) if sites[name].plan.mode == "removed"]
    assert removed
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for _ in range(3):
        loss = (net(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for i in removed:
        assert bool((net[i].act.linear_end[0] == 0).all())
    folded = linearize.fold(copy.deepcopy(net).eval(), x, latency=False)
    assert linearize.count_flops(folded, x[:1]) <= sum(s.plan.flops for s in sites.values())


def test_hybrid_on_a_bert_ffn_leaves_out_padding_and_folds_exactly():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)
    torch.manual_seed(0)
    model = linearize.convert(transformers.BertModel(config).double().eval(), target_modules=[r".*intermediate.*"])
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[:, 6:] = 0
    batch = {"input_ids": torch.randint(0, 50, (4, 9)), "attention_mask": mask}
    sites = linearize.one_shot(model, batch, end="hybrid", flops=0.4)
    assert len(sites) == 2
    for site in sites.values():
        assert site.plan.d_in == site.plan.d_out == 16 and site.plan.flops <= 0.4 * site.plan.flops_full
        assert site.fit.count == 24  # the 4 x 6 data positions, padding left out
    folded = linearize.fold(copy.deepcopy(model), batch, latency=False)
    with torch.no_grad():
        out, ref = folded(**batch).last_hidden_state, model(**batch).last_hidden_state
    assert torch.allclose(out, ref, rtol=0, atol=1e-10)
    ffn = sum(m.in_features * m.out_features for n, m in folded.named_modules()
              if isinstance(m, nn.Linear) and (".intermediate." in n or ".output.dense" in n) and "attention" not in n)
    assert 2 * ffn == sum(s.plan.flops for s in sites.values())


def test_hybrid_refuses_bad_budgets_and_units_outside_an_ffn_naming_them():
    x = torch.randn(64, 8)
    net = linearize.convert(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), example_inputs=x[:2])
    for bad in (1.5, -0.1, None, True, "0.3"):
        with pytest.raises(ValueError, match=r"flops must be a fraction in \[0, 1\].*got"):
            linearize.one_shot(net, x, end="hybrid", flops=bad)
    with pytest.raises(ValueError, match=r"not target=0.25"):
        linearize.one_shot(net, x, end="hybrid", flops=0.3, target=0.25)
    with pytest.raises(ValueError, match=r"flops=0.3 is the budget of end='hybrid'"):
        linearize.one_shot(net, x, flops=0.3)
    with pytest.raises(ValueError, match="outgoing= is not used"):
        linearize.one_shot(net, x, end="hybrid", flops=0.3, outgoing={"1": torch.ones(16)})
    assert net[1].linear_end is None and bool((net[1].slope == 0).all())  # nothing was set
    tail = linearize.convert(nn.Sequential(nn.Linear(8, 16), nn.GELU()), example_inputs=x[:2])
    with pytest.raises(ValueError, match=r"unit '1' is not the middle of an FFN.*feeds no layer.*units=\[\.\.\.\]"):
        linearize.one_shot(tail, x, end="hybrid", flops=0.3)
    deep = linearize.convert(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)),
                             example_inputs=torch.randn(2, 3, 9, 9))
    with pytest.raises(ValueError, match=r"unit '1' is not the middle of an FFN.*fed by Conv2d and feeds Conv2d"):
        linearize.one_shot(deep, torch.randn(4, 3, 9, 9), end="hybrid", flops=0.3)
