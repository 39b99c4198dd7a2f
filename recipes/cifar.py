"""Train (and linearize) a ResNet or VGG on CIFAR-10/100 with Accelerate.

    python recipes/cifar.py --data-dir /path/to/cifar10-jpeg.tar.gz --arch resnet20 --output_dir runs/r20
    accelerate launch --num_processes 2 recipes/cifar.py ...        # N processes / GPUs

Data (``--data-dir``, default ``$LINEARIZE_CIFAR10``): torchvision's CIFAR format
(``cifar-10-batches-py`` / ``cifar-100-python``; ``--download`` fetches it), an image-folder tree
``train/<class>/*.jpg`` + ``test/<class>/*.jpg``, or a ``.tar.gz`` of such a tree. Images are
decoded once into a uint8 tensor cache (``--cache-dir``) so that epochs never decode JPEGs;
``--subset N`` decodes only N training images. Augmentation (4 px pad + random crop, flip) runs on
uint8 batches in the training loop, on the device.

The calls of linearize, in :func:`main`: ``linearize.convert`` once the model is built (``--linearize``),
``linearize.Sparsifier(model, linearize.schedules.target(...)).attach(optimizer)`` (``--target``,
``--schedule``: it steps after every optimizer step), then after training ``linearize.freeze`` (``--freeze``),
``linearize.fold`` + ``linearize.save_folded`` (``--fold``) and ``linearize.report`` (``--report``).
``recipes/common/`` holds the plumbing: flags, the Accelerate loop, checkpoints, ``metrics.json``.

The comparison a user would make instead: ``--linearize none --prune magnitude|taylor --target-latency R
--init-from RUN/model`` prunes the trained network's sites at step 0 (``linearize.prune``, one keep fraction for
all) to the largest fraction whose BN-folded CPU latency is at most R of the original's (:func:`prune_to_latency`),
then trains on. The kept channels go to ``OUTPUT_DIR/pruned_channels.json`` and the saved model's folder; a
resumed run and :func:`load_model` rebuild the pruned shapes from them (:func:`rebuild_pruned`).
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import io
import json
import math
import os
import sys
import tarfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import airbench  # noqa: E402
import common  # noqa: E402

import linearize  # noqa: E402
from linearize.inputs import image_size, read_image_file, read_tar_image  # noqa: E402
from linearize.pruning import PruneSite  # noqa: E402
from linearize.serialization import UnitsOnlyWarning  # noqa: E402
from linearize.timing import busy_cpu, median_latency_ms  # noqa: E402

RECIPE = "cifar"
MOBILENET_WIDTHS = {"mobilenet_v2": 1.0, "mobilenet_v2_x0_75": 0.75, "mobilenet_v2_x0_5": 0.5,
                    "mobilenet_v2_x0_35": 0.35}
# CIFAR ResNets: (depth, width of the first stage); the narrower ResNet-20s are the alternative a user
# would train for a faster model (the speed study, recipes/reproduce/speed.py)
CIFAR_RESNETS = {"resnet20": (20, 16), "resnet56": (56, 16), "resnet20_x0_75": (20, 12), "resnet20_x0_5": (20, 8)}
ARCHS = ("resnet18", "resnet34", "resnet50", *CIFAR_RESNETS, "vgg11_bn", "vgg16_bn", *MOBILENET_WIDTHS, *airbench.ARCHS)
VGG_CFG = {
    "vgg11_bn": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16_bn": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}
IMAGE_EXTS = (".jpg", ".jpeg", ".png")
PRUNE_BATCHES = 4  # training batches (of --batch-size) the Taylor importance of --prune sums over
PRUNE_SEARCH_STEPS = 7  # bisection steps over --prune's keep fraction: within 1/128 of the largest under the budget
PRUNE_TIMING_S = 3.0  # seconds of interleaved batch-1 timing (one thread) of each candidate against the original


# ----------------------------------------------------------------------------- models


class CifarResNet(nn.Module):
    """ResNet-(6n+2) of He et al. (2016) for 32x32 inputs: widths 16, 32, 64, ``n`` blocks each.

    Blocks are torchvision's ``BasicBlock`` (so ``linearize.fold`` knows them), with a 1x1
    conv + BN projection where the shape changes (option B of the paper).
    """

    def __init__(self, depth: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n + 2, got {depth}")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        from torchvision.models.resnet import BasicBlock

        layers, cin = [], width
        for i, w in enumerate((width, 2 * width, 4 * width)):
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or cin != w:
                down = nn.Sequential(nn.Conv2d(cin, w, 1, stride, bias=False), nn.BatchNorm2d(w))
            blocks = [BasicBlock(cin, w, stride, down)] + [BasicBlock(w, w) for _ in range(n - 1)]
            layers.append(nn.Sequential(*blocks))
            cin = w
        self.layer1, self.layer2, self.layer3 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def _vgg(cfg: list, num_classes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    cin = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1, bias=False), nn.BatchNorm2d(v), nn.ReLU()]
            cin = v
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def cifar_mobilenet_v2(width: float, num_classes: int = 10) -> nn.Module:
    """torchvision's MobileNet-V2 (``width_mult=width``) with the CIFAR stem: the stem conv and the
    first stride-2 block at stride 1, so 32x32 inputs end at 4x4 (as the CIFAR ResNets' 8x8 / 4x4)."""
    from torchvision.models import mobilenet_v2

    model = mobilenet_v2(width_mult=width, num_classes=num_classes)
    model.features[0][0].stride = (1, 1)
    model.features[2].conv[1][0].stride = (1, 1)
    return model


def build_model(arch: str, num_classes: int) -> nn.Module:
    """A CIFAR model: torchvision ResNet-18/34/50 with the CIFAR stem (3x3 conv, stride 1, no
    max-pool), ResNet-20/56 (He et al., width 16; ResNet-20 also at width 12 and 8: ``resnet20_x0_75``,
    ``resnet20_x0_5``), VGG-11/16 with batch norm (one linear head), or
    MobileNet-V2 at width 1, 0.75, 0.5 or 0.35 with the CIFAR stem (:func:`cifar_mobilenet_v2`), or the wide
    airbench94 network (:func:`airbench.airbench94`, trained with its own recipe).

    Example:
        >>> build_model("mobilenet_v2_x0_5", 10)(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """
    if arch in ("resnet18", "resnet34", "resnet50"):
        import torchvision

        model = getattr(torchvision.models, arch)(num_classes=num_classes)
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
        return model
    if arch in CIFAR_RESNETS:
        depth, width = CIFAR_RESNETS[arch]
        return CifarResNet(depth, num_classes, width)
    if arch in VGG_CFG:
        return _vgg(VGG_CFG[arch], num_classes)
    if arch in MOBILENET_WIDTHS:
        return cifar_mobilenet_v2(MOBILENET_WIDTHS[arch], num_classes)
    if arch == "airbench94":
        return airbench.airbench94(num_classes)
    raise ValueError(f"unknown --arch {arch!r}; choose from {ARCHS}")


CIFAR_RECIPE_KEYS = ("arch", "num_classes", "linearize", "image_size")  # what load_model reads
MAX_IMAGE_SIZE = 1024  # --image-size and recipe.json's image_size: the side images are resized to (ImageNet: 224)


def read_meta(directory: str | Path) -> dict:
    """``recipe.json`` of a model saved by this recipe, with the fields :func:`load_model` reads checked
    (a clear ``linearize.LoadError`` naming the file and the field instead of a failure further on)."""
    directory = Path(directory)
    meta = common.read_recipe_json(directory, CIFAR_RECIPE_KEYS)
    n = meta["num_classes"]
    problems = [what for bad, what in (
        (meta["arch"] not in ARCHS, f"arch {meta['arch']!r} is not one of {ARCHS}"),
        (type(n) is not int or n < 1, f"num_classes {n!r} is not a whole number >= 1"),
        (meta["linearize"] not in common.LINEARIZE_MODES,
         f"linearize {meta['linearize']!r} is not one of {common.LINEARIZE_MODES}"),
        (type(meta["image_size"]) is not int or not 1 <= meta["image_size"] <= MAX_IMAGE_SIZE,
         f"image_size {meta['image_size']!r} is not a whole number in [1, {MAX_IMAGE_SIZE}]"),
        ("pruned" in meta and not isinstance(meta["pruned"], bool), f"pruned {meta.get('pruned')!r} is not true/false"),
        ("classes" in meta and not (isinstance(meta["classes"], list) and len(meta["classes"]) == n
                                    and all(isinstance(c, str) for c in meta["classes"])),
         f"classes is not a list of num_classes ({n!r}) names")) if bad]
    if problems:
        raise linearize.LoadError(f"{directory / 'recipe.json'}: {'; '.join(problems)}: the save is damaged or was "
                                  "edited; train again or restore it")
    return meta


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads included: unit ``frozen`` buffers hold NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _load_weights(model: nn.Module, weights: dict[str, torch.Tensor], path: Path, meta: dict) -> None:
    """Load ``weights`` (of ``model.safetensors`` at ``path``) into ``model`` (built from ``recipe.json``, units
    restored from the sidecar): its tensors must fit the model, be finite, and its unit tensors equal the
    sidecar's (checked there: slopes in [0, 1], frozen values), which they may not overwrite."""
    own = model.state_dict()
    unit_keys = {f"{n}.{k}" for n, u in linearize.units(model) for k in u.state_dict()}
    _check_fit(weights, own, unit_keys, path, meta)
    for k in sorted(unit_keys & weights.keys()):
        if not _same_bits(weights[k], own[k]):
            raise linearize.LoadError(f"{path}: unit tensor {k} differs from the linearize sidecar of "
                                      f"{path.parent} (linearize_config.json, linearize_units-*.safetensors); "
                                      "one of them was modified: train again or restore the folder")
    rest = {k: v for k, v in weights.items() if k not in unit_keys}
    _check_finite(rest, path)
    model.load_state_dict(rest, strict=False)


def _check_finite(weights: dict[str, torch.Tensor], path: Path) -> None:
    bad = common.first_nonfinite(weights.items())
    if bad is not None:
        raise linearize.LoadError(f"{path}: tensor {bad} holds inf or NaN; refusing to load it")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError, OSError: a damaged or missing file
        raise linearize.LoadError(f"{path} cannot be read ({type(e).__name__}: {e}); train again or restore it") from e


def _check_fit(weights: dict, own: dict, unit_keys: set[str], path: Path, meta: dict, plain: bool = False) -> None:
    """``LoadError`` naming ``recipe.json`` when ``weights`` do not fit the model's state ``own`` (less its
    ``unit_keys``); ``plain``: ``own`` is the model before conversion, so extra keys (its units') may remain."""
    missing = sorted(own.keys() - weights.keys() - unit_keys)
    unexpected = [] if plain else sorted(weights.keys() - own.keys())
    shapes = [f"{k} {tuple(weights[k].shape)} (model {tuple(own[k].shape)})" for k in sorted(weights.keys() & own.keys())
              if weights[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        raise linearize.LoadError(
            f"{path} does not fit the model its recipe.json describes (arch {meta['arch']}, num_classes "
            f"{meta['num_classes']}, linearize {meta['linearize']}): missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, other shapes {shapes[:5]}; recipe.json was edited or belongs to other weights")


def load_model(directory: str | Path) -> nn.Module:
    """Rebuild a model saved by this recipe (``OUTPUT_DIR/model``): the architecture from
    ``recipe.json`` (:func:`read_meta`; sized on the meta device and checked against the weights before it is
    built), its files checked against their recorded sizes and sha256, the weights, the units with ``linearize.from_pretrained`` (which checks the weights it sits on; a gated
    ``dgn`` / ``dlgn`` split, two copies ``feature.*`` and ``value.*`` of the network, is sized per copy and
    rebuilt from its sidecar), then every
    tensor again against the converted model (:func:`_load_weights`).
    ``recipe.json`` also lists the class names in label order (``classes``). The model comes back in eval
    mode, as from ``transformers``' ``from_pretrained`` and :func:`wmt14.load_model`: ready to evaluate or
    fold (call ``.train()`` to train it on).

    A ``--prune`` run's model (``recipe.json``'s ``pruned``) is built pruned to the channels its folder's
    ``pruned_channels.json`` records (:func:`rebuild_pruned`) before its weights are loaded.

    Example::

        model = cifar.load_model("recipes/results/mnv2_x0_5_lat_70_sal_kd_s0/model")
        folded = linearize.fold(model, torch.zeros(1, 3, 32, 32))
    """
    directory = Path(directory)
    meta = read_meta(directory)
    common.check_files(directory, meta)
    path = directory / "model.safetensors"
    weights = _read_weights(path)

    def build() -> nn.Module:  # a --prune run's model: the pruned shapes rebuilt from the kept channels
        model = build_model(meta["arch"], meta["num_classes"])
        if not meta.get("pruned"):
            return model
        try:
            return rebuild_pruned(model, common.read_kept(directory)["sites"], meta["image_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise linearize.LoadError(f"{directory / common.KEPT_FILE}: {e}; the save is damaged or was edited: "
                                      "train again or restore it") from e

    with torch.device("meta"):  # sizes first: recipe.json's numbers must not allocate what the weights do not hold
        sized = build()
    gated = meta["linearize"] in ("dgn", "dlgn")  # two copies of the network: feature.* (gates) and value.*
    for prefix in ("feature.", "value.") if gated else ("",):
        _check_fit({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}, sized.state_dict(),
                   set(), path, meta, plain=meta["linearize"] != "none" and not gated)
    model = build()
    if meta["linearize"] != "none":  # the weights first: the sidecar checks them by their digests
        if not gated:  # the gated split's weights come from its sidecar (from_pretrained)
            plain = model.state_dict()
            _check_finite({k: weights[k] for k in plain}, path)
            model.load_state_dict({k: weights[k] for k in plain}, strict=True)
        example = torch.zeros(2, 3, meta["image_size"], meta["image_size"])
        with warnings.catch_warnings():  # saves from before the digests: the weights are loaded here
            warnings.simplefilter("ignore", UnitsOnlyWarning)
            model = linearize.from_pretrained(model, directory, example_inputs=example)
    _load_weights(model, weights, path, meta)
    return model.eval()


def trained_weights(directory: str | Path, arch: str, classes: list[str]) -> dict:
    """The state dict of an unlinearized model saved by this recipe, checked against ``arch`` and the
    class list (its names where ``recipe.json`` records them, else their number)."""
    num_classes = len(classes)
    try:
        meta = read_meta(directory)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--init-from {directory}: {e}; give the OUTPUT_DIR/model folder of a finished "
                                "run of this recipe") from None
    if meta["linearize"] != "none":
        raise ValueError(f"--init-from {directory} holds a --linearize {meta['linearize']} model; start from an "
                         "unlinearized (--linearize none) run")
    if meta.get("pruned"):
        raise ValueError(f"--init-from {directory} holds a pruned (--prune) model, not the {arch} --arch builds; "
                         "start from an unpruned run")
    if (meta["arch"], meta["num_classes"]) != (arch, num_classes):
        raise ValueError(f"--init-from {directory} is a {meta['arch']} with {meta['num_classes']} classes, "
                         f"not a {arch} with {num_classes}")
    if meta.get("classes", classes) != classes:
        raise ValueError(f"--init-from {directory} was trained on the classes {meta['classes']}, "
                         f"this run has {classes}")
    return load_model(directory).state_dict()


# ----------------------------------------------------------------------------- pruning


class TrainingLoss(nn.Module):
    """The cross-entropy of a batch as a module call (``x``: normalized images, ``y``: labels), for
    ``linearize.prune``'s Taylor importance. A ``--distill`` term adds no gradient at step 0, where the
    student is its teacher."""

    def __init__(self, model: nn.Module, label_smoothing: float) -> None:
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y, label_smoothing=self.label_smoothing)


def rebuild_pruned(model: nn.Module, sites: dict[str, list[int]], image_size: int) -> nn.Module:
    """``model`` as :func:`build_model` makes it (on any device, ``meta`` included), pruned in place to the
    channels ``sites`` kept (``pruned_channels.json``'s ``sites``): the shapes of a ``--prune`` run's model,
    whose state dict then loads into it. ``ValueError`` naming a site that does not fit."""
    device = next(model.parameters()).device
    return linearize.prune(model, sites, example_inputs=torch.zeros(2, 3, image_size, image_size, device=device))


def kept_channels(sites: dict[str, PruneSite], fraction: float) -> dict[str, list[int]]:
    """The channels each of ``sites`` (of a ranked ``linearize.prune``'s summary) keeps at ``fraction`` of its
    channels, ranked by their scores as ``linearize.prune(model, fraction)`` ranks them."""
    return {n: s.score.sort(descending=True, stable=True).indices[:max(1, round(fraction * s.channels))].sort()
            .values.tolist() for n, s in sites.items()}


def bn_folded(model: nn.Module, image: torch.Tensor) -> nn.Module:
    """A copy of the plain ``model`` with its BatchNorms folded into the convs before them (``linearize.fold``,
    checked on ``image``): what a user deploys, and what latencies are compared on."""
    with warnings.catch_warnings():  # a plain model has no units: folding its BatchNorms is all there is to do
        warnings.filterwarnings("ignore", "the model has no linearize units", UserWarning)
        return linearize.fold(model, image, latency=False)


def latency_ratio(original: nn.Module, candidate: nn.Module, image: torch.Tensor) -> float:
    """CPU latency of ``candidate`` over ``original`` on ``image`` (batch 1): medians of repetitions
    interleaved for ``PRUNE_TIMING_S`` seconds on one thread (``linearize.timing``)."""
    base, ms = median_latency_ms([original, candidate], image, budget_s=PRUNE_TIMING_S, threads=1)
    return ms / base


def prune_to_latency(model: nn.Module, importance: str, target: float, batches: list[dict[str, torch.Tensor]],
                     image: torch.Tensor, label_smoothing: float = 0.0) -> dict:
    """Prune every site of ``model`` (in place; ``linearize.prune``) to the largest keep fraction, one for all
    sites, whose BN-folded CPU latency at batch 1 (``image``, :func:`latency_ratio` against the original folded)
    is at most ``target`` of the original's: ``PRUNE_SEARCH_STEPS`` bisection steps over the fraction, the
    channels ranked once by ``importance`` (``"taylor"``: on ``batches`` ``{"x", "y"}`` with the training loss,
    :class:`TrainingLoss`). Returns the record of ``pruned_channels.json``: the importance, the target, the
    fraction kept, its measured latency ratio, every fraction tried with its ratio, and the kept ``sites``."""
    net = TrainingLoss(copy.deepcopy(model), label_smoothing)
    linearize.prune(net, 1.0, importance, data=batches, example_inputs=batches[0], loss=lambda loss: loss)
    scored = {n.removeprefix("model."): s for n, s in net.linearize_prune_summary.sites.items()}
    if busy := busy_cpu():
        warnings.warn(f"--prune: the CPU is busy while the search times pruned models ({busy}), so their times are "
                      "noisy, up to 2x either way, and the kept fraction may miss the budget: prune on a quieter "
                      "machine", RuntimeWarning, stacklevel=2)
    model.eval()
    original = bn_folded(model, image)
    low, high, best, tried = 0.0, 1.0, None, []
    for _ in range(PRUNE_SEARCH_STEPS):
        fraction = (low + high) / 2
        sites = kept_channels(scored, fraction)
        candidate = rebuild_pruned(copy.deepcopy(model), sites, image.shape[-1]).eval()
        ratio = latency_ratio(original, bn_folded(candidate, image), image)
        tried.append([fraction, ratio])
        if ratio <= target:
            low, best = fraction, {"keep": fraction, "latency_ratio": ratio, "sites": sites}
        else:
            high = fraction
    if best is None:
        raise ValueError(f"--target-latency {target}: keeping {tried[-1][0]:g} of every site's channels still runs at "
                         f"{tried[-1][1]:.3f} of the original's CPU latency (folded, batch 1): the layers outside the "
                         "sites cost more than that; give a larger --target-latency")
    rebuild_pruned(model, best["sites"], image.shape[-1])
    return {"importance": importance, "target_latency": target, "keep": best["keep"],
            "latency_ratio": best["latency_ratio"], "tried": tried, "sites": best["sites"]}


def prune_step(model: nn.Module, args: argparse.Namespace, train: dict, image: torch.Tensor, mean: torch.Tensor,
               std: torch.Tensor) -> dict:
    """``--prune`` at step 0, on ``model`` in place: resuming from a checkpoint (every one comes after the prune),
    the pruned shapes rebuilt from ``OUTPUT_DIR/pruned_channels.json`` (the checkpoint's weights then replace
    the model's); else :func:`prune_to_latency` on the first ``PRUNE_BATCHES`` training batches of epoch 0, its
    record written there. Returns the record."""
    out_dir = Path(args.output_dir)
    common.remove_partial_checkpoints(out_dir)  # as common.start does: the checkpoint it will load
    ckpt = common.resume_checkpoint(args.resume_from_checkpoint, out_dir)[0]
    if ckpt is not None:
        common.check_args(ckpt, args)  # before the rebuild: a run of other flags is refused naming them
        record = common.read_kept(out_dir)
        rebuild_pruned(model, record["sites"], args.image_size)
        return record
    order = torch.tensor(list(common.EpochSampler(len(train["y"]), args.seed)))  # epoch 0's, as training's
    batches = [{"x": normalize(train["x"][idx], mean, std), "y": train["y"][idx]}
               for idx in order[:PRUNE_BATCHES * args.batch_size].split(args.batch_size)]
    record = prune_to_latency(model, args.prune, args.target_latency, batches, image, args.label_smoothing)
    common.write_kept(out_dir, record)
    return record


# ----------------------------------------------------------------------------- data


def _select(names: list[str], n: int | None) -> list[int]:
    """Indices of a fixed random subset of ``n`` of ``names`` (seed 0: the same for every run), sorted."""
    if n is None or n >= len(names):
        return list(range(len(names)))
    g = torch.Generator().manual_seed(0)
    return sorted(torch.randperm(len(names), generator=g)[:n].tolist())


def _decode(data: bytes, size: int, where: str) -> torch.Tensor:
    """The image ``data`` as uint8 ``[3, size, size]``; ``ValueError`` naming ``where`` (its file) and the fix when it
    is damaged (cut short by an interrupted copy) or would decode to a huge map."""
    from torchvision.io import ImageReadMode, decode_image

    image_size(data, where)  # refuses an image that would decode to a huge map
    try:
        img = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError as err:  # torchvision's decoders: truncated or corrupt data
        raise ValueError(f"{where}: damaged image, it cannot be decoded ({str(err).strip().splitlines()[-1]}): "
                         "replace it or remove it from the dataset") from None
    if img.shape[-1] != size or img.shape[-2] != size:
        img = F.interpolate(img[None].float(), size=(size, size), mode="bilinear", antialias=True,
                            align_corners=False).round().clamp(0, 255).to(torch.uint8)[0]
    return img


def _label_of(path: str, split: str) -> str | None:
    parts = Path(path).parts
    for i, p in enumerate(parts[:-2]):
        if p == split and len(parts) == i + 3 and path.lower().endswith(IMAGE_EXTS):
            return parts[i + 1]
    return None


def _pick(items: list[tuple[str, str]], split: str, subset: int | None, classes: list[str] | None,
          drop_others: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """Apply the class list to ``(path, class)`` items, then select the subset.

    ``classes`` None: the split's own classes (sorted). Otherwise labels are positions in ``classes``;
    items of other classes are dropped (``drop_others``: a ``--classes`` subset) or refused (a test
    class unknown to the training split). Each of ``classes`` must have training images.
    """
    if not items:
        raise FileNotFoundError(f"no images under '{split}/<class>/' ({', '.join(IMAGE_EXTS)}); expected the layout "
                                "train/<class>/*.jpg and test/<class>/*.jpg")
    items = sorted(items)
    found = sorted({c for _, c in items})
    if classes is None:
        classes = found
    else:
        unknown = [c for c in found if c not in classes]
        if unknown and not drop_others:
            raise ValueError(f"{split}/ has images of class(es) {unknown} that train/ lacks (training classes: "
                             f"{classes}); labels follow the training classes, so remove those folders from {split}/, "
                             "add training images of them, or choose classes with --classes")
        missing = [c for c in classes if c not in found]
        if missing and split == "train":
            raise ValueError(f"--classes {','.join(classes)}: no training images of {missing} (train/ has {found})")
        items = [it for it in items if it[1] in classes]
        if not items:
            raise FileNotFoundError(f"no '{split}/<class>/' images of the classes {classes} (found {found})")
    return [items[i] for i in _select([p for p, _ in items], subset)], list(classes)


def _tensors(chosen: list[tuple[str, str]], classes: list[str], read, split: str, size: int, show: bool,
             name: Callable[[str], str]) -> dict:
    """Decode the chosen ``(path, class)`` items with ``read(path) -> bytes`` into uint8 tensors; errors name an
    item by ``name(path)`` (its file, or archive and member)."""
    x = torch.empty(len(chosen), 3, size, size, dtype=torch.uint8)
    y = torch.empty(len(chosen), dtype=torch.long)
    for i, (p, c) in enumerate(tqdm(chosen, desc=f"decode {split}", disable=not show, leave=False)):
        x[i] = _decode(read(p), size, name(p))
        y[i] = classes.index(c)
    return {"x": x, "y": y, "classes": classes}


@functools.lru_cache(maxsize=2)
def _tar_files(path: Path, stamp: tuple) -> dict[str, tarfile.TarInfo]:
    """The regular files of a tar archive by name (the last of a repeated name wins, as extraction does): one
    pass over its headers, shared by the splits of one process. ``stamp`` keys a changed file: its inode, size,
    mtime and ctime (a rewrite that keeps size and mtime, as ``cp -p`` does, still changes the ctime)."""
    with tarfile.open(path, "r:*") as tar:
        return {m.name: m for m in tar if m.isfile()}


def _from_tar(path: Path, split: str, subset: int | None, size: int, show: bool, classes: list[str] | None,
              drop_others: bool) -> dict:
    """Decode only the selected members of a ``.tar.gz`` image-folder tree: the header pass, then a forward
    read of the chosen members at their offsets (no header of the others parsed again)."""
    st = path.stat()
    files = _tar_files(path, (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    items = [(name, c) for name in files if (c := _label_of(name, split))]
    if not items:
        raise FileNotFoundError(f"{path} holds no '{split}/<class>/*.jpg' images; expected the layout "
                                "train/<class>/*.jpg and test/<class>/*.jpg")
    chosen, classes = _pick(items, split, subset, classes, drop_others)
    blobs: dict[str, bytes] = {}
    with tarfile.open(path, "r:*") as tar:
        for name in sorted({p for p, _ in chosen}, key=lambda n: files[n].offset_data):
            blobs[name] = read_tar_image(tar, files[name], f"{path}:{name}")
    return _tensors(chosen, classes, blobs.__getitem__, split, size, show, lambda p: f"{path}:{p}")


def _from_folder(root: Path, split: str, subset: int | None, size: int, show: bool, classes: list[str] | None,
                 drop_others: bool) -> dict:
    base = root / split
    items = [(str(p.relative_to(root)), p.parent.name) for p in base.glob("*/*") if p.suffix.lower() in IMAGE_EXTS]
    chosen, classes = _pick(items, split, subset, classes, drop_others)
    return _tensors(chosen, classes, lambda p: read_image_file(root / p), split, size, show, lambda p: str(root / p))


def _from_torchvision(root: Path, dataset: str, split: str, subset: int | None, size: int, download: bool,
                      classes: list[str] | None) -> dict:
    import torchvision

    cls = torchvision.datasets.CIFAR10 if dataset == "cifar10" else torchvision.datasets.CIFAR100
    ds = cls(str(root), train=split == "train", download=download)
    x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
    y = torch.tensor(ds.targets, dtype=torch.long)
    if classes is not None:  # keep those classes, labelled by their position in `classes`
        unknown = [c for c in classes if c not in ds.classes]
        if unknown:
            raise ValueError(f"--classes: {unknown} are not {dataset} classes ({ds.classes})")
        relabel = torch.full((len(ds.classes),), -1, dtype=torch.long)
        relabel[torch.tensor([ds.classes.index(c) for c in classes])] = torch.arange(len(classes))
        keep = relabel[y] >= 0
        x, y = x[keep], relabel[y[keep]]
    idx = torch.tensor(_select([""] * len(y), subset))
    x, y = x[idx], y[idx]
    if size != x.shape[-1]:
        x = F.interpolate(x.float(), size=(size, size), mode="bilinear", antialias=True,
                          align_corners=False).round().clamp(0, 255).to(torch.uint8)
    return {"x": x, "y": y, "classes": list(ds.classes) if classes is None else list(classes)}


def _torchvision_present(root: Path, dataset: str) -> bool:
    return (root / ("cifar-10-batches-py" if dataset == "cifar10" else "cifar-100-python")).is_dir()


def load_split(data: str | Path | None, dataset: str, split: str, subset: int | None, size: int,
               cache_dir: Path, download: bool = False, show: bool = True, classes: list[str] | None = None,
               drop_others: bool = False) -> dict:
    """``{"x": uint8 [N, 3, size, size], "y": long [N], "classes": [str]}``, cached as a tensor file.

    ``classes``: the class list the labels index (None: the split's own classes); images of other
    classes are dropped with ``drop_others``, else refused (see :func:`_pick`). The cache key covers
    the source path, its size and mtime, the split, the subset, the size and the class list, so a
    changed source is decoded again.
    """
    if data is None:
        raise FileNotFoundError("no CIFAR data given: pass --data-dir (or set LINEARIZE_CIFAR10) to torchvision's "
                                "CIFAR folder (add --download to fetch it), an image-folder tree "
                                "train/<class>/*.jpg + test/<class>/*.jpg, or a .tar.gz of that tree")
    path = Path(data).expanduser().resolve()
    if not path.exists() and not download:
        raise FileNotFoundError(f"--data-dir {path} does not exist: pass an existing folder or .tar.gz, "
                                "or add --download to fetch torchvision's CIFAR into it")
    stat = path.stat() if path.exists() else None
    parts = [str(path), stat and stat.st_size, stat and stat.st_mtime, dataset, split, subset, size]
    if path.is_dir():  # a folder's own mtime misses images added, removed or replaced in its subfolders
        parts.append(_tree_signature(path / split if (path / split).is_dir() else path))
    if classes is not None:  # the training split without --classes keeps its old key; every test split
        parts += [classes, drop_others]  # gets a new one (old caches labelled test classes per split)
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]
    cache = cache_dir / f"{dataset}-{split}-{key}.pt"
    if cache.exists():
        cached = _read_cache(cache, size, classes)
        if cached is not None:
            return cached
    if path.is_file() and tarfile.is_tarfile(path):
        out = _from_tar(path, split, subset, size, show, classes, drop_others)
    elif path.is_dir() and (path / split).is_dir():
        out = _from_folder(path, split, subset, size, show, classes, drop_others)
    elif download or (path.is_dir() and _torchvision_present(path, dataset)):
        out = _from_torchvision(path, dataset, split, subset, size, download, classes)
    else:
        raise FileNotFoundError(
            f"{path} is not CIFAR data: expected torchvision's '{'cifar-10-batches-py' if dataset == 'cifar10' else 'cifar-100-python'}' "
            "inside it (or add --download), an image-folder tree train/<class>/*.jpg + test/<class>/*.jpg, "
            "or a .tar.gz of that tree"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    from linearize._files import atomic_write

    buf = io.BytesIO()
    torch.save(out, buf)
    atomic_write(cache, buf.getvalue())
    return out


def _tree_signature(root: Path) -> str:
    """Hash of the relative path, size and mtime of every file under ``root``."""
    h = hashlib.sha256()
    for dirpath, _, filenames in sorted(os.walk(root)):
        for name in sorted(filenames):
            st = os.stat(os.path.join(dirpath, name))
            h.update(f"{os.path.relpath(os.path.join(dirpath, name), root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _read_cache(cache: Path, size: int, classes: list[str] | None) -> dict | None:
    """A decoded split from ``cache`` (``torch.load(weights_only=True)``), or None (with a warning)
    when the file is damaged, refused or not a split of ``size``-pixel images: it is decoded again."""
    try:
        out = torch.load(cache, map_location="cpu", weights_only=True)
        x, y, names = out["x"], out["y"], out["classes"]
        ok = (isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.dim() == 4
              and tuple(x.shape[1:]) == (3, size, size) and isinstance(y, torch.Tensor) and y.dtype == torch.long
              and tuple(y.shape) == (len(x),) and isinstance(names, list) and all(isinstance(c, str) for c in names)
              and (classes is None or names == list(classes))
              and (len(y) == 0 or 0 <= int(y.min()) and int(y.max()) < len(names)))
    except Exception as e:  # a decoder of arbitrary bytes: truncated zip, refused pickle, missing keys
        ok, why = False, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    else:
        why = "not a decoded split of this size and class list"
    if ok:
        return out
    warnings.warn(f"ignoring the damaged CIFAR cache {cache} ({why}); decoding the data again", RuntimeWarning,
                  stacklevel=3)
    return None


def load_data(args: argparse.Namespace, show: bool = True) -> tuple[dict, dict]:
    """The train and test splits (:func:`load_split`) with one class list: ``--classes`` (labels
    0..k-1 in that order, other classes left out) or else the training split's classes, so a test
    split lacking a class keeps the training labels and a test class unknown to training is refused."""
    kw = dict(cache_dir=Path(args.cache_dir), download=args.download, show=show, drop_others=args.classes is not None)
    train = load_split(args.data_dir, args.dataset, "train", args.subset, args.image_size, classes=args.classes, **kw)
    test = load_split(args.data_dir, args.dataset, "test", args.eval_subset, args.image_size,
                      classes=train["classes"], **kw)
    return train, test


class TensorImages(torch.utils.data.Dataset):
    """uint8 images and labels in memory; ``__getitems__`` fetches a whole batch at once."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def __getitems__(self, idx: list[int]):
        idx_t = torch.as_tensor(idx)
        return self.x[idx_t], self.y[idx_t]


def _identity(batch):
    return batch


def augment(x: torch.Tensor, pad: int = 4, mode: str = "constant") -> torch.Tensor:
    """Random crop after padding by ``pad`` pixels (``mode``: zeros, or ``"reflect"`` as airbench94's 2-pixel
    translations) and random horizontal flip, per image.

    ``x``: uint8 ``[N, C, H, W]``; uses torch's global RNG on ``x.device``'s default generator.
    """
    n, c, h, w = x.shape
    if mode == "constant":
        xp = F.pad(x, (pad, pad, pad, pad))
    else:  # reflect / replicate pad floats only
        xp = F.pad(x.float(), (pad, pad, pad, pad), mode=mode).to(x.dtype)
    oy = torch.randint(0, 2 * pad + 1, (n,), device=x.device)
    ox = torch.randint(0, 2 * pad + 1, (n,), device=x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, None, :]
    out = xp[torch.arange(n, device=x.device)[:, None, None, None], torch.arange(c, device=x.device)[None, :, None, None],
             rows, cols]
    flip = torch.rand(n, device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


def normalize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, 3, H, W]`` -> float, per-channel standardized (mean/std in 0..1 units)."""
    return (x.float() / 255.0 - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = p.add_argument_group("data and model")
    d.add_argument("--data-dir", "--data_dir", dest="data_dir", default=os.environ.get("LINEARIZE_CIFAR10"),
                   help="torchvision CIFAR folder, image-folder tree or .tar.gz (default $LINEARIZE_CIFAR10)")
    d.add_argument("--dataset", choices=["cifar10", "cifar100"], default="cifar10")
    d.add_argument("--download", action="store_true", help="download torchvision's CIFAR into --data-dir")
    d.add_argument("--cache-dir", "--cache_dir", dest="cache_dir",
                   default=os.environ.get("LINEARIZE_CACHE", str(Path.home() / ".cache" / "linearize")),
                   help="where decoded uint8 tensors are cached")
    d.add_argument("--classes", default=None,
                   help="comma-separated class names (e.g. airplane,cat): train and evaluate on these classes only, "
                        "labelled 0..k-1 in this order (default: all classes of the training split)")
    d.add_argument("--subset", type=int, default=None, help="use only N training images (a fixed random subset)")
    d.add_argument("--eval-subset", "--eval_subset", dest="eval_subset", type=int, default=None,
                   help="use only N test images")
    d.add_argument("--image-size", "--image_size", dest="image_size", type=int, default=32)
    d.add_argument("--arch", choices=ARCHS, default="resnet20",
                   help="airbench94 trains with its own recipe (recipes/airbench.py) and its own defaults: "
                        + ", ".join(f"{common.flag(k)} {v:.4g}" for k, v in airbench.DEFAULTS.items()))
    d.add_argument("--init-from", "--init_from", dest="init_from", default=None,
                   help="start from the weights of OUTPUT_DIR/model of an earlier --linearize none run (same "
                        "--arch): linearize an already trained network, the 'late' setting of seed 000")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=float, default=200,
                   help="training epochs; a fraction ends the run inside the last epoch (steps rounded up)")
    t.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, default=128,
                   help="global batch size (split over the processes)")
    t.add_argument("--eval-batch-size", "--eval_batch_size", dest="eval_batch_size", type=int, default=500)
    t.add_argument("--lr", type=float, default=0.1, help="peak SGD learning rate (cosine decay to 0)")
    t.add_argument("--warmup-epochs", "--warmup_epochs", dest="warmup_epochs", type=float, default=0.0)
    t.add_argument("--weight-decay", "--weight_decay", dest="weight_decay", type=float, default=5e-4)
    t.add_argument("--tta", type=int, choices=(0, 1, 2), default=0,
                   help="also report the test accuracy with test-time augmentation: 1 the mean with the mirror "
                        "image, 2 also with 1-pixel translations (airbench's levels)")
    t.add_argument("--label-smoothing", "--label_smoothing", dest="label_smoothing", type=float, default=0.0)
    t.add_argument("--distill", type=float, default=0.0, metavar="ALPHA",
                   help="with --init-from: learn from the --init-from model too (knowledge distillation from the "
                        "unlinearized network): loss = (1 - ALPHA) * cross-entropy + ALPHA * T^2 * "
                        "KL(teacher || student) at temperature T; 0 (default): labels only")
    t.add_argument("--distill-temperature", "--distill_temperature", dest="distill_temperature", type=float,
                   default=None, metavar="T", help="softmax temperature of --distill, in (0, 1e4) (default 4)")
    t.add_argument("--channels-last", "--channels_last", dest="channels_last", action="store_true",
                   help="keep the model and its maps in channels_last memory (same values, faster convolutions "
                        "on the CPU: training steps of ResNet-20 and MobileNet-V2 about 1.4-1.5x); a run resumes "
                        "only with the flag it started with")
    common.add_linearize_args(p)
    p.add_argument("--units", choices=("channel", "element"), default="channel",
                   help="--linearize prelu: one slope per channel (default), or per activation element, every "
                        "position of every map (C x H x W per image, as SNL and AutoReP linearize ReLUs); element "
                        "units take images of --image-size only")
    p.add_argument("--target-relus", "--target_relus", dest="target_relus", type=float, default=None, metavar="N",
                   help="instead of --target: at most N nonlinear ReLUs per image (activation elements, as SNL and "
                        "AutoReP count them: linearize.schedules.target(relus=N))")
    p.add_argument("--prune", choices=common.PRUNE_IMPORTANCES, default=None,
                   help="with --linearize none, --init-from and --target-latency R: at step 0 remove the channels of "
                        "every site of the trained network (linearize.prune, ranked by this importance, one keep "
                        "fraction for all sites) down to the largest fraction whose BN-folded CPU latency at batch 1 "
                        "is at most R of the original's, then train on: the comparison to linearizing at equal latency")
    common.add_run_args(p)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--arch")
    if first.parse_known_args(argv)[0].arch in airbench.ARCHS:
        p.set_defaults(**airbench.DEFAULTS)
    args = p.parse_args(argv)
    common.check_run_args(args)
    if args.target_relus is not None:  # before check_linearize_args, which fills in --target 0.1
        other = next((k for k in ("target", "target_flops", "target_latency") if getattr(args, k) is not None), None)
        if other:
            p.error(f"give one target: --target-relus or {common.flag(other)}, not both")
        if not 0 < args.target_relus < math.inf:
            p.error(f"--target-relus is a number of ReLUs per image, a positive finite number, got {args.target_relus}")
        if args.linearize != "prelu" or args.schedule == "none":
            p.error("--target-relus steers the sparsity pressure, which --linearize none / dgn / dlgn and --schedule "
                    "none turn off: drop it, or use --linearize prelu with a schedule")
    if args.units == "element" and args.linearize != "prelu":
        p.error(f"--units element makes blend units (--linearize prelu), got --linearize {args.linearize}")
    if args.prune:
        what = f"--prune {args.prune}"
        if args.linearize != "none":
            p.error(f"{what} removes channels of the plain model, and --linearize {args.linearize} (the default is "
                    "prelu) converts its activations: add --linearize none")
        if args.init_from is None:
            p.error(f"{what} prunes a trained network at step 0: give it with --init-from (OUTPUT_DIR/model of a "
                    "--linearize none run)")
        if args.target_latency is None or not 0.0 < args.target_latency < 1.0:
            p.error(f"{what} prunes to a CPU latency budget: add --target-latency R with R in (0, 1), the pruned model's "
                    f"BN-folded latency over the original's (got {args.target_latency})")
        latency, args.target_latency = args.target_latency, None  # common's check refuses it without units
    common.check_linearize_args(args)
    if args.prune:
        args.target_latency, args.target = latency, None
    if args.target_relus is not None:
        args.target = None
    for name in ("subset", "eval_subset", "batch_size", "eval_batch_size", "image_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"{common.flag(name)} must be >= 1")
    if args.image_size > MAX_IMAGE_SIZE:
        p.error(f"--image-size {args.image_size} is more than {MAX_IMAGE_SIZE} (the side every image is resized "
                "to): give a smaller size")
    if not math.isfinite(args.epochs):
        p.error(f"--epochs must be a finite number >= 1, got {args.epochs}")
    for name in ("lr", "warmup_epochs", "weight_decay"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            p.error(f"{common.flag(name)} must be a finite number >= 0, got {getattr(args, name)}")
    if not 0.0 <= args.label_smoothing < 1.0:
        p.error(f"--label-smoothing must lie in [0, 1), got {args.label_smoothing}")
    if args.classes is not None:
        args.classes = [c.strip() for c in args.classes.split(",")]
        if not all(args.classes) or len(set(args.classes)) != len(args.classes):
            p.error(f"--classes takes distinct comma-separated class names, got {','.join(args.classes)!r}")
    if not 0.0 <= args.distill <= 1.0:  # also refuses NaN
        p.error(f"--distill is a weight in [0, 1], got {args.distill}")
    if args.distill > 0 and args.init_from is None:
        p.error("--distill needs a teacher: give the trained network with --init-from")
    if args.distill_temperature is not None and not args.distill > 0:
        p.error("--distill-temperature is the temperature of --distill: add --distill ALPHA (e.g. 0.9)")
    args.distill_temperature = 4.0 if args.distill_temperature is None else args.distill_temperature
    if not 0.0 < args.distill_temperature < 1e4:
        p.error(f"--distill-temperature must lie in (0, 1e4), got {args.distill_temperature}")
    return args



def evaluate(model, loader, accelerator, mean, std, tta: int = 0) -> dict:
    """Top-1 accuracy and mean loss over the (gathered, de-duplicated) test set, and with ``tta`` > 0 also the
    accuracy with test-time augmentation (:func:`airbench.tta_logits`); leaves ``model`` in eval mode."""
    model.eval()
    correct = correct_tta = total = 0
    loss_sum = 0.0
    with torch.no_grad():
        for x, y in tqdm(loader, desc="eval", disable=not accelerator.is_local_main_process, leave=False):
            x = normalize(x, mean, std)
            logits = model(x)
            loss = F.cross_entropy(logits, y, reduction="none")
            pred_tta = airbench.tta_logits(model, x, tta).argmax(1) if tta else logits.argmax(1)
            pred, pred_tta, y, loss = accelerator.gather_for_metrics((logits.argmax(1), pred_tta, y, loss))
            correct += int((pred == y).sum())
            correct_tta += int((pred_tta == y).sum())
            total += len(y)
            loss_sum += float(loss.sum())
    out = {"test_accuracy": correct / total, "test_loss": loss_sum / total, "test_images": total}
    if tta:
        out.update(test_accuracy_tta=correct_tta / total, tta_level=tta)
    return out


def main(argv: list[str] | None = None) -> dict:
    """Train (or resume) one run into ``--output_dir`` and save it; returns its metrics. The folder's run lock
    (taken by ``common.make_accelerator``: a second run into it is refused meanwhile) is released at the end."""
    args = parse_args(argv)
    try:
        return train_run(args, time.time())
    finally:
        common.release_output_dir(args.output_dir)


def train_run(args: argparse.Namespace, start_time: float) -> dict:
    """The run of :func:`main` (``start_time``: when it began)."""
    accelerator = common.make_accelerator(args, split_batches=True)
    n_proc = accelerator.num_processes
    if args.batch_size % n_proc or args.eval_batch_size % n_proc:
        raise ValueError(f"--batch-size {args.batch_size} and --eval-batch-size {args.eval_batch_size} are global "
                         f"batch sizes and must be multiples of the number of processes ({n_proc})")
    if args.target_latency is not None and n_proc > 1:  # each process would time and plan on its own
        raise ValueError(f"--target-latency times the model on each of the {n_proc} processes, whose plans "
                         "could then differ and their copies of the model drift apart: use --target-flops "
                         "(the same plan everywhere), or one process")
    show = accelerator.is_local_main_process
    out_dir = Path(args.output_dir)

    with accelerator.main_process_first():
        train, test = load_data(args, show)
    classes = train["classes"]
    num_classes = len(classes)
    if len(train["y"]) < args.batch_size:
        raise ValueError(f"{len(train['y'])} training images are fewer than one batch ({args.batch_size})")
    mean = train["x"].float().mean((0, 2, 3)) / 255.0
    std = train["x"].float().std((0, 2, 3)) / 255.0

    torch.manual_seed(args.seed)
    model = build_model(args.arch, num_classes)
    teacher = None
    if args.init_from:
        weights = trained_weights(args.init_from, args.arch, classes)
        model.load_state_dict(weights)
        if args.distill > 0:  # the unlinearized network, fixed, in eval mode (its BN statistics)
            teacher = build_model(args.arch, num_classes)
            teacher.load_state_dict(weights)
            teacher.eval().requires_grad_(False)
            args.teacher_sha256 = common.state_sha256(weights)  # recorded: a resume with another teacher is refused
    elif args.arch in airbench.ARCHS:  # the whitening filters from (normalized) training patches
        airbench.init_whitening(model.whiten, normalize(train["x"][:5000], mean, std))
    pruned = None  # what --prune kept (common.KEPT_FILE)
    if args.prune:  # at step 0, before the shapes are fingerprinted and the optimizer holds the parameters
        pruned = prune_step(model, args, train, normalize(test["x"][:1], mean, std), mean, std)
        accelerator.print(f"pruned ({args.prune}): {pruned['keep']:.4f} of every site's channels kept, CPU latency "
                          f"{pruned['latency_ratio']:.3f} of the original's (folded, batch 1; target "
                          f"{args.target_latency})")
    if args.linearize != "none":  # every activation becomes a unit with a learnable slope (or a gated split)
        model = linearize.convert(model, mode=args.linearize,
                                  example_inputs=torch.zeros(2, 3, args.image_size, args.image_size),
                                  **({"granularity": "element"} if args.units == "element" else {}))
    if args.channels_last:  # convolutions then give channels_last maps, the units keep them (linearize.unit._prelu)
        model = model.to(memory_format=torch.channels_last)
        if teacher is not None:
            teacher = teacher.to(memory_format=torch.channels_last)
    fingerprint = common.model_fingerprint(model) + ("-channels_last" if args.channels_last else "")
    if args.classes is not None:  # a class subset must match on resume (all classes: the fingerprint as before)
        fingerprint += "-" + hashlib.sha256(json.dumps(classes).encode()).hexdigest()[:8]

    sampler = common.EpochSampler(len(train["y"]), args.seed)
    train_loader = torch.utils.data.DataLoader(TensorImages(train["x"], train["y"]), batch_size=args.batch_size,
                                               sampler=sampler, drop_last=True, collate_fn=_identity)
    test_loader = torch.utils.data.DataLoader(TensorImages(test["x"], test["y"]), batch_size=args.eval_batch_size,
                                              shuffle=False, collate_fn=_identity)
    steps_per_epoch = len(train_loader)
    total_steps = common.run_length(args, steps_per_epoch)
    warmup = int(args.warmup_epochs * steps_per_epoch)

    if args.arch in airbench.ARCHS:
        optimizer, scheduler = airbench.optimizer_and_schedule(model, args.lr, args.weight_decay, total_steps,
                                                               steps_per_epoch)
        lookahead = airbench.Lookahead(model, optimizer, total_steps)
        optimizer.register_step_post_hook(lambda *_: lookahead.step(scheduler.last_epoch + 1))
    else:
        # no weight decay on slopes (it would pull them back towards the activation), biases and norms
        optimizer = torch.optim.SGD(linearize.param_groups(model, weight_decay=args.weight_decay), lr=args.lr,
                                    momentum=0.9, nesterov=True)

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    sparsifier = None
    if args.linearize == "prelu" and args.schedule != "none":  # after every optimizer step: slopes towards 1
        schedule = linearize.schedules.target(args.target, start=common.schedule_start(args, total_steps),
                                              end=args.ramp_end, flops=args.target_flops, latency=args.target_latency,
                                              relus=args.target_relus)
        # a cost target folds copies of the model to price its sites: on one test image, the batch-1 latency;
        # a ReLU target counts the elements of each map on it
        priced = args.target_flops is not None or args.target_latency is not None or args.target_relus is not None
        image = normalize(test["x"][:1], mean, std) if priced else None
        sparsifier = linearize.Sparsifier(model, schedule, total_steps, lam=args.lam, rate=args.rate,
                                          select=args.select, linear_end=args.linear_end,
                                          granularity=args.granularity,
                                          example_inputs=image).attach(optimizer)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    mean, std = mean.to(accelerator.device), std.to(accelerator.device)
    if teacher is not None:
        teacher.to(accelerator.device)
    run = common.Run(accelerator, args, model, optimizer, scheduler, sparsifier, out_dir, fingerprint, RECIPE,
                     started=start_time)
    step, last_step = common.start(run, total_steps)
    accelerator.print(f"{args.arch} on {args.dataset}: {len(train['y'])} train / {len(test['y'])} test images, "
                      f"{steps_per_epoch} steps/epoch, {total_steps} steps, {n_proc} process(es)")

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        x = normalize(augment(x, 2, "reflect") if args.arch in airbench.ARCHS else augment(x), mean, std)
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=args.label_smoothing)
        if teacher is None:
            return loss
        with torch.no_grad():
            target = teacher(x)
        return (1 - args.distill) * loss + args.distill * linearize.distill_loss(
            logits, target, "logits", temperature=args.distill_temperature)

    step = common.train(run, train_loader, sampler, loss_fn, step, last_step, steps_per_epoch)

    metrics = {"recipe": RECIPE, "arch": args.arch, "dataset": args.dataset, "steps": step,
               "total_steps": total_steps, "train_images": len(train["y"])}
    raw = accelerator.unwrap_model(model)
    if args.freeze:  # linear channels (slope >= 1 - tol) set to exactly 1 and no longer trained
        linearize.freeze(raw, tol=args.tol)  # on every process: the copies stay identical
    metrics.update(evaluate(model, test_loader, accelerator, mean, std, args.tta))
    metrics.update(common.unit_stats(raw, args.tol))
    if accelerator.is_main_process:
        history = out_dir / "sparsifier_history.json"
        # an earlier run's, in a reused --output_dir, that this run does not write again (those it writes below
        # replace the earlier ones: a symlinked folded/ or report/ keeps its link, and its target gets this run's)
        common.remove_earlier_outputs(out_dir, [*(["folded"] * (not args.fold)), *(["report"] * (not args.report)),
                                                history.name, *([] if args.prune else [common.KEPT_FILE])])
        if sparsifier is not None:
            sparsifier.save_history(history)
        probe = normalize(test["x"][:64].to(accelerator.device), mean, std)
        if linearize.units(raw):  # ReLUs per image (activation elements), as the private-inference papers count
            relus = linearize.measures.count_relus(raw, probe[:1], tol=args.tol)
            metrics.update(relus_total=relus["total"], relus_nonlinear=relus["nonlinear"])
            try:
                metrics["average_path_length"] = float(linearize.measures.average_path_length(raw, probe,
                                                                                              normalized=True))
            except (TypeError, ValueError, NotImplementedError) as e:
                warnings.warn(f"average path length not computed: {e}")
        if pruned is not None:
            metrics["prune"] = {**{k: v for k, v in pruned.items() if k != "sites"},
                                "kept_indices": str(out_dir / common.KEPT_FILE)}
        save_final(raw, out_dir / "model", args, classes, mean, std, pruned)
        raw.eval()
        if args.fold:  # linear parts folded into the layers around them (a plain nn.Module, no units left)
            folded = linearize.fold(raw, probe)
            with common.replaced_dir(out_dir / "folded") as stage:  # never a half-written folded/
                # the recipe builds its models itself: load with linearize.load_folded(dir, base=<its model>)
                linearize.save_folded(folded, stage, builder="plain", example_inputs=probe)
            metrics["fold"] = common.fold_metrics(folded, out_dir / "folded")
        if args.report:
            data = (normalize(test["x"][:128].to(accelerator.device), mean, std), test["y"][:128])
            linearize.report(raw, data, tol=args.tol, max_samples=args.report_samples,
                             skip=[m for m in args.report_skip.split(",") if m],
                             history=history if history.exists() else None).save(out_dir / "report")
            metrics["report"] = str(out_dir / "report")
        # last: a metrics.json of the whole schedule marks the run finished (recipes/reproduce's is_done), so a
        # run killed before its outputs are all written is resumed, never taken as finished without them
        common.write_metrics(out_dir, metrics, args, start_time, n_proc, str(accelerator.device), run.earlier_s)
        accelerator.print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)}))
    if args.with_tracking:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return metrics


def save_final(model: nn.Module, directory: Path, args: argparse.Namespace, classes: list[str],
               mean: torch.Tensor, std: torch.Tensor, pruned: dict | None = None) -> None:
    """Weights (``model.safetensors``), the linearize sidecar, the kept channels of a ``--prune`` run
    (``pruned``, as ``pruned_channels.json``) and ``recipe.json`` (what :func:`load_model` needs to rebuild
    the model)."""
    from safetensors.torch import save_file

    with common.writing(directory), common.replaced_dir(directory) as stage:  # the three files replace the old ones
        if args.linearize != "none":  # the units, and digests of the weights model.safetensors holds
            linearize.save_pretrained(model, stage, weights=False)
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  str(stage / "model.safetensors"))
        if pruned is not None:
            common.write_kept(stage, pruned)
        meta = {"arch": args.arch, "num_classes": len(classes), "classes": classes, "dataset": args.dataset,
                "image_size": args.image_size, "linearize": args.linearize, "mean": mean.tolist(),
                "std": std.tolist(), **({"pruned": True} if pruned is not None else {}),
                "files": common.file_records(stage)}
        (stage / "recipe.json").write_text(json.dumps(meta, indent=2))


if __name__ == "__main__":
    # run as the module `cifar`, so its classes are `cifar.CifarResNet`, not `__main__.CifarResNet`
    import cifar

    cifar.main()
