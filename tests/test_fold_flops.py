"""The FLOP counter reads every op's operands by position or keyword (timm EVA-02's
``F.linear(x, weight=..., bias=...)``), checked against hand counts of multiply-adds; a failure of the
counter itself is never reported as the user's inputs not fitting the model."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linearize
from linearize.folding import count_flops
from linearize.folding import flops as flops_module
FlopCounterError = getattr(flops_module, "FlopCounterError", ValueError)


class _Op(nn.Module):
    """Runs one op on its stored operands (the input is ignored)."""

    def __init__(self, op: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op()


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# (op with its operands given by keyword, hand count: 2 x multiply-adds)
CASES = {
    "linear": (lambda: F.linear(_t(16, 4), weight=_t(8, 4), bias=_t(8)), 2 * 16 * 8 * 4),
    "linear, 1-D weight": (lambda: F.linear(_t(16, 4), _t(4)), 2 * 16 * 4),
    "conv2d": (lambda: F.conv2d(_t(2, 3, 8, 8), weight=_t(5, 3, 3, 3), padding=1), 2 * (2 * 5 * 64) * 27),
    "conv1d-grouped": (lambda: torch.conv1d(input=_t(1, 4, 9), weight=_t(6, 2, 3), groups=2), 2 * (6 * 7) * 2 * 3),
    "matmul": (lambda: torch.matmul(input=_t(2, 3, 4), other=_t(4, 5)), 2 * (2 * 3 * 5) * 4),
    "mm": (lambda: torch.mm(input=_t(3, 4), mat2=_t(4, 5)), 2 * 15 * 4),
    "bmm": (lambda: torch.bmm(input=_t(2, 3, 4), mat2=_t(2, 4, 5)), 2 * 30 * 4),
    "addmm": (lambda: torch.addmm(_t(5), mat1=_t(3, 4), mat2=_t(4, 5)), 2 * 15 * 4),
    "baddbmm": (lambda: torch.baddbmm(_t(2, 3, 5), batch1=_t(2, 3, 4), batch2=_t(2, 4, 5)), 2 * 30 * 4),
    # q [2, 4, 6, 8], k [.., 10, 8], v [.., 10, 7]: q k^T is 48 x 10 dots of 8, scores @ v 48 x 7 dots of 10
    "sdpa": (lambda: F.scaled_dot_product_attention(query=_t(2, 4, 6, 8), key=_t(2, 4, 10, 8), value=_t(2, 4, 10, 7)),
             2 * (2 * 4 * 6 * 10 * 8 + 2 * 4 * 6 * 7 * 10)),
    # every one of the 2 * 4 * 5 * 5 input elements meets 3 * 3 * 3 weights
    "conv_transpose2d": (lambda: F.conv_transpose2d(_t(2, 4, 5, 5), weight=_t(4, 3, 3, 3)), 2 * (2 * 4 * 25) * 27),
    "Tensor.addmm": (lambda: _t(5).addmm(mat1=_t(3, 4), mat2=_t(4, 5)), 2 * 15 * 4),
    "einsum": (lambda: torch.einsum("bij,bjk->bik", _t(2, 3, 4), _t(2, 4, 5)), 2 * 30 * 4),
    "einsum, operand list": (lambda: torch.einsum("bij,bjk->bik", [_t(2, 3, 4), _t(2, 4, 5)]), 2 * 30 * 4),
    # "..." broadcasts [2, 1] with [6]: 12 batches of a 3 x 4 by 4 x 5 product
    "einsum, broadcast ellipsis": (lambda: torch.einsum("...ij,...jk->...ik", _t(2, 1, 3, 4), _t(6, 4, 5)),
                                   2 * (12 * 15) * 4),
    "einsum, one operand (a trace)": (lambda: torch.einsum("ii->", _t(3, 3)), 0),
    # three operands, contracted left to right as PyTorch does without opt_einsum: (3x4 @ 4x5) then @ 5x6
    "einsum, a chain of three": (lambda: torch.einsum("ij,jk,kl->il", _t(3, 4), _t(4, 5), _t(5, 6)),
                                 2 * 15 * 4 + 2 * 18 * 5),
    "einsum, implicit output": (lambda: torch.einsum("ij,jk,kl", _t(3, 4), _t(4, 5), _t(5, 6)), 2 * 15 * 4 + 2 * 18 * 5),
    # u^T W v: u^T W is 5 dot products of length 4, then one of length 5 (i is summed out after the first)
    "einsum, a bilinear form": (lambda: torch.einsum("i,ij,j->", _t(4), _t(4, 5), _t(5)), 2 * 5 * 4 + 2 * 5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_operands_given_by_keyword_are_counted_like_a_hand_count(name):
    op, hand = CASES[name]
    assert count_flops(_Op(op), torch.zeros(1)) == hand


class _KeywordLinear(nn.Module):
    """The repro: ``F.linear`` with keyword weight and bias, as timm EVA-02 attention calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(F.linear(x, weight=self.fc.weight, bias=self.fc.bias)))


