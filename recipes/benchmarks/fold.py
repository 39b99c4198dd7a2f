"""Benchmark ``linearize.fold``: FLOPs, params, CPU latency and error, folded vs unfolded.

For (a) a ResNet-style CNN (torchvision BasicBlocks), (b) a BERT-style encoder (Hugging Face
``BertModel`` from a small config, no download) and (c) a MobileNet-V2, each with 0%, 50%, 90%
and 100% of every unit's channels set linear (slope 1, the rest slope 0 = the original
activation; set directly, no training), fold with ``--objective`` and print the ratios folded /
unfolded. Latency is the median of interleaved repetitions of both models in one run
(``fold(latency=True)``). Then a row times a stack of fully linear Transformer FFN blocks
(target: >= 3x faster), and a last row folds the ResNet-style model at 100% linear with
``objective="depth"``: each BasicBlock becomes one border-corrected conv (``BorderExactConv``,
skip in its centre tap), so the sequential conv layers drop while FLOPs rise.

    python recipes/benchmarks/fold.py            # small sizes, about 2 minutes on 2 cores
    python recipes/benchmarks/fold.py --threads 2 --batch 16
    python recipes/benchmarks/fold.py --objective depth

Targets: error <= 1e-4 relative everywhere; latency ratio within 15% of the FLOP ratio
where FLOPs drop by at least 2x; the fully linear FFN stack at least 3x faster.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

import linearize
from linearize.folding import BorderExactConv

FRACTIONS = (0.0, 0.5, 0.9, 1.0)


def resnet_style(width: int = 16) -> nn.Module:
    """CIFAR-style ResNet: stem + 3 stages of torchvision BasicBlocks (widths w, 2w, 4w)."""
    from torchvision.models.resnet import BasicBlock

    def down(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=2, bias=False), nn.BatchNorm2d(cout))

    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
        BasicBlock(w, w), BasicBlock(w, 2 * w, stride=2, downsample=down(w, 2 * w)),
        BasicBlock(2 * w, 4 * w, stride=2, downsample=down(2 * w, 4 * w)),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, 10),
    )


def bert_style(hidden: int = 128, layers: int = 2) -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=4 * hidden, hidden_act="gelu")
    return BertModel(cfg, add_pooling_layer=False)


def mobilenet(width: float = 0.5) -> nn.Module:
    from torchvision.models import mobilenet_v2

    return mobilenet_v2(width_mult=width, num_classes=10)


def ffn_stack(hidden: int = 256, layers: int = 4) -> nn.Module:
    """Transformer FFN blocks (Linear d->4d, GELU unit, Linear 4d->d, LayerNorm)."""
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, 4 * hidden), linearize.LinearizableActivation(nn.GELU(), 4 * hidden, -1),
                   nn.Linear(4 * hidden, hidden), nn.LayerNorm(hidden)]
    return nn.Sequential(*blocks)


def randomize_bn(model: nn.Module, seed: int = 0) -> None:
    """Give BatchNorm layers non-trivial eval statistics (an untrained BN is the identity)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            m.weight.data.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            m.bias.data.copy_(torch.randn(n, generator=g) * 0.1)


@torch.no_grad()
def set_linear_fraction(model: nn.Module, fraction: float, seed: int = 0) -> None:
    """Slope 1 on a random ``fraction`` of every unit's channels, slope 0 on the rest."""
    g = torch.Generator().manual_seed(seed)
    for _, unit in linearize.units(model):
        unit.slope.zero_()
        k = round(fraction * unit.num_channels)
        unit.slope[torch.randperm(unit.num_channels, generator=g)[:k]] = 1.0


def sequential_convs(model: nn.Module) -> int:
    """Conv layers on the main path (a ``BorderExactConv`` counts once: its strips run beside it)."""
    inside = {id(m.conv) for m in model.modules() if isinstance(m, BorderExactConv)}
    return sum(isinstance(m, BorderExactConv) or (isinstance(m, nn.Conv2d) and id(m) not in inside)
               for m in model.modules())


def row(name: str, fraction: float, summary) -> str:
    rel = summary.max_abs_error / max(summary.output_scale, 1e-12)
    flag = ""
    if summary.flop_ratio <= 0.5:
        off = abs(summary.latency_ratio - summary.flop_ratio) / summary.flop_ratio
        flag = f"  latency vs FLOPs off by {off:.0%}"
    return (f"{name:<12} {fraction:>5.0%} {summary.flop_ratio:>7.3f} {summary.param_ratio:>7.3f} "
            f"{summary.latency_ratio:>8.3f} {summary.latency_ms_before:>9.2f} {summary.latency_ms_after:>9.2f} "
            f"{rel:>9.1e}{flag}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = steadier timings)")
    parser.add_argument("--objective", default="flops", choices=["flops", "depth"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")

    ids = torch.randint(0, 1000, (args.batch, 64))
    cases = [
        ("resnet", resnet_style(), torch.randn(args.batch, 3, 32, 32)),
        ("bert", bert_style(), {"input_ids": ids}),
        ("mobilenetv2", mobilenet(), torch.randn(args.batch, 3, 64, 64)),
    ]
    print(f"{'model':<12} {'linear':>6} {'FLOPs':>7} {'params':>7} {'latency':>8} {'ms before':>9} "
          f"{'ms after':>9} {'rel err':>9}   (ratios folded / unfolded)")
    for name, model, inputs in cases:
        randomize_bn(model)
        model.eval()
        linearize.convert(model, example_inputs=inputs)
        for fraction in FRACTIONS:
            set_linear_fraction(model, fraction)
            folded = linearize.fold(model, inputs, objective=args.objective)
            print(row(name, fraction, folded.linearize_fold_summary), flush=True)

    stack = ffn_stack().eval()
    set_linear_fraction(stack, 1.0)
    folded = linearize.fold(stack, torch.randn(args.batch, 64, 256), objective=args.objective)
    s = folded.linearize_fold_summary
    print(row("ffn-stack", 1.0, s))
    print(f"fully linear FFN stack: {1 / s.latency_ratio:.2f}x faster (target >= 3x)")

    resnet, inputs = cases[0][1:]
    set_linear_fraction(resnet, 1.0)
    folded = linearize.fold(resnet, inputs, objective="depth")
    print(row("resnet/depth", 1.0, folded.linearize_fold_summary))
    print(f"resnet at 100% linear, objective='depth': sequential convs {sequential_convs(resnet)} -> "
          f"{sequential_convs(folded)}")


if __name__ == "__main__":
    main()
