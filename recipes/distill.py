"""Distil a converted Hugging Face model from its original: no labels, the original is the teacher.

The feed-forward activations of any local HF encoder or decoder (``--model-dir``, loaded with
``AutoModel``) become linearizable units; a :func:`linearize.schedules.target` schedule with the
default scale-free pressure drives ``--target`` of those channels to exactly linear, while AdamW
trains the student to match the teacher (``--kind hidden``: last hidden states, ``pooled``:
mean-pooled sentence embeddings, ``logits``: for ``AutoModelForCausalLM``-style outputs).

Evaluation on ``--eval-file``: mean cosine of the student's mean-pooled sentence embeddings to the
teacher's, retrieval top-1 (each sentence's student embedding finds its own teacher embedding among
all), then freeze + fold and the FFN FLOPs and CPU latency of the folded model. ``metrics.json``
goes to ``--output-dir`` (no weights unless ``--save-model``: ``model/``), written last and atomically; an
earlier run's ``metrics.json`` and ``model/`` there are removed first (a run without ``--save-model`` leaves
no ``model/``), and a second run into the folder while one trains there is refused (the run lock of
``recipes/cifar.py``)::

    python recipes/distill.py --model-dir <dir> --train-file train.jsonl.gz --eval-file test.jsonl.gz \\
        --text-field translation.en --target 0.25 --output-dir runs/distill_25

Several processes (``accelerate launch --multi_gpu --num_processes N``, gloo on a CPU) split every batch;
``--fsdp`` shards the student across them (FSDP2, docs/distributed.md).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import random
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import linearize  # noqa: E402
from linearize._files import atomic_write  # noqa: E402
from linearize.distill import KINDS, distill_loss, mean_pool  # noqa: E402
from linearize.sparsifier import SELECT  # noqa: E402

FFN_PATTERNS = [r".*(intermediate|mlp|ffn|feed_forward|fc1|fc2).*"]  # FFN activations, not the pooler


def read_texts(path: str | Path, field: str, limit: int | None = None) -> list[str]:
    """Lines of a text file, or ``field`` (dotted: ``translation.en``) of a .jsonl(.gz) file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    texts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if ".jsonl" in path.name or ".json" in path.name:
                value = json.loads(line)
                for key in field.split("."):
                    if not isinstance(value, dict) or key not in value:
                        raise ValueError(f"{path}: no field {field!r} in {line[:120]}")
                    value = value[key]
                line = str(value)
            texts.append(line)
            if limit is not None and len(texts) >= limit:
                break
    if not texts:
        raise ValueError(f"{path}: no text")
    return texts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="a local Hugging Face model directory (AutoModel)")
    p.add_argument("--train-file", required=True, help="text lines, or .jsonl(.gz) with --text-field")
    p.add_argument("--eval-file", required=True)
    p.add_argument("--text-field", default="text", help="dotted field of jsonl records, e.g. translation.en")
    p.add_argument("--max-train", type=int, default=None, help="use the first N training texts")
    p.add_argument("--max-eval", type=int, default=1000)
    p.add_argument("--target", type=float, default=0.25, help="fraction of FFN channels left nonlinear")
    p.add_argument("--start", type=float, default=0.1, help="start of the target path (fraction of training)")
    p.add_argument("--end", type=float, default=0.8, help="the target is reached by this fraction")
    p.add_argument("--rate", type=float, default=None, help="pressure, slope units per step (default 1/ramp)")
    p.add_argument("--lam", type=float, default=None, help="legacy lr * lam pressure (overrides --rate)")
    p.add_argument("--select", choices=SELECT, default="saliency",
                   help="which channels the target makes linear: saliency (cheapest by the loss, no uniform "
                        "push: for Adam fine-tuning) or slope (pushed highest first)")
    p.add_argument("--kind", choices=KINDS, default="hidden", help="what the student matches")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="texts per step, split evenly across the processes")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW peak learning rate (linear decay)")
    p.add_argument("--warmup", type=float, default=0.05, help="LR warm-up, fraction of --steps")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="AdamW weight decay (default 0: decay pulls the student away from the teacher)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--save-model", action="store_true",
                   help="also save the student to OUTPUT_DIR/model (weights, units, tokenizer; load it with "
                        "linearize.from_pretrained(AutoModel, dir))")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--fsdp", action="store_true", help=common.FSDP_HELP)
    args = p.parse_args(argv)
    if not 0.0 < args.target <= 1.0:
        raise ValueError(f"--target must lie in (0, 1], got {args.target}")
    if not 0.0 <= args.start < args.end <= 1.0:
        raise ValueError(f"need 0 <= --start < --end <= 1, got {args.start}, {args.end}")
    return args


