"""Functional activation calls inside ``forward`` (``F.relu``, ``x.relu_()``, ``F.gelu`` ...) become units."""

import copy
import socket
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import linearize
from linearize.functional_sites import FunctionalSiteError, FunctionalSites
from zoo import randomize_batchnorm

W = 6  # width of every layer of AllCalls


def calls():
    """(name, function of x) for every listed functional form, in place ones included."""
    return [
        ("F.relu", lambda x: F.relu(x)),
        ("torch.relu", lambda x: torch.relu(x)),
        ("Tensor.relu", lambda x: x.relu()),
        ("F.relu6", lambda x: F.relu6(x)),
        ("F.leaky_relu", lambda x: F.leaky_relu(x, 0.2)),
        ("F.gelu", lambda x: F.gelu(x)),
        ("F.gelu tanh", lambda x: F.gelu(x, approximate="tanh")),
        ("F.silu", lambda x: F.silu(x)),
        ("F.hardswish", lambda x: F.hardswish(x)),
        ("F.mish", lambda x: F.mish(x)),
        ("F.relu inplace", lambda x: F.relu(x, inplace=True)),
        ("Tensor.relu_", lambda x: x.relu_()),
        ("torch.relu_ (result unused)", lambda x: (torch.relu_(x), x)[1]),
        ("F.leaky_relu_", lambda x: F.leaky_relu_(x, 0.1)),
        ("F.silu inplace", lambda x: F.silu(x, inplace=True)),
    ]


