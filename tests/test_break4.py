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
