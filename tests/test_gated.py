"""Gated splits (seed 003): DGN / DLGN construction, exactness, linearity, gate counts, errors."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models.resnet import Bottleneck, ResNet

import linearize
from linearize.config import LinearizeConfig
from linearize.gated import FeatureTap, GatedNetwork, convert_gated, gate_statistics
from linearize.config import GatedConfig


def small_vgg(batch_norm: bool) -> nn.Module:
    """A VGG-style net from torchvision's own layer builder (max pooling included), small head."""
    features = torchvision.models.vgg.make_layers([8, "M", 16, 16, "M"], batch_norm=batch_norm)
    return nn.Sequential(features, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 12), nn.ReLU(inplace=True), nn.Linear(12, 10))


def bottleneck_resnet() -> nn.Module:
    """Bottleneck blocks (three ReLU calls each, the last after the residual add), two stages."""
    model = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=32)
    model.layer3, model.layer4, model.fc = nn.Identity(), nn.Identity(), nn.Linear(512, 10)
    return model


def randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial eval statistics, so BatchNorm is a real affine map in the checks."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(0.2 * torch.randn(m.num_features, generator=g))
            m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g))
            m.weight.data.copy_(1 + 0.2 * torch.randn(m.num_features, generator=g))
            m.bias.data.copy_(0.1 * torch.randn(m.num_features, generator=g))
    return model


pytestmark = pytest.mark.usefixtures("one_thread")


def cfg(mode: str, **kw) -> LinearizeConfig:
    return LinearizeConfig(mode=mode, **kw)


@pytest.fixture(scope="module")
def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return randomize_bn(torchvision.models.resnet18(num_classes=10)).eval()


X = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- (1) DGN == DNN


@pytest.mark.parametrize("build", ["resnet18", "bottleneck", "vgg_bn", "vgg"])
def test_dgn_copy_hard_gates_equals_original_exactly(build, resnet18):
    torch.manual_seed(0)
    model = {"resnet18": lambda: resnet18, "bottleneck": lambda: randomize_bn(bottleneck_resnet()),
             "vgg_bn": lambda: randomize_bn(small_vgg(True)), "vgg": lambda: small_vgg(False)}[build]().eval()
    gated = convert_gated(model, cfg("dgn", init="copy", hard_gates=True), X).eval()
    with torch.no_grad():
        expected = model(X)
        assert torch.equal(gated(X), expected)
        # soft gates are a different function: the check above can fail
        soft = convert_gated(model, cfg("dgn", init="copy", beta=4.0), X).eval()
        assert not torch.allclose(soft(X), expected, atol=1e-4)


def test_dgn_through_linearize_convert_leaves_model_untouched():
    torch.manual_seed(0)
    model = small_vgg(True).eval()
    before = copy.deepcopy(model.state_dict())
    gated = linearize.convert(model, mode="dgn", init="copy", hard_gates=True, example_inputs=X)
    assert isinstance(gated, GatedNetwork) and gated is not model
    assert gated.linearize_config.mode == "dgn" and gated.linearize_config.beta == 4.0
    assert isinstance(model[0][2], nn.ReLU)  # the original keeps its activations
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(gated.eval()(X), model(X))