class AllCalls(nn.Module):
    """A chain of Linear layers with one functional call of each form after each layer."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(W, W) for _ in calls())
        self.fns = [fn for _, fn in calls()]

    def forward(self, x):
        for lin, fn in zip(self.lins, self.fns):
            x = fn(lin(x))
        return x

    def linear(self, x):
        """The network with every activation replaced by the identity, by hand."""
        for lin in self.lins:
            x = x @ lin.weight.T + lin.bias
        return x


class CifarBlock(nn.Module):
    """The CIFAR ResNet BasicBlock most training code uses: functional ReLUs."""

    def __init__(self, cin=4, cout=8, stride=2):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.block = CifarBlock()
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        out = F.relu(self.bn(self.conv(x)))
        out = self.block(out)
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


def _convert(model, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot be swapped" warning: every call converts
        return linearize.convert(model, example_inputs=x, **kw)


def _set_slopes(model, value=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.rand(u.num_channels, generator=gen) if value is None else torch.full_like(u.slope, value))


def test_every_form_gets_its_own_unit_exact_at_init_and_linear_at_slope_one():
    torch.manual_seed(0)
    model = AllCalls().double()
    x = torch.randn(5, W, dtype=torch.float64, requires_grad=True)
    ref = model(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *model.parameters()])
    _convert(model, x.detach())
    names = [n for n, _ in linearize.units(model)]
    kinds = ["relu"] * 3 + ["relu6", "leaky_relu", "gelu", "gelu", "silu", "hardswish", "mish"] + ["relu"] * 3 + [
        "leaky_relu", "silu"]
    assert names == [f"linearize_functional.{k}_{i}" for i, k in enumerate(kinds)]
    assert not model.linearize_report.functional_calls
    assert linearize.count_units(model)["total"] == W * len(kinds)
    out = model(x)
    assert torch.equal(out, ref)  # bit for bit, float64
    grads = torch.autograd.grad(out.square().sum(), [x, *[p for n, p in model.named_parameters() if "slope" not in n]])
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)  # in-place forms keep the input the unit's backward needs

    _set_slopes(model, 1.0)
    with torch.no_grad():
        assert torch.allclose(model(x), model.linear(x), rtol=0, atol=1e-12)


def test_each_unit_keeps_its_own_slopes_and_the_probe_widths():
    model = CifarNet().eval()
    randomize_batchnorm(model)
    x = torch.randn(2, 3, 16, 16)
    _convert(model, x)
    found = dict(linearize.units(model))
    assert sorted(found) == ["block.linearize_functional.relu_0", "block.linearize_functional.relu_1",
                             "linearize_functional.relu_0"]
    assert [found[n].num_channels for n in sorted(found)] == [8, 8, 4]
    assert all(u.channel_dim == 1 for u in found.values())
    assert len({id(u.slope) for u in found.values()}) == 3
    keys = [k for k in model.state_dict() if "linearize_functional" in k]
    assert keys == ["block.linearize_functional.relu_0.slope", "block.linearize_functional.relu_0.frozen",
                    "block.linearize_functional.relu_1.slope", "block.linearize_functional.relu_1.frozen",
                    "linearize_functional.relu_0.slope", "linearize_functional.relu_0.frozen"]  # module order


def test_cifar_block_exact_at_init_and_linear_at_slope_one():
    torch.manual_seed(0)
    block = CifarBlock().double().eval()
    randomize_batchnorm(block)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        ref = block(x)
        _convert(block, x)
        assert torch.equal(block(x), ref)
        _set_slopes(block, 1.0)
        by_hand = block.bn2(block.conv2(block.bn1(block.conv1(x)))) + block.shortcut(x)
        assert torch.allclose(block(x), by_hand, rtol=0, atol=1e-12)


def test_googlenet_converts_every_functional_relu_exactly():
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True, num_classes=10)
    model = model.double().eval()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    calls = sum(type(m).__name__ == "BasicConv2d" for m in model.modules())  # one F.relu each
    with torch.no_grad():
        ref = model(x)
        _convert(model, x)
        assert torch.equal(model(x), ref)
    assert len(linearize.units(model)) == calls == 57
    assert not model.linearize_report.problems()


def test_save_load_round_trip_in_a_fresh_model(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    model = CifarNet().eval()
    randomize_batchnorm(model)
    fresh = copy.deepcopy(model)
    _convert(model, x)
    _set_slopes(model)
    unit = dict(linearize.units(model))["block.linearize_functional.relu_1"]
    unit.freeze_(torch.arange(8) < 3, 1.0)
    linearize.save_pretrained(model, tmp_path)
    loaded = linearize.from_pretrained(fresh, tmp_path, example_inputs=x)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for (n, a), (m, b) in zip(linearize.units(model), linearize.units(loaded)):
        assert n == m and torch.equal(a.slope, b.slope) and torch.equal(a.frozen.isnan(), b.frozen.isnan())
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_deepcopy_is_independent():
    model = CifarNet().eval()
    x = torch.randn(2, 3, 16, 16)
    _convert(model, x)
    _set_slopes(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(x), model(x))
        before = model(x)
        _set_slopes(twin, 1.0)
        assert torch.equal(model(x), before)
        assert not torch.equal(twin(x), before)
    assert isinstance(twin.block.linearize_functional, FunctionalSites)
    twin.block.linearize_functional.relu_0.slope.grad = None
    twin(x).sum().backward()  # the copy's forward reaches the copy's units
    assert twin.block.linearize_functional.relu_0.slope.grad is not None
    assert model.block.linearize_functional.relu_0.slope.grad is None


def test_freeze_and_fold_replace_functional_units():
    torch.manual_seed(0)
    model = CifarNet().eval()
    randomize_batchnorm(model)
    x = torch.randn(4, 3, 16, 16)
    _convert(model, x)
    _set_slopes(model)
    with torch.no_grad():  # some channels near 1, some near 0, one unit fully linear
        for name, u in linearize.units(model):
            u.slope[::3] = 0.9995
            u.slope[1::3] = 0.0
            if name == "linearize_functional.relu_0":
                u.slope.fill_(1.0)
    summary = linearize.freeze(model, tol=1e-3)
    assert summary is not None
    with torch.no_grad():
        ref = model(x)
    folded = linearize.fold(model, x, latency=False)
    assert not linearize.units(folded)
    with torch.no_grad():
        assert (folded(x) - ref).abs().max() <= 1e-5
    replaced = folded.linearize_functional.relu_0
    assert isinstance(replaced, nn.Identity)


class Branchy(nn.Module):
    """One extra ReLU call when the input's mean is positive: the call count depends on the input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = F.relu(self.lin(x))
        if x.mean() > 0:
            h = F.relu(h - 0.5)
        return h


