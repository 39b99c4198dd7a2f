"""FSDP2 on GPUs (NCCL) against one process: the comparison of ``tests/test_fsdp.py``, for a GPU machine.

Each rank trains a small GPT-2 (GELU units, a target that picks channels by slope) and a small Llama (gated
MLP: only the gate activation converted, a target that picks by saliency), and the GPT-2 under a FLOPs target
(``gpt2+flops``: whole sites, planned on gathered copies), sharded with
``torch.distributed.fsdp.fully_shard`` on its own GPU, for 8 steps on the same global batches (each rank its
rows); then rank 0 trains the same models unsharded on its GPU on the whole batches and compares: the same
linear channels, slopes within ``--atol`` (1e-6 by default; TF32 is switched off), the loss curves within a
relative 1e-4, the global counts. A resume from a sharded checkpoint (torch.distributed.checkpoint + the
Sparsifier's state) must end bit-identical to the uninterrupted sharded run. Prints one JSON line per check and
exits 1 when one fails. Without CUDA it runs the same on the CPU over gloo (how it was checked on a CPU machine).

Run (not in CI: it needs GPUs)::

    torchrun --nproc_per_node 2 recipes/benchmarks/fsdp_gpu_check.py            # one rank per GPU
    torchrun --nproc_per_node 2 recipes/benchmarks/fsdp_gpu_check.py --ckpt /tmp/fsdp_ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import linearize
from linearize.distributed import full_value

STEPS, HALF, BATCH, SEQ, VOCAB = 8, 4, 4, 16, 64


def build(arch: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch.startswith("gpt2"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=32))
    model = linearize.convert(model, example_inputs={"input_ids": torch.zeros(1, SEQ, dtype=torch.long)})
    return model.to(device)


def shard(model: torch.nn.Module, arch: str) -> torch.nn.Module:
    for block in (model.transformer.h if arch.startswith("gpt2") else model.model.layers):
        fully_shard(block)
    return fully_shard(model)


def run(arch: str, model, steps: range, rank: int, world: int, device, state: dict | None = None):
    """Train ``steps`` (a Sparsifier attached); ``state``: a checkpoint to resume from first. The global
    losses, the Sparsifier and the optimizer."""
    opt = torch.optim.AdamW(linearize.param_groups(model, weight_decay=0.01), lr=1e-2)
    if arch == "gpt2+flops":  # a cost target: whole sites, chosen by saliency, planned on gathered copies
        sp = linearize.Sparsifier(model, linearize.schedules.target(flops=0.8, start=2, end=6), STEPS,
                                  granularity="site", select="saliency",
                                  example_inputs={"input_ids": torch.zeros(1, SEQ, dtype=torch.long)})
    else:
        target = linearize.schedules.target(0.5, start=2, end=6)
        sp = linearize.Sparsifier(model, target, STEPS, select="saliency" if arch == "llama" else "slope")
    sp.attach(opt)
    if state is not None:
        msd, osd = get_state_dict(model, opt)
        loaded = {"model": msd, "optim": osd}
        dcp.load(loaded, checkpoint_id=state["dir"])
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        sp.load_state_dict(state["sparsifier"])
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    rows = BATCH // world
    losses = []
    for step in steps:
        x = data[step][rank * rows:(rank + 1) * rows].to(device)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if world > 1 and dist.is_initialized() and isinstance(model, torch.distributed.fsdp.FSDPModule):
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses, sp, opt


def slopes(model) -> torch.Tensor:
    return torch.cat([full_value(u.slope.detach()).cpu() for _, u in linearize.units(model)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--ckpt", default=None, help="folder for the sharded checkpoint (default: a temporary one)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    ckpt = args.ckpt or (tempfile.mkdtemp(prefix="fsdp_ckpt_") if rank == 0 else None)
    box = [ckpt]
    dist.broadcast_object_list(box)
    ckpt = box[0]
    failed = False

    def report(check: str, ok: bool, **values) -> None:
        nonlocal failed
        failed |= not ok
        if rank == 0:
            print(json.dumps({"check": check, "ok": ok, "device": str(device), "world": world, **values}), flush=True)

    for arch in ("gpt2", "llama", "gpt2+flops"):
        model = shard(build(arch, device), arch)
        losses, sp, _ = run(arch, model, range(STEPS), rank, world, device)
        got, counts, fraction = slopes(model), linearize.count_units(model), sp.nonlinear_fraction()  # collectives
        if arch == "gpt2":  # resume: half the steps, a sharded checkpoint, a new model, the rest
            half = shard(build(arch, device), arch)
            first, sp_half, opt_half = run(arch, half, range(HALF), rank, world, device)
            msd, osd = get_state_dict(half, opt_half)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
            state = {"dir": ckpt, "sparsifier": sp_half.state_dict()}
            sp_half.detach()
            resumed = shard(build(arch, device), arch)
            rest, _, _ = run(arch, resumed, range(HALF, STEPS), rank, world, device, state)
            report("resume_exact", torch.equal(slopes(resumed), got) and first + rest == losses, arch=arch)
        if rank == 0:  # the truth: one process, the whole batches
            single = build(arch, device)
            want_losses, want_sp, _ = run(arch, single, range(STEPS), 0, 1, device)
            want = slopes(single)
            report("same_linear_channels", torch.equal(got == 1, want == 1), arch=arch, linear=int((want == 1).sum()),
                   channels=want.numel())
            report("slopes_within_atol", bool((got - want).abs().max() <= args.atol), arch=arch,
                   max_diff=float((got - want).abs().max()))
            report("losses_close", all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, want_losses)), arch=arch,
                   sharded=losses, single=want_losses)
            report("global_counts", counts == linearize.count_units(single)
                   and fraction == want_sp.nonlinear_fraction(), arch=arch)
            if arch == "gpt2+flops":
                report("same_cost_plan", sp.cost_plan == want_sp.cost_plan, arch=arch, plan=want_sp.cost_plan)
        dist.barrier()
    box = [failed]
    dist.broadcast_object_list(box)
    dist.destroy_process_group()
    return 1 if box[0] else 0


if __name__ == "__main__":
    sys.exit(main())