def test_leaky_relu_gate_is_exact_with_hard_gates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LeakyReLU(0.1), nn.Linear(7, 3))
    x = torch.randn(16, 5)
    gated = convert_gated(model, cfg("dgn", init="copy", hard_gates=True), x)
    assert gated.gates()[0][1].leak == pytest.approx(0.1)
    torch.testing.assert_close(gated(x), model(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("act", [nn.ReLU(), nn.LeakyReLU(0.1), nn.ReLU(inplace=True)], ids=["relu", "leaky", "inplace"])
def test_dgn_copy_hard_gates_equal_the_activation_at_inf_nan_and_signed_zeros(act):
    """docs/gated.md: ``init="copy", hard_gates=True`` equals the model exactly. ``z * (q > 0)`` gave NaN for a
    -inf pre-activation (``-inf * 0``; ReLU gives 0) and -0 for -1. Truth: the original activation, bit for bit
    (the sign of zero included), and a masked (-inf) input row through a ReLU MLP gives the original's output."""
    x = torch.tensor([[1.0, -1.0, math.inf, -math.inf, 0.0, -0.0, math.nan, -7.5]])
    model = nn.Sequential(nn.Identity(), act)
    gated = convert_gated(model, cfg("dgn", init="copy", hard_gates=True), x)
    got, want = gated(x.clone()), model(x.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.signbit(), want.signbit())
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        mlp[0].weight.abs_()  # a -inf input reaches every hidden unit as -inf
    masked = torch.tensor([[0.5, -math.inf, 1.0], [1.0, 2.0, 3.0]])
    gated = convert_gated(mlp, cfg("dgn", init="copy", hard_gates=True), masked)
    assert torch.equal(gated(masked), mlp(masked))


def test_dgn_soft_gates_at_a_closed_gate_give_0_for_an_infinite_value():
    """A sigmoid gate that underflows to 0 (``q = -inf``) gave ``z * 0 = NaN`` for an infinite ``z``: a closed
    gate passes nothing, as ReLU(-inf) = 0; an open one (``q = +inf``) passes ``z``."""
    x = torch.tensor([[-math.inf, math.inf, -2.0, 3.0]])
    gated = convert_gated(nn.Sequential(nn.Identity(), nn.ReLU()), cfg("dgn", init="copy", beta=4.0), x)
    got = gated(x)
    assert got[0, 0] == 0 and not got[0, 0].signbit() and got[0, 1] == math.inf
    torch.testing.assert_close(got[0, 2:], x[0, 2:] * torch.sigmoid(4.0 * x[0, 2:]))


def test_mobilenet_v2_relu6_is_gated_by_its_relu_part():
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=10, width_mult=0.25).eval()
    x = torch.randn(2, 3, 16, 16)
    gated = convert_gated(model, cfg("dgn", init="copy", hard_gates=True), x).eval()
    gates = gated.gates()
    assert len(gates) == sum(isinstance(m, nn.ReLU6) for m in model.modules()) and gates[0][1].kind == "relu6"
    # independent reference: the same weights with every ReLU6 replaced by ReLU (no cap at 6)
    reference = copy.deepcopy(model)
    for owner in list(reference.modules()):
        for attr, child in list(owner.named_children()):
            if isinstance(child, nn.ReLU6):
                setattr(owner, attr, nn.ReLU())
    with torch.no_grad():
        torch.testing.assert_close(gated(x), reference(x), rtol=1e-5, atol=1e-5)
        # the DGN feature network itself keeps the ReLU6 (caps at 6)
        torch.testing.assert_close(gated.feature(x), model(x), rtol=0, atol=0)


class _TiedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(16, 16), nn.ReLU()

    def forward(self, x):
        return self.act(self.lin(x))


class _WeightTied(nn.Module):
    """One block applied three times per forward (weight tying, as ALBERT's shared layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), _TiedBlock(), nn.Linear(16, 2)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = self.block(h)
        return self.out(h)


def test_dgn_of_a_block_applied_several_times_gates_each_application_by_its_own_call():
    """Every application of a weight-tied block was gated by the last application's pre-activation."""
    torch.manual_seed(0)
    model = _WeightTied().double().eval()
    x = torch.randn(32, 8, dtype=torch.float64)
    gated = convert_gated(model, cfg("dgn", init="copy", hard_gates=True), x).eval()
    assert [site for site, _ in gated.gates()] == ["block.act"]
    xm, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, out = model(xm), gated(xg)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    expected.sum().backward()
    out.sum().backward()
    torch.testing.assert_close(xg.grad, xm.grad, rtol=0, atol=1e-12)


def test_dgn_of_albert_with_its_shared_layer_equals_the_relu_model():
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    model = AlbertModel(AlbertConfig(vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=3,
                                     num_attention_heads=2, intermediate_size=32, hidden_act="relu",
                                     max_position_embeddings=16, initializer_range=0.5)).eval()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    gated = convert_gated(model, cfg("dgn", init="copy", hard_gates=True), {"input_ids": ids}).eval()
    assert len(gated.gates()) == 1  # one shared layer, one site, three calls per forward
    with torch.no_grad():
        assert torch.equal(gated(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)


class _Rendezvous(nn.Module):
    """Identity that, while ``barrier`` is set, waits there for the other threads (each forward of a gated
    split passes it twice: in the feature network, then in the value network)."""

    barrier: threading.Barrier | None = None

    def forward(self, x):
        if _Rendezvous.barrier is not None:
            _Rendezvous.barrier.wait()
        return x


def test_threads_running_one_gated_split_each_get_their_own_gates():
    """Threads shared one store of pre-activations: a thread's value network read another thread's gates."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), _Rendezvous(), nn.Linear(16, 3)).double().eval()
    xs = [torch.randn(8, 8, dtype=torch.float64) for _ in range(4)]
    gated = convert_gated(model, cfg("dgn", init="copy", hard_gates=True), xs[0]).eval()
    outs: dict[int, torch.Tensor | Exception] = {}

    def run(i: int) -> None:
        try:
            with torch.no_grad():
                outs[i] = gated(xs[i])
        except Exception as e:  # noqa: BLE001 - reported below
            _Rendezvous.barrier.abort()
            outs[i] = e

    _Rendezvous.barrier = threading.Barrier(len(xs), timeout=60)  # every feature pass before any value pass
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _Rendezvous.barrier = None
    with torch.no_grad():
        for i, x in enumerate(xs):
            assert isinstance(outs[i], torch.Tensor), outs[i]
            torch.testing.assert_close(outs[i], model(x), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- (2) DLGN is linear


def _feature_and_preacts(gated: GatedNetwork, x: torch.Tensor) -> list[torch.Tensor]:
    """The feature network's output and every gate pre-activation, flattened, for input ``x``."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].flatten()))
             for m in gated.feature.modules() if isinstance(m, FeatureTap)]
    try:
        with torch.no_grad():
            out = gated.feature(x)
    finally:
        for h in hooks:
            h.remove()
    return [out.flatten()] + seen


@pytest.mark.parametrize("mode,linear", [("dlgn", True), ("dgn", False)])
def test_dlgn_feature_network_is_affine_in_eval_mode(mode, linear, resnet18):
    gated = convert_gated(resnet18, cfg(mode, init="copy"), X).double().eval()
    if mode == "dlgn":
        pools = [m for m in gated.feature.modules() if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d))]
        assert [type(p) for p in pools] == [nn.AvgPool2d]
        assert (pools[0].kernel_size, pools[0].stride, pools[0].padding) == (3, 2, 1)
    g = torch.Generator().manual_seed(3)
    u, v = (torch.randn(1, 3, 16, 16, generator=g, dtype=torch.float64) for _ in range(2))
    a, b = 0.7, -1.3
    f0, fu, fv, fuv = (_feature_and_preacts(gated, t) for t in (torch.zeros_like(u), u, v, a * u + b * v))
    assert len(f0) == 1 + 17
    errors = []
    for z, pu, pv, puv in zip(f0, fu, fv, fuv):
        lhs, rhs = puv - z, a * (pu - z) + b * (pv - z)
        errors.append(float((lhs - rhs).abs().max() / rhs.abs().max()))
    if linear:
        assert max(errors) < 1e-10
    else:  # the DGN feature network keeps its ReLUs: clearly not affine
        assert max(errors) > 1e-2