def test_control_flow_is_refused_with_the_module_the_counts_and_the_fix():
    model = nn.Sequential(nn.Linear(4, 4), Branchy())
    pos, neg = torch.ones(2, 4), -torch.ones(2, 4)
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    _convert(model, pos)
    assert len(linearize.units(model)) == 2
    with pytest.raises(FunctionalSiteError, match=r"module '1' made 1 functional activation call\(s\).* made 2 "
                                                  r"\(relu, relu\).*exclude_modules=\['1'\].*example_inputs"):
        model(neg)
    model(pos)  # the probe's path still runs

    root = Branchy()
    _convert(root, pos)
    with pytest.raises(FunctionalSiteError, match=r"module '<root>'.*exclude_modules=\['linearize_functional\.\*'\]"):
        root(neg)
    with pytest.raises(ValueError, match="no convertible activation"):  # the suggested pattern excludes them
        linearize.convert(Branchy(), example_inputs=pos, exclude_modules=["linearize_functional.*"])
    kept = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Branchy())
    with torch.no_grad():
        ref = kept(neg)
    _convert(kept, pos, exclude_modules=["2"])  # the fix: Branchy's calls stay as they are
    assert [n for n, _ in linearize.units(kept)] == ["1"]
    with torch.no_grad():
        assert torch.equal(kept(neg), ref)


def test_config_patterns_and_gates_apply_to_functional_calls():
    x = torch.randn(2, 3, 16, 16)
    model = _convert(CifarNet().eval(), x, exclude_modules=["block"])
    assert [n for n, _ in linearize.units(model)] == ["linearize_functional.relu_0"]
    assert model.linearize_report.excluded == ["block.linearize_functional.relu_0", "block.linearize_functional.relu_1"]
    model = _convert(CifarNet().eval(), x, exclude_modules=["relu_1"])
    assert len(linearize.units(model)) == 2 and "block.linearize_functional.relu_1" in model.linearize_report.excluded
    with torch.no_grad():
        ref = CifarNet().eval()
        ref.load_state_dict({k: v for k, v in model.state_dict().items() if "linearize" not in k})
        assert torch.equal(model(x), ref(x))

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            h = self.conv(x)
            return F.relu(h) * F.relu(h.mean((2, 3), keepdim=True))  # second call: a broadcast gate

    model = _convert(Gate(), x)
    assert [n for n, _ in linearize.units(model)] == ["linearize_functional.relu_0"]
    assert list(model.linearize_report.gates) == ["linearize_functional.relu_1"]
    model = _convert(Gate(), x, gates="include")
    assert len(linearize.units(model)) == 2


def test_measures_see_functional_units():
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.c(F.relu(self.b(F.relu(self.a(x)))))

    model = Chain()
    x = torch.randn(16, 4)
    _convert(model, x)
    # a chain of L unit layers: sum over layers of (nonlinear channels / width)
    assert linearize.measures.average_path_length(model, x) == pytest.approx(2.0)
    with torch.no_grad():
        dict(linearize.units(model))["linearize_functional.relu_1"].slope[:2] = 1.0
    assert linearize.measures.average_path_length(model, x) == pytest.approx(1.75)
    sites = [s for s, _ in linearize.measures.affinity_signature(model, x)]
    assert sites == ["linearize_functional.relu_0", "linearize_functional.relu_1"]


