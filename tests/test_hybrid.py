"""The hybrid one-shot (``one_shot(end="hybrid", flops=...)``) and the fold of FFNs whose linear channels are all
constants (removed: ``alpha = 0``, no passthrough). Truths: brute force over the budget, per-channel least squares
and output errors computed by hand in float64, and the unfolded model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
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
def test_without_refit_hybrid_picks_per_ffn_the_mode_with_the_lower_calibration_error(flops):
    base = _two_blocks()
    x = torch.randn(600, 8, dtype=torch.float64)
    inputs = _block_inputs(base, x)
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    sites = linearize.one_shot(net, x, end="hybrid", flops=flops, refit=False)
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


def _mode_ends(block: Block, x: torch.Tensor, mode: str, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mode's (linear channels, alpha, beta) fitted on ``x`` by hand, as :func:`_mode_truth` chooses them."""
    nonlinear, _ = _mode_truth(block, x, mode, keep)
    with torch.no_grad():
        h = block.fc1(x).double()
        y = block.act(h)
    alpha, beta = torch.zeros(h.shape[1], dtype=h.dtype), y.mean(0)
    if mode == "linear":
        for c in range(h.shape[1]):
            a = np.stack([h[:, c].numpy(), np.ones(len(h))], 1)
            alpha[c], beta[c] = map(float, np.linalg.lstsq(a, y[:, c].numpy(), rcond=None)[0])
    return torch.tensor([c not in nonlinear for c in range(h.shape[1])]), alpha, beta


