"""Linear regions per second: the exact adaptive method (seed 001) vs dense sampling.

Dense sampling counts regions as runs of equal activation patterns on a uniform grid in ``t``.
It is run "to the same exactness": per segment, a grid with two points in the shortest region
the exact method found (the most favourable setting for sampling, which in practice does not
know that resolution in advance). The counts of both methods are checked to be equal.

Paths: the closed translation loops of seed 001 (8 anchors on a circle of radius 4 px) of
CIFAR-10 test images when ``LINEARIZE_CIFAR10`` points at the JPEG tarball, else random images
(stated in the output). Models: a small CNN and an MLP, randomly initialised (seeded).
Both methods run in float64 on one thread, ``--reps`` times; medians are printed.
``--pieces 1,64`` times the exact method with each number of parallel sub-segments per segment
(``linear_regions(..., pieces=P)``, identical results, checked).

``--trained RUN_DIR ...`` instead times only the exact method (CPU time of the process, robust to
other jobs on a shared machine), for each ``--pieces``, on trained models saved by
``recipes/cifar.py`` (loaded and fed as ``recipes/reproduce`` does): the first ``--part`` of the
first segment of the closed translation loop (radius ``--radius`` px) of the run's first test image.

    python recipes/benchmarks/regions.py --images 2 --reps 3
    python recipes/benchmarks/regions.py --trained runs/reproduce/cpu-small/cifar_baseline --pieces 1,32 --part 0.01
"""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from linearize.inputs import read_tar_image
from linearize.measures.regions import activation_patterns, linear_regions, translation_loops

CHUNK = 4096
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def load_images(n: int) -> tuple[torch.Tensor, str]:
    """``n`` normalised ``[n, 3, 32, 32]`` images and a description of where they came from."""
    path = os.environ.get("LINEARIZE_CIFAR10")
    if path and os.path.isfile(path):
        from PIL import Image

        images = []
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile() and member.name.startswith("test/") and member.name.endswith(".jpg"):
                    data = read_tar_image(tar, member, f"{path}:{member.name}")
                    img = Image.open(io.BytesIO(data)).convert("RGB")
                    images.append(torch.from_numpy(np.asarray(img, dtype=np.float32)))
                    if len(images) == n:
                        break
        x = torch.stack(images).permute(0, 3, 1, 2) / 255
        source = f"{n} CIFAR-10 test images from {path}"
    else:
        x = torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        source = f"{n} RANDOM images (set LINEARIZE_CIFAR10 to the CIFAR-10 tarball for real ones)"
    mean, std = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return (x - mean) / std, source


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3072, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return {"cnn": cnn, "mlp": mlp}


def dense_count(model: nn.Module, x0: torch.Tensor, x1: torch.Tensor, t_end: float, n: int) -> int:
    """Regions of one segment on ``[0, t_end]`` as runs of equal patterns on ``n`` uniform samples."""
    ts = torch.linspace(0, t_end, n, dtype=torch.float64).view(-1, *([1] * x0.ndim))
    d = x1.double() - x0.double()
    last, changes = None, 0
    for chunk in ts.split(CHUNK):
        pat = activation_patterns(model, x0.double() + chunk * d, batch_size=CHUNK)
        if last is not None:
            pat = torch.cat([last, pat])
        changes += int((pat[1:] != pat[:-1]).any(1).sum())
        last = pat[-1:]
    return changes + 1


def time_exact(model: nn.Module, x0: torch.Tensor, x1: torch.Tensor, pieces: list[int], reps: int,
               batch_size: int, clock=time.perf_counter) -> tuple[dict[int, float], int]:
    """Median seconds (of ``clock``) of ``linear_regions`` per ``pieces`` value (interleaved) and
    the region count, checked equal for every value."""
    times: dict[int, list[float]] = {p: [] for p in pieces}
    counts = set()
    for _ in range(reps):
        for p in pieces:
            start = clock()
            result = linear_regions(model, x0, x1, batch_size=max(batch_size, p * x0.shape[0]), pieces=p)
            times[p].append(clock() - start)
            counts.add(tuple(result.count.tolist()))
    if len(counts) != 1:
        raise AssertionError(f"region counts differ between pieces {pieces}: {counts}")
    return {p: statistics.median(v) for p, v in times.items()}, sum(counts.pop())


