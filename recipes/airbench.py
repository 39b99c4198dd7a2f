"""The airbench94 network and its training recipe, in fp32 for any device (``recipes/cifar.py --arch airbench94``).

After Keller Jordan's airbench94 ("94% on CIFAR-10 in 3.29 seconds on a single GPU", 2024; PyPI ``airbench``,
CUDA and fp16 only): a frozen 2x2 patch-whitening convolution (24 channels, initialised from the eigenvectors of
the training patches' covariance) and GELU, then three groups conv3x3 -> max-pool 2 -> BatchNorm -> GELU ->
conv3x3 -> BatchNorm -> GELU of 64 / 256 / 256 channels, no residuals, max-pool 3, a linear head scaled by 1/9.
About 118M multiply-adds per 32x32 image; 1,176 GELU channels, 81,560 GELU activations per image.

The recipe, as the original where it matters: batch 1024, Nesterov SGD (momentum 0.85) with a triangular
learning rate (0.2 -> 1 over the first 23% of the steps, then linearly to 0.07), label smoothing 0.2, BatchNorm
weights fixed at 1 (biases learn 64x faster, with the same decay), the whitening bias trained for the first 3
epochs only, lookahead (every 5 steps the weights move to their running average, whose weight grows as
``0.95**5 * (step / steps)**3``; the final weights are the average), random 2-pixel translations of the
reflect-padded image and flips (``cifar.augment``), and test-time augmentation (flip + 1-pixel translations, ``--tta 2``).
Left out: the original's alternating ("derandomized") flips, which need each image's index; flips are random.

The original's learning rate (11.5 per 1024 images on a summed loss) and decay (0.0153, decoupled) are given
as the equivalent PyTorch values for a mean loss: ``--lr 1.5`` and ``--weight-decay 1.33e-3``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

ARCHS = ("airbench94",)
WIDTHS = (64, 256, 256)
WHITEN_WIDTH = 24  # 2 x 3 x 2 x 2: each eigenvector of the 2x2 patches and its negative
MOMENTUM = 0.85
BIAS_LR_SCALE = 64.0
WHITEN_BIAS_EPOCHS = 3
LOOKAHEAD_EVERY = 5
# The original's learning rate (11.5 per 1024 images, with momentum 0.85 on a summed loss) and decay (0.0153 per
# 1024 images, decoupled from the learning rate), as PyTorch SGD values for the mean loss: the same updates.
LR = 11.5 / (1 + 1 / (1 - MOMENTUM))  # 1.5
WEIGHT_DECAY = 0.0153 / 11.5  # 1.33e-3, PyTorch's decay: lr * decay = the original's per-step decay
# Flag defaults of --arch airbench94 (a flag given on the command line wins).
DEFAULTS = {"batch_size": 1024, "epochs": 9.9, "lr": LR, "weight_decay": WEIGHT_DECAY, "label_smoothing": 0.2,
            "eval_batch_size": 2000, "tta": 2, "channels_last": True}


class Scale(nn.Module):
    """Multiply by a fixed number (the head's 1/9)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


def _conv(cin: int, cout: int) -> nn.Conv2d:
    """3x3 'same' convolution without bias whose first ``cin`` filters start as the identity (dirac)."""
    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:cin])
    return conv


def _norm(c: int) -> nn.BatchNorm2d:
    """BatchNorm with the original's settings: running statistics momentum 0.4, eps 1e-12, weight fixed at 1."""
    bn = nn.BatchNorm2d(c, eps=1e-12, momentum=0.4)
    bn.weight.requires_grad_(False)
    return bn


class ConvGroup(nn.Sequential):
    """conv -> max-pool 2 -> BN -> GELU -> conv -> BN -> GELU (one GELU module per call)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(OrderedDict(conv1=_conv(cin, cout), pool=nn.MaxPool2d(2), norm1=_norm(cout), act1=nn.GELU(),
                                     conv2=_conv(cout, cout), norm2=_norm(cout), act2=nn.GELU()))


def airbench94(num_classes: int = 10) -> nn.Sequential:
    """The airbench94 network for 32x32 images (the whitening conv is fixed: see :func:`init_whitening`).

    Example:
        >>> airbench94(10)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    w1, w2, w3 = WIDTHS
    net = nn.Sequential(OrderedDict(
        whiten=nn.Conv2d(3, WHITEN_WIDTH, 2, bias=True), act=nn.GELU(),
        group1=ConvGroup(WHITEN_WIDTH, w1), group2=ConvGroup(w1, w2), group3=ConvGroup(w2, w3),
        pool=nn.MaxPool2d(3), flatten=nn.Flatten(), head=nn.Linear(w3, num_classes, bias=False), scale=Scale(1 / 9)))
    net.whiten.weight.requires_grad_(False)
    return net


