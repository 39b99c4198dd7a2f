"""``one_shot``'s refit of the layer each unit feeds: the ridge least-squares fit, towards the layer's own weights,
of what the layer computed from the original activation, given the unit's new output. Truths: the same problem
solved by brute force (``torch.linalg.lstsq`` on the stacked data and ridge rows, float64), the layer left as it
was when nothing changed, the error on held-out data, and the unfolded model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn

import linearize


def _ffn(seed: int = 0, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 24), nn.GELU(), nn.Linear(24, 5, bias=bias)).double()
    with torch.no_grad():
        net[0].bias.add_(-0.5)
    return net


@pytest.mark.parametrize("bias", [True, False])
def test_the_refit_is_the_ridge_least_squares_solution(bias):
    base, x = _ffn(bias=bias), torch.randn(400, 6, dtype=torch.float64)
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    sites = linearize.one_shot(net, x, target=0.25)
    assert sites["1"].refit == "2"
    unit = net[1]
    with torch.no_grad():  # brute force: stacked least squares, the ridge as extra rows
        h = base[0](x)
        target = F.gelu(h) @ base[2].weight.T
        alpha, beta = unit.linear_end
        u = torch.where(sites["1"].linear, alpha * h + beta, F.gelu(h))
        cols = [u, torch.ones(len(u), 1, dtype=u.dtype)] if bias else [u]
        a = torch.cat(cols, 1)
        r = 1e-3 * float((u * u).sum(0).mean())
        reg = torch.zeros(24, a.shape[1], dtype=a.dtype)
        reg[:, :24] = math.sqrt(r) * torch.eye(24, dtype=a.dtype)
        rhs = torch.cat([target, math.sqrt(r) * base[2].weight.T])
        sol = torch.linalg.lstsq(torch.cat([a, reg]), rhs).solution
    torch.testing.assert_close(net[2].weight, sol[:24].T, rtol=1e-8, atol=1e-10)
    if bias:
        torch.testing.assert_close(net[2].bias, base[2].bias + sol[24], rtol=1e-8, atol=1e-10)
    else:
        assert net[2].bias is None


def test_a_unit_left_unchanged_leaves_its_layer_as_it_was():
    base, x = _ffn(), torch.randn(300, 6, dtype=torch.float64)
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    assert "computes what it did" in linearize.one_shot(net, x, target=1.0)["1"].refit
    assert torch.equal(net[2].weight, base[2].weight) and torch.equal(net[2].bias, base[2].bias)


@pytest.mark.parametrize("end", ["affine", "identity"])
def test_the_refit_lowers_the_error_on_held_out_data_and_folds_exactly(end):
    base = _ffn(1)
    x, held_out = torch.randn(1000, 6, dtype=torch.float64), torch.randn(1000, 6, dtype=torch.float64)
    errors = {}
    for refit in (False, True):
        net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
        linearize.one_shot(net, x, target=0.25, end=end, refit=refit)
        with torch.no_grad():
            errors[refit] = float(((net(held_out) - base(held_out)) ** 2).mean())
        folded = linearize.fold(copy.deepcopy(net).eval(), x[:8], latency=False)
        with torch.no_grad():
            torch.testing.assert_close(folded(held_out), net(held_out), rtol=1e-9, atol=1e-9)
    assert errors[True] < errors[False]


def test_a_hugging_face_conv1d_layer_is_refit_in_its_own_layout():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, 50, (16, 12))
    net = linearize.convert(copy.deepcopy(base), example_inputs={"input_ids": ids[:2]})
    data = [{"input_ids": ids[i:i + 4]} for i in range(0, 16, 4)]
    errors = {}
    for refit in (False, True):
        student = copy.deepcopy(net)
        sites = linearize.one_shot(student, data, target=0.25, refit=refit)
        with torch.no_grad():
            errors[refit] = float(((student(input_ids=ids).last_hidden_state
                                    - base(input_ids=ids).last_hidden_state) ** 2).mean())
    assert list(sites.values())[0].refit == "h.0.mlp.c_proj"
    assert errors[True] < errors[False]


def test_units_whose_layer_cannot_be_refit_say_why_and_keep_it():
    class TwoConsumers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act, self.b, self.c = nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3), nn.Linear(8, 3)

        def forward(self, x):
            h = self.act(self.a(x))
            return self.b(h) + self.c(h)

    class SharedLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act, self.b = nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.act(self.a(x))) + self.b(x)  # b also takes the raw input

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    for cls, why in ((TwoConsumers, "feeds 2 layers"), (SharedLayer, "takes other inputs")):
        base = cls()
        net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
        sites = linearize.one_shot(net, x, target=0.5, outgoing={"act": torch.ones(8)} if cls is TwoConsumers else None)
        assert why in sites["act"].refit
        for name, p in base.named_parameters():
            if not name.startswith("a."):
                assert torch.equal(p, net.get_parameter(name)), name


def test_a_deep_stack_is_refit_layer_by_layer_and_ends_closer_than_without():
    """Each layer is refit on the inputs the refits before it left (one simultaneous pass over the original's
    inputs made a 10-layer GELU MLP worse than no refit at all): held-out error below refit=False's."""
    torch.manual_seed(0)
    layers = []
    for _ in range(10):
        layers += [nn.Linear(16, 16), nn.GELU()]
    base = nn.Sequential(*layers, nn.Linear(16, 4)).double()
    x, held_out = torch.randn(2000, 16, dtype=torch.float64), torch.randn(2000, 16, dtype=torch.float64)
    errors = {}
    for refit in (False, True):
        net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
        linearize.one_shot(net, x, target=0.25, refit=refit)
        with torch.no_grad():
            errors[refit] = float(((net(held_out) - base(held_out)) ** 2).mean())
    assert errors[True] < errors[False]