# ----------------------------------------------------------------------------- (3) one gate per call


def _expected_sites(model: ResNet) -> dict[str, int]:
    sites = {"relu": model.conv1.out_channels}
    for i in range(1, 5):
        layer = getattr(model, f"layer{i}")
        for j, block in enumerate(layer if isinstance(layer, nn.Sequential) else []):
            convs = [block.conv1, block.conv2] + ([block.conv3] if isinstance(block, Bottleneck) else [])
            for k, conv in enumerate(convs):
                sites[f"layer{i}.{j}.relu.calls.{k}"] = conv.out_channels
    return sites


@pytest.mark.parametrize("build", ["resnet18", "bottleneck"])
def test_gate_count_per_site_is_the_channel_count(build, resnet18):
    model = resnet18 if build == "resnet18" else bottleneck_resnet()
    gated = convert_gated(model, cfg("dlgn"), X)
    assert {s: g.num_channels for s, g in gated.gates()} == _expected_sites(model)
    assert [s.name for s in gated.linearize_report.sites] == [s for s, _ in gated.gates()]
    stats = gate_statistics(gated, X)
    assert {s: d["channels"] for s, d in stats.items()} == _expected_sites(model)


def test_gate_statistics_match_an_independent_count():
    torch.manual_seed(0)
    model = randomize_bn(small_vgg(True)).eval()
    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)]
    preacts: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(relus))}
    hooks = [  # in-place ReLUs: a pre-hook sees the pre-activation
        r.register_forward_pre_hook(lambda mod, args, i=i: preacts[i].append(args[0].clone()))
        for i, r in enumerate(relus)
    ]
    batches = [torch.randn(3, 3, 16, 16) for _ in range(3)]
    with torch.no_grad():
        for x in batches:
            model(x)
    for h in hooks:
        h.remove()
    gated = convert_gated(model, cfg("dgn", init="copy", hard_gates=True), batches[0]).train()
    loader = [(x, torch.zeros(3)) for x in batches]  # DataLoader-like (x, y) batches
    stats = gate_statistics(gated, loader)
    assert list(stats) == ["0.2", "0.6", "0.9", "4"]
    for i, s in enumerate(stats.values()):
        q = torch.cat(preacts[i])
        on = (q > 0).double().movedim(1, -1).reshape(-1, q.shape[1])
        p = on.mean(0).numpy()
        h = [0.0 if pc in (0.0, 1.0) else -(pc * math.log2(pc) + (1 - pc) * math.log2(1 - pc)) for pc in p]
        assert s["channels"] == q.shape[1]
        assert s["fraction_on"] == pytest.approx(float(on.mean()), abs=1e-12)
        assert s["entropy"] == pytest.approx(sum(h) / len(h), abs=1e-12)
        assert s["always_on"] == int((p == 1).sum()) and s["always_off"] == int((p == 0).sum())
    assert not gated._store.recording and gated.training


