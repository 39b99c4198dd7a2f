"""Sharded training (PyTorch FSDP2, ``fully_shard``) against one process on the same global batches.

One launch (``python tests/test_fsdp.py OUT``: 2 processes over gloo on the CPU, torch.multiprocessing
spawn) runs every sharded scenario and writes what each rank saw; the tests compare it with single-process
runs of the same models, seeds and global batches (the truth):

* a small GPT-2 (GELU units) under a target schedule that picks channels by slope, and a small Llama
  (gated MLP: only the gate activation converted) under a target picking by saliency: the same linear
  channels, slopes within 1e-6, the same loss curve, the same global counts on every rank;
* freeze on the sharded GPT-2 freezes what it freezes on one process; the Sparsifier's penalty as a loss
  term (mode="loss") moves sharded slopes as on one process;
* a run resumed from a sharded checkpoint (torch.distributed.checkpoint + the Sparsifier's state)
  ends bit-identical to the uninterrupted sharded run;
* a save made sharded (full state dict gathered) loads unsharded bit-identically, and a single-process
  save loads into a sharded model bit-identically;
* a cost target (``target(flops=...)``) plans on whole copies of the sharded model: the same plan, linear
  sites and slopes as on one process; a latency target gives every rank the same plan (rank 0's timings);
* ``full_copy`` of the sharded model computes what the unsharded one does, with no FSDP left in it;
* what stays unsupported is refused with the fix: fold / save_pretrained on a sharded model, FSDP1
  wrappers and DeepSpeed ZeRO-3 slopes (these two marked by hand: neither runs on this CPU).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import linearize

from linearize.distributed import full_copy, full_value

transformers = pytest.importorskip("transformers")

WORLD = 2
STEPS = 8
HALF = 4  # the resumed run stops here and starts again
BATCH, SEQ, VOCAB = 4, 16, 64  # global batch: each rank takes BATCH // WORLD rows


EXAMPLE = {"input_ids": torch.zeros(1, SEQ, dtype=torch.long)}


def build(arch: str) -> nn.Module:
    """The converted model, same weights on every process (seed 0)."""
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(config)
    return linearize.convert(model, example_inputs=EXAMPLE)


def sparsifier(arch: str, model: nn.Module) -> linearize.Sparsifier:
    if arch == "gpt2":  # channels chosen by slope, pushed at the auto rate
        return linearize.Sparsifier(model, linearize.schedules.target(0.5, start=2, end=6), total_steps=STEPS,
                                    select="slope")
    return linearize.Sparsifier(model, linearize.schedules.target(0.5, start=2, end=6), total_steps=STEPS,
                                select="saliency")


def cost_sparsifier(model: nn.Module, **cost: float) -> linearize.Sparsifier:
    """A cost target over the two MLP sites of the GPT-2, ranked by saliency (read from global gradients)."""
    return linearize.Sparsifier(model, linearize.schedules.target(**cost, start=2, end=6), total_steps=STEPS,
                                granularity="site", select="saliency", example_inputs=EXAMPLE)


def penalty_run(model: nn.Module, rank: int = 0, world: int = 1) -> torch.Tensor:
    """A small MLP trained with the Sparsifier's penalty in the loss (mode="loss"): its global slopes."""
    opt = torch.optim.SGD(linearize.param_groups(model), lr=0.1)
    sp = linearize.Sparsifier(model, linearize.schedules.constant(), total_steps=6, mode="loss", rate=0.05).attach(opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(BATCH, 8, generator=g)[rank * (BATCH // world):(rank + 1) * (BATCH // world)]
        loss = model(x).square().mean() + sp.penalty()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return slopes(model)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return linearize.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 15), nn.ReLU(), nn.Linear(15, 2)),
                             example_inputs=torch.randn(1, 8))


def batches(rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """The global batches of the run, and this rank's rows of each."""
    g = torch.Generator().manual_seed(1)
    rows = BATCH // world
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)[rank * rows:(rank + 1) * rows] for _ in range(STEPS)]


