"""linearize.prune: structured channel pruning of FFN and conv sites, against independent truths (the unpruned
model on channels that are dead on the data, hand counts of FLOPs and parameters, brute-force removal and
replacement of one channel at a time)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torchvision
from torch import nn

import linearize
from linearize._optional import MissingExtra


def _mlp(dead: list[int], hidden: int = 12) -> nn.Sequential:
    """Linear(6, hidden) -> ReLU -> Linear(hidden, 3) in float64 whose ``dead`` channels are 0 on any input
    (zero rows, bias -1), with small but nonzero outgoing weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 3)).double()
    with torch.no_grad():
        net[0].weight[dead] = 0.0
        net[0].bias[dead] = -1.0
        net[2].weight[:, dead] *= 1e-3
    return net


class Block(nn.Module):
    """A residual block ``x + bn2(conv2(relu(bn1(conv1(x)))))`` followed by a ReLU."""

    def __init__(self, channels: int = 4, inner: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, inner, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(inner)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(inner, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


def _conv_net(dead: list[int]) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), Block()).double().eval()
    with torch.no_grad():
        for bn in (net[2].bn1, net[2].bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
        net[2].bn1.weight[dead] = 0.0  # the BatchNorm's output is its bias: -1, and the ReLU's 0
        net[2].bn1.bias[dead] = -1.0
        net[2].conv1.weight[dead] *= 1e-3  # small weights in and out: magnitude ranks them last
        net[2].conv2.weight[:, dead] *= 1e-3
    return net


@pytest.mark.parametrize("importance", ["magnitude", "taylor", "residual"])
def test_removing_channels_dead_on_the_data_keeps_the_mlp_output(importance):
    dead = [1, 4, 5, 9]
    net = _mlp(dead)
    x = torch.randn(64, 6, dtype=torch.float64)
    expected = net(x)
    linearize.prune(net, keep=8, importance=importance, data=x)
    site = net.linearize_prune_summary.sites["0"]
    assert sorted(set(range(12)) - set(site.kept.tolist())) == dead
    assert net[0].weight.shape == (8, 6) and net[2].weight.shape == (3, 8)
    torch.testing.assert_close(net(x), expected, rtol=0, atol=1e-12)


def test_removing_conv_channels_dead_on_the_data_keeps_the_residual_block_output():
    pytest.importorskip("torch_pruning")
    dead = [0, 3, 6]
    net = _conv_net(dead)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    expected = net(x)
    linearize.prune(net, keep=5, example_inputs=x)
    summary = net.linearize_prune_summary
    assert list(summary.sites) == ["2.conv1"]  # the stem's channels are the residual stream's: no site
    assert "0" in summary.skipped
    assert sorted(set(range(8)) - set(summary.sites["2.conv1"].kept.tolist())) == dead
    block = net[2]
    assert (block.conv1.out_channels, block.bn1.num_features, block.conv2.in_channels) == (5, 5, 5)
    torch.testing.assert_close(net(x), expected, rtol=0, atol=1e-12)


def test_flops_and_parameters_of_a_pruned_mlp_match_a_hand_count():
    net = _mlp([])
    x = torch.randn(5, 6, dtype=torch.float64)
    linearize.prune(net, keep=4, example_inputs=x)
    summary = net.linearize_prune_summary
    assert summary.params_before == 6 * 12 + 12 + 12 * 3 + 3
    assert summary.params_after == sum(p.numel() for p in net.parameters()) == 6 * 4 + 4 + 4 * 3 + 3
    # 2 FLOPs per multiply-add (linearize.count_flops), biases not counted
    assert summary.flops_before == 2 * 5 * (6 * 12 + 12 * 3)
    assert summary.flops_after == linearize.count_flops(net, x) == 2 * 5 * (6 * 4 + 4 * 3)


def test_flops_and_parameters_of_a_pruned_residual_block_match_a_hand_count():
    pytest.importorskip("torch_pruning")
    net = _conv_net([])
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    linearize.prune(net, keep=3, example_inputs=x)
    summary = net.linearize_prune_summary
    pixels = 8 * 8
    stem = 4 * 3 * 9 * pixels
    block_macs = 3 * 4 * 9 * pixels + 4 * 3 * 9 * pixels  # conv1 4 -> 3, conv2 3 -> 4, 3x3
    norms = (3 + 4) * pixels  # BatchNorm: 2 FLOPs per element
    assert summary.flops_after == 2 * (stem + block_macs) + 2 * norms
    assert summary.params_after == (4 * 3 * 9 + 4) + 3 * 4 * 9 + 2 * 3 + 4 * 3 * 9 + 2 * 4
    assert summary.params_after == sum(p.numel() for p in net.parameters())


def _one_channel_changes(net: nn.Sequential, x: torch.Tensor, replace) -> torch.Tensor:
    """Brute force: per hidden channel ``c``, the output with ``h[:, c]`` replaced by ``replace(h[:, c], pre[:, c])``
    minus the original output ``[C, N, out]``."""
    pre = net[0](x)
    h = net[1](pre)
    base = net[2](h)
    changes = []
    for c in range(h.shape[1]):
        h2 = h.clone()
        h2[:, c] = replace(h[:, c], pre[:, c])
        changes.append(net[2](h2) - base)
    return torch.stack(changes)


def test_taylor_scores_with_a_loss_linear_in_the_output_are_the_brute_force_removal_changes():
    net = _mlp([])
    x = torch.randn(40, 6, dtype=torch.float64)
    v = torch.randn(3, dtype=torch.float64)
    with torch.no_grad():  # the output is linear in h, so removing channel c changes <out_n, v> by exactly -a * g
        removal = _one_channel_changes(net, x, lambda h, pre: torch.zeros_like(h))
    brute = (removal @ v).abs().sum(1)  # summed over the samples of |change of sample n's loss|
    linearize.prune(net, keep=5, importance="taylor", data=x, loss=lambda out: (out @ v).sum())
    site = net.linearize_prune_summary.sites["0"]
    torch.testing.assert_close(site.score, brute, rtol=1e-9, atol=1e-12)
    assert site.kept.tolist() == sorted(torch.argsort(brute, descending=True)[:5].tolist())


def test_taylor_scores_of_a_float16_model_rank_its_channels_as_in_float64():
    """Finite float16 values and gradients whose product overflows float16: the scores used to be multiplied in
    float16 and the run was refused, blaming the data. Truth: the same model's scores and ranking in float64."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        net[0].weight.mul_(torch.linspace(1, 40, 8)[:, None] * 10)
        net[2].weight.mul_(20)
    x = torch.randn(64, 4)
    reference, half = copy.deepcopy(net).double(), copy.deepcopy(net).half()
    with torch.no_grad():
        h = half[1](half[0](x.half()))
        grad = half[2](h) @ half[2].weight  # of the default loss, 0.5 * sum(out ** 2): finite
        assert torch.isfinite(grad).all() and not torch.isfinite(h * grad).all()  # their float16 product is not
    linearize.prune(reference, keep=4, importance="taylor", data=x.double())
    linearize.prune(half, keep=4, importance="taylor", data=x.half())
    truth, got = (m.linearize_prune_summary.sites["0"] for m in (reference, half))
    torch.testing.assert_close(got.score, truth.score, rtol=2e-2, atol=0)
    assert got.kept.tolist() == truth.kept.tolist() == [4, 5, 6, 7]


def test_a_non_finite_loss_gradient_is_named_as_such_not_as_the_data():
    """Finite data whose loss gradient is inf: the error names the gradient and its fixes, not the samples."""
    net = _mlp([])
    with pytest.raises(ValueError, match=r"loss gradient at site '0' holds NaN/inf on batch 0.*site's values are "
                                         r"finite.*model.float\(\)") as caught:
        linearize.prune(net, keep=4, importance="taylor", data=torch.randn(8, 6, dtype=torch.float64),
                        loss=lambda out: out.sum() * float("inf"))
    assert "drop or repair" not in str(caught.value)


def test_residual_scores_are_the_brute_force_output_error_of_each_channels_affine_fit():
    net = _mlp([])
    x = torch.randn(200, 6, dtype=torch.float64)

    def fitted(h, pre):  # least squares of relu(pre) on [pre, 1]
        design = torch.stack([pre, torch.ones_like(pre)], 1)
        coef = torch.linalg.lstsq(design, h.unsqueeze(1)).solution
        return (design @ coef).squeeze(1)

    with torch.no_grad():
        changes = _one_channel_changes(net, x, fitted)
    brute = (changes ** 2).sum(2).mean(1)  # mean over samples of the squared output change
    linearize.prune(net, keep=5, importance="residual", data=x)
    site = net.linearize_prune_summary.sites["0"]
    torch.testing.assert_close(site.score, brute, rtol=1e-6, atol=1e-12)
    assert site.kept.tolist() == sorted(torch.argsort(brute, descending=True)[:5].tolist())


def test_magnitude_is_the_norm_of_each_channels_weights_in_and_out():
    net = _mlp([])
    w1, w2 = net[0].weight.detach().clone(), net[2].weight.detach().clone()
    linearize.prune(net, keep=0.5, example_inputs=torch.randn(2, 6, dtype=torch.float64))
    site = net.linearize_prune_summary.sites["0"]
    expected = torch.stack([torch.linalg.vector_norm(torch.cat([w1[c], w2[:, c]])) for c in range(12)])
    torch.testing.assert_close(site.score, expected)
    assert site.kept.tolist() == sorted(torch.argsort(expected, descending=True)[:6].tolist())


def test_hf_bert_ffns_are_pruned_and_the_pooler_is_no_site():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    inputs = {"input_ids": torch.randint(0, 50, (3, 7)), "attention_mask": torch.ones(3, 7, dtype=torch.long)}
    inputs["attention_mask"][0, 5:] = 0
    linearize.prune(model, keep=12, importance="taylor", data=inputs)
    summary = model.linearize_prune_summary
    assert list(summary.sites) == [f"encoder.layer.{i}.intermediate.dense" for i in range(2)]
    assert "pooler.dense" in summary.skipped
    for layer in model.encoder.layer:
        assert layer.intermediate.dense.weight.shape == (12, 16) and layer.output.dense.weight.shape == (16, 12)
    assert summary.flops_after < summary.flops_before
    assert model(**inputs).last_hidden_state.shape == (3, 7, 16)


def test_mobilenet_v2_expand_and_depthwise_sites_lose_the_same_channels():
    pytest.importorskip("torch_pruning")
    model = torchvision.models.mobilenet_v2(width_mult=0.5).eval()
    x = torch.randn(1, 3, 32, 32)
    linearize.prune(model, keep=0.5, example_inputs=x)
    sites = model.linearize_prune_summary.sites
    expand, depthwise = sites["features.2.conv.0.0"], sites["features.2.conv.1.0"]
    assert expand.coupled == ("features.2.conv.1.0",) and torch.equal(expand.kept, depthwise.kept)
    block = model.features[2].conv
    assert block[0][0].out_channels == block[1][0].out_channels == block[2].in_channels == len(expand.kept)
    assert model(x).shape == (1, 1000)


def test_a_model_rebuilt_from_the_kept_indices_has_the_pruned_shapes_and_outputs():
    """MobileNet-V2 (coupled expand and depthwise sites) and an MLP: a fresh model pruned to the indices a
    ranked prune kept has that pruned model's shapes, and with its state dict its outputs."""
    pytest.importorskip("torch_pruning")
    cases = [(lambda: torchvision.models.mobilenet_v2(width_mult=0.35, num_classes=10).eval(), torch.randn(2, 3, 32, 32)),
             (lambda: _mlp([3, 5]), torch.randn(4, 6, dtype=torch.float64))]
    for build, x in cases:
        torch.manual_seed(0)
        pruned = linearize.prune(build(), 0.5, "taylor", data=[x])
        kept = {n: s.kept.tolist() for n, s in pruned.linearize_prune_summary.sites.items()}
        torch.manual_seed(1)  # other initial weights: only the state dict makes the outputs equal
        rebuilt = linearize.prune(build(), kept, example_inputs=x)
        assert rebuilt.linearize_prune_summary.importance == "indices"
        assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in pruned.state_dict().items()}
        rebuilt.load_state_dict(pruned.state_dict())
        with torch.no_grad():
            assert torch.equal(rebuilt(x), pruned(x))