# ----------------------------------------------------------------------------- training, saving


def test_training_steps_reduce_the_loss_and_reach_the_feature_network():
    torch.manual_seed(0)
    gated = convert_gated(small_vgg(True), cfg("dlgn", value_input="ones"), X)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    opt = torch.optim.Adam(gated.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(gated(x), y)
        opt.zero_grad()
        loss.backward()
        if not losses:
            grads = [p.grad for p in gated.feature[0].parameters()]
            assert all(gr is not None and gr.abs().sum() > 0 for gr in grads)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_freeze_feature_keeps_fixed_learnt_gates():
    torch.manual_seed(0)
    model = randomize_bn(small_vgg(True))
    gated = convert_gated(model, cfg("dgn", init="copy", freeze_feature=True), X).train()
    assert not gated.feature.training and gated.value.training
    assert not any(p.requires_grad for p in gated.feature.parameters())
    before = copy.deepcopy(gated.feature.state_dict())
    opt = torch.optim.SGD([p for p in gated.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        loss = gated(torch.randn(4, 3, 16, 16)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = gated.feature.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and BN statistics


def test_independent_init_reinitializes_only_the_feature_network():
    torch.manual_seed(0)
    model = small_vgg(False)
    gated = convert_gated(model, cfg("dgn"), X)
    conv = model[0][0].weight
    assert torch.equal(gated.value[0][0].weight, conv)
    assert not torch.equal(gated.feature[0][0].weight, conv)


def test_reconvert_of_a_fresh_model_loads_the_state_dict_strictly():
    torch.manual_seed(0)
    config = cfg("dlgn", value_input="ones")
    gated = convert_gated(randomize_bn(bottleneck_resnet()), config)  # default probe input
    fresh = convert_gated(bottleneck_resnet(), config)
    fresh.load_state_dict(gated.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(X), gated.eval()(X), rtol=0, atol=0)
        torch.testing.assert_close(copy.deepcopy(gated)(X), gated(X), rtol=0, atol=0)


def test_save_pretrained_and_from_pretrained_round_trip(tmp_path):
    torch.manual_seed(0)
    gated = linearize.convert(randomize_bn(small_vgg(True)), mode="dlgn", value_input="ones", example_inputs=X)
    linearize.save_pretrained(gated, tmp_path)
    loaded = linearize.from_pretrained(small_vgg(True), tmp_path)
    assert isinstance(loaded, GatedNetwork) and loaded.linearize_config.to_dict() == gated.linearize_config.to_dict()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(X), gated.eval()(X), rtol=0, atol=0)


# ----------------------------------------------------------------------------- transformers


def _tiny_bert(act: str):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=32, hidden_act=act, num_labels=3)
    return BertForSequenceClassification(config).eval()


def test_bert_ffn_gates_equal_the_relu_model_and_train():
    model = _tiny_bert("relu")
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    gated = convert_gated(model, cfg("dgn", init="copy", hard_gates=True), {"input_ids": ids}).eval()
    assert {s: (g.num_channels, g.channel_dim) for s, g in gated.gates()} == {
        f"bert.encoder.layer.{i}.intermediate.intermediate_act_fn": (24, -1) for i in range(2)
    }
    with torch.no_grad():
        assert torch.equal(gated(input_ids=ids).logits, model(input_ids=ids).logits)
    dlgn = convert_gated(model, cfg("dlgn"), {"input_ids": ids}).train()
    loss = F.cross_entropy(dlgn(input_ids=ids).logits, torch.tensor([0, 2]))
    loss.backward()
    ffn = dlgn.feature.bert.encoder.layer[0].intermediate.dense.weight
    assert ffn.grad is not None and ffn.grad.abs().sum() > 0
    with pytest.raises(TypeError, match="floating-point"):
        convert_gated(model, cfg("dlgn", value_input="ones"), {"input_ids": ids})


# ----------------------------------------------------------------------------- bad input


class _FunctionalMaxPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.act = nn.Conv2d(3, 4, 3), nn.ReLU()

    def forward(self, x):
        return F.max_pool2d(self.act(self.conv(x)), 2)


class _FunctionalRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)

    def forward(self, x):
        return F.relu(self.b(self.act(self.a(x))))


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(2, 4)
    relu_mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="beta"):
        LinearizeConfig(mode="dlgn", beta=0.0)
    bad = cfg("dgn")
    bad.beta = -1.0
    with pytest.raises(ValueError, match="beta"):
        convert_gated(relu_mlp, bad, x)
    with pytest.raises(ValueError, match="mode"):
        convert_gated(relu_mlp, cfg("prelu"), x)
    with pytest.raises(TypeError, match="nn.Module"):
        convert_gated("resnet", cfg("dgn"), x)
    gelu_mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"smooth activation.*gelu.*1 \(gelu\)"):
        convert_gated(gelu_mlp, cfg("dlgn"), x)
    with pytest.raises(ValueError, match=r"gelu.*hidden_act='relu'"):
        convert_gated(_tiny_bert("gelu"), cfg("dlgn"))
    with pytest.raises(ValueError, match=r"max pooling would remain.*<root>: max_pool2d"):
        convert_gated(_FunctionalMaxPool(), cfg("dlgn"), torch.randn(1, 3, 8, 8))
    convert_gated(_FunctionalMaxPool(), cfg("dgn"), torch.randn(1, 3, 8, 8))  # fine in a DGN
    with pytest.raises(ValueError, match="functionally"):
        convert_gated(_FunctionalRelu(), cfg("dgn"), x)
    with pytest.raises(ValueError, match="dilation"):
        convert_gated(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2, dilation=2)),
                      cfg("dlgn"), torch.randn(1, 3, 9, 9))
    gated = convert_gated(relu_mlp, cfg("dgn"), x)
    with pytest.raises(RuntimeError, match="GatedNetwork itself"):
        gated.value(x)
    with pytest.raises(ValueError, match="no batch"):
        gate_statistics(gated, iter([]))
    with pytest.raises(TypeError, match="GatedNetwork"):
        gate_statistics(relu_mlp, x)


