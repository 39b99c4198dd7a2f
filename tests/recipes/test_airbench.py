"""``recipes/cifar.py --arch airbench94``: the network, its whitening, schedule and lookahead, and a run that
resumes exactly.

Truths: the definition of whitening (the whitened patches' covariance is the identity), the original's
schedule values, and the uninterrupted run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import airbench  # noqa: E402


def test_the_network_has_the_published_shape_and_cost():
    net = airbench.airbench94(10).eval()
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [24, 64, 64, 256, 256, 256, 256]
    macs = 0
    for conv, size in zip(convs, (31, 31, 15, 15, 7, 7, 3)):
        macs += size * size * conv.out_channels * conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
    assert 117e6 < macs < 119e6  # "about 118M multiply-adds per image"
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert not net.whiten.weight.requires_grad
    assert all(not bn.weight.requires_grad for bn in net.modules() if isinstance(bn, torch.nn.BatchNorm2d))


def test_whitening_makes_the_patch_covariance_the_identity():
    torch.manual_seed(0)
    images = torch.randn(256, 3, 32, 32) @ torch.randn(32, 32) * 0.3 + 0.1  # correlated pixels
    conv = airbench.airbench94().whiten
    airbench.init_whitening(conv, images, eps=0.0)
    with torch.no_grad():
        out = torch.nn.functional.conv2d(images.double(), conv.weight.double())  # no bias: the whitening itself
    feats = out.permute(0, 2, 3, 1).reshape(-1, 24)
    cov = feats[:, :12].T @ feats[:, :12] / len(feats)
    assert torch.allclose(cov, torch.eye(12, dtype=torch.float64), atol=1e-3)
    assert torch.equal(conv.weight[12:], -conv.weight[:12])


def test_the_schedule_is_the_originals():
    total = 476
    warm = int(total * 0.23)
    assert airbench.lr_factor(0, total) == pytest.approx(0.2)
    assert airbench.lr_factor(warm, total) == pytest.approx(1.0)
    assert airbench.lr_factor(total, total) == pytest.approx(0.07)
    assert airbench.LR == pytest.approx(1.5) and airbench.LR * airbench.WEIGHT_DECAY == pytest.approx(0.0153 * 1024 / (
        1024 * (1 + 1 / (1 - 0.85))))  # the original's decay per step, per 1024 images


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("cifar32")
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 24), ("test", 6)):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / c / f"{i}.png")
    return root


def test_a_run_stopped_and_resumed_ends_as_the_uninterrupted_one(tree, tmp_path):
    import cifar

    common = ["--data-dir", str(tree), "--cache-dir", str(tmp_path / "cache"), "--arch", "airbench94",
              "--linearize", "none", "--batch-size", "8", "--epochs", "1.9", "--eval-batch-size", "12", "--tta", "2",
              "--checkpointing_steps", "2", "--log_every", "100"]
    whole = cifar.main(common + ["--output_dir", str(tmp_path / "whole")])
    assert whole["steps"] == whole["total_steps"] == 12  # 6 steps per epoch, 1.9 epochs rounded up
    assert 0 <= whole["test_accuracy_tta"] <= 1 and whole["tta_level"] == 2
    cifar.main(common + ["--output_dir", str(tmp_path / "parts"), "--stop-after", "7"])  # lookahead at 5, not 10
    parts = cifar.main(common + ["--output_dir", str(tmp_path / "parts"), "--resume_from_checkpoint", "latest"])
    a = load_file(str(tmp_path / "whole" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert parts["test_accuracy"] == whole["test_accuracy"]
    model = cifar.load_model(tmp_path / "whole" / "model")
    assert isinstance(model.whiten, torch.nn.Conv2d) and not model.training


def test_translations_are_crops_of_the_reflect_padded_image():
    import cifar

    torch.manual_seed(0)
    x = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    out = cifar.augment(x, 2, "reflect")
    padded = torch.nn.functional.pad(x.float(), (2,) * 4, mode="reflect")
    for i in range(len(x)):
        crops = [padded[i, :, r:r + 8, c:c + 8] for r in range(5) for c in range(5)]
        candidates = crops + [t.flip(-1) for t in crops]
        assert any(torch.equal(out[i].float(), t) for t in candidates)
