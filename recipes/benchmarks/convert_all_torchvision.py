"""Every torchvision classification builder (80 in torchvision 0.29), random init, ``num_classes=10``:
``linearize.convert(model)`` with no example inputs; prints units and skipped activation calls per
model and writes them as JSON (``--out``). About 5 minutes on 2 threads (vit_h_14 and
regnet_y_128gf dominate); tests/test_zoo.py checks a cheaper subset much more deeply.

    python recipes/benchmarks/convert_all_torchvision.py --out convert_all.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import warnings

import torch
import torchvision

import linearize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="convert_all_torchvision.json")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = {}
    for name in torchvision.models.list_models(module=torchvision.models):
        t = time.time()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = torchvision.models.get_model(name, weights=None, num_classes=10).eval()
                linearize.convert(model)
            out[name] = {"units": len(linearize.units(model)), "skipped": len(model.linearize_report.problems())}
            del model
        except Exception as err:  # report every model, do not stop at the first
            out[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
        out[name]["seconds"] = round(time.time() - t, 1)
        print(name, out[name], flush=True)
        gc.collect()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    bad = {k: v for k, v in out.items() if "error" in v or v["skipped"] or not v["units"]}
    print(f"{len(out)} models; refused or with skipped calls: {bad or 'none'}")


if __name__ == "__main__":
    main()