def test_count_units_counts_every_gate_channel_as_nonlinear():
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    gated = linearize.convert(model, mode="dgn", example_inputs=torch.randn(1, 3, 32, 32))
    counts = linearize.count_units(gated)
    assert len(counts["sites"]) == 17
    assert counts["total"] == counts["nonlinear"] == sum(g.num_channels for _, g in gated.gates())
    assert linearize.nonlinear_fraction(gated) == 1.0


class _InputInPlace(nn.Module):
    """An in-place LeakyReLU of the model input itself, then ``head(act(h) + h)`` (an input read again)."""

    def __init__(self) -> None:
        super().__init__()
        self.act0 = nn.LeakyReLU(0.1, inplace=True)
        self.lin, self.act, self.head = nn.Linear(4, 4), nn.LeakyReLU(0.1, inplace=True), nn.Linear(4, 2)

    def forward(self, x):
        x = self.act0(x)
        h = self.lin(x)
        return self.head(self.act(h) + h)


def test_dgn_in_place_tap_on_the_model_input_does_not_change_the_value_networks_input():
    """DGN: the feature network's in-place tap wrote into the caller's input, so the value network applied the leaky ReLU twice."""
    torch.manual_seed(0)
    model = _InputInPlace().double().eval()
    x = torch.randn(16, 4, dtype=torch.float64)
    x_orig = x.clone()
    ref = model(x_orig)  # the original writes leaky_relu(x) into x_orig
    gated = convert_gated(model, GatedConfig(mode="dgn", init="copy", hard_gates=True), x.clone()).eval()
    assert all(g.inplace for _, g in gated.gates())
    xg = x.clone()
    out = gated(xg)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(xg, x_orig, rtol=0, atol=0)  # the caller's input is written once, as by the original
