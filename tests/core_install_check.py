"""The core install's promise, run by ``.ci/run`` in a venv holding only ``pip install .`` (no extras).

convert -> Sparsifier (steps to a target) -> freeze -> fold on torchvision's resnet18, each checked
against a truth computed here (the unconverted model's outputs, the schedule's target, the converted
model's outputs), and that the extras are really absent and each missing one is named with its extra.
Exits non-zero on any failure. Usage: ``python tests/core_install_check.py`` (about 10 s on 2 cores).
"""

from __future__ import annotations

import importlib
import sys

import torch
import torchvision

import linearize


def main() -> int:
    extras = []
    for name in ("transformers", "accelerate", "matplotlib", "scipy", "sklearn", "datasets"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        extras.append(name)
    assert not extras, f"not a core-only environment: {extras} installed"

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        truth = model(x)
    linearize.convert(model, example_inputs=x[:1])
    with torch.no_grad():
        assert torch.allclose(model(x), truth, atol=1e-5), "convert changed the function"
    channels = linearize.count_units(model)["total"]

    target, steps = 0.25, 6
    sparsifier = linearize.Sparsifier(model, linearize.schedules.target(target, start=0, end=4), total_steps=steps,
                                      lam=1.0)
    opt = torch.optim.SGD(linearize.param_groups(model, weight_decay=0.0), lr=1e-3)
    sparsifier.attach(opt)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    sparsifier.detach()
    fraction = linearize.nonlinear_fraction(model)
    assert abs(fraction - round(target * channels) / channels) < 1e-9, f"fraction {fraction}, target {target}"

    linearize.freeze(model, tol=1e-3)
    model.eval()
    with torch.no_grad():
        converted = model(x)
    folded = linearize.fold(model, x, latency=False)
    with torch.no_grad():
        err = (folded(x) - converted).abs().max().item()
    assert err <= 1e-3 * max(1.0, converted.abs().max().item()), f"fold changed the function by {err}"

    try:
        importlib.import_module("linearize.integrations")
    except ImportError as e:
        assert 'linearize[hf]' in str(e) and "transformers" in str(e), str(e)
    else:
        raise AssertionError("linearize.integrations imported without transformers")
    print(f"core install OK: torch {torch.__version__}, resnet18 {channels} channels, nonlinear fraction "
          f"{fraction:.3f} (target {target}), fold max error {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
