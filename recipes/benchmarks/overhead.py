"""Training-step overhead of linearize units: converted / original, side by side in one run.

ResNet-18 (torchvision, 10 classes) on 32x32 inputs, batch 64, SGD with momentum, on the CPU.
Time: the two models alternate step by step (interleaved repetitions), the ratio is taken of the
medians. Memory: the peak heap growth during one training step (glibc ``mallinfo2``: in-use plus
mmapped bytes, sampled after every module's forward and at every saved-tensor use in backward;
gradients and activations), plus the bytes of the weights and the optimizer state held across
steps: the CPU analogue of ``torch.cuda.max_memory_allocated``. Both numbers are printed.

    python recipes/benchmarks/overhead.py [--reps 30] [--threads 2]

Targets (issue 2): time ratio <= 1.05, memory ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision
from tqdm import tqdm

import linearize


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_in_use() -> int:
    """Bytes the C heap has handed out right now (small blocks plus mmapped large ones)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def make_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """A training step closure and its optimizer."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step, opt


def static_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes held between steps: weights, buffers and optimizer state."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_step_memory(step) -> int:
    """Peak heap growth (bytes) over one call of ``step``, sampled in forward and backward."""
    base = heap_in_use()
    peak = [base]

    def sample(*_):
        peak[0] = max(peak[0], heap_in_use())

    def unpack(t: torch.Tensor) -> torch.Tensor:  # runs in backward, each time a saved tensor is used
        sample()
        return t

    hook = torch.nn.modules.module.register_module_forward_hook(sample)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            step()
    finally:
        hook.remove()
    sample()
    return peak[0] - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    original = torchvision.models.resnet18(weights=None, num_classes=10)
    converted = linearize.convert(copy.deepcopy(original), example_inputs=torch.randn(1, 3, 32, 32))
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    made = {"original": make_step(original, x, y), "converted": make_step(converted, x, y)}
    steps = {name: step for name, (step, _) in made.items()}
    for step in steps.values():  # warm-up: allocator, optimizer state
        step(), step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in tqdm(range(args.reps), desc="interleaved steps"):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    growth = {name: statistics.median(peak_step_memory(step) for _ in range(3)) for name, step in steps.items()}
    models = {"original": original, "converted": converted}
    peak = {name: growth[name] + static_bytes(models[name], made[name][1]) for name in made}
    med = {k: statistics.median(v) for k, v in times.items()}
    mib = 2**20
    print(f"ResNet-18, 32x32, batch 64, CPU, {torch.get_num_threads()} threads, {args.reps} interleaved reps")
    for name in steps:
        print(f"  {name:<10} step {med[name] * 1e3:8.1f} ms   peak memory {peak[name] / mib:7.1f} MiB "
              f"(of which step growth {growth[name] / mib:6.1f} MiB)")
    print(f"time ratio converted/original:        {med['converted'] / med['original']:.3f}  (target <= 1.05)")
    print(f"peak memory ratio converted/original: {peak['converted'] / peak['original']:.3f}  (target <= 1.10)")
    print(f"step growth ratio converted/original: {growth['converted'] / growth['original']:.3f}  "
          "(activations + gradients only: a PReLU keeps its input for the slope gradient, an in-place ReLU does not)")


if __name__ == "__main__":
    main()