@torch.no_grad()
def embed(model, tokenizer, texts: list[str], args, device) -> torch.Tensor:
    """Mean-pooled last hidden states, L2-normalized ``[N, D]``."""
    out = []
    for i in range(0, len(texts), 64):
        batch = tokenizer(texts[i : i + 64], padding=True, truncation=True, max_length=args.max_length,
                          return_tensors="pt").to(device)
        hidden = model(**batch).last_hidden_state
        out.append(F.normalize(mean_pool(hidden, batch["attention_mask"]).float(), dim=-1).cpu())
    return torch.cat(out)


def ffn_flops_per_token(model) -> int:
    """FLOPs (2 per multiply-add) of the converted FFN blocks for one token: the Linear before and
    after each unit (e.g. ``intermediate.dense`` and ``output.dense`` of BERT)."""
    total = 0
    for _, unit in linearize.units(model):
        total += 2 * 2 * unit.num_channels * model.config.hidden_size
    return total


def main(argv: list[str] | None = None) -> dict:
    """Distil one student into ``--output-dir`` and write its outputs; returns its metrics. The main process
    holds the folder's run lock meanwhile (``common.hold_output_dir``: a second run into it is refused)."""
    args = parse_args(argv)
    try:
        return distill_run(args, argv)
    finally:
        common.release_output_dir(args.output_dir)


