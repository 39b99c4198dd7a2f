"""What converts and folds among models nobody tuned for: every torchvision classification family and a
timm set, converted with NO example inputs (the probe input is guessed from the model).

For each model (float32, random init, its own small input ``x``), :func:`check` measures:

- ``init_error``: converted vs a deep copy of the original, max error over the output scale;
- ``linear_error``: at slope 1 vs the original with every non-gate activation replaced by the
  identity (activation modules swapped for ``nn.Identity``, and functional activation calls made
  identity by a ``TorchFunctionMode`` unless convert reported them skipped: then they keep their
  function in both). Sigmoid/hardsigmoid gates stay in both;
- ``roundtrip``: ``save_pretrained`` then ``from_pretrained`` into a fresh, unconverted copy gives
  bit-identical outputs (random slopes);
- ``fold_error``: ``linearize.fold`` at random 0/1 slopes, folded vs converted, over the output scale;
- ``skipped``: activation calls the conversion report lists as not converted.

tests/test_zoo.py asserts these per model; this script prints them as a markdown table by family:

    python recipes/reproduce/zoo_table.py            # about 2 minutes on one CPU thread
    python recipes/reproduce/zoo_table.py --models   # one row per model

Left out of the torchvision set: the variants whose class a smaller tested variant exercises and that
take seconds to build or run on one CPU thread (``LEFT_OUT``: left out -> the tested variant).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import warnings
from collections import defaultdict
from typing import Any

import timm
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.overrides import TorchFunctionMode

import linearize

LEFT_OUT = {
    "convnext_base": "convnext_small", "convnext_large": "convnext_small",
    "densenet169": "densenet121", "densenet201": "densenet121",
    "efficientnet_b4": "efficientnet_b3", "efficientnet_b5": "efficientnet_b3", "efficientnet_b6": "efficientnet_b3",
    "efficientnet_b7": "efficientnet_b3", "efficientnet_v2_m": "efficientnet_v2_s", "efficientnet_v2_l": "efficientnet_v2_s",
    "regnet_x_8gf": "regnet_x_3_2gf", "regnet_x_16gf": "regnet_x_3_2gf", "regnet_x_32gf": "regnet_x_3_2gf",
    "regnet_y_8gf": "regnet_y_3_2gf", "regnet_y_16gf": "regnet_y_3_2gf", "regnet_y_32gf": "regnet_y_3_2gf",
    "regnet_y_128gf": "regnet_y_3_2gf",
    "resnet101": "resnet50", "resnet152": "resnet50", "wide_resnet50_2": "resnet50", "wide_resnet101_2": "resnet50",
    "resnext101_32x8d": "resnext50_32x4d", "resnext101_64x4d": "resnext50_32x4d",
    "swin_b": "swin_t", "swin_s": "swin_t", "swin_v2_b": "swin_v2_t", "swin_v2_s": "swin_v2_t",
    "vgg11": "vgg11_bn", "vgg13": "vgg11_bn", "vgg13_bn": "vgg11_bn", "vgg16": "vgg11_bn",
    "vgg16_bn": "vgg11_bn", "vgg19": "vgg11_bn", "vgg19_bn": "vgg11_bn",
    "vit_b_32": "vit_b_16", "vit_l_16": "vit_b_16", "vit_l_32": "vit_b_16", "vit_h_14": "vit_b_16",
}
TV_KWARGS = {"vit_b_16": {"image_size": 32}}  # construction keywords (default: num_classes=10 only)
TV_SIDE = {"alexnet": 63, "inception_v3": 75, "maxvit_t": 64}  # input side (default 32 px)


def timm_overlay(side: int) -> dict:
    """timm's own record of a model's input size (``pretrained_cfg['input_size']``), set to ``side``."""
    return {"pretrained_cfg_overlay": {"input_size": (3, side, side)}}


# timm name -> (create_model keywords, input side); the smallest variants, small images
TIMM = {
    "vit_tiny_patch16_224": ({"img_size": 32}, 32),
    "deit_tiny_patch16_224": ({"img_size": 32}, 32),
    "convnext_atto": (timm_overlay(32), 32),
    "efficientnet_b0": (timm_overlay(32), 32),
    "mobilenetv3_small_050": (timm_overlay(32), 32),
    "regnetx_002": (timm_overlay(32), 32),
    "resnet18d": (timm_overlay(32), 32),
    "ghostnet_050": (timm_overlay(32), 32),
    "rexnet_100": (timm_overlay(32), 32),
    "levit_128s": ({"img_size": 64, **timm_overlay(64)}, 64),
    "mixer_s16_224": ({"img_size": 32}, 32),
    "coat_lite_tiny": ({"img_size": 32}, 32),
    "swin_tiny_patch4_window7_224": ({"img_size": 32, "window_size": 2}, 32),
    "poolformer_s12": (timm_overlay(32), 32),
    "edgenext_xx_small": (timm_overlay(32), 32),
    "vit_tiny_r_s16_p8_224": ({"img_size": 32}, 32),  # hybrid: ResNet stem, ViT body
    "mobilevit_xxs": (timm_overlay(64), 64),  # hybrid: MobileNet blocks and transformers
}
TV_NAMES = [n for n in torchvision.models.list_models(module=torchvision.models) if n not in LEFT_OUT]
MODELS = [*TV_NAMES, *(f"timm.{n}" for n in TIMM)]


def family(model_id: str) -> str:
    """``timm.<arch>`` or the torchvision module that builds the model (``resnet``, ``vision_transformer``)."""
    if model_id.startswith("timm."):
        return "timm." + timm.models.model_entrypoint(model_id.removeprefix("timm.")).__module__.rsplit(".", 1)[1]
    return torchvision.models.get_model_builder(model_id).__module__.rsplit(".", 1)[1]


def maxvit_small() -> nn.Module:
    """maxvit_t's blocks at 64 px (maxvit_t fixes partition 7, hence 224 px inputs)."""
    model = torchvision.models.MaxVit(input_size=(64, 64), stem_channels=64, partition_size=2,
                                      block_channels=[64, 128, 256, 512], block_layers=[2, 2, 5, 2], head_dim=32,
                                      stochastic_depth_prob=0.2, num_classes=10)
    model.image_size = 64  # tells the input-size guess what the model was built for
    return model