def train(model, optimizer, steps: range, data: list[torch.Tensor], world: int) -> list[float]:
    """Steps of the loop (the Sparsifier attached to ``optimizer``); the global mean loss of each."""
    losses = []
    for step in steps:
        x = data[step]
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        value = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(linearize.param_groups(model, weight_decay=0.01), lr=1e-2)


def slopes(model: nn.Module) -> torch.Tensor:
    """Every slope, global value (a collective under FSDP2)."""
    return torch.cat([full_value(u.slope.detach()).cpu() for _, u in linearize.units(model)])


# ---------------------------------------------------------------------------------------------- sharded side
def _shard(model: nn.Module, arch: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    blocks = model.transformer.h if arch == "gpt2" else model.model.layers
    for block in blocks:
        fully_shard(block)
    return fully_shard(model)


def _refusals(out: dict, model: nn.Module) -> None:
    """Errors naming the fix for a sharded model passed where the whole model is needed."""
    calls = {
        "fold": lambda: linearize.fold(model, EXAMPLE),
        "save_pretrained": lambda: linearize.save_pretrained(model, "unused"),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    out_dir = Path(out_dir)
    result: dict = {}
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for arch in ("gpt2", "llama"):
        model = _shard(build(arch), arch)
        opt = optimizer_of(model)
        sp = sparsifier(arch, model)
        sp.attach(opt)
        losses = train(model, opt, range(STEPS), batches(rank, WORLD), WORLD)
        result[arch] = {"losses": losses, "slopes": slopes(model).tolist(), "counts": linearize.count_units(model),
                        "fraction": sp.nonlinear_fraction(), "history": sp.history}
        if arch == "gpt2":
            state = get_model_state_dict(model, options=full)  # every rank takes part; rank 0 gets the values
            if rank == 0:  # a sharded save: gathered, loaded into a plain model, saved as on one process
                plain = build(arch)
                plain.load_state_dict(state)
                plain.save_pretrained(out_dir / "sharded_save")
                linearize.save_pretrained(plain, out_dir / "sharded_save")
                torch.save(state, out_dir / "sharded_state.pt")
            copied = full_copy(model)  # every rank: the whole model, on this process alone
            result["full_copy"] = {
                "fsdp": sorted({type(m).__name__ for m in copied.modules()} - {type(m).__name__ for m in build(arch).modules()}),
                "logits": copied(batches()[0]).logits.tolist(),
                "differs": [] if rank else [k for k, v in copied.state_dict().items() if k not in state or not
                                            torch.allclose(v, state[k], rtol=0, atol=0, equal_nan=True)]}
            summary = linearize.freeze(model, tol=0.05)  # (after the save: it writes the buffers state holds)
            result["freeze"] = {"linear_after": summary.linear_after, "snapped": summary.snapped_one,
                                "slopes": slopes(model).tolist()}
            _refusals(result, model)
        else:
            result["saliency"] = torch.cat(list(sp.saliency().values())).tolist()

    # cost targets: planned on whole copies of the sharded model
    for cost in ({"flops": 0.8}, {"latency": 0.9}):
        model = _shard(build("gpt2"), "gpt2")
        opt = optimizer_of(model)
        sp = cost_sparsifier(model, **cost).attach(opt)
        losses = train(model, opt, range(STEPS), batches(rank, WORLD), WORLD)
        result[next(iter(cost))] = {"losses": losses, "slopes": slopes(model).tolist(), "plan": sp.cost_plan,
                                    "counts": linearize.count_units(model)}

    # resume: 4 steps, a sharded checkpoint (DCP) and the Sparsifier's state, then a new process state
    arch, data = "gpt2", batches(rank, WORLD)
    model = _shard(build(arch), arch)
    opt = optimizer_of(model)
    sp = sparsifier(arch, model).attach(opt)
    first = train(model, opt, range(HALF), data, WORLD)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out_dir / "ckpt"))
    (out_dir / f"sparsifier_{rank}.json").write_text(json.dumps(sp.state_dict()))
    sp.detach()
    del model, opt, sp
    model = _shard(build(arch), arch)
    opt = optimizer_of(model)
    sp = sparsifier(arch, model).attach(opt)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(out_dir / "ckpt"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sp.load_state_dict(json.loads((out_dir / f"sparsifier_{rank}.json").read_text()))
    rest = train(model, opt, range(HALF, STEPS), data, WORLD)
    result["resume"] = {"losses": first + rest, "slopes": slopes(model).tolist(), "history": sp.history}

    # a single-process save (made by the test) loaded into a sharded model
    loaded = linearize.from_pretrained(transformers.GPT2LMHeadModel, str(out_dir / "single_save"), EXAMPLE)
    loaded = _shard(loaded, "gpt2")
    state = get_model_state_dict(loaded, options=full)
    if rank == 0:
        torch.save(state, out_dir / "loaded_sharded_state.pt")
    # and the other way: a full state dict put into a sharded model from rank 0
    fresh = _shard(build("gpt2"), "gpt2")
    single = torch.load(out_dir / "single_state.pt") if rank == 0 else {}
    set_model_state_dict(fresh, single, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    result["broadcast_slopes"] = slopes(fresh).tolist()
    from torch.distributed.fsdp import fully_shard

    result["penalty"] = penalty_run(fully_shard(mlp()), rank, WORLD).tolist()

    # full_copy after a forward without backward: the root holds unsharded compute copies (bfloat16 here)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    net = mlp()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with torch.no_grad():
        net(torch.randn(2, 8))
    copied = full_copy(net, device="cpu")
    result["copy_after_forward"] = [k for k, v in copied.state_dict().items()
                                    if not torch.allclose(v, want[k], rtol=0, atol=0, equal_nan=True)]
    # DDP-style replicas (nothing sharded) under a latency target: each rank times, rank 0's plan is everyone's
    net = mlp()
    sp = linearize.Sparsifier(net, linearize.schedules.target(latency=0.8, start=0, end=2), total_steps=3,
                              granularity="site", select="slope", example_inputs=torch.randn(1, 8))
    sp.attach(torch.optim.SGD(linearize.param_groups(net), lr=0.0))
    for _ in range(3):
        net(torch.randn(2, 8)).sum().backward()
        sp.optimizer.step()
    result["replica_plan"] = sp.cost_plan
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------- the tests
def _single(arch: str):
    model = build(arch)
    opt = optimizer_of(model)
    sp = sparsifier(arch, model).attach(opt)
    losses = train(model, opt, range(STEPS), batches(), 1)
    return model, sp, losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Single-process runs (here) and the sharded ones (2 processes), on the same global batches."""
    out = tmp_path_factory.mktemp("fsdp")
    single = {arch: _single(arch) for arch in ("gpt2", "llama")}
    model = single["gpt2"][0]
    model.save_pretrained(out / "single_save")
    linearize.save_pretrained(model, out / "single_save")
    torch.save(model.state_dict(), out / "single_state.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return out, single, ranks


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fsdp_run_matches_single_process(runs, arch):
    _, single, ranks = runs
    model, sp, losses = single[arch]
    want = slopes(model)
    assert 0 < int((want == 1).sum()) < want.numel()  # the target made some channels linear, not all
    for r in ranks:
        got = torch.tensor(r[arch]["slopes"])
        assert torch.equal(got == 1, want == 1)  # the same linear channels
        assert torch.allclose(got, want, rtol=0, atol=1e-6)
        assert r[arch]["losses"] == pytest.approx(losses, rel=1e-5)
        assert r[arch]["counts"] == linearize.count_units(model)  # the global count, not a shard's
        assert r[arch]["fraction"] == sp.nonlinear_fraction()
        assert [h["nonlinear_fraction"] for h in r[arch]["history"]] == [h["nonlinear_fraction"] for h in sp.history]
    if arch == "llama":  # only the gate activation of each gated MLP is a unit
        assert [n for n, _ in linearize.units(model)] == [f"model.layers.{i}.mlp.act_fn" for i in range(2)]
        for r in ranks:
            saliency = torch.tensor(r["saliency"], dtype=torch.float64)
            assert torch.allclose(saliency, torch.cat(list(sp.saliency().values())), rtol=1e-4, atol=1e-12)


def test_fsdp_penalty_in_the_loss_matches_single_process(runs):
    _, _, ranks = runs
    want = penalty_run(mlp())
    assert 0 < float(want.min()) < 1  # the penalty moved the slopes
    for r in ranks:
        assert torch.allclose(torch.tensor(r["penalty"]), want, rtol=0, atol=1e-6)


def test_fsdp_flops_target_matches_single_process(runs):
    _, _, ranks = runs
    model = build("gpt2")
    opt = optimizer_of(model)
    sp = cost_sparsifier(model, flops=0.8).attach(opt)
    losses = train(model, opt, range(STEPS), batches(), 1)
    want = slopes(model)
    linear = {n for n, c in linearize.count_units(model)["sites"].items() if c["nonlinear"] == 0}
    assert len(linear) == 1 and sp.cost_plan[-1]["cost"] <= 0.8  # one of the two sites linear meets the goal
    for r in ranks:
        assert r["flops"]["plan"] == sp.cost_plan
        assert torch.allclose(torch.tensor(r["flops"]["slopes"]), want, rtol=0, atol=1e-6)
        assert r["flops"]["losses"] == pytest.approx(losses, rel=1e-5)


def test_fsdp_latency_target_is_one_plan_on_every_rank(runs):
    _, _, ranks = runs
    plan = ranks[0]["latency"]["plan"]
    assert plan and all(r["latency"]["plan"] == plan for r in ranks)  # rank 0's timings decide for all
    assert ranks[0]["latency"]["slopes"] == ranks[1]["latency"]["slopes"]
    held = next(p for k, p in enumerate(plan) if p["cost"] <= 0.9 or k == len(plan) - 1)
    linear = {n for n, c in ranks[0]["latency"]["counts"]["sites"].items() if c["nonlinear"] == 0}
    assert linear == set(held["sites"])  # the target ends at the plan's prefix within the goal


def test_full_copy_after_a_forward_holds_the_master_weights_not_compute_copies(runs):
    _, _, ranks = runs
    assert all(r["copy_after_forward"] == [] for r in ranks)  # float32, bit-identical to the weights sharded


def test_a_latency_plan_is_rank_zeros_on_every_replica(runs):
    _, _, ranks = runs
    assert ranks[0]["replica_plan"] and ranks[0]["replica_plan"] == ranks[1]["replica_plan"]


def test_full_copy_of_a_sharded_model_is_the_model_on_one_process(runs):
    _, single, ranks = runs
    model = single["gpt2"][0]
    want = model(batches()[0]).logits
    for r in ranks:
        assert r["full_copy"]["fsdp"] == []  # no FSDP class left
        assert r["full_copy"]["differs"] == []  # bit-identical to the gathered full state dict
        assert torch.allclose(torch.tensor(r["full_copy"]["logits"]), want, rtol=0, atol=1e-5)


def test_fsdp_freeze_matches_single_process(runs):
    _, single, ranks = runs
    model = copy.deepcopy(single["gpt2"][0])
    summary = linearize.freeze(model, tol=0.05)
    for r in ranks:
        assert r["freeze"]["linear_after"] == summary.linear_after
        assert r["freeze"]["snapped"] == summary.snapped_one
        assert torch.allclose(torch.tensor(r["freeze"]["slopes"]), slopes(model), rtol=0, atol=1e-6)


def test_fsdp_resume_from_sharded_checkpoint_is_exact(runs):
    _, _, ranks = runs
    for r in ranks:
        assert r["resume"]["slopes"] == r["gpt2"]["slopes"]  # bit-identical to the uninterrupted sharded run
        assert r["resume"]["losses"] == r["gpt2"]["losses"]
        assert r["resume"]["history"] == r["gpt2"]["history"]


def identical(a: dict, b: dict) -> None:
    """The same keys and bit-identical tensors (NaN where NaN: the frozen buffers' free channels)."""
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=k)


def test_fsdp_sharded_save_loads_unsharded_bit_identically(runs):
    out, single, ranks = runs
    gathered = torch.load(out / "sharded_state.pt")
    loaded = linearize.from_pretrained(transformers.GPT2LMHeadModel, str(out / "sharded_save"), EXAMPLE)
    identical(loaded.state_dict(), gathered)
    # the other way round: a single-process save loaded, then sharded, gives back every tensor exactly
    mine = single["gpt2"][0].state_dict()
    identical(torch.load(out / "loaded_sharded_state.pt"), mine)
    for r in ranks:  # a full state dict broadcast from rank 0 into a sharded model
        assert torch.equal(torch.tensor(r["broadcast_slopes"]), torch.cat([u.slope.detach().reshape(-1) for _, u in
                                                                           linearize.units(single["gpt2"][0])]))


def test_fsdp_unsupported_uses_are_refused_with_the_fix(runs):
    _, _, ranks = runs
    for r in ranks:
        for what in ("fold", "save_pretrained"):
            assert "full_copy(model)" in r[what] and "sharded" in r[what], r[what]


def test_fsdp1_wrapper_is_refused_with_the_fix():
    # FSDP1 needs an accelerator to wrap anything: a wrapper built without its __init__ carries its class,
    # which is what the check reads (the GPU script wraps a real one)
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), example_inputs=torch.randn(1, 4))
    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper._modules["_fsdp_wrapped_module"] = model  # (add_module reads attributes FSDP1 forwards there)
    with pytest.raises(TypeError, match="FSDP1.*fully_shard.*fsdp_version: 2"):
        linearize.Sparsifier(wrapper, linearize.schedules.target(0.5), 10)


