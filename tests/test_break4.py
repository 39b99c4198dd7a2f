"""Fourth break-it round, the library: defects a hostile review found in folded saves, the
distillation loss, reused activation modules, low-precision LeakyReLU units, guessed probe inputs,
in-place activations whose input is read again, and in-place SELU/CELU calls (each test failed on the
code it was written against). The linear-regions allow-list is tested in tests/test_regions.py."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linearize
from linearize import deploy
from linearize.functional_sites import FunctionalSiteError


def _seq() -> nn.Module:
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)), example_inputs=torch.randn(2, 4))
    _set_slopes(model)
    return model.eval()


def _set_slopes(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.copy_(torch.rand(unit.slope.shape, generator=g))


# ----------------------------------------------------------------------------- save_folded


def test_save_folded_interrupted_before_its_json_keeps_the_previous_save(tmp_path, monkeypatch):
    x = torch.randn(5, 4)
    first = linearize.fold(_seq(), x)
    linearize.save_folded(first, tmp_path)
    second = copy.deepcopy(first)
    with torch.no_grad():
        second[0].weight.add_(1.0)
    writes = []
    real = deploy.atomic_write

    def failing(path, data):
        writes.append(path.name)
        if path.name == deploy.FOLDED_CONFIG:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(deploy, "atomic_write", failing)
    with pytest.raises(OSError):
        linearize.save_folded(second, tmp_path)
    monkeypatch.undo()
    assert writes[0].startswith("folded-")  # the weights went to a new file, the JSON failed after
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path)(x), first(x), rtol=0, atol=0)
    linearize.save_folded(second, tmp_path)  # a later save succeeds and removes the orphaned weights
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) == 1
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path)(x), second(x), rtol=0, atol=0)


def test_load_folded_reads_the_old_file_name_and_refuses_paths_out_of_the_folder(tmp_path):
    x = torch.randn(5, 4)
    folded = linearize.fold(_seq(), x)
    linearize.save_folded(folded, tmp_path)
    meta_path = tmp_path / deploy.FOLDED_CONFIG
    meta = json.loads(meta_path.read_text())
    (tmp_path / meta["weights"]["file"]).rename(tmp_path / "folded.safetensors")  # a save of the old layout
    meta["weights"]["file"] = "folded.safetensors"
    meta_path.write_text(json.dumps(meta))
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path)(x), folded(x), rtol=0, atol=0)
    for bad in ("../folded.safetensors", "/etc/passwd", 3, None):
        meta["weights"]["file"] = bad
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(linearize.LoadError, match="names no weights file"):
            linearize.load_folded(tmp_path)


# ----------------------------------------------------------------------------- distill_loss


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


# ----------------------------------------------------------------------------- conversion


class _Loop(nn.Module):
    """One activation module called ``steps`` times (weight-tied recurrence)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(4, 4), nn.ReLU()
        self.steps = 2

    def forward(self, x):
        for _ in range(self.steps):
            x = self.act(self.lin(x))
        return x