def build(model_id: str) -> tuple[nn.Module, torch.Tensor]:
    """The model (seeded, eval mode, ``num_classes=10``) and its own input batch ``[2, 3, S, S]``.

    Zero-initialized weight matrices (ViT heads) are drawn from N(0, 0.02), constant layer scales
    below 1e-3 (ConvNeXt, PoolFormer, EdgeNeXt) set to 1 and convs too small to carry the signal
    (GoogLeNet, Inception v3) re-drawn (Kaiming), so that every activation shows in the output.
    """
    torch.manual_seed(0)
    if model_id.startswith("timm."):
        kwargs, side = TIMM[model_id.removeprefix("timm.")]
        model = timm.create_model(model_id.removeprefix("timm."), pretrained=False, num_classes=10, **kwargs)
    elif model_id == "maxvit_t":
        model, side = maxvit_small(), TV_SIDE[model_id]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GoogLeNet/Inception init-weights notices
            model = torchvision.models.get_model(model_id, weights=None, num_classes=10, **TV_KWARGS.get(model_id, {}))
        side = TV_SIDE.get(model_id, 32)
        if model_id.startswith("swin"):
            model.image_size = side  # Swin takes any size; its weights' min_size (224/256) is slow here
    with torch.no_grad():
        for m in model.modules() if model_id in ("googlenet", "inception_v3") else ():
            if isinstance(m, nn.Conv2d):  # truncated N(0, 0.01-0.1): the signal vanishes before the head
                nn.init.kaiming_normal_(m.weight)
        for p in model.parameters():
            if p.ndim >= 2 and not p.any():
                p.normal_(0, 0.02)
            elif p.numel() > 1 and 0 < p.abs().max() < 1e-3 and bool((p == p.flatten()[0]).all()):
                p.fill_(1.0)
    x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))
    return model.eval(), x


# ----------------------------------------------------------------------------- truths

GATES = (nn.Sigmoid, nn.Hardsigmoid)  # left as they are by convert (LinearizeConfig.gates="exclude")
ACTIVATION_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Hardswish, nn.Mish, nn.ELU,
                      nn.CELU, nn.SELU, nn.Softplus, nn.Tanh, nn.Hardtanh)
ACTIVATION_FUNCTIONS = {
    F.relu, F.relu_, torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_, F.relu6, F.leaky_relu,
    F.leaky_relu_, F.gelu, F.silu, F.hardswish, F.mish, F.elu, F.elu_, F.celu, F.selu, F.softplus, F.hardtanh,
    torch.tanh, F.tanh, torch.Tensor.tanh,
}


# models whose torch.sigmoid calls are no gates (Swin V2: 16 * sigmoid(position-bias table))
SIGMOID_NOT_GATE = {"swin_v2_t"}