def test_trainer_fsdp1_is_refused_with_the_fix_not_told_it_did_not_shard():
    # TrainingArguments(fsdp=...) defaults to FSDP1: the callback, given a Sparsifier built before the Trainer
    # wrapped the model, refuses the FSDP1 wrapper (it must not warn that the Trainer did not shard)
    from types import SimpleNamespace

    from torch.distributed.fsdp import FullyShardedDataParallel

    from linearize.integrations import LinearizeCallback

    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), example_inputs=torch.randn(1, 4))
    callback = LinearizeCallback(sparsifier=linearize.Sparsifier(model, linearize.schedules.target(0.5), 10))
    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper._modules["_fsdp_wrapped_module"] = model
    args = SimpleNamespace(fsdp=["full_shard"])
    state = SimpleNamespace(global_step=0, max_steps=10, stateful_callbacks={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "did not shard" warning first
        with pytest.raises(TypeError, match="FSDP1.*fsdp_version: 2"):
            callback.on_train_begin(args, state, None, model=wrapper)


def test_deepspeed_zero3_slopes_are_refused_with_the_fix():
    # ZeRO-3 marks the parameters it partitions with ds_id (DeepSpeed is not installed here: marked by hand)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), example_inputs=torch.randn(1, 4))
    model[1].slope.ds_id = 0
    with pytest.raises(TypeError, match="ZeRO-3.*stage 1 or 2.*fully_shard"):
        linearize.Sparsifier(model, linearize.schedules.target(0.5), 10)
    with pytest.raises(TypeError, match="ZeRO-3"):
        linearize.count_units(model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    torch.multiprocessing.spawn(_worker, args=(_free_port(), sys.argv[1]), nprocs=WORLD)