def test_a_reused_module_called_more_often_than_in_the_probe_is_refused():
    model = linearize.convert(_Loop(), example_inputs=torch.randn(2, 4))
    model(torch.randn(2, 4))
    model.steps = 1  # fewer calls: each still runs its own call's unit
    model(torch.randn(2, 4))
    model.steps = 3
    with pytest.raises(FunctionalSiteError, match="more than 2 times.*example_inputs="):
        model(torch.randn(2, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("leak", [0.01, 0.2])
def test_leaky_relu_units_are_exact_at_both_ends_in_low_precision(dtype, leak):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    unit = linearize.LinearizableActivation(nn.LeakyReLU(leak), 16)
    assert torch.equal(unit(x), F.leaky_relu(x, leak))
    with torch.no_grad():
        unit.slope.fill_(1.0)
    assert torch.equal(unit(x), x)
    with torch.no_grad():
        unit.slope.fill_(0.5)
    want = 0.5 * F.leaky_relu(x.double(), leak) + 0.5 * x.double()  # the blend's definition in float64
    torch.testing.assert_close(unit(x).double(), want, rtol=2 ** -7, atol=1e-3)


def test_a_wrong_guessed_input_names_the_guess_and_the_fix():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 2)  # registered first, called last
            self.conv = nn.Conv2d(3, 8, 3)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.fc(self.act(self.conv(x)).mean((2, 3)))

    with pytest.raises(ValueError, match=r"guessed the input of Net as a tensor of shape \(2, 8\).*example_inputs="):
        linearize.convert(Net())
    assert len(list(linearize.units(linearize.convert(Net(), example_inputs=torch.randn(2, 3, 8, 8))))) == 1


class _Aliased(nn.Module):
    """``out = relu_(h) + h``: the in-place activation's input is read again (it holds relu(h) then)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.head = nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)

    def forward(self, x):
        h = self.lin(x)
        out = self.act(h)
        return self.head(out + h)


def test_in_place_activation_read_again_keeps_its_function_through_training_fold_and_save(tmp_path):
    torch.manual_seed(0)
    original = _Aliased()
    x = torch.randn(16, 8, requires_grad=True)
    model = linearize.convert(copy.deepcopy(original), example_inputs=x.detach())
    # the truth at init: the original module, forward and input gradient (2 relu(h) feeds the head)
    ref = original(x)
    gx_ref, = torch.autograd.grad(ref.sum(), x)
    out = model(x)
    gx, = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-6)
    # partly linear: the definition (2 * blend(h)) in float64, and the folded model and its save
    _set_slopes(model)
    a = next(u for _, u in linearize.units(model)).slope.detach().double()
    with torch.no_grad():
        h = model.lin.double()(x.detach().double())
        want = model.head.double()(2 * ((1 - a) * h.relu() + a * h))
        model.float()
        torch.testing.assert_close(model(x.detach()).double(), want, rtol=1e-5, atol=1e-5)
        folded = linearize.fold(model, x.detach())
        torch.testing.assert_close(folded(x.detach()).double(), want, rtol=1e-5, atol=1e-5)
        linearize.save_folded(folded, tmp_path)
        loaded = linearize.load_folded(tmp_path, base=_Aliased())
        torch.testing.assert_close(loaded(x.detach()).double(), want, rtol=1e-5, atol=1e-5)


def test_in_place_activations_not_read_again_stay_out_of_place():
    """torchvision's ReLU(inplace=True) everywhere, no input read again: the units keep the cheaper
    out-of-place forward (no copy per call)."""
    torchvision = pytest.importorskip("torchvision")
    model = linearize.convert(torchvision.models.resnet18(num_classes=4), example_inputs=torch.randn(2, 3, 32, 32))
    assert not any(u.inplace for _, u in linearize.units(model))


@pytest.mark.parametrize("call", [torch.selu_, torch.selu, lambda h: torch.celu_(h, 0.5), lambda h: torch.celu(h, 0.5)],
                         ids=["selu_", "selu", "celu_", "celu"])
def test_torch_namespace_selu_and_celu_calls_become_units(call):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(call(self.a(x)))

    torch.manual_seed(0)
    net, x = Net().double(), torch.randn(8, 4, dtype=torch.float64)
    with torch.no_grad():
        ref = net(x.clone())
        model = linearize.convert(net, example_inputs=x.clone())
        assert len(list(linearize.units(model))) == 1
        torch.testing.assert_close(model(x.clone()), ref, rtol=0, atol=0)
        for _, unit in linearize.units(model):
            unit.slope.fill_(1.0)
        # all slopes 1: an affine map, so f(2x) - 2 f(x) + f(0) = 0
        zero = torch.zeros_like(x)
        assert float((model(2 * x) - 2 * model(x.clone()) + model(zero)).abs().max()) < 1e-12


# ----------------------------------------------------------------------------- the review of this round's fixes


def test_two_savers_into_one_folder_leave_the_last_complete_save_loadable(tmp_path, monkeypatch):
    x = torch.randn(5, 4)
    a = linearize.fold(_seq(), x)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[0].weight.add_(1.0)
    real = deploy.atomic_write

    def interleaved(path, data):  # B has written its weights when A saves completely, then B finishes
        real(path, data)
        if path.name.startswith("folded-") and not interleaved.done:
            interleaved.done = True
            monkeypatch.setattr(deploy, "atomic_write", real)
            linearize.save_folded(a, tmp_path)

    interleaved.done = False
    monkeypatch.setattr(deploy, "atomic_write", interleaved)
    linearize.save_folded(b, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path)(x), b(x), rtol=0, atol=0)


def test_load_folded_checks_the_size_before_reading(tmp_path, monkeypatch):
    x = torch.randn(5, 4)
    linearize.save_folded(linearize.fold(_seq(), x), tmp_path)
    meta = json.loads((tmp_path / deploy.FOLDED_CONFIG).read_text())
    weights = tmp_path / meta["weights"]["file"]
    with open(weights, "ab") as f:
        f.truncate(weights.stat().st_size + (1 << 30))  # 1 GiB more, sparse
    monkeypatch.setattr(type(weights), "read_bytes", lambda self: pytest.fail("read a file of the wrong size"))
    with pytest.raises(linearize.LoadError, match="truncated or modified"):
        linearize.load_folded(tmp_path)


def test_folded_float64_prelu_and_a_function_attribute_load_back(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.f = nn.Linear(4, 6), nn.Linear(6, 2), F.relu

        def forward(self, x):
            return self.b(self.f(self.a(x)))

    torch.manual_seed(0)
    x = torch.randn(8, 4, dtype=torch.float64)
    model = linearize.convert(Net().double(), example_inputs=x)
    _set_slopes(model)
    folded = linearize.fold(model, x)
    linearize.save_folded(folded, tmp_path)
    loaded = linearize.load_folded(tmp_path, base=Net().double())
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-10, atol=1e-10)


def test_in_place_check_with_init_slope_the_model_input_and_integer_outputs():
    class OnInput(nn.Module):  # the activation works in place on the model's own input
        def __init__(self, argmax=False):
            super().__init__()
            self.act, self.fc, self.argmax = nn.ReLU(inplace=True), nn.Linear(4, 3), argmax

        def forward(self, x):
            out = self.fc(self.act(x) + x)
            return out.argmax(1) if self.argmax else out

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    for argmax, init_slope in ((False, 0.0), (False, 0.5), (True, 0.0)):
        original = OnInput(argmax)
        given = x.clone()
        model = linearize.convert(copy.deepcopy(original), example_inputs=given, init_slope=init_slope)
        assert torch.equal(given, x)  # convert leaves the caller's inputs as they were
        assert all(u.inplace for _, u in linearize.units(model))
        assert all(bool((u.slope == init_slope).all()) for _, u in linearize.units(model))
        for _, unit in linearize.units(model):
            with torch.no_grad():
                unit.slope.zero_()
        with torch.no_grad():
            assert torch.equal(model(x.clone()), original(x.clone()))


@pytest.mark.parametrize("op", [lambda t: t.detach(), lambda t: t.data, lambda t: t.to(torch.long).to(t.dtype),
                                lambda t: t.new_tensor(t), lambda t: t * t.to(torch.bool)],
                         ids=["detach", "data", "to_long", "new_tensor", "to_bool"])
def test_regions_refuse_ops_that_cut_or_quantize_the_input(op):
    from linearize.measures.regions import linear_regions

    net = nn.Sequential(nn.Linear(1, 1)).double()
    with torch.no_grad():
        net[0].weight.fill_(3.0)

    class Net(nn.Module):
        def forward(self, x):
            return torch.relu(op(net(x)) - 1.0) + net(x)  # a kink (or steps) the tracer would not see

    with pytest.raises(ValueError, match="cuts the output's dependence|into torch"):
        linear_regions(Net(), torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64))


def test_regions_accept_where_with_a_constant_mask_and_addcmul_with_one_input_factor():
    from linearize.measures.regions import linear_regions

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1, 3)

        def forward(self, x):
            h = self.lin(x)
            mask = torch.tensor([True, False, True])
            return torch.where(mask, torch.relu(h), 0.0).addcmul(h, torch.full((3,), 2.0)).sum(1, keepdim=True)

    torch.manual_seed(0)
    net = Net().double()
    x0, x1 = torch.tensor([[-3.0]], dtype=torch.float64), torch.tensor([[3.0]], dtype=torch.float64)
    ts = torch.linspace(0, 1, 100001, dtype=torch.float64)[:, None]
    with torch.no_grad():
        h = net.lin(x0 + ts * (x1 - x0)) > 0  # regions: activation patterns of the ReLU (seed 001), all 3 channels
    assert int(linear_regions(net, x0, x1).count.reshape(-1)[0]) == int((h[1:] != h[:-1]).any(1).sum()) + 1


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