def trained(args: argparse.Namespace) -> None:
    """Exact regions/s on trained CIFAR models for every ``--pieces`` (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from reproduce.measure import cifar_inputs, run_model

    print(f"float64, 1 thread, CPU time of this process (the machine may be shared); first {args.part:g} of "
          f"segment 0 of the closed translation loop (8 anchors, radius {args.radius:g} px) of the run's first "
          f"test image; median of {args.reps}")
    print(f"{'run':28} {'regions':>8} " + " ".join(f"{f'P={p} s':>9} {f'P={p} reg/s':>11}" for p in args.pieces))
    for run in args.trained:
        x = cifar_inputs(Path(run), None, 1)[0].double()
        x0, x1 = translation_loops(x, n_anchors=8, radius=args.radius)
        x1 = x0[:1] + args.part * (x1[:1] - x0[:1])
        times, regions = time_exact(run_model(Path(run)), x0[:1], x1, args.pieces, args.reps, args.batch_size,
                                    clock=time.process_time)
        print(f"{Path(run).name:28} {regions:8d} " + " ".join(f"{times[p]:9.1f} {regions / times[p]:11.1f}"
                                                             for p in args.pieces), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2, help="images (8 segments each)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="at least pieces * segments")
    parser.add_argument("--dense-samples", type=int, default=3 * CHUNK, help="samples timed for the projection")
    parser.add_argument("--pieces", type=lambda v: [int(p) for p in v.split(",")], default=[1],
                        help="comma-separated sub-segments per segment to time the exact method with")
    parser.add_argument("--trained", nargs="+", default=None, help="run folders of recipes/cifar.py (see above)")
    parser.add_argument("--part", type=float, default=0.01, help="--trained: fraction of the segment walked")
    parser.add_argument("--radius", type=float, default=1.0, help="--trained: loop radius in pixels")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.trained:
        trained(args)
        return
    images, source = load_images(args.images)
    x0, x1 = translation_loops(images, n_anchors=8, radius=4)
    print(f"paths: {source}; {x0.shape[0]} segments (closed loops, 8 anchors, radius 4 px)")
    print("float64, 1 thread, random-init models; dense grid: 2 points in the shortest exact region")
    print(
        "dense sampling over all segments is too slow to run here: its time is projected from its\n"
        "measured throughput (samples/s, --dense-samples samples), and its count is checked equal\n"
        "to the exact one on the first 2% of segment 0 (sampled to the same exactness)"
    )
    header = (
        f"{'model':5} {'pieces':>6} {'regions':>8} {'min region':>10} {'samples':>10} {'exact s':>8} {'dense s':>10} "
        f"{'exact reg/s':>11} {'dense reg/s':>11} {'ratio':>7}"
    )
    print(header)
    for name, model in models().items():
        first = linear_regions(model, x0, x1, batch_size=args.batch_size)
        widths = first.end - first.start
        shortest = torch.stack([widths[first.segment == s].min() for s in range(x0.shape[0])])
        points = sum(math.ceil(2 / w) + 1 for w in shortest.tolist())
        # correctness of the comparison: same count on the first 2% of segment 0
        part = 0.02
        rows = (first.segment == 0) & (first.start < part)
        need = math.ceil(2 * part / widths[rows].min().item()) + 1
        exact_part = int(rows.sum())
        dense_part = dense_count(model, x0[0], x1[0], part, need)
        if dense_part != exact_part:
            raise AssertionError(f"{name}: dense {dense_part} != exact {exact_part} regions on [0, {part}]")
        exact_t, regions = time_exact(model, x0, x1, args.pieces, args.reps, args.batch_size)
        assert regions == int(first.count.sum())
        probe = torch.linspace(0, 1, args.dense_samples, dtype=torch.float64).view(-1, 1, 1, 1)
        dense_t = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for chunk in probe.split(CHUNK):
                activation_patterns(model, x0[0].double() + chunk * (x1[0].double() - x0[0].double()), CHUNK)
            dense_t.append((time.perf_counter() - start) * points / args.dense_samples)
        td = statistics.median(dense_t)
        for pieces, te in exact_t.items():
            print(
                f"{name:5} {pieces:6d} {regions:8d} {shortest.min().item():10.2e} {points:10d} {te:8.2f} {td:10.1f} "
                f"{regions / te:11.1f} {regions / td:11.2f} {td / te:6.0f}x   (check on [0, {part}] of segment 0: "
                f"{exact_part} regions, dense {need} samples: equal)",
                flush=True,
            )


if __name__ == "__main__":
    main()