def distill_run(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """The run of :func:`main` (``argv``: its arguments, for the command recorded)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

    t0, cpu0 = time.time(), resource.getrusage(resource.RUSAGE_SELF)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    # several CPU processes: gloo (DDP), not N runs; parameters outside the compared outputs (a pooler) get no
    # gradient, which DDP must be told
    accelerator = Accelerator(cpu=not common.has_device(),
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    common.check_fsdp(accelerator, args)
    if accelerator.is_main_process:
        common.hold_output_dir(args.output_dir)
    rank, world = accelerator.process_index, accelerator.num_processes
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the {world} processes (each takes "
                         "an equal part of every batch)")
    device = accelerator.device
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    teacher = AutoModel.from_pretrained(args.model_dir).eval().to(device)
    for p_ in teacher.parameters():
        p_.requires_grad_(False)

    def build():  # the student before training: the teacher converted
        return linearize.convert(copy.deepcopy(teacher), target_modules=FFN_PATTERNS).requires_grad_(True)

    student = build()
    student.eval()  # no dropout: the student matches the deterministic teacher (loss 0 at step 0)
    channels = sum(u.num_channels for _, u in linearize.units(student))
    if args.fsdp:  # FSDP2: each layer sharded across the processes, then the rest; the teacher stays whole
        common.shard(student, common.blocks(student), device)
    train_texts = read_texts(args.train_file, args.text_field, args.max_train)
    eval_texts = read_texts(args.eval_file, args.text_field, args.max_eval)

    optimizer = torch.optim.AdamW(linearize.param_groups(student, weight_decay=args.weight_decay), lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup * args.steps), args.steps)
    student, optimizer = common.prepare(accelerator, student, optimizer)
    schedule = linearize.schedules.target(args.target, start=args.start, end=args.end)
    sparsifier = linearize.Sparsifier(accelerator.unwrap_model(student), schedule, args.steps,
                                      lam=args.lam, rate=args.rate, select=args.select).attach(optimizer)

    rng = random.Random(args.seed)
    order: list[int] = []
    log = []
    for step in range(args.steps):
        if len(order) < args.batch_size:
            order += rng.sample(range(len(train_texts)), len(train_texts))
        idx, order = order[: args.batch_size], order[args.batch_size :]
        batch = tokenizer([train_texts[i] for i in idx[rank::world]], padding=True, truncation=True,
                          max_length=args.max_length, return_tensors="pt").to(device)
        with torch.no_grad():
            t_out = teacher(**batch)
        loss = distill_loss(student(**batch), t_out, args.kind, batch["attention_mask"])
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % args.log_every == 0 or step == args.steps - 1:
            rec = {"step": step + 1, "loss": round(loss.item(), 6),
                   "nonlinear_fraction": round(sparsifier.nonlinear_fraction(), 4),
                   "minutes": round((time.time() - t0) / 60, 2)}
            log.append(rec)
            accelerator.print(json.dumps(rec))

    student = accelerator.unwrap_model(student)
    if args.fsdp:  # evaluation, fold and the save need the whole student: gathered onto every process
        student = common.gathered(student, build)
    train_minutes = (time.time() - t0) / 60
    te, se = embed(teacher, tokenizer, eval_texts, args, device), embed(student, tokenizer, eval_texts, args, device)
    cosine = (te * se).sum(-1).mean().item()
    top1 = ((se @ te.T).argmax(1) == torch.arange(len(te))).float().mean().item()

    linearize.freeze(student, tol=0.0)
    example = tokenizer(eval_texts[:32], padding=True, truncation=True, max_length=args.max_length,
                        return_tensors="pt")
    student_cpu = copy.deepcopy(student).cpu().float()
    folded = linearize.fold(student_cpu, dict(example))
    summary = folded.linearize_fold_summary
    tokens = int(example["input_ids"].numel())
    ffn_before = ffn_flops_per_token(student_cpu) * tokens
    ffn_after = ffn_before - (summary.flops_before - summary.flops_after)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    metrics = {
        "model_dir": str(args.model_dir),
        "target": args.target,
        "ffn_channels": channels,
        "nonlinear_fraction": linearize.nonlinear_fraction(student),
        "eval_sentences": len(eval_texts),
        "train_sentences": len(train_texts),
        "mean_cosine": round(cosine, 5),
        "retrieval_top1": round(top1, 5),
        "ffn_flops_ratio": round(ffn_after / ffn_before, 4),
        "model_flops_ratio": round(summary.flop_ratio, 4),
        "latency_ms_before": summary.latency_ms_before,
        "latency_ms_after": summary.latency_ms_after,
        "latency_ratio": (round(summary.latency_ms_after / summary.latency_ms_before, 4)
                          if summary.latency_ms_before else None),
        "fold_max_abs_error": summary.max_abs_error,
        "sparsifier_rate": sparsifier.rate,
        "sparsifier_max_step": sparsifier.max_step,
        "train_minutes_wall": round(train_minutes, 2),
        "minutes_wall": round((time.time() - t0) / 60, 2),
        "minutes_cpu": round((cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / 60, 2),
        "torch_threads": torch.get_num_threads(),
        "num_processes": world,
        "log": log,
        "command": "python " + " ".join(sys.argv) if argv is None else "main(" + repr(argv) + ")",
        "args": vars(args),
    }
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        # an earlier run's metrics.json (and model/, which this run does not save again) must never be read as
        # this run's: removed first, so that a kill while writing leaves no metrics.json, never a stale one
        common.remove_earlier_outputs(out, ["metrics.json", *(["model"] * (not args.save_model))])
        if args.save_model:  # the HF save carries the fine-tuned weights and the units (config.linearize)
            with common.writing(out / "model"), common.replaced_dir(out / "model") as stage:  # never half written
                student.save_pretrained(stage)
                tokenizer.save_pretrained(stage)
        atomic_write(out / "metrics.json", json.dumps(metrics, indent=2))  # last: the run is complete
    accelerator.print(json.dumps({k: v for k, v in metrics.items() if k not in ("log", "args")}, indent=1))
    accelerator.wait_for_everyone()
    return metrics


if __name__ == "__main__":
    main()
