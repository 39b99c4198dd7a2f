"""freeze: snapping, gradient stop, and stably-active channels on data (seed 004)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import linearize
from linearize import LinearizableActivation


def mlp(slopes=None, bias0=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), LinearizableActivation("relu", 5, -1), nn.Linear(5, 2))
    with torch.no_grad():
        if slopes is not None:
            model[1].slope.copy_(torch.tensor(slopes))
        if bias0 is not None:
            model[0].bias.copy_(torch.tensor(bias0))
    return model


def test_snaps_to_one_and_zero_with_counts():
    model = mlp(slopes=[0.9995, 0.5, 0.0005, 1.0, 0.998])
    summary = linearize.freeze(model, tol=1e-3, snap_zero=True)
    assert torch.equal(model[1].slope.detach(), torch.tensor([1.0, 0.5, 0.0, 1.0, 0.998]))
    site = summary.sites["1"]
    assert (site["linear_before"], site["linear_after"]) == (1, 2)
    assert site["snapped_one"] == 2  # channels 0 and 3 newly frozen at 1
    assert site["snapped_zero"] == 1
    assert summary.stably_active == 0
    frozen = model[1].frozen
    assert frozen[0] == 1 and frozen[3] == 1 and frozen[2] == 0
    assert torch.isnan(frozen[[1, 4]]).all()


def test_without_snap_zero_small_slopes_stay_free():
    model = mlp(slopes=[0.0005, 0.2, 0.3, 0.4, 0.5])
    summary = linearize.freeze(model, tol=1e-3)
    assert summary.snapped_zero == 0 and summary.snapped_one == 0
    assert model[1].slope[0].item() == pytest.approx(0.0005)
    assert torch.isnan(model[1].frozen).all()


def test_frozen_channels_stop_training_the_rest_trains():
    model = mlp(slopes=[0.9999, 0.5, 0.5, 0.5, 0.5])
    linearize.freeze(model, tol=1e-3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    x = torch.randn(64, 3)
    before = model[1].slope.detach().clone()
    for _ in range(5):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    after = model[1].slope.detach()
    assert after[0].item() == 1.0
    assert not torch.equal(after[1:], before[1:])


def _expected_stably_active(model, x):
    pre = model[0](x)
    return pre.amin(0) > 0


@pytest.mark.parametrize("as_", ["tensor", "loader", "list"])
def test_stably_active_on_data_matches_brute_force_and_keeps_outputs(as_):
    model = mlp(slopes=[0.1, 0.2, 0.3, 0.4, 0.0], bias0=[5.0, -5.0, 0.0, 4.0, 0.1])
    x = torch.rand(200, 3)
    expected = _expected_stably_active(model, x)
    assert 0 < int(expected.sum()) < 5  # the case is not trivial
    y0 = model(x).detach()
    data = {"tensor": x, "loader": DataLoader(TensorDataset(x, torch.zeros(200)), batch_size=32),
            "list": list(x.split(50))}[as_]
    summary = linearize.freeze(model, data=data)
    assert summary.stably_active == int(expected.sum())
    assert torch.equal(model[1].slope.detach() == 1, expected)
    assert torch.equal(model(x).detach(), y0)  # linear there: the function on the data is unchanged


def test_conv_unit_counts_every_position():
    torch.manual_seed(1)
    conv = nn.Conv2d(2, 4, 3, padding=1)
    model = nn.Sequential(conv, LinearizableActivation("relu", 4, 1), nn.Flatten(), nn.Linear(4 * 36, 2))
    with torch.no_grad():
        conv.bias.copy_(torch.tensor([6.0, 0.0, -6.0, 0.5]))
    x = torch.rand(16, 2, 6, 6)
    expected = conv(x).amin(dim=(0, 2, 3)) > 0
    summary = linearize.freeze(model, data=x)
    assert summary.sites["1"]["stably_active"] == int(expected.sum()) >= 1
    assert torch.equal(model[1].slope.detach() == 1, expected)


def test_data_pass_restores_training_flags_and_batchnorm_stats():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), LinearizableActivation("relu", 4, -1))
    model.train()
    model[1].eval()  # a mixed state that must survive
    stats = model[1].running_mean.clone()
    linearize.freeze(model, data=torch.randn(8, 3) + 3)
    assert model.training and model[0].training and not model[1].training
    assert torch.equal(model[1].running_mean, stats)


def test_non_relu_units_are_skipped_on_data():
    model = nn.Sequential(nn.Linear(3, 4), LinearizableActivation(nn.GELU(), 4, -1))
    with torch.no_grad():
        model[0].bias.fill_(10.0)
    summary = linearize.freeze(model, data=torch.rand(8, 3))
    assert summary.skipped_sites == ["1"] and summary.stably_active == 0


def test_errors():
    with pytest.raises(ValueError, match="convert"):
        linearize.freeze(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ValueError, match="empty loader"):
        linearize.freeze(mlp(), data=[])
    with pytest.raises(ValueError, match="empty tensor"):
        linearize.freeze(mlp(), data=torch.zeros(0, 3))
    with pytest.raises(TypeError, match="DataLoader"):
        linearize.freeze(mlp(), data=3)
    x = torch.rand(4, 3)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN.*'1'"):
        linearize.freeze(mlp(), data=x)
    with pytest.raises(ValueError, match="tol"):
        linearize.freeze(mlp(), tol=0.7)


@pytest.mark.parametrize("activation", ["relu", nn.GELU()])
def test_data_without_a_batch_is_refused_before_any_change(activation):
    """data=[] ran as data=None on a model without ReLU-like units, and on one with them raised only after it had
    snapped and frozen channels (one_shot, prune and the measures refuse it up front). Truth: a copy's tensors."""
    model = nn.Sequential(nn.Linear(3, 4), LinearizableActivation(activation, 4, -1))
    with torch.no_grad():
        model[1].slope.copy_(torch.tensor([1 - 1e-4, 0.5, 0.0, 1.0]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for empty in ([], DataLoader(TensorDataset(torch.zeros(0, 3)), batch_size=2), iter([])):
        with pytest.raises(ValueError, match="yielded no batches"):
            linearize.freeze(model, data=empty)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True, msg=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_snap_zero_is_exact_in_the_slope_dtype(dtype):
    """``a <= tol`` as float64 decides it (the truth), not ``tol`` rounded into the slope's dtype."""
    v = float(torch.tensor(0.0035).to(dtype))
    tol = v - 1e-7  # rounds up onto v in dtype: a slope of exactly v lies above tol and must stay free
    assert float(torch.tensor(tol, dtype=torch.float64).to(dtype)) == v > tol
    slopes = torch.tensor([v, 0.0, 0.5, tol / 2, 1.0]).to(dtype)
    model = mlp()
    model[1].slope.data = slopes.clone()
    linearize.freeze(model, tol=tol, snap_zero=True)
    assert torch.equal(model[1].frozen == 0, slopes.double() <= tol)


def test_convert_and_freeze_inside_inference_mode_freeze_the_expected_channels():
    # channel 0: pre-activation 100 + W x > 0 on all data (stably active); channel 1 slope 0.9995 (snaps);
    # channels 2-4: slopes 0.5, 0.3, 0 and mixed signs: free. Expected, by hand: frozen [1, 1, nan, nan, nan].
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).eval()
    x = torch.randn(64, 3)
    with torch.no_grad():
        base[0].bias.copy_(torch.tensor([100.0, 0.0, 0.0, 0.0, 0.0]))
    with torch.inference_mode():
        model = linearize.convert(base, example_inputs=x)
        model[1].slope.copy_(torch.tensor([0.2, 0.9995, 0.5, 0.3, 0.0]))
        summary = linearize.freeze(model, tol=1e-3, data=x)
        y = model(x)
    frozen = model[1].frozen
    assert torch.equal(frozen[:2], torch.ones(2)) and torch.isnan(frozen[2:]).all()
    assert summary.sites["1"]["snapped_one"] == 1 and summary.sites["1"]["stably_active"] == 1
    a = torch.tensor([1.0, 1.0, 0.5, 0.3, 0.0], dtype=torch.float64)
    w1, b1, w2, b2 = (p.detach().double() for p in (base[0].weight, base[0].bias, base[2].weight, base[2].bias))
    h = x.double() @ w1.T + b1
    ref = torch.where(h > 0, h, a * h) @ w2.T + b2
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
