"""Training-step overhead of linearize units: converted / original, side by side in one run.

ResNet-18 (torchvision, 10 classes) on 32x32 inputs, batch 64, SGD with momentum, on the CPU.
Time: the two models alternate step by step (interleaved repetitions), the ratio is taken of the
medians. Memory: the peak heap growth during one training step (glibc ``mallinfo2``: in-use plus
mmapped bytes, sampled after every module's forward and at every saved-tensor use in backward;
gradients and activations), plus the bytes of the weights and the optimizer state held across
steps: the CPU analogue of ``torch.cuda.max_memory_allocated``. Both numbers are printed.

Allocator: ``--malloc tcmalloc`` (or ``jemalloc``) re-runs the script with that allocator preloaded
(``LD_PRELOAD``), as PyTorch's CPU performance guide recommends for training; the default is glibc's
``malloc``. glibc returns freed heap memory to the kernel when enough of it sits at the top of the heap
and faults it back in on the next step; how often depends on the heap's history, for both models
alike: the minor page faults per step are printed next to the times (tcmalloc keeps freed memory
and removes most of them; the ratio measured with it was the same). The memory ratio is measured
with glibc only (``mallinfo2``).

The units run on the compiled CPU kernel (:mod:`linearize.kernels`); ``LINEARIZE_CPU_KERNEL=0`` times
their PyTorch-ops path instead. The script prints which one ran.

``--profile`` adds a ``torch.profiler`` table: the ops whose self time per step differs most between
the two models.

``--functional`` also times a ResNet-18 whose ReLUs are functional calls (``F.relu`` in each block's
``forward``, as CIFAR ResNet code writes them; same weights), original and converted, in the same
interleaved loop: its ratio against the module path's shows what dispatching functional calls to their
units costs (:mod:`linearize.functional_sites`).

``--clock cpu`` times each step by the CPU time of this process (``time.process_time``) instead of wall
time: on a shared, busy machine other processes' load then stretches neither model's steps (use it with
``--threads 1``).

    python recipes/benchmarks/overhead.py [--reps 30] [--threads 2] [--malloc glibc|tcmalloc|jemalloc] [--profile]
                                          [--functional] [--clock wall|cpu]

Targets: time ratio <= 1.05, memory ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import torchvision
from tqdm import tqdm

import linearize
from linearize import kernels


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


ALLOCATORS = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
INSTALL_HINT = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}


def use_allocator(name: str) -> None:
    """Re-execute this script with allocator ``name`` preloaded (no-op for glibc or when it already is)."""
    if name == "glibc" or os.environ.get("LINEARIZE_BENCH_MALLOC") == name:
        return
    found = [lib for lib in map(ctypes.util.find_library, ALLOCATORS[name]) if lib]
    if not found:
        raise SystemExit(f"--malloc {name}: no {name} library found; install it (Debian/Ubuntu: "
                         f"apt install {INSTALL_HINT[name]}) or use --malloc glibc")
    preload = " ".join(filter(None, [found[0], os.environ.get("LD_PRELOAD")]))
    env = dict(os.environ, LD_PRELOAD=preload, LINEARIZE_BENCH_MALLOC=name)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def minor_faults() -> int:
    """Minor page faults of this process so far (memory the kernel had to map in)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def heap_in_use() -> int:
    """Bytes the C heap has handed out right now (small blocks plus mmapped large ones)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class FunctionalBasicBlock(torchvision.models.resnet.BasicBlock):
    """torchvision's BasicBlock with functional ReLUs (no ``relu`` module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class FunctionalResNet(torchvision.models.ResNet):
    """torchvision's ResNet with a functional stem ReLU."""

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def functional_resnet18(original: torch.nn.Module) -> torch.nn.Module:
    """A ResNet-18 with ``original``'s weights whose 17 ReLU calls are all ``F.relu`` calls."""
    model = FunctionalResNet(FunctionalBasicBlock, [2, 2, 2, 2], num_classes=original.fc.out_features)
    for m in model.modules():
        m.__dict__["_modules"].pop("relu", None)
    model.load_state_dict(original.state_dict())
    return model


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


