"""recipes/benchmarks/block_sensitivity.py: each block's accuracy when linear against the same model with
that block's activations replaced by ``nn.Identity`` (no linearize units involved), on a tiny image tree."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
sys.path.insert(0, str(RECIPES))
sys.path.insert(0, str(RECIPES / "benchmarks"))

import block_sensitivity  # noqa: E402
import cifar  # noqa: E402

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture
def plain_model_dir(tmp_path) -> tuple[Path, nn.Module]:
    """A MobileNet-V2 x0.35 with random weights and BatchNorm statistics, saved as recipes/cifar.py does."""
    torch.manual_seed(0)
    model = cifar.build_model("mobilenet_v2_x0_35", 10)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None
    with torch.no_grad():
        model.train()(torch.randn(16, 3, 8, 8))
    model.eval()
    args = argparse.Namespace(arch="mobilenet_v2_x0_35", dataset="cifar10", image_size=8, linearize="none")
    mean, std = torch.full((3,), 0.5), torch.full((3,), 0.25)
    cifar.save_final(model, tmp_path / "model", args, CLASSES, mean, std)
    return tmp_path / "model", model


def test_accuracy_with_a_block_linear_is_the_model_without_its_activations(plain_model_dir, tiny_cifar, tmp_path):
    directory, plain = plain_model_dir
    out = block_sensitivity.main(["--model", str(directory), "--data-dir", str(tiny_cifar), "--images", "10",
                                  "--batches", "1", "--budget", "0.2", "--cache-dir", str(tmp_path / "cache")])
    meta = cifar.read_meta(directory)
    s = cifar.load_split(str(tiny_cifar), "cifar10", "test", 10, 8, tmp_path / "cache", show=False, classes=CLASSES)
    x = cifar.normalize(s["x"], torch.tensor(meta["mean"]), torch.tensor(meta["std"]))

    def accuracy(m: nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            out = m(x)
        return (out.argmax(1) == s["y"]).float().mean().item(), nn.functional.cross_entropy(out, s["y"]).item()

    assert (out["accuracy"], out["loss"]) == pytest.approx(accuracy(plain), rel=1e-5)
    blocks = [r["block"] for r in out["rows"]]
    assert blocks[0] == "features.0.2" and "features.1" in blocks and "features.17" in blocks  # stem, blocks, last conv
    for r in out["rows"]:
        truth = copy.deepcopy(plain)
        for name, m in list(truth.named_modules()):
            if isinstance(m, nn.ReLU6) and (name == r["block"] or name.startswith(r["block"] + ".")):
                parent, _, leaf = name.rpartition(".")
                setattr(truth.get_submodule(parent), leaf, nn.Identity())
        assert (r["accuracy_linear"], r["loss_linear"]) == pytest.approx(accuracy(truth), rel=1e-5), r["block"]
        assert r["loss_linear"] != pytest.approx(out["loss"], rel=1e-6)  # each block changes the function
        assert r["saliency"] >= 0 and r["mflops_saved"] >= 0  # fold never merges where FLOPs would grow
    assert -1 <= out["spearman"]["saliency"] <= 1


def test_a_linearized_model_is_refused(tmp_path, tiny_cifar):
    import linearize

    model = linearize.convert(cifar.build_model("resnet20", 10), example_inputs=torch.zeros(2, 3, 8, 8))
    args = argparse.Namespace(arch="resnet20", dataset="cifar10", image_size=8, linearize="prelu")
    cifar.save_final(model, tmp_path / "model", args, CLASSES, torch.zeros(3), torch.ones(3))
    with pytest.raises(SystemExit):
        block_sensitivity.main(["--model", str(tmp_path / "model"), "--data-dir", str(tiny_cifar)])
