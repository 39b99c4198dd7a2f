"""The running least-squares fit of the units' activations during training (``linearize.RunningFit``),
against brute force: float64 weighted least squares (numpy) over the exact positions and weights the
decayed window means, the outgoing weights read off the layer, and a two-process run against one process
seeing both batches."""

from __future__ import annotations

import copy
import socket
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import linearize

pytestmark = pytest.mark.usefixtures("one_thread")


def _net(act: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    return linearize.convert(nn.Sequential(nn.Linear(4, 6), act or nn.GELU(), nn.Linear(6, 3)),
                             example_inputs=torch.randn(2, 4))


def _pre_activations(net: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return net[0](x).double().numpy()


def _weighted_lstsq(h: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per channel: argmin sum w (y - alpha h - beta)^2 by numpy's lstsq, and the weighted mean residual."""
    alphas, betas, residuals = [], [], []
    sw = np.sqrt(w)
    for c in range(h.shape[1]):
        design = np.stack([h[:, c], np.ones(len(h))], 1) * sw[:, None]
        (alpha, beta), *_ = np.linalg.lstsq(design, y[:, c] * sw, rcond=None)
        alphas.append(alpha)
        betas.append(beta)
        residuals.append(float((w * (y[:, c] - alpha * h[:, c] - beta) ** 2).sum() / w.sum()))
    return np.array(alphas), np.array(betas), np.array(residuals)


def test_decayed_window_is_the_weighted_least_squares_fit_of_all_batches_seen():
    net = _net()
    tracker = linearize.RunningFit(net, decay=0.5)
    xs = [torch.randn(40, 4) * (k + 1) + k for k in range(3)]  # shifting batches: the weights matter
    for x in xs:
        net(x)
        tracker.step()
    h = np.concatenate([_pre_activations(net, x) for x in xs])
    y = torch.nn.functional.gelu(torch.from_numpy(h).float()).double().numpy()  # the unit computes in float32
    w = np.concatenate([np.full(40, 0.5 ** (len(xs) - 1 - k)) for k in range(len(xs))])
    alpha, beta, residual = _weighted_lstsq(h, y, w)
    fit = tracker.fits()["1"]
    np.testing.assert_allclose(fit.alpha.numpy(), alpha, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fit.beta.numpy(), beta, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fit.residual.numpy(), residual, rtol=1e-7, atol=1e-12)
    assert fit.count == pytest.approx(40 * (0.25 + 0.5 + 1))
    w_out = net[2].weight.detach().double()
    np.testing.assert_allclose(fit.outgoing.numpy(), (w_out ** 2).sum(0).numpy(), rtol=1e-12)
    tracker.close()


def test_two_forwards_in_one_step_count_alike_and_eval_and_copies_are_not_recorded():
    net = _net(nn.ReLU())
    tracker = linearize.RunningFit(net, decay=0.9)
    a, b = torch.randn(30, 4), torch.randn(20, 4)
    net(a)
    net(b)  # gradient accumulation: two forwards before one step
    net.eval()
    net(torch.randn(50, 4) * 100)  # an evaluation pass: not training data
    net.train()
    twin = copy.deepcopy(net)  # e.g. a teacher copied from the student: holds no-op hooks in their place
    twin(torch.randn(50, 4) * 100)
    tracker.step()
    h = np.concatenate([_pre_activations(net, a), _pre_activations(net, b)])
    alpha, beta, _ = _weighted_lstsq(h, np.maximum(h, 0), np.ones(len(h)))
    fit = tracker.fits()["1"]
    np.testing.assert_allclose(fit.alpha.numpy(), alpha, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fit.beta.numpy(), beta, rtol=1e-9, atol=1e-12)
    assert fit.count == 50
    tracker.close()
    assert not any(len(m._forward_pre_hooks) or len(m._forward_hooks) for m in net.modules())


def test_a_recorded_model_and_its_deep_copies_pickle_and_their_forwards_are_not_recorded():
    """torch.save(model) while a RunningFit (a default Sparsifier's) records it, and of a deep copy made then
    (an EMA, a "best so far" copy), used to fail on the hook closures, on the copy for good. Truth: the
    unpickled models compute what the original does, and neither they nor the copy add to the fit."""
    import io
    import pickle

    net = _net()
    tracker = linearize.RunningFit(net)
    x = torch.randn(30, 4)
    expected = net(x)
    twin = copy.deepcopy(net)
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    restored = pickle.loads(pickle.dumps(twin))
    for other in (loaded, restored, twin):
        torch.testing.assert_close(other(x), expected, rtol=0, atol=0)
    tracker.step()
    assert tracker.fits()["1"].count == 30  # the forward of net only
    tracker.close()
    pickle.dumps(twin)  # after the fit's end too


def test_positions_holding_nan_or_inf_are_left_out_of_the_fit():
    """A position whose input holds NaN/inf (an overflow, NaN padding) used to drop its whole step (every step,
    with NaN padding in every batch: no fit at all); now only that position is left out. Truth: numpy's
    weighted least squares over the finite positions."""
    net = _net()
    tracker = linearize.RunningFit(net, decay=0.5)
    a, bad, c = torch.randn(40, 4), torch.randn(40, 4), torch.randn(40, 4) * 2 + 1
    bad[3, 0] = float("inf")  # e.g. an fp16 overflow: a step a loss scaler skips
    for x in (a, bad, c):
        x[-2:] = float("nan")  # padded positions, in every batch
        net(x)
        tracker.step()
    fit = tracker.fits()["1"]
    finite = [a[:-2], torch.cat([bad[:3], bad[4:-2]]), c[:-2]]
    h = np.concatenate([_pre_activations(net, x) for x in finite])
    y = torch.nn.functional.gelu(torch.from_numpy(h).float()).double().numpy()
    w = np.concatenate([np.full(len(x), 0.5 ** (2 - k)) for k, x in enumerate(finite)])
    alpha, beta, _ = _weighted_lstsq(h, y, w)
    np.testing.assert_allclose(fit.alpha.numpy(), alpha, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fit.beta.numpy(), beta, rtol=1e-9, atol=1e-12)
    assert fit.count == pytest.approx(38 * 0.25 + 37 * 0.5 + 38) and tracker.left_out == {"1": 7}
    tracker.close()


def test_state_dict_restores_the_fits_and_crafted_states_are_refused():
    net = _net()
    tracker = linearize.RunningFit(net)
    for _ in range(2):
        net(torch.randn(16, 4))
        tracker.step()
    state = tracker.state_dict()
    other = linearize.RunningFit(net)
    assert other.fits() == {}  # nothing seen yet
    other.load_state_dict(state)
    assert torch.equal(other.fits()["1"].alpha, tracker.fits()["1"].alpha)
    bad = copy.deepcopy(state)
    bad["units"]["1"]["sums"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        other.load_state_dict(bad)
    bad = copy.deepcopy(state)
    bad["units"]["1"]["sums"] = torch.zeros(5, 2)
    with pytest.raises(ValueError, match=r"\[5, 6\]"):
        other.load_state_dict(bad)
    with pytest.raises(ValueError, match="must hold the units"):
        other.load_state_dict({"units": {"x": {}}})
    with pytest.raises(ValueError, match="decay"):
        linearize.RunningFit(net, decay=1.0)
    with pytest.raises(ValueError, match="no unit named"):
        linearize.RunningFit(net, units=["nope"])
    tracker.close()
    other.close()


def test_element_units_fit_each_position_and_read_their_channels_outgoing_weights():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.GELU(), nn.Conv2d(3, 4, 1))
    x0 = torch.randn(2, 2, 4, 4)
    net = linearize.convert(net, granularity="element", example_inputs=x0)
    tracker = linearize.RunningFit(net, decay=0.0)
    x = torch.randn(64, 2, 4, 4)
    net(x)
    tracker.step()
    fit = tracker.fits()["1"]
    with torch.no_grad():
        h = net[0](x).reshape(64, -1).double().numpy()  # one column per position, row-major (c, i, j)
    y = torch.nn.functional.gelu(torch.from_numpy(h).float()).double().numpy()
    alpha, beta, _ = _weighted_lstsq(h, y, np.ones(64))
    np.testing.assert_allclose(fit.alpha.numpy(), alpha, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fit.beta.numpy(), beta, rtol=1e-9, atol=1e-12)
    w = net[2].weight.detach().double()
    per_channel = (w ** 2).sum((0, 2, 3))
    np.testing.assert_allclose(fit.outgoing.numpy(), per_channel.repeat_interleave(16).numpy(), rtol=1e-12)
    tracker.close()


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_nested_batches_fit_their_sequences_positions_and_name_where_nan_entered(layout):
    """A nested tensor (torch.nested, which channel units take) through a recorded model crashed the statistics
    hook deep inside torch ("view(): cannot view shape (3, j1, 6) as [-1, 6]"), and the NaN/inf tracker of every
    Sparsifier with it. Truth: numpy's least squares over the positions of the sequences, each run dense; the
    position holding NaN left out, and counted by the tracker as one position."""
    torch.manual_seed(0)
    net = linearize.convert(nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3)),
                            example_inputs=torch.randn(2, 5, 4))
    named = linearize.units(net)
    tracker = linearize.RunningFit(net, decay=0.0)
    inputs = linearize.calibration.NonfiniteInputs(net, named)
    seqs = [torch.randn(n, 4) * (k + 1) for k, n in enumerate((3, 5, 7))]
    seqs[1][2, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the strided layout is a prototype
        net(torch.nested.as_nested_tensor(seqs, layout=layout))
    tracker.step()
    fit = tracker.fits()["1"]
    h = np.concatenate([_pre_activations(net, x) for x in seqs])
    h = h[np.isfinite(h).all(1)]
    y = torch.nn.functional.gelu(torch.from_numpy(h).float()).double().numpy()
    alpha, beta, _ = _weighted_lstsq(h, y, np.ones(len(h)))
    np.testing.assert_allclose(fit.alpha.numpy(), alpha, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fit.beta.numpy(), beta, rtol=1e-9, atol=1e-12)
    assert fit.count == 14 and tracker.left_out["1"] == 1
    np.testing.assert_allclose(fit.outgoing.numpy(), (net[2].weight.detach().double() ** 2).sum(0).numpy())
    assert "unit '1', the first, NaN/inf inputs (1 position) from a finite batch" not in inputs.cause()
    assert "unit '1', the first, NaN/inf inputs (1 position): the batch held them" in inputs.cause()
    tracker.close()
    inputs.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    net = _net()
    tracker = linearize.RunningFit(net)
    torch.manual_seed(10 + rank)
    net(torch.randn(24 + 8 * rank, 4))  # different batch sizes per rank
    tracker.step()
    fit = tracker.fits()["1"]
    torch.save({"alpha": fit.alpha, "beta": fit.beta, "count": fit.count}, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_processes_share_one_fit_over_all_their_batches(tmp_path):
    torch.multiprocessing.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2)
    net = _net()
    batches = []
    for rank in range(2):
        torch.manual_seed(10 + rank)
        batches.append(torch.randn(24 + 8 * rank, 4))
    h = np.concatenate([_pre_activations(net, x) for x in batches])
    y = torch.nn.functional.gelu(torch.from_numpy(h).float()).double().numpy()
    alpha, beta, _ = _weighted_lstsq(h, y, np.ones(len(h)))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["count"] == 56
        np.testing.assert_allclose(got["alpha"].numpy(), alpha, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got["beta"].numpy(), beta, rtol=1e-9, atol=1e-12)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's note on the cycle
@pytest.mark.parametrize("create_graph", [False, True])
def test_batches_whose_gradients_no_step_took_are_left_out_and_accumulated_ones_kept(create_graph):
    """A batch run forward and backward whose gradients are then dropped with no optimizer step (set to None by
    zero_grad: the step a loss scaler skipped) used to count in the fit; micro-batches accumulated into one step
    count all, under backward(create_graph=True) too (which accumulates into a new .grad object at every
    backward: every micro-batch but the last was left out as dropped). Truth: numpy's least squares over
    exactly the batches the optimizer steps took."""
    net = _net()
    unit = linearize.units(net)[0][1]
    tracker = linearize.RunningFit(net, decay=0.0)  # the last step's batches alone
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # the weights stay: the truth reruns them
    g = torch.Generator().manual_seed(3)
    skipped, first, second = (torch.randn(40, 4, generator=g) for _ in range(3))
    net(skipped).sum().backward(create_graph=create_graph)  # its step skipped: no opt.step()
    opt.zero_grad()
    net(first).sum().backward(create_graph=create_graph)  # two micro-batches accumulated into one step
    net(second).sum().backward(create_graph=create_graph)
    opt.step()
    opt.zero_grad()  # create_graph: .grad holds the graph, a reference cycle with the parameter
    tracker.step()
    tracker.close()
    taken = torch.cat([first, second])
    h = _pre_activations(net, taken)
    alpha, beta, _ = _weighted_lstsq(h, unit.activation(torch.from_numpy(h)).numpy(), np.ones(len(h)))
    fit = tracker.fits()["1"]
    np.testing.assert_allclose(fit.alpha.numpy(), alpha, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(fit.beta.numpy(), beta, rtol=1e-6, atol=1e-9)
    assert tracker.skipped_batches == 1 and fit.count == 80
