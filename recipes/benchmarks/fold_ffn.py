"""Benchmark fold by shape: FFNs of models nobody wrote a fold rule for.

timm ViT-Tiny, ConvNeXt-Atto (1x1-conv and channels-last Linear MLPs), MLP-Mixer and torchvision's
ViT (``MLPBlock``), created from scratch (no download); every unit gets 90% of its channels exactly
linear (slope 1), the others uniform in [0, 1). Fold the whole model in float32 (its own verification
on), then per FFN: FLOPs after / before by :func:`linearize.count_flops` and by hand from the weights
and slopes (``rows * (d n + (n + d) d_out) / (rows * (d m + m d_out))``, ``n`` nonlinear channels),
and the FFN's max abs output error relative to its output scale, float32 folded vs the unfolded FFN
in float64.

    python recipes/benchmarks/fold_ffn.py          # about 1.5 minutes on the shared 2 cores

Target: every FFN at most 0.35x its FLOPs with error below 1e-4 (relative to its output scale).
"""

from __future__ import annotations

import argparse
import copy
import warnings

import timm
import torch
from torch import nn

import linearize


def models(size: int) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """name -> (model, input batch); every FFN of each is measured."""
    from timm.models.mlp_mixer import MlpMixer
    from torchvision.models import VisionTransformer

    x = torch.randn(4, 3, size, size)
    out = {
        "timm vit_tiny": timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=size, num_classes=10),
        "convnext_atto": timm.create_model("convnext_atto", pretrained=False, num_classes=10),
        "convnext_atto (channels-last)": timm.create_model("convnext_atto", pretrained=False, num_classes=10,
                                                           conv_mlp=False),
        "mlp-mixer": MlpMixer(num_classes=10, img_size=size, patch_size=16, num_blocks=8, embed_dim=256),
        "torchvision vit": VisionTransformer(image_size=size, patch_size=16, num_layers=4, num_heads=4,
                                             hidden_dim=192, mlp_dim=768, num_classes=10),
    }
    return {k: (m.eval(), x) for k, m in out.items()}


def set_linear(model: nn.Module, fraction: float, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, u in linearize.units(model):
            c = u.slope.numel()
            a = torch.rand(c, generator=g)
            a[torch.randperm(c, generator=g)[: round(fraction * c)]] = 1.0
            u.slope.copy_(a)


def ffn_paths(model: nn.Module) -> list[str]:
    """Modules holding one unit between two linear layers (timm Mlp, torchvision MLPBlock)."""
    return [n for n, m in model.named_modules()
            if type(m).__name__ in ("Mlp", "MLPBlock") and len(linearize.units(m)) == 1]


def measure(name: str, model: nn.Module, x: torch.Tensor, fraction: float) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=x)
    set_linear(model, fraction)
    folded = linearize.fold(model, x, latency=False)
    paths = ffn_paths(model)
    seen: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(p).register_forward_pre_hook(
        lambda m, a, p=p: seen.setdefault(p, a[0].detach().clone())) for p in paths]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    rows = []
    for p in paths:
        ffn, new, h = model.get_submodule(p), folded.get_submodule(p), seen[p]
        layers = [m for m in ffn.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        unit = linearize.units(ffn)[0][1]
        d, m, d_out = layers[0].weight.shape[1], layers[0].weight.shape[0], layers[-1].weight.shape[0]
        n = int((unit.slope != 1).sum())
        hand = (d * n + (n + d) * d_out) / (d * m + m * d_out)
        with torch.no_grad():
            ref = copy.deepcopy(ffn).double()(h.double())
            err = float((new(h).double() - ref).abs().max() / ref.abs().max())
        counted = linearize.count_flops(new, h) / linearize.count_flops(ffn, h)
        rows.append({"model": name, "ffn": p, "d": d, "m": m, "n": n, "counted": counted, "hand": hand, "error": err})
    s = folded.linearize_fold_summary
    print(f"{name:<30} {len(paths):>4} FFNs  FFN FLOPs {min(r['counted'] for r in rows):.3f}-"
          f"{max(r['counted'] for r in rows):.3f}x (by hand {max(r['hand'] for r in rows):.3f}x)  "
          f"max FFN error {max(r['error'] for r in rows):.1e}  whole model FLOPs {s.flop_ratio:.3f}x, "
          f"error {s.max_abs_error / max(s.output_scale, 1e-30):.1e} ({s.verified_on})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64, help="input image size")
    parser.add_argument("--linear", type=float, default=0.9, help="fraction of each unit's channels set linear")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for name, (model, x) in models(args.size).items():
        rows += measure(name, model, x, args.linear)
    worst = max(r["counted"] for r in rows)
    print(f"worst FFN: {worst:.3f}x FLOPs (target <= 0.35), error {max(r['error'] for r in rows):.1e} (target < 1e-4)")
    return rows


if __name__ == "__main__":
    main()