def test_wrong_kept_indices_are_refused_by_site_and_leave_the_model_alone():
    x = torch.randn(2, 6, dtype=torch.float64)
    for keep, message in [({"nope": [0]}, r"no site named 'nope'"), ({"0": [0, 12]}, r"index 12 is not a channel .*has 12"),
                          ({"0": [-1]}, "index -1"), ({"0": [1, 1]}, "indices repeat"), ({"0": []}, "non-empty list"),
                          ({"0": [0.5]}, "non-empty list"), ({}, "names no site"),
                          ({"0": "0,2,4"}, r"keep\['0'\]: give a non-empty list"),  # as read from a text file
                          ({"0": ["0", "2"]}, r"keep\['0'\]: give"), ({"0": {0: 1}}, r"keep\['0'\]: give"),
                          ({"0": [[0, 1], [2]]}, r"keep\['0'\]: give")]:
        net = _mlp([])
        with pytest.raises(ValueError, match=message):
            linearize.prune(net, keep, example_inputs=x)
        assert net[0].out_features == 12
    with pytest.raises(ValueError, match="drop sites="):
        linearize.prune(_mlp([]), {"0": [1]}, example_inputs=x, sites=["0"])
    pytest.importorskip("torch_pruning")
    model = torchvision.models.mobilenet_v2(width_mult=0.35, num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match=r"'features.2.conv.0.0' and 'features.2.conv.1.0' are coupled"):
        linearize.prune(model, {"features.2.conv.0.0": [0, 1], "features.2.conv.1.0": [0, 2]}, example_inputs=x)
    assert model.features[2].conv[0][0].out_channels == model.features[2].conv[1][0].out_channels == 48