class _Tied(nn.Module):
    """An FFN whose second layer's weight another module holds too (a tied head)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _ffn()
        self.other = nn.Linear(24, 5).double()
        self.other.weight = self.net[2].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_layer_whose_weight_a_hook_computes_or_another_module_shares_is_left_as_it_is():
    """torch's pruning (as weight_norm) recomputes the weight from hidden tensors before each forward (a refit of
    ``weight`` was overwritten, the bias shift kept alone), and a weight tied to another module would change that module too:
    both layers are left as they are, and the site says why."""
    x = torch.randn(300, 6, dtype=torch.float64)
    normed = _ffn()
    torch.nn.utils.prune.l1_unstructured(normed[2], "weight", amount=0.2)  # weight = weight_orig * mask, by a hook
    for model, why in ((normed, "computed by a hook or parametrization"), (_Tied(), "shared with 'other'")):
        net = linearize.convert(model, example_inputs=x[:2])
        layers = [m for m in net.modules() if isinstance(m, nn.Linear)]
        before = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in layers]
        sites = linearize.one_shot(net, x, target=0.25)
        assert why in next(iter(sites.values())).refit
        for m, (w, b) in zip(layers, before):
            assert torch.equal(m.weight, w) and torch.equal(m.bias, b)


def test_a_second_call_keeps_the_linear_channels_and_the_fraction():
    """Linear channels stay linear and the ranking is among the others (a second call ranked every channel again by
    the refit layer's norms and froze a different set: 0.25 became 0.1875). One unit on the same data: nothing
    changes at all; a deep stack: the same channels, the fraction held; a larger target cannot undo linear
    channels (warned); the hybrid plans from the start and refuses."""
    base, x = _ffn(), torch.randn(600, 6, dtype=torch.float64)
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    first = linearize.one_shot(net, x, target=0.25)["1"]
    state = copy.deepcopy(net.state_dict())
    second = linearize.one_shot(net, x, target=0.25)["1"]
    assert torch.equal(second.linear, first.linear) and linearize.nonlinear_fraction(net) == 0.25
    torch.testing.assert_close(net.state_dict(), state, rtol=0, atol=0, equal_nan=True)
    with pytest.warns(UserWarning, match=r"one_shot\(target=0.5\): 1 unit.*1 \(6 of 12\).*not made nonlinear again"):
        linearize.one_shot(net, x, target=0.5)
    assert linearize.nonlinear_fraction(net) == 0.25
    with pytest.raises(ValueError, match=r"end='hybrid'.*\['1'\] already have linear channels.*freshly converted"):
        linearize.one_shot(net, x, end="hybrid", flops=0.5)

    torch.manual_seed(1)
    deep = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3)).double()
    net = linearize.convert(deep, example_inputs=x[:2])
    first = {n: s.linear.clone() for n, s in linearize.one_shot(net, x, target=0.25).items()}
    second = linearize.one_shot(net, x, target=0.25)
    assert all(torch.equal(second[n].linear, first[n]) for n in first)
    assert linearize.nonlinear_fraction(net) == 0.25


@pytest.mark.parametrize("conv", [nn.Conv2d, nn.Conv1d])
def test_a_1x1_conv_is_refit_to_the_ridge_least_squares_solution(conv):
    """A unit on ``[N, C, H, W]`` (or ``[N, C, L]``) inputs feeding a 1x1 conv: the refit ran the unit on 2-D rows,
    which it refuses as unbatched (a ValueError from inside the unit). Truth: the stacked float64 least squares."""
    torch.manual_seed(0)
    base = nn.Sequential(conv(4, 12, 1), nn.GELU(), conv(12, 5, 1)).double()
    x = torch.randn(40, 4, *([3, 3] if conv is nn.Conv2d else [7]), dtype=torch.float64)
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    sites = linearize.one_shot(net, x, target=0.25)
    assert sites["1"].refit == "2"
    with torch.no_grad():
        h = base[0](x).movedim(1, -1).reshape(-1, 12)  # one row per position
        w = base[2].weight.reshape(5, 12)
        target = F.gelu(h) @ w.T
        alpha, beta = net[1].linear_end
        u = torch.where(sites["1"].linear, alpha * h + beta, F.gelu(h))
        a = torch.cat([u, torch.ones(len(u), 1, dtype=u.dtype)], 1)
        r = 1e-3 * float((u * u).sum(0).mean())
        reg = torch.zeros(12, 13, dtype=a.dtype)
        reg[:, :12] = math.sqrt(r) * torch.eye(12, dtype=a.dtype)
        sol = torch.linalg.lstsq(torch.cat([a, reg]), torch.cat([target, math.sqrt(r) * w.T])).solution
    torch.testing.assert_close(net[2].weight.reshape(5, 12), sol[:12].T, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(net[2].bias, base[2].bias + sol[12], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("end", ["affine", "constant", "hybrid"])
def test_a_failed_call_leaves_the_model_as_it_was(end):
    """one_shot raising midway (here the data fails on the second unit's refit pass, after the first unit's layer
    was refit) had already set slopes, frozen flags, ends and a layer's weights: every tensor is put back, the same
    parameter objects, with the same values."""
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3)).double()
    x = torch.randn(200, 6, dtype=torch.float64)
    net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
    state = copy.deepcopy(net.state_dict())
    params = dict(net.named_parameters())
    passes, written = [], []

    def fail_on_the_second_refit(module, args, out):  # 1 calibration, 1 finding the layers, 1 per refit
        passes.append(1)
        if len(passes) == (5 if end == "hybrid" else 4):  # the hybrid measures its plans in one more pass
            written.append(not torch.equal(net[2].weight, base[2].weight))
            raise RuntimeError("data failed")

    net[4].register_forward_hook(fail_on_the_second_refit)
    kw = {"flops": 0.5} if end == "hybrid" else {"target": 0.25}
    with pytest.raises(ValueError, match="data failed"):
        linearize.one_shot(net, x, end=end, **kw)
    assert written == [True]  # the first refit had changed that layer
    torch.testing.assert_close(net.state_dict(), state, rtol=0, atol=0, equal_nan=True)
    assert dict(net.named_parameters()) == params and net[1].linear_end is None
    assert linearize.nonlinear_fraction(net) == 1.0


@pytest.mark.parametrize("end", ["affine", "constant", "hybrid"])
def test_a_unit_whose_output_is_0_on_the_data_leaves_its_layer_and_says_why(end):
    """A unit whose output is 0 at every position (fed by a zero-initialised layer) makes the normal equations
    singular: torch's solve raised its raw singular-matrix error before the check meant for it. Truth: the same call
    with refit=False, which the refit must leave as it is."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).double()
    with torch.no_grad():
        base[0].weight.zero_()
        base[0].bias.zero_()
    x = torch.randn(256, 8, dtype=torch.float64)
    kw = {"flops": 0.5} if end == "hybrid" else {"target": 0.25}
    states = {}
    for refit in (False, True):
        net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
        sites = linearize.one_shot(net, x, end=end, refit=refit, **kw)
        states[refit] = net.state_dict()
    assert sites["1"].refit == "its input is 0 on the data (not refit)"
    torch.testing.assert_close(states[True], states[False], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(states[True]["2.weight"], base[2].weight)