def test_autocast_matches_the_original():
    torch.manual_seed(0)
    model = CifarNet().eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    _convert(model, x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(x), ref)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_registers_and_trains_the_functional_slopes():
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        x = torch.randn(2, 3, 16, 16)
        model = _convert(CifarNet(), x)
        ddp = nn.parallel.DistributedDataParallel(model)
        slopes = {n for n, _ in ddp.named_parameters() if n.endswith(".slope")}
        assert slopes == {f"module.{n}.slope" for n, _ in linearize.units(model)}
        ddp(x).square().sum().backward()
        assert all(u.slope.grad is not None and u.slope.grad.abs().sum() > 0 for _, u in linearize.units(model))
    finally:
        dist.destroy_process_group()


def test_torch_compile_gives_the_same_outputs_and_gradients():
    pytest.importorskip("torch._dynamo", reason="torch.compile is not available")
    torch._dynamo.reset()
    model = CifarNet().eval()
    x = torch.randn(2, 3, 16, 16)
    _convert(model, x)
    _set_slopes(model)
    compiled = torch.compile(model, backend="aot_eager")  # no C++ codegen: fast
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x))
    compiled(x).sum().backward()
    unit = model.block.linearize_functional.relu_1
    grad = unit.slope.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(unit.slope.grad, grad)


def test_in_place_call_on_a_tensor_without_grad_still_trains_its_slopes():
    class Stem(nn.Module):
        def forward(self, x):
            h = x * 2  # no parameter before the unit: h does not require grad
            F.relu_(h)  # result unused: h itself holds it
            return h

    model = Stem()
    x = torch.randn(2, 4, 3, 3)
    _convert(model, x)
    unit = model.linearize_functional.relu_0
    with torch.no_grad():
        unit.slope.fill_(0.25)
    out = model(x)
    assert torch.equal(out, torch.where(x > 0, 2 * x, 0.5 * x))
    out.sum().backward()
    # d/da of (1 - a) relu(h) + a h = min(h, 0), summed over all but the channel dim
    assert torch.allclose(unit.slope.grad, (2 * x).clamp(max=0).sum((0, 2, 3)))