def init_whitening(conv: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> None:
    """Set ``conv`` (3 -> 2 * 3 * k * k channels, k x k kernel) to whiten the k x k patches of ``images``
    (normalized, ``[N, 3, H, W]``): its filters are the eigenvectors ``v`` of the patches' covariance
    (uncentred, as the original), scaled by ``1 / sqrt(eigenvalue + eps)``, and their negatives."""
    k = conv.kernel_size[0]
    patches = images.double().unfold(2, k, 1).unfold(3, k, 1).transpose(1, 3).reshape(-1, 3 * k * k)
    cov = patches.T @ patches / len(patches)
    values, vectors = torch.linalg.eigh(cov)  # ascending; the original orders them largest first
    values, vectors = values.flip(0), vectors.T.flip(0)
    filters = (vectors / torch.sqrt(values.clamp_min(0) + eps)[:, None]).reshape(-1, 3, k, k)
    with torch.no_grad():
        conv.weight.copy_(torch.cat((filters, -filters)).to(conv.weight.dtype))


def lr_factor(step: int, total_steps: int) -> float:
    """The original's triangular schedule: 0.2 -> 1 over the first 23% of the steps, then 1 -> 0.07."""
    warmup = int(total_steps * 0.23)
    if step < warmup:
        frac = step / warmup
        return 0.2 * (1 - frac) + frac
    frac = (step - warmup) / max(1, total_steps - warmup)
    return (1 - frac) + 0.07 * frac


def optimizer_and_schedule(model: nn.Module, lr: float, weight_decay: float, total_steps: int,
                           steps_per_epoch: int) -> tuple[torch.optim.SGD, torch.optim.lr_scheduler.LambdaLR]:
    """Nesterov SGD over three groups: BatchNorm biases (``lr`` x 64, the same decay per step), the whitening
    bias (learning for the first 3 epochs only), everything else that learns, unit slopes included (no decay
    on slopes: decay pulls them back to the activation). The triangular schedule (:func:`lr_factor`)."""
    slopes = {id(p) for n, p in model.named_parameters() if n.endswith(".slope")}
    whiten_bias = model.whiten.bias
    norms = [p for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters() if p.requires_grad]
    taken = {id(p) for p in norms} | {id(whiten_bias)}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken and id(p) not in slopes]
    groups = [{"params": norms, "lr": lr * BIAS_LR_SCALE, "weight_decay": weight_decay / BIAS_LR_SCALE},
              {"params": [whiten_bias], "lr": lr, "weight_decay": weight_decay},
              {"params": rest, "lr": lr, "weight_decay": weight_decay}]
    slope_params = [p for n, p in model.named_parameters() if id(p) in slopes and p.requires_grad]
    if slope_params:
        groups.append({"params": slope_params, "lr": lr, "weight_decay": 0.0})
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=MOMENTUM, nesterov=True)
    whiten_steps = WHITEN_BIAS_EPOCHS * steps_per_epoch

    def main(step: int) -> float:
        return lr_factor(step, total_steps)

    def whiten(step: int) -> float:
        return lr_factor(step, total_steps) if step < whiten_steps else 0.0

    lambdas = [main, whiten, main] + [main] * bool(slope_params)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


class Lookahead:
    """The original's lookahead: after every 5th optimizer step the weights (parameters and BatchNorm
    statistics; not unit slopes, which are the Sparsifier's) move to their running average
    ``avg <- avg + (1 - d) * (w - avg)`` with ``d = 0.95**5 * (step / total_steps)**3``; after the last step the
    weights become the average. The average lives in the optimizer's state (of its first parameter), so
    checkpoints hold it and a resumed run continues exactly. Call :meth:`step` after each optimizer step."""

    KEY = "lookahead_average"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, total_steps: int) -> None:
        self.model, self.optimizer, self.total_steps = model, optimizer, total_steps
        self.names = [n for n, t in model.state_dict().items() if t.is_floating_point() and not n.endswith(".slope")
                      and not n.endswith(".frozen")]
        self.anchor = optimizer.param_groups[0]["params"][0]
        self._average()  # from the weights at step 0 (a resumed run's optimizer state replaces it)

    def _average(self) -> dict[str, torch.Tensor]:
        state = self.optimizer.state[self.anchor]
        if self.KEY not in state:
            own = self.model.state_dict()
            state[self.KEY] = {n: own[n].detach().clone() for n in self.names}
        return state[self.KEY]

    def step(self, step: int) -> None:
        """After optimizer step ``step`` (1-based)."""
        if step % LOOKAHEAD_EVERY and step < self.total_steps:
            return
        decay = 1.0 if step >= self.total_steps else 0.95 ** 5 * (step / self.total_steps) ** 3
        average, own = self._average(), self.model.state_dict()
        with torch.no_grad():
            for n in self.names:
                average[n].lerp_(own[n], 1 - decay)
                own[n].copy_(average[n])


def tta_logits(model: nn.Module, x: torch.Tensor, level: int) -> torch.Tensor:
    """Logits of normalized images ``x`` with the original's test-time augmentation: ``level`` 0 none, 1 the mean
    with the mirror image, 2 also the mean over 1-pixel translations (reflect padding) up-left and down-right."""
    if level == 0:
        return model(x)
    mirror = 0.5 * model(x) + 0.5 * model(x.flip(-1))
    if level == 1:
        return mirror
    h, w = x.shape[-2:]
    padded = F.pad(x, (1,) * 4, mode="reflect")
    shifted = [padded[..., :h, :w], padded[..., 2:h + 2, 2:w + 2]]
    return 0.5 * mirror + 0.25 * sum(0.5 * model(s) + 0.5 * model(s.flip(-1)) for s in shifted)
