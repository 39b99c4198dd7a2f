"""Non-linearity signature of a ResNet-18: ``linearize.measures.affinity_signature`` vs the
straightforward method (scipy ``sqrtm`` + POT ``emd2`` per site), side by side in one run.

torchvision ResNet-18 (``weights=None``, 10 classes, eval) on 1024 CIFAR-sized inputs: random
N(0, 1) images, or the first CIFAR-10 test images when ``LINEARIZE_CIFAR10`` (or ``--data``) points
to CIFAR data (any format ``recipes/cifar.py`` reads). All 17 activation call sites (the stem ReLU
and two calls of each ``BasicBlock.relu``), feature maps pooled over space to ``[1024, C]``.

Reference, per site: covariances as in ours (1/n, relative ridge ``1e-6 tr(C) / d I``), ``A = Sx^(-1/2) (Sx^(1/2) Sy
Sx^(1/2))^(1/2) Sx^(-1/2)`` with ``scipy.linalg.sqrtm``, ``W2^2 = ot.emd2`` on ``ot.dist(A x + b, y)``.
Timed twice: the whole signature (forward pass, capture, scores), and the scores alone on the
same captured activations. Also timed: the bare forward pass (no hooks), which both methods must
pay: ``reference signature / forward`` bounds the end-to-end speed-up even with free scores. The
methods alternate (interleaved repetitions); speed-ups are ratios of medians, of wall-clock and of
process CPU time (robust to other load on the machine, but it counts every thread's time).
With ``--threads`` > 1 the reference is also timed tuned: its BLAS limited to one thread (its
scores ran slower on two BLAS threads than on one on a 2-core machine: numpy and scipy each load
their own OpenBLAS, whose waiting threads contend with the other's), its forward on ``--threads``.

Both methods get the same resources: ``--threads`` sets torch's threads and the BLAS threads
(threadpoolctl) for both. The reference uses them the straightforward way (multi-threaded
forward and BLAS); ours scores ``--threads`` sites at a time on one BLAS thread each. On a machine
shared with other jobs, multi-threaded runs measure the sharing: OpenMP / OpenBLAS threads wait at
barriers for peers that are descheduled (a 2-core machine under a load of ~3 ran the bare forward
6x slower with 2 threads than with 1); compare the 1-thread numbers there.

    python recipes/benchmarks/affinity.py [--n 1024] [--reps 3] [--threads 1]

Target: speed-up >= 5x with equal values.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import ot
import scipy.linalg
import torch
import torchvision
from threadpoolctl import threadpool_limits
from torch import nn

from linearize.measures import affinity_signature
from linearize.measures.affinity import _score_sites

TUNED = "signature: reference, BLAS on 1 thread"
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def capture(model: nn.Module, x: torch.Tensor, batch_size: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Pooled ``[n, C]`` float64 (input, output) of every ReLU call, the straightforward way."""
    captured: dict[tuple[str, int], tuple[list, list]] = {}  # (module, call) -> (inputs, outputs)
    counter: dict[str, int] = {}

    def pre(name):
        def hook(module, args):
            call = counter[name] = counter.get(name, 0) + 1
            captured.setdefault((name, call - 1), ([], []))[0].append(args[0].mean((2, 3), dtype=torch.float64))

        return hook

    def post(name):
        def hook(module, args, output):
            captured[(name, counter[name] - 1)][1].append(output.mean((2, 3), dtype=torch.float64))

        return hook

    relus = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ReLU)]
    handles = [h for n, m in relus for h in (m.register_forward_pre_hook(pre(n)), m.register_forward_hook(post(n)))]
    with torch.no_grad():
        for batch in x.split(batch_size):
            counter.clear()
            model(batch)
    for h in handles:
        h.remove()
    return [
        (f"{name}.calls.{call}" if counter[name] > 1 else name, torch.cat(xs).numpy(), torch.cat(ys).numpy())
        for (name, call), (xs, ys) in captured.items()
    ]


def reference_score(xs: np.ndarray, ys: np.ndarray, ridge: float = 1e-6) -> float:
    """``1 - W2 / sqrt(2 tr Cov(y))`` with POT's Bures map formula on ``scipy.linalg.sqrtm`` and ``ot.emd2``;
    ``ridge`` relative to each covariance's average variance ``tr(C) / d``, as in ours."""
    n, d = xs.shape
    cx = np.cov(xs, rowvar=False, bias=True)
    cx += ridge * np.trace(cx) / d * np.eye(d)
    cy = np.cov(ys, rowvar=False, bias=True)
    cx12 = np.real(scipy.linalg.sqrtm(cx))
    cx12inv = np.linalg.inv(cx12)
    a = cx12inv @ np.real(scipy.linalg.sqrtm(cx12 @ (cy + ridge * np.trace(cy) / d * np.eye(d)) @ cx12)) @ cx12inv
    b = ys.mean(0) - xs.mean(0) @ a
    w = np.full(n, 1.0 / n)
    w2 = np.sqrt(ot.emd2(w, w, ot.dist(xs @ a + b, ys), numItermax=10**7))
    return float(1 - w2 / np.sqrt(2 * np.trace(cy)))