def test_a_call_on_a_scalar_keeps_its_place_in_the_order_and_runs_as_it_is():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.gain = nn.Parameter(torch.tensor(-0.5))

        def forward(self, x):
            g = torch.relu(self.gain)  # call 0: a scalar, no channels
            return F.relu(self.lin(x)) + g  # call 1: a unit

    model = Scaled()
    x = torch.randn(3, 4)
    ref = model(x)
    with pytest.warns(UserWarning, match="Scaled: relu"):
        linearize.convert(model, example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["linearize_functional.relu_1"]
    assert torch.equal(model(x), ref)
    _set_slopes(model, 1.0)
    with torch.no_grad():
        assert torch.equal(model(x), model.lin(x))  # relu(-0.5) = 0 still: the scalar call is not a unit


def test_a_call_on_integers_is_no_site_and_runs_as_it_is():
    """``torch.relu`` on an integer tensor (index clamping) got a unit, and every forward of the converted model
    then raised inside it ("prelu not implemented for 'Long'"). Truth: the unconverted model, at slope 0 and
    (the integer call has no slope) at slope 1 against the float calls made linear by hand; calls after it keep
    their own units."""
    class Clamped(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.out = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            h = F.relu(self.lin(x))
            idx = torch.relu((x * 3).long()) + (x * 2).long().relu_()  # integer calls, a function and a method
            return F.gelu(self.out(h)) + idx.sum(1, keepdim=True)

    torch.manual_seed(0)
    model, x = Clamped(), torch.randn(5, 4)
    original = copy.deepcopy(model)
    linearize.convert(model, example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["linearize_functional.relu_0", "linearize_functional.gelu_1"]
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            assert torch.equal(model(x), original(x))
    _set_slopes(model, 1.0)
    with torch.no_grad():
        idx = torch.relu((x * 3).long()) + (x * 2).long().relu()
        assert torch.equal(model(x), original.out(original.lin(x)) + idx.sum(1, keepdim=True))


def test_integer_calls_of_activation_modules_and_float_valued_functions_run_as_they_are():
    """``torch.tanh`` / ``torch.sigmoid`` on an integer tensor return floats: the probe recorded them as sites while
    the dispatch passed them through, and convert failed with a call-order error; an ``nn.ReLU`` / ``nn.Tanh``
    module called on integers got a unit that raised inside the kernels. Truth: the unconverted model, at slope 0
    and at slope 1 (integer calls have no slope: only the float call changes); the modules are reported, not
    converted."""
    class Indexing(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act, self.squash = nn.Linear(4, 4), nn.ReLU(), nn.Tanh()

        def forward(self, x):
            n = (x * 3).long()
            ints = self.act(n) + F.relu(n - 1) + torch.tanh(n) + torch.sigmoid(n.bool().float().long())
            return F.relu(self.lin(x)), ints, self.squash(n)

    torch.manual_seed(0)
    model, x = Indexing(), torch.randn(5, 4)
    original = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"act: called on an integer or bool tensor"):
        linearize.convert(model, example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["linearize_functional.relu_0"]
    assert {"act", "squash"} <= set(model.linearize_report.unreachable)
    for slope in (0.0, 1.0):
        _set_slopes(model, slope)
        with torch.no_grad():
            got, want = model(x), original(x)
        for g, w in zip(got[1:], want[1:]):
            assert g.dtype == w.dtype and torch.equal(g, w)
        assert torch.equal(got[0], want[0] if slope == 0 else original.lin(x))


class Mixed(nn.Module):
    """Functional calls around a ReLU module child: the child's own F.relu is not the owner's."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 6)
        self.act = nn.ReLU()

    def forward(self, x):
        h = F.relu(self.a(x))
        h = self.act(self.b(h))
        return F.gelu(h - 0.1)


def test_module_children_calls_are_not_the_owners_also_after_fold_or_exclusion():
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    model = _convert(Mixed().eval(), x)
    assert [n for n, _ in linearize.units(model)] == ["act", "linearize_functional.relu_0",
                                                      "linearize_functional.gelu_1"]
    _set_slopes(model)
    with torch.no_grad():
        model.act.slope.zero_()  # fold makes it a plain nn.ReLU, whose forward calls F.relu
        ref = model(x)
    folded = linearize.fold(model, x, latency=False)
    assert type(folded.act) is nn.ReLU
    with torch.no_grad():
        assert torch.allclose(folded(x), ref, rtol=0, atol=1e-6)

    kept = _convert(Mixed().eval(), x, exclude_modules=["act"])
    assert type(kept.act) is nn.ReLU and len(linearize.units(kept)) == 2
    with torch.no_grad():
        kept(x)  # no call-count error: the excluded module's F.relu is its own


def test_an_error_inside_an_owner_leaves_no_mode_behind():
    model = CifarNet().eval()
    x = torch.randn(2, 3, 16, 16)
    _convert(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the conv's error alone: no silenced call-count error
        with pytest.raises(RuntimeError, match="channels"):
            model(torch.randn(2, 5, 16, 16))  # the stem conv refuses 5 channels, inside the root owner
    assert torch._C._len_torch_function_stack() == 0
    with torch.no_grad():
        assert torch.equal(model(x), copy.deepcopy(model)(x))


@pytest.fixture(scope="module")
def real_cifar(tmp_path_factory) -> tuple[torch.Tensor, torch.Tensor]:
    """64 real CIFAR-10 training images (normalized, 32 px) and labels; skip without the data."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    data = Path(os.environ.get("LINEARIZE_CIFAR10", root.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"))
    if not data.exists():
        pytest.skip(f"real CIFAR-10 images not found at {data} (set LINEARIZE_CIFAR10)")
    sys.path.insert(0, str(root / "recipes"))
    import cifar

    split = cifar.load_split(data, "cifar10", "train", 64, 32, tmp_path_factory.mktemp("cifar"), show=False)
    x = split["x"].float() / 255
    return (x - x.mean((0, 2, 3), keepdim=True)) / x.std((0, 2, 3), keepdim=True), split["y"]


@pytest.mark.parametrize("build", [
    lambda: CifarNet(),
    lambda: torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True, num_classes=10),
], ids=["functional-cifar-resnet", "googlenet"])
def test_functional_models_train_to_a_target_on_real_cifar_and_fold_exactly(build, real_cifar):
    """Models whose activations are all functional train under the Sparsifier to a 10% target on real
    images, reach it exactly, and fold to the same function."""
    x, y = real_cifar
    torch.manual_seed(0)
    model = _convert(build(), x[:2])
    steps = 8
    opt = torch.optim.SGD(linearize.param_groups(model, weight_decay=0.0), lr=0.02, momentum=0.9)
    sp = linearize.Sparsifier(model, linearize.schedules.target(0.1, start=0, end=0.75), total_steps=steps)
    sp.attach(opt)
    model.train()
    for step in range(steps):
        i = torch.arange(step * 16, step * 16 + 16) % len(x)
        loss = F.cross_entropy(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    channels = sum(u.num_channels for _, u in linearize.units(model))
    assert linearize.nonlinear_fraction(model) == round(0.1 * channels) / channels
    assert torch.isfinite(loss)
    model.eval()
    linearize.freeze(model, tol=0.0)
    folded = linearize.fold(model, x[:16])
    with torch.no_grad():
        ref, out = model(x[:32]), folded(x[:32])
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()


class _MadeInForward(nn.Module):
    """HF Mamba's reference kernels call ``ACT2FN["silu"](x)``: an activation module made during forward,
    not registered in the model, whose F.silu the owner's dispatch cannot see; then an F.silu of its own
    on a (batch, features, length) map after a Linear that leaves the axis open."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(6, 12), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 6)
        h, z = self.proj(x).transpose(1, 2).chunk(2, dim=1)  # (B, 6, T) each
        h = nn.SiLU()(h)  # made here: stays as it is, named in the report
        return self.out((h * F.silu(z)).transpose(1, 2))


def test_an_activation_module_made_during_forward_is_left_as_it_is_and_named():
    torch.manual_seed(0)
    model = _MadeInForward().eval()
    x = torch.randn(2, 5, 6)
    with torch.no_grad():
        ref = model(x)
    with pytest.warns(UserWarning, match=r"silu \(inside a SiLU made during forward, not a registered module\)"):
        linearize.convert(model, example_inputs=x)
    with torch.no_grad():
        assert torch.equal(model(x), ref)  # the same input: exact, no error
    with pytest.raises(FunctionalSiteError, match=r"input shape \(2, 6, 7\), its unit 5 channels at dim -1.*"
                                                  r"sequence or spatial axis.*channel_dim="):
        model(torch.randn(2, 7, 6))  # the probe took the length (5) for the features: named, with the fix
    model = linearize.convert(_MadeInForward().eval(), example_inputs=x, channel_dim=1)
    with torch.no_grad():
        assert model(torch.randn(2, 7, 6)).shape == (2, 7, 6)


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


class _TrainOnlyCall(nn.Module):
    """A functional GELU called only in training (an auxiliary branch), or, with ``module``, an activation
    module called there; a ReLU module and a functional GELU on the main path."""

    def __init__(self, module: bool = False) -> None:
        super().__init__()
        self.fc, self.act, self.aux, self.out = nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 2)
        self.aux_act = nn.GELU() if module else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.act(self.fc(x)))
        if self.training:
            z = self.aux(x)
            h = h + 0.1 * (F.gelu(z) if self.aux_act is None else self.aux_act(z))
        return self.out(h)


def test_a_training_only_functional_call_names_training_mode_and_fixes_that_work():
    """The probe runs in eval mode: the first training forward of an owner with a training-only functional
    call raised an error blaming the input, whose fix (other example inputs) cannot work. Now it names
    training mode; both fixes it names give the original function in both modes. Truth: the unconverted model."""
    torch.manual_seed(0)
    original, x = _TrainOnlyCall(), torch.randn(4, 6)
    model = linearize.convert(copy.deepcopy(original), example_inputs=x)
    with pytest.raises(FunctionalSiteError,
                       match=r"training mode, the probe forward in eval mode.*exclude_modules.*activation module"):
        model.train()(x)
    fixed = [linearize.convert(copy.deepcopy(original), example_inputs=x, exclude_modules=["linearize_functional.*"])]
    torch.manual_seed(0)
    with_module = _TrainOnlyCall(module=True)
    fixed.append(linearize.convert(copy.deepcopy(with_module), example_inputs=x))
    for reference, converted, units in zip((original, with_module), fixed,
                                           (["act"], ["act", "linearize_functional.gelu_0"])):
        assert [n for n, _ in linearize.units(converted)] == units
        for training in (True, False):
            with torch.no_grad():
                assert torch.equal(converted.train(training)(x), reference.train(training)(x))


class SequentialThenReLU(nn.Sequential):
    """A container whose own forward makes a functional call after its layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


def test_a_functional_call_of_a_container_subclass_is_listed_with_the_reason_and_the_fix():
    """It was left as "cannot be swapped" with no reason; now the report and convert's refusal say why (a
    container's children are its layers) and the fix, and the fix converts it."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"SequentialThenReLU: relu.*is a container \(nn\.Sequential subclass\).*fix: "
                                         r"make SequentialThenReLU an nn\.Module.*or end the container with an "
                                         r"activation module"):
        linearize.convert(SequentialThenReLU(nn.Linear(6, 6), nn.Linear(6, 3)), example_inputs=x)
    model = nn.Sequential(SequentialThenReLU(nn.Linear(6, 6)), nn.GELU(), nn.Linear(6, 3))
    with pytest.warns(UserWarning, match=r"functional call 0: relu \(1 call\(s\) per forward\): its owner "
                                         r"SequentialThenReLU is a container"):
        linearize.convert(model, example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["1"] and not model.linearize_report.functional_calls
    fixed = nn.Sequential(nn.Linear(6, 6), nn.ReLU())  # the fix: the activation as the container's last layer
    want = fixed(x)
    linearize.convert(fixed, example_inputs=x)
    assert [n for n, _ in linearize.units(fixed)] == ["1"] and torch.equal(fixed(x), want)


class ConvThenTokens(nn.Module):
    """A conv over (batch, 8 channels, length) maps, transposed to (batch, length, 8) tokens before the ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.l = nn.Conv1d(8, 8, 1), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(F.relu(self.c(x).transpose(1, 2)))


def test_a_channel_axis_a_transpose_made_ambiguous_warns_naming_the_call_and_channel_dim():
    """Probed with length == channels, dims 1 and -1 both had the conv's width after the transpose: convert took the
    time axis silently. Now it warns, naming the call and channel_dim=; with channel_dim=-1 each slope acts on its
    own feature (channel 0 linear, the rest ReLU, written out by hand)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 8)
    with pytest.warns(UserWarning, match=r"functional call .*relu.*dims 1 and -1 both.*channel_dim="):
        linearize.convert(ConvThenTokens(), example_inputs=x)
    model = ConvThenTokens()
    linearize.convert(model, example_inputs=x, channel_dim=-1)
    (_, unit), = linearize.units(model)
    with torch.no_grad():
        unit.slope.zero_()
        unit.slope[0] = 1.0
        h = model.c(x).transpose(1, 2)
        want = h.clamp(min=0)
        want[..., 0] = h[..., 0]
        torch.testing.assert_close(model(x), model.l(want))