EINSUMS = {  # equation: operand shapes; each contraction here runs as matmuls inside torch.einsum
    "ij,jk,kl->l": [(1000, 3), (3, 4), (4, 5)],  # i: summed out of the first operand before any product
    "ij,jk,kl->i": [(2, 3), (3, 4), (4, 1000)],  # l: likewise, of the last
    "...ij,...jk,kl->il": [(6, 2, 3), (6, 3, 4), (4, 5)],  # the batch dims the output drops
    "ij,jk,kl->il": [(0, 3), (3, 4), (4, 5)],  # an empty operand: no work
    "ij,jk->k": [(3, 4), (4, 5)],
    "bij,bjk,bkl->bil": [(1, 2, 3), (4, 3, 5), (4, 5, 6)],  # a batch of 1 broadcast to 4
    "ab,bc,cd,de->ae": [(2, 3), (3, 4), (4, 5), (5, 6)],
    "ii,ij->j": [(3, 3), (3, 4)],  # a diagonal
}


@pytest.mark.parametrize("equation", list(EINSUMS))
def test_einsum_counts_what_torch_runs(equation):
    """Truth: torch's own FLOP counter on the matmuls that torch.einsum runs (aten level)."""
    from torch.utils.flop_counter import FlopCounterMode

    operands = [_t(*shape) for shape in EINSUMS[equation]]
    with FlopCounterMode(display=False) as truth:
        torch.einsum(equation, *operands)
    assert count_flops(_Op(lambda: torch.einsum(equation, *operands)), torch.zeros(1)) == truth.get_total_flops()


def test_fold_counts_a_keyword_linear():
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    model = linearize.convert(_KeywordLinear().eval(), example_inputs=x)
    folded = linearize.fold(model, x, latency=False)
    assert folded.linearize_fold_summary.flops_before == 2 * 16 * 4 * 8 + 2 * 16 * 8 * 2


def test_a_failure_of_the_counter_is_not_blamed_on_the_inputs(monkeypatch):
    def broken(*args: object) -> int:
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(flops_module, "_op_flops", broken)
    model = nn.Sequential(nn.Linear(4, 2)).eval()
    with pytest.raises(FlopCounterError, match="FLOP counter failed on .*linear.*IndexError") as info:
        linearize.fold(model, torch.randn(3, 4), latency=False)
    assert "do not fit" not in str(info.value)