def reference_signature(model: nn.Module, x: torch.Tensor, batch_size: int) -> list[tuple[str, float]]:
    """Affinity signature the straightforward way: hooks per call, scipy ``sqrtm``, POT ``emd2``."""
    return [(name, reference_score(xs, ys)) for name, xs, ys in capture(model, x, batch_size)]


class Timer:
    """Wall-clock and process CPU seconds of a block, appended to ``times[key]``."""

    def __init__(self, times: dict, key: str) -> None:
        self.times, self.key = times, key

    def __enter__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc) -> None:
        self.times.setdefault(self.key, []).append((time.perf_counter() - self.wall, time.process_time() - self.cpu))


def load_inputs(n: int, data: str | None, seed: int) -> tuple[torch.Tensor, str]:
    if not data:
        return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed)), "random N(0, 1) images"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import cifar

    with tempfile.TemporaryDirectory() as cache:
        split = cifar.load_split(data, "cifar10", "test", n, 32, Path(cache), show=True)
    x = split["x"].float() / 255
    mean, std = torch.tensor(CIFAR_MEAN).view(3, 1, 1), torch.tensor(CIFAR_STD).view(3, 1, 1)
    return (x - mean) / std, f"{len(x)} CIFAR-10 test images from {data}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="number of inputs")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of each method")
    parser.add_argument("--threads", type=int, default=1, help="BLAS and torch threads, for both methods")
    parser.add_argument("--data", default=os.environ.get("LINEARIZE_CIFAR10"), help="CIFAR data (default $LINEARIZE_CIFAR10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    x, source = load_inputs(args.n, args.data, args.seed)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"ResNet-18 (weights=None, eval), {source}, {args.threads} thread(s) for each method, {cores} CPU core(s)")

    times: dict[str, list[tuple[float, float]]] = {}
    with threadpool_limits(args.threads):
        sites = capture(model, x, args.batch_size)
        for _ in range(args.reps):
            with Timer(times, "forward"), torch.no_grad():
                for batch in x.split(args.batch_size):
                    model(batch)
            with Timer(times, "signature: ours"):
                ours = affinity_signature(model, x, batch_size=args.batch_size, max_samples=args.n, progress=False)
            with Timer(times, "signature: reference"):
                ref = reference_signature(model, x, args.batch_size)
            if args.threads > 1:  # the reference tuned: multi-threaded forward, BLAS on one thread
                with Timer(times, TUNED), threadpool_limits(1):
                    reference_signature(model, x, args.batch_size)
            with Timer(times, "scores only: ours"):
                ours_scores = [score for _, score in _score_sites(sites, None, 1e-6, progress=False)]
            with Timer(times, "scores only: reference"):
                ref_scores = [reference_score(xs, ys) for _, xs, ys in sites]

    assert [n for n, _ in ours] == [n for n, _ in ref], (ours, ref)
    diff = max(abs(a - b) for (_, a), (_, b) in zip(ours, ref))
    print(f"{'site':<24} {'ours':>8} {'reference':>10}")
    for (name, a), (_, b) in zip(ours, ref):
        print(f"{name:<24} {a:8.5f} {b:10.5f}")
    same_input = max(abs(a - b) for a, b in zip(ours_scores, ref_scores))
    print(f"sites: {len(ours)}, max |ours - reference|: {diff:.1e} (signatures; ours pools in float32), "
          f"{same_input:.1e} (scores of the same float64 activations)")
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    result = {"sites": len(ours), "max_abs_diff": diff, "max_abs_diff_same_input": same_input}
    print(f"median of {args.reps} interleaved repetitions (wall s / CPU s):")
    w_f, c_f = med["forward"]
    w_r, c_r = med["signature: reference"]
    print(f"  forward pass alone (no hooks) {w_f:6.2f} / {c_f:6.2f}: bounds the end-to-end speed-up by "
          f"{w_r / w_f:4.1f}x wall, {c_r / c_f:4.1f}x CPU")
    result["forward"] = (w_f, c_f)
    for stage in ("signature", "scores only"):
        (w_o, c_o), (w_r, c_r) = med[f"{stage}: ours"], med[f"{stage}: reference"]
        print(f"  {stage:<12} ours {w_o:6.2f} / {c_o:6.2f}   reference {w_r:6.2f} / {c_r:6.2f}   "
              f"speed-up {w_r / w_o:4.1f}x wall, {c_r / c_o:4.1f}x CPU")
        result[stage] = {"ours": (w_o, c_o), "reference": (w_r, c_r), "speedup_wall": w_r / w_o, "speedup_cpu": c_r / c_o}
    if TUNED in med:
        (w_o, c_o), (w_t, c_t) = med["signature: ours"], med[TUNED]
        print(f"  signature, reference with BLAS on 1 thread (its forward on {args.threads}) {w_t:6.2f} / {c_t:6.2f}: "
              f"ours is {w_t / w_o:4.1f}x faster wall, {c_t / c_o:4.1f}x CPU")
        result["signature"].update(reference_blas1=(w_t, c_t), speedup_wall_blas1=w_t / w_o, speedup_cpu_blas1=c_t / c_o)
    return result


if __name__ == "__main__":
    main()