class FunctionsAsIdentity(TorchFunctionMode):
    """Every non-gate activation function returns its input (``sigmoid=True``: sigmoid too)."""

    def __init__(self, sigmoid: bool = False) -> None:
        super().__init__()
        self.functions = ACTIVATION_FUNCTIONS | ({torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid} if sigmoid else set())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.functions:
            return args[0]
        return func(*args, **(kwargs or {}))


def identity_activations(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every non-gate activation module replaced by ``nn.Identity``."""
    model = copy.deepcopy(model)
    for owner in list(model.modules()):
        for attr, child in list(owner.named_children()):
            if isinstance(child, ACTIVATION_MODULES):
                setattr(owner, attr, nn.Identity())
    return model


def output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` over ``max |b|``."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def set_slopes(model: nn.Module, fill) -> None:
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.copy_(fill(unit.slope.shape, gen))


def check(model_id: str, directory: str, row: dict[str, Any]) -> dict[str, Any]:
    """Measure ``model_id`` into ``row`` (see the module docstring), step by step; a failing step raises
    and leaves the steps before it in ``row``."""
    model, x = build(model_id)
    original = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipped calls are counted in row["skipped"]
        try:
            linearize.convert(model)  # no example inputs: guessed from the model
        except ValueError:  # refused (no convertible activation): count what it would skip
            row["skipped"] = len(linearize.dry_run(original).problems())
            raise
    report = model.linearize_report
    row.update(sites=len(report.sites), skipped=len(report.problems()))
    reference = output(original, x)
    row["init_error"] = relative_error(output(model, x), reference)

    set_slopes(model, lambda shape, gen: torch.ones(shape))
    truth_model = identity_activations(original)
    if report.problems():  # skipped calls keep their function in the converted model
        truth = output(truth_model, x)
    else:
        with FunctionsAsIdentity(sigmoid=model_id in SIGMOID_NOT_GATE):
            truth = output(truth_model, x)
    row["activations_matter"] = relative_error(truth, reference)  # > 0: the truth differs from the original
    row["linear_error"] = relative_error(output(model, x), truth)

    set_slopes(model, lambda shape, gen: torch.rand(shape, generator=gen))
    linearize.save_pretrained(model, directory)
    loaded = linearize.from_pretrained(original, directory)  # the pristine copy: a fresh, unconverted model
    row["roundtrip"] = torch.equal(output(loaded, x), output(model, x))

    set_slopes(model, lambda shape, gen: (torch.rand(shape, generator=gen) < 0.5).float())
    folded = linearize.fold(model, x, latency=False)
    row["fold_error"] = relative_error(output(folded, x), output(model, x))
    return row


# ----------------------------------------------------------------------------- the table

INIT_TOL, LINEAR_TOL, FOLD_TOL = 1e-5, 1e-5, 1e-4


def measure(model_id: str) -> dict[str, Any]:
    """``check`` with the exception, if any, recorded as ``row["error"]``."""
    row: dict[str, Any] = {"model": model_id}
    with tempfile.TemporaryDirectory() as directory:
        try:
            check(model_id, directory, row)
        except Exception as err:  # noqa: BLE001 - the table reports every failure
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
    return row


def verdicts(row: dict[str, Any]) -> dict[str, bool]:
    return {
        "converts": "sites" in row,
        "exact": row.get("init_error", 1) <= INIT_TOL and row.get("linear_error", 1) <= LINEAR_TOL
        and row.get("roundtrip", False),
        "folds": row.get("fold_error", 1) <= FOLD_TOL,
    }


def table(rows: list[dict[str, Any]], per_model: bool) -> str:
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["model"] if per_model else family(row["model"])].append(row)
    lines = ["| family | models | converts | exact | folds | skipped calls |", "|---|---|---|---|---|---|"]
    for name, members in groups.items():
        counts = [verdicts(r) for r in members]
        cells = [f"{sum(c[k] for c in counts)}/{len(members)}" for k in ("converts", "exact", "folds")]
        skipped = sum(r.get("skipped", 0) for r in members)
        models = ", ".join(r["model"].removeprefix("timm.") for r in members)
        lines.append(f"| {name} | {models} | {' | '.join(cells)} | {skipped} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", action="store_true", help="one row per model instead of per family")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(m) for m in MODELS]
    print(table(rows, args.models))
    for row in rows:
        if "error" in row:
            print(f"\n{row['model']}: {row['error']}")


if __name__ == "__main__":
    main()