def _ridge_refit(u: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The documented refit by brute force: ``lstsq`` of ``[u, 1]`` on ``target`` with ridge rows towards
    ``weight`` (``1e-3`` times the mean of ``u``'s column squares); the solution and the mean squared residual."""
    a = torch.cat([u, torch.ones(len(u), 1, dtype=u.dtype)], 1)
    k = u.shape[1]
    r = 1e-3 * float((u * u).sum(0).mean())
    reg = torch.zeros(k, k + 1, dtype=u.dtype)
    reg[:, :k] = r ** 0.5 * torch.eye(k, dtype=u.dtype)
    sol = torch.linalg.lstsq(torch.cat([a, reg]), torch.cat([target, r ** 0.5 * weight.T])).solution
    return sol, float(((a @ sol - target) ** 2).sum(1).mean())


@pytest.mark.parametrize("flops", [0.3, 0.5, 0.75])
def test_with_refit_each_ffn_takes_the_plan_whose_refit_errs_less(flops):
    base = _two_blocks(2)
    x = torch.randn(600, 8, dtype=torch.float64)
    originals = _block_inputs(base, x)
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    sites = linearize.one_shot(net, x, end="hybrid", flops=flops)
    current = x  # brute force, block by block: the second refit sees the first block as refit
    for i, name in enumerate(("0.act", "1.act")):
        block, plan = base[i], sites[name].plan
        with torch.no_grad():
            h = block.fc1(current)
            y = F.gelu(h)
        target, w2 = y @ block.fc2.weight.T, block.fc2.weight.detach()
        truth = {}
        for mode, keep in _budget_truth(8, 16, 8, flops).items():
            linear, alpha, beta = _mode_ends(block, originals[i], mode, keep)  # chosen on the original's data
            u = torch.where(linear, alpha * h + beta, y)
            truth[mode] = (linear, u, *_ridge_refit(u, target, w2))
        best = min(truth, key=lambda mode: (truth[mode][3], mode != "removed"))
        assert plan.mode == best, (name, {m: t[3] for m, t in truth.items()})
        for mode, (_, _, _, error) in truth.items():
            assert plan.refit_errors[mode] == pytest.approx(error, rel=1e-6, abs=1e-12), (name, mode)
        linear, u, sol, _ = truth[best]
        assert torch.equal(sites[name].linear, linear) and sites[name].refit == f"{i}.fc2"
        torch.testing.assert_close(net[i].fc2.weight, sol[:16].T, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(net[i].fc2.bias, block.fc2.bias + sol[16], rtol=1e-8, atol=1e-10)
        assert bool((net[i].act.linear_end[0] == 0).all()) == (best == "removed")
        with torch.no_grad():
            current = current + u @ net[i].fc2.weight.T + net[i].fc2.bias
    with torch.no_grad():
        torch.testing.assert_close(net(x), current, rtol=1e-9, atol=1e-9)


def test_the_refit_changes_the_plan_where_a_removed_ffn_refits_better():
    # channels 8-15 repeat channels 0-7 (outgoing weights 0.7x): removing them costs much before the refit (the linear
    # plan errs less), nothing after it (the kept copies carry them); the linear plan keeps 4 channels nonlinear
    torch.manual_seed(0)
    x = torch.randn(500, 8, dtype=torch.float64)
    base = Block(8, 16, 0.0).double()
    with torch.no_grad():
        rows = torch.nn.functional.normalize(torch.randn(8, 8, dtype=torch.float64), dim=1)
        base.fc1.weight.copy_(torch.cat([rows, rows])), base.fc1.bias.zero_()
        cols = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0]
        base.fc2.weight.copy_(torch.cat([cols, 0.7 * cols], 1))
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    before = linearize.one_shot(copy.deepcopy(net), x, end="hybrid", flops=0.5, refit=False)["act"].plan
    site = linearize.one_shot(net, x, end="hybrid", flops=0.5)["act"]
    assert before.mode == "linear" and site.plan.mode == "removed", (before.errors, site.plan.refit_errors)
    assert torch.equal(site.linear, torch.arange(16) >= 8)
    assert site.plan.refit_errors["removed"] < 1e-4 * site.plan.refit_errors["linear"]  # the ridge leaves a trace
    with torch.no_grad():  # the reported error is the model's: one FFN plus the residual
        error = float(((net(x) - base(x)) ** 2).sum(1).mean())
    assert error == pytest.approx(site.plan.refit_errors["removed"], rel=1e-6)


@pytest.mark.parametrize("refit", [False, True])
def test_constant_ends_prune_the_lowest_variance_channels_and_fold_to_a_narrower_ffn(refit):
    base = Block(8, 16, -1.0).double()
    x = torch.randn(400, 8, dtype=torch.float64)
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    site = linearize.one_shot(net, x, target=0.25, end="constant", refit=refit)["act"]
    with torch.no_grad():  # by hand: keep the 4 channels of highest Var[gelu(h)] * ||W2[:, c]||^2, the rest at the mean
        y = F.gelu(base.fc1(x))
        w2 = base.fc2.weight
        kept = ((y.var(0, unbiased=False) * (w2 ** 2).sum(0)).argsort(descending=True)[:4]).sort().values
        removed = torch.tensor([c for c in range(16) if c not in kept])
        pruned = x + y[:, kept] @ w2[:, kept].T + base.fc2.bias + w2[:, removed] @ y[:, removed].mean(0)
    assert torch.equal(site.linear, torch.isin(torch.arange(16), removed))
    assert bool((net.act.linear_end[0] == 0).all()) and not any(p.requires_grad for p in net.act.linear_end)
    with torch.no_grad():
        out = net(x)
    if refit:  # the reconstruction can only lower the error on its data
        assert float(((out - base(x)) ** 2).mean()) < float(((pruned - base(x)) ** 2).mean())
    else:
        torch.testing.assert_close(out, pruned, rtol=1e-12, atol=1e-12)
    folded = linearize.fold(copy.deepcopy(net).eval(), x, latency=False)
    assert not any(isinstance(m, LinearWithPassthrough) for m in folded.modules())
    assert linearize.count_flops(folded, x[:1]) == 2 * _macs(8, 4, 8, False)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), out, rtol=0, atol=1e-12)


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
