"""Keller Jordan's airbench94, unchanged, on the same CIFAR-10 pixels as ``recipes/cifar.py --arch airbench94``.

The control for that recipe's baseline: is a shortfall from the published 94% the recipe's or the data's? The
PyPI package ``airbench`` (CUDA and fp16 only; not a dependency) trains ``train94()`` with its own defaults on
the images that ``cifar.load_split`` decodes from ``--data-dir`` (written in the package's ``cifar10/train.pt``
and ``test.pt`` format in a temporary folder), ``--runs`` times after one warm-up, and writes each run's test
accuracy without and with its test-time augmentation (level 2) as JSON.

Run (not in CI: it needs a GPU)::

    pip install airbench==0.1.8
    python recipes/benchmarks/airbench_original.py --data-dir /path/cifar10-jpeg.tar.gz --runs 5 \\
        --out recipes/results/airbench_original.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cifar  # noqa: E402  (recipes/cifar.py: the decoder the recipe trains on)


def write_airbench_data(data_dir: str, cache_dir: Path, folder: Path) -> None:
    """``folder/cifar10/{train,test}.pt`` as the package reads them: uint8 NHWC images, labels, class names."""
    (folder / "cifar10").mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        d = cifar.load_split(data_dir, "cifar10", split, None, 32, cache_dir=cache_dir, show=False)
        torch.save({"images": d["x"].permute(0, 2, 3, 1).contiguous(), "labels": d["y"], "classes": d["classes"]},
                   folder / "cifar10" / f"{split}.pt")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True, help="CIFAR-10 as recipes/cifar.py reads it")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "linearize")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("airbench94 runs on CUDA only (fp16): run this on a machine with a GPU")
    try:
        import airbench
        from airbench.utils import CifarLoader, evaluate
    except ImportError:
        sys.exit("the original airbench94 is the PyPI package airbench: pip install airbench==0.1.8")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        write_airbench_data(args.data_dir, args.cache_dir, Path(tmp))
        os.chdir(tmp)  # the package reads ./cifar10/
        airbench.warmup94(verbose=False)
        for run in range(args.runs):
            start = time.time()
            model = airbench.train94(run=run, verbose=False)
            test = CifarLoader("cifar10", train=False, batch_size=2000)
            runs.append({"run": run, "test_accuracy": evaluate(model, test, tta_level=0),
                         "test_accuracy_tta": evaluate(model, test, tta_level=2), "seconds": time.time() - start})
            print(json.dumps(runs[-1]), flush=True)
    args.out.write_text(json.dumps({"package": "airbench 0.1.8 (PyPI), train94() defaults",
                                    "data": str(args.data_dir), "gpu": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