def _brute_conv(x: torch.Tensor, w: torch.Tensor, stride: tuple, padding: tuple, dilation: tuple, groups: int,
                transposed: bool, output_padding: tuple = ()) -> tuple[torch.Tensor, int]:
    """A (transposed) conv computed from its definition, one multiply-add at a time: ``(output, multiply-adds)``.
    Zero-padding products count, as the dense op does them; a transposed conv scatters every input element
    into a full output that padding then crops."""
    import itertools

    import numpy as np

    unbatched = x.ndim == w.ndim - 1
    xs, ws = (x.unsqueeze(0) if unbatched else x).double().numpy(), w.detach().double().numpy()
    n, cin, space, kernel = xs.shape[0], xs.shape[1], xs.shape[2:], ws.shape[2:]
    macs = 0
    if not transposed:  # out[b, o, p] = sum over the group's inputs c and kernel taps k of w[o, c, k] x_pad[b, c, p*s + k*d]
        cout, cin_g = ws.shape[0], ws.shape[1]
        xs = np.pad(xs, [(0, 0), (0, 0), *((p, p) for p in padding)])
        size = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, p, d, k, st in zip(space, padding, dilation, kernel, stride)]
        out = np.zeros((n, cout, *size))
        for b, o, pos, c, k in itertools.product(range(n), range(cout), itertools.product(*map(range, size)),
                                                 range(cin_g), itertools.product(*map(range, kernel))):
            src = tuple(p * st + kk * d for p, st, kk, d in zip(pos, stride, k, dilation))
            out[(b, o, *pos)] += ws[(o, c, *k)] * xs[(b, o // (cout // groups) * cin_g + c, *src)]
            macs += 1
    else:  # full[b, g*cout_g + o, i*s + k*d] += x[b, c, i] w[c, o, k], then crop padding from both ends
        cout_g = ws.shape[1]
        full_size = [(s - 1) * st + d * (k - 1) + 1 + op for s, st, d, k, op in
                     zip(space, stride, dilation, kernel, output_padding)]
        full = np.zeros((n, cout_g * groups, *full_size))
        for b, c, pos, o, k in itertools.product(range(n), range(cin), itertools.product(*map(range, space)),
                                                 range(cout_g), itertools.product(*map(range, kernel))):
            dst = tuple(p * st + kk * d for p, st, kk, d in zip(pos, stride, k, dilation))
            full[(b, c // (cin // groups) * cout_g + o, *dst)] += xs[(b, c, *pos)] * ws[(c, o, *k)]
            macs += 1
        out = full[(slice(None), slice(None), *(slice(p, f - p) for p, f in zip(padding, full_size)))]
    out = torch.from_numpy(np.ascontiguousarray(out))
    return (out[0] if unbatched else out), macs


def _brute_matmul(x: torch.Tensor, w_in_out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x @ W`` over the last dim from its definition: ``(output, multiply-adds)``."""
    rows, w = x.reshape(-1, x.shape[-1]).double().tolist(), w_in_out.detach().double().tolist()
    out, macs = [[0.0] * len(w[0]) for _ in rows], 0
    for r, row in enumerate(rows):
        for j in range(len(w[0])):
            for i in range(len(w)):
                out[r][j] += row[i] * w[i][j]
                macs += 1
    return torch.tensor(out, dtype=torch.float64).reshape(*x.shape[:-1], len(w[0])), macs



# name: (layer, input shape); strides, padding, dilation, groups and output_padding all differ from 1 / 0
LAYERS = {
    "Conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2), (2, 4, 9)),
    "Conv1d, unbatched": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2), (4, 9)),
    "Conv2d": (lambda: nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2), (2, 4, 7, 6)),
    "Conv3d": (lambda: nn.Conv3d(2, 4, 2, stride=(1, 2, 1), padding=1, dilation=(2, 1, 1), groups=2), (1, 2, 4, 5, 3)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, dilation=2,
                                                   groups=2), (2, 4, 5)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 3), padding=(1, 0), output_padding=(1, 2),
                                                   dilation=(1, 2), groups=2), (2, 4, 3, 4)),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(2, 4, 2, stride=2, padding=(0, 1, 0), groups=2), (1, 2, 3, 2, 3)),
    "Linear": (lambda: nn.Linear(5, 3), (2, 4, 5)),
    "LinearWithPassthrough": (lambda: linearize.folding.LinearWithPassthrough(5, 3), (2, 4, 5)),
    "ConvWithPassthrough": (lambda: linearize.folding.ConvWithPassthrough(4, 6, 1), (2, 4, 3, 3)),
    "HF Conv1D": (lambda: __import__("transformers.pytorch_utils").pytorch_utils.Conv1D(3, 5), (2, 4, 5)),
}


def _brute_layer(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The layer's op (without bias) from its definition: ``(output, multiply-adds)``."""
    if isinstance(m, nn.Linear):
        return _brute_matmul(x, m.weight.T)
    if isinstance(m, nn.modules.conv._ConvNd):
        transposed = isinstance(m, nn.modules.conv._ConvTransposeNd)
        return _brute_conv(x, m.weight, m.stride, m.padding, m.dilation, m.groups, transposed,
                           m.output_padding if transposed else ())
    return _brute_matmul(x, m.weight)  # HF Conv1D: weight [in, out]


@pytest.mark.parametrize("name", list(LAYERS))
def test_module_flops_and_count_flops_equal_the_multiply_adds_of_the_layers_definition(name):
    """Truth: the op computed from its definition, counting each multiply-add (its output checked against
    the layer's); fold's planner and the sparsifier's weights (module_flops, also on meta shapes) and the
    summary (count_flops) must both give 2 FLOPs per multiply-add."""
    torch.manual_seed(0)
    make, shape = LAYERS[name]
    m = make().double()
    if getattr(m, "bias", None) is not None:
        nn.init.zeros_(m.bias)
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        out = m(x)
    brute, macs = _brute_layer(m, x)
    op_out = out[..., :m.out_features] if isinstance(m, linearize.folding.LinearWithPassthrough) else out
    op_out = op_out[:, :m.out_channels] if isinstance(m, linearize.folding.ConvWithPassthrough) else op_out
    assert torch.allclose(op_out, brute, atol=1e-12)
    assert flops_module.module_flops(m, (x,), out) == 2 * macs
    meta = (torch.empty(x.shape, device="meta"),), torch.empty(out.shape, device="meta")
    assert flops_module.module_flops(m, *meta) == 2 * macs
    assert count_flops(m, x) == 2 * macs