def test_keep_errors_name_the_site_and_the_fix():
    x = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"keep=13 channels, but site '0' has only 12"):
        linearize.prune(_mlp([]), keep=13, example_inputs=x)
    for keep in (0, -1):
        with pytest.raises(ValueError, match="keep at least 1 channel"):
            linearize.prune(_mlp([]), keep=keep, example_inputs=x)
    for keep in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"a fraction must be in \(0, 1\]"):
            linearize.prune(_mlp([]), keep=keep, example_inputs=x)
    with pytest.raises(TypeError, match="keep must be a number"):
        linearize.prune(_mlp([]), keep=True, example_inputs=x)


def test_a_site_with_no_following_layer_is_refused_by_name():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU())
    with pytest.raises(ValueError, match=r"site '2' cannot be pruned: .*has no following layer"):
        linearize.prune(net, keep=4, example_inputs=torch.randn(2, 4), sites=["2"])
    with pytest.raises(ValueError, match=r"no prunable site.*has no following layer"):
        linearize.prune(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), keep=4, example_inputs=torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"no site named 'nope'.*\['0'\]"):
        linearize.prune(net, keep=4, example_inputs=torch.randn(2, 4), sites=["nope"])


def test_channels_that_reach_more_than_the_next_layer_are_no_site():
    class Gated(nn.Module):  # the GELU's output also scales the input: slicing it would break the product
        def __init__(self):
            super().__init__()
            self.up, self.act, self.down = nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)

        def forward(self, x):
            h = self.act(self.up(x))
            return self.down(h) + self.down(h * x)

    with pytest.raises(ValueError, match="no prunable site"):
        linearize.prune(Gated(), keep=2, example_inputs=torch.randn(2, 4))