def profile_diff(steps: dict, n_steps: int = 20, top: int = 15) -> None:
    """Print the ops whose self CPU time per step differs most between the models (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    per_step = {}
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n_steps):
                step()
        per_step[name] = {e.key: e.self_cpu_time_total / n_steps / 1e3 for e in prof.key_averages()}
    orig, conv = per_step["original"], per_step["converted"]
    ops = sorted(set(orig) | set(conv), key=lambda k: -abs(conv.get(k, 0.0) - orig.get(k, 0.0)))
    print(f"torch.profiler, self CPU ms per step over {n_steps} steps (profiling slows both models):")
    print(f"  {'op':<48} {'original':>9} {'converted':>9} {'diff':>7}")
    for op in ops[:top]:
        print(f"  {op[:48]:<48} {orig.get(op, 0.0):9.3f} {conv.get(op, 0.0):9.3f} {conv.get(op, 0.0) - orig.get(op, 0.0):7.3f}")
    print(f"  {'total':<48} {sum(orig.values()):9.3f} {sum(conv.values()):9.3f} {sum(conv.values()) - sum(orig.values()):7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--malloc", choices=["glibc", *ALLOCATORS], default="glibc",
                        help="C allocator for the run (tcmalloc/jemalloc are preloaded; memory is measured with glibc only)")
    parser.add_argument("--profile", action="store_true", help="also print the ops whose time differs most")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time steps by wall time or by this process's CPU time (for a busy machine)")
    parser.add_argument("--functional", action="store_true",
                        help="also time a ResNet-18 with functional F.relu calls, original and converted")
    args = parser.parse_args()
    use_allocator(args.malloc)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    original = torchvision.models.resnet18(weights=None, num_classes=10)
    converted = linearize.convert(copy.deepcopy(original), example_inputs=torch.randn(1, 3, 32, 32))
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    models = {"original": original, "converted": converted}
    if args.functional:
        functional = functional_resnet18(original)
        models["functional original"] = functional
        models["functional converted"] = linearize.convert(copy.deepcopy(functional),
                                                           example_inputs=torch.randn(1, 3, 32, 32))
    made = {name: make_step(model, x, y) for name, model in models.items()}
    steps = {name: step for name, (step, _) in made.items()}
    for step in steps.values():  # warm-up: allocator, optimizer state
        step(), step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    faults = dict.fromkeys(steps, 0)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for _ in tqdm(range(args.reps), desc="interleaved steps"):
        for name, step in steps.items():
            f0, t0 = minor_faults(), clock()
            step()
            times[name].append(clock() - t0)
            faults[name] += minor_faults() - f0
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"ResNet-18, 32x32, batch 64, CPU, {torch.get_num_threads()} threads, {args.reps} interleaved reps, "
          f"{args.malloc} malloc, {args.clock} clock")
    print("  units run on " + ("the compiled CPU kernel" if kernels.cpu_prelu() else
                               f"PyTorch ops (the compiled kernel is off: {kernels.ENV_SWITCH}=0 or its build failed)"))
    for name in steps:
        print(f"  {name:<21} step {med[name] * 1e3:8.1f} ms   {faults[name] / args.reps:8.0f} minor page faults per step")
    print(f"time ratio converted/original:        {med['converted'] / med['original']:.3f}  (target <= 1.05)")
    if args.functional:
        ratio = med["functional converted"] / med["functional original"]
        print(f"functional F.relu ResNet-18 ratio:    {ratio:.3f}  (target: within 0.02 of the module path's "
              f"{med['converted'] / med['original']:.3f}; difference {ratio - med['converted'] / med['original']:+.3f})")
    if args.profile:
        profile_diff(steps)
    if args.malloc != "glibc":
        return
    growth = {name: statistics.median(peak_step_memory(step) for _ in range(3)) for name, step in steps.items()}
    peak = {name: growth[name] + static_bytes(models[name], made[name][1]) for name in made}
    mib = 2**20
    for name in steps:
        print(f"  {name:<21} peak memory {peak[name] / mib:7.1f} MiB (of which step growth {growth[name] / mib:6.1f} MiB)")
    print(f"peak memory ratio converted/original: {peak['converted'] / peak['original']:.3f}  (target <= 1.10)")
    print(f"step growth ratio converted/original: {growth['converted'] / growth['original']:.3f}  "
          "(activations + gradients only: a PReLU keeps its input for the slope gradient, an in-place ReLU does not)")


if __name__ == "__main__":
    main()