def test_data_dependent_importances_need_data_and_a_scalar_loss():
    with pytest.raises(ValueError, match="needs calibration data"):
        linearize.prune(_mlp([]), keep=4, importance="taylor", example_inputs=torch.randn(2, 6))
    with pytest.raises(ValueError, match="importance must be one of"):
        linearize.prune(_mlp([]), keep=4, importance="random", example_inputs=torch.randn(2, 6))
    with pytest.raises(ValueError, match="scalar tensor"):
        linearize.prune(_mlp([]), keep=4, importance="taylor", data=torch.randn(4, 6, dtype=torch.float64),
                        loss=lambda out: out)


@pytest.mark.parametrize("importance, message", [
    ("taylor", r"values at site '0' hold NaN/inf on batch 1 of data.*drop or repair"),
    ("residual", r"calibration data holds NaN/inf.*unit '1'.*batch 1 of data.*drop or repair"),
])
def test_data_with_nan_names_the_batch_and_leaves_the_model_alone(importance, message):
    net = _mlp([])
    original = copy.deepcopy(net)
    batches = [torch.randn(8, 6, dtype=torch.float64) for _ in range(3)]
    batches[1][2, 0] = float("nan")  # one corrupted value: every channel's score would be NaN, the ranking arbitrary
    with pytest.raises(ValueError, match=message):
        linearize.prune(net, keep=4, importance=importance, data=batches)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), original.state_dict().values()))


def test_a_converted_model_is_refused_with_the_fix():
    plain = _mlp([])
    converted = linearize.convert(copy.deepcopy(plain), example_inputs=torch.randn(2, 6, dtype=torch.float64))
    before = copy.deepcopy(converted.state_dict())
    with pytest.raises(ValueError, match=r"prune takes a plain model.*linearize.convert.*\['1'\].*before convert"):
        linearize.prune(converted, keep=4, example_inputs=torch.randn(2, 6, dtype=torch.float64))
    for k, v in converted.state_dict().items():  # unchanged (`frozen` holds NaN)
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)
    small = linearize.prune(plain, keep=4, example_inputs=torch.randn(2, 6, dtype=torch.float64))  # the fix works
    assert small[0].out_features == 4


def test_conv_sites_without_torch_pruning_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_pruning", None)  # import fails as if not installed
    with pytest.raises(MissingExtra, match=r'pip install "linearize\[prune\]"'):
        linearize.prune(_conv_net([]), keep=4, example_inputs=torch.randn(1, 3, 8, 8, dtype=torch.float64))
    net = _mlp([])  # dense sites need no extra
    linearize.prune(net, keep=4, example_inputs=torch.randn(2, 6, dtype=torch.float64))
    assert net[0].out_features == 4


def test_the_taylor_score_leaves_parameters_and_their_gradients_alone():
    net = _mlp([])
    net[2].weight.requires_grad_(False)
    before = copy.deepcopy(net.state_dict())
    linearize.prune(net, keep=12, importance="taylor", data=torch.randn(8, 6, dtype=torch.float64))
    assert all(p.grad is None for p in net.parameters())
    assert not net[2].weight.requires_grad
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, before[k])
