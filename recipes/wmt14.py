"""Train (and linearize the FFN activations of) a Transformer for translation with Accelerate.

    python recipes/wmt14.py --train-file train.jsonl.gz --validation-file validation.jsonl.gz \\
        --test-file test.jsonl.gz --model-size small --output_dir runs/mt
    accelerate launch recipes/wmt14.py --dataset wmt14 --dataset-config de-en --model-size base ...
    torchrun --nproc_per_node 8 recipes/wmt14.py --fsdp ...   # the model sharded (FSDP2, docs/distributed.md)
    python recipes/wmt14.py ... --linearize none --prune magnitude   # structured pruning instead, same cost

The model is Transformer-base of Vaswani et al. (6+6 layers, d_model 512, 8 heads, FFN 2048,
ReLU, shared embeddings, dropout 0.1, label smoothing 0.1, inverse-sqrt LR with warm-up) built
as a Hugging Face ``MarianMTModel`` from a config, so ``generate`` with beam search works.
Presets ``--model-size base|small|tiny``. The tokenizer is a joint BPE trained with
``tokenizers`` on the training pairs (saved with the model), or ``--tokenizer DIR``.
Evaluation: detokenized sacreBLEU on the test split (beam 4, length penalty 0.6), with its
signature printed and saved in ``metrics.json``; with ``--validation-file`` as well, the validation
split's BLEU beside it (``validation_bleu``: for choices made without looking at the test split),
and on the validation split alone when there is no test split.

The calls of linearize are in :func:`main`, as in ``recipes/cifar.py``: ``linearize.convert``,
``linearize.Sparsifier(...).attach(optimizer)``, ``linearize.freeze``, ``linearize.fold`` +
``linearize.save_folded``, ``linearize.report``; ``recipes/common/`` holds the plumbing.

The comparison a user would make instead: ``--linearize none --prune magnitude|taylor`` trains the plain
model the same way and, at the step where the late schedule would start (``--late-start``), removes FFN
intermediate channels with ``linearize.prune`` down to the FFN multiply-adds per token of the model
linearized to ``--target`` and folded (:func:`prune_budget`), then trains on with the optimizer state of the
kept channels (:func:`prune_ffns`). A checkpoint after that step holds the pruned model; resuming from it
builds the pruned shapes first.

The one-shot counterpart (``--linearize prelu --one-shot affine|hybrid|constant|identity``): the units' slopes
frozen at 0 (the plain model) up to ``--late-start``, where ``linearize.one_shot`` linearizes the FFN channels in
one step, on the first training batches of that epoch that hold 1,024 pairs (at most 32 batches), to the same
budget of FFN multiply-adds folded (:func:`one_shot_ffns`); then training goes on without sparsity pressure, the
linear channels frozen at 1 with their ends (learnable for ``affine`` and a hybrid's linear FFNs), the others
at 0. A checkpoint after that step holds the ends; resuming from it loads them first.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import linearize  # noqa: E402

RECIPE = "wmt14"
PRESETS = {  # layers, d_model, heads, ffn, peak lr, warm-up steps
    "base": dict(layers=6, d_model=512, heads=8, ffn=2048, lr=7e-4, warmup=4000),
    "small": dict(layers=3, d_model=256, heads=4, ffn=1024, lr=1e-3, warmup=800),
    "tiny": dict(layers=1, d_model=64, heads=2, ffn=128, lr=1e-3, warmup=10),
}
SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2
PAD, EOS = 0, 1
SELECT_DEFAULT = "saliency"  # AdamW: channels chosen by saliency (see common.add_linearize_args)
VOCAB_SIZE = 8000  # of the joint BPE trained here (without --tokenizer)
PROVENANCE = "provenance.json"  # beside OUTPUT_DIR/tokenizer: what it was trained on
PRUNE_IMPORTANCES = common.PRUNE_IMPORTANCES
PRUNE_BATCHES = 32  # training batches the Taylor importance sums over
KEPT_FILE = common.KEPT_FILE  # OUTPUT_DIR/: the indices each pruned FFN kept
ONE_SHOT_ENDS = ("affine", "hybrid", "constant", "identity")  # linearize.one_shot's ends
ONE_SHOT_PAIRS = 1024  # calibration pairs of --one-shot (as recipes/benchmarks/hybrid_one_shot.py --calibration 1024)
ONE_SHOT_FILE = "one_shot.json"  # OUTPUT_DIR/: what --one-shot did (the metrics' one_shot block)


# ----------------------------------------------------------------------------- data


def _builder(path: str) -> str:
    name = path.lower()
    if name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    raise ValueError(f"{path}: expected a .jsonl(.gz) or .parquet file in the WMT layout "
                     '{"translation": {"de": ..., "en": ...}}')


def load_pairs(args: argparse.Namespace) -> dict[str, list[tuple[str, str]]]:
    """``{split: [(source, target)]}`` for the splits present (train, validation, test)."""
    import datasets

    files = {k: v for k, v in (("train", args.train_file), ("validation", args.validation_file),
                               ("test", args.test_file)) if v}
    if files:
        for split, f in files.items():
            if not Path(f).is_file():
                raise FileNotFoundError(f"--{split}-file {f} does not exist (expected JSONL/Parquet with "
                                        '{"translation": {"<src>": ..., "<tgt>": ...}} per row)')
        builders = {_builder(f) for f in files.values()}
        if len(builders) > 1:
            raise ValueError("--train-file/--validation-file/--test-file must share one format (JSONL or Parquet)")
        raw = datasets.load_dataset(builders.pop(), data_files=files)
    elif args.dataset:
        raw = datasets.load_dataset(args.dataset, args.dataset_config)
    else:
        raise FileNotFoundError("no data: pass --train-file/--validation-file/--test-file (JSONL or Parquet, rows "
                                '{"translation": {"de": ..., "en": ...}}; e.g. $LINEARIZE_MULTI30K/train.jsonl.gz) '
                                "or --dataset wmt14 --dataset-config de-en (needs the hub)")
    if "train" not in raw:
        raise ValueError(f"the data has no train split (found {list(raw)})")
    src, tgt = args.source_lang, args.target_lang
    out = {}
    for split in ("train", "validation", "test"):
        if split not in raw:
            continue
        ds = raw[split]
        if "translation" not in ds.column_names:
            raise ValueError(f"{split} rows have columns {ds.column_names}; expected a 'translation' column "
                             '{"<src>": ..., "<tgt>": ...}')
        limit = args.max_train_samples if split == "train" else args.max_eval_samples
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        rows = ds["translation"]
        langs = set(rows[0]) if rows else set()
        if src not in langs or tgt not in langs:
            raise ValueError(f"language pair {src}-{tgt} is not in the {split} data, which holds "
                             f"{sorted(langs)}: choose --source-lang/--target-lang from these")
        out[split] = [(r[src], r[tgt]) for r in rows]
    return out


def train_tokenizer(pairs: list[tuple[str, str]], vocab_size: int, show: bool):
    """Joint BPE (``tokenizers``) on source and target training text; ``</s>`` appended on encode."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), min_frequency=2,
                                  show_progress=show)
    tok.train_from_iterator((s for pair in pairs for s in pair), trainer=trainer, length=2 * len(pairs))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", EOS)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tokenizer_provenance(pairs: list[tuple[str, str]], vocab_size: int) -> dict:
    """What a tokenizer trained by :func:`train_tokenizer` depends on: the vocabulary size and the training
    pairs (their number and sha256), stored as ``provenance.json`` beside it."""
    h = hashlib.sha256()
    for src, tgt in pairs:
        h.update(src.encode() + b"\0" + tgt.encode() + b"\0")
    return {"vocab_size": vocab_size, "train_pairs": len(pairs), "train_sha256": h.hexdigest()}


def prepare_tokenizer(directory: Path, pairs: list[tuple[str, str]], args: argparse.Namespace, show: bool) -> None:
    """Train the joint BPE into ``directory`` (``OUTPUT_DIR/tokenizer``, written as a whole: a temp folder
    renamed into place) unless the intact one there was trained on the same ``pairs`` with the same
    ``--vocab-size`` (its :func:`tokenizer_provenance`). A fresh run trains another one; a resumed run
    refuses one trained otherwise (its checkpoint was trained with that tokenizer), and keeps one written
    before the provenance was recorded (the checkpoint's fingerprint covers its vocabulary)."""
    want = tokenizer_provenance(pairs, args.vocab_size)
    try:
        load_tokenizer(directory)
        have = json.loads((directory / PROVENANCE).read_text())
    except FileNotFoundError:  # none yet, or no provenance recorded
        have = "unrecorded" if (directory / "tokenizer.json").is_file() else None
    except (ValueError, RecursionError):  # damaged: unreadable tokenizer files or provenance.json (nested too deep)
        have = None
    if have == want:
        return
    if args.resume_from_checkpoint and have is not None:
        if have == "unrecorded":
            return
        changed = [f"{k} {have.get(k)!r} (now {v!r})" if isinstance(have, dict) else f"{k} {v!r}"
                   for k, v in want.items() if not isinstance(have, dict) or have.get(k) != v]
        raise ValueError(f"{directory} was trained otherwise than this run's data and --vocab-size give: "
                         f"{'; '.join(changed)}; resume with the --vocab-size and training data the run started "
                         "with, or start a fresh --output_dir")
    if directory.exists():
        print(f"{directory}: not trained on this run's data and --vocab-size ({have or 'unreadable'}); training "
              "the tokenizer again", file=sys.stderr)
    with common.replaced_dir(directory) as stage:
        train_tokenizer(pairs, args.vocab_size, show).save_pretrained(str(stage))
        (stage / PROVENANCE).write_text(json.dumps(want, indent=1))


def load_tokenizer(path: str | Path):
    """The tokenizer of ``--tokenizer``, of ``OUTPUT_DIR/tokenizer`` or the one saved next to a model
    (``OUTPUT_DIR/model``: its files checked against ``recipe.json``), checked for this recipe's special
    tokens. A damaged folder raises ``ValueError`` naming it and the fix."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {path} holds no tokenizer.json (a folder written by save_pretrained)")
    if (path / "recipe.json").is_file():
        common.check_files(path, common.read_recipe_json(path))
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as e:  # the tokenizers parser raises a bare Exception on truncated JSON
        first = (str(e).strip().splitlines() or [repr(e)])[0]
        raise ValueError(f"{path / 'tokenizer.json'} (or another tokenizer file in {path}) cannot be read "
                         f"({type(e).__name__}: {first}): the save is damaged; delete {path} to have the recipe "
                         "train its tokenizer again, or restore it") from e
    if tok.pad_token_id != PAD or tok.eos_token_id != EOS:
        raise ValueError(f"tokenizer {path} must have <pad> = {PAD} and </s> = {EOS} "
                         f"(got {tok.pad_token_id}, {tok.eos_token_id})")
    return tok


def encode(tokenizer, pairs: list[tuple[str, str]], max_length: int) -> list[tuple[list[int], list[int]]]:
    """Token ids (ending in ``</s>``, truncated to ``max_length``) of each pair."""
    kw = dict(truncation=True, max_length=max_length)
    src = tokenizer([s for s, _ in pairs], **kw)["input_ids"]
    tgt = tokenizer([t for _, t in pairs], **kw)["input_ids"]
    return list(zip(src, tgt))


def token_batches(lengths: list[int], max_tokens: int, order: list[int]) -> list[list[int]]:
    """Greedy batches of indices in ``order`` such that ``len(batch) * max length <= max_tokens``."""
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and m * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    return batches


class TokenBatchSampler:
    """Batches of similar length holding at most ``max_tokens`` padded tokens; the order within
    equal lengths and the batch order depend only on ``(seed, epoch)``."""

    drop_last = True  # accelerate: drop an incomplete last round instead of repeating batches

    def __init__(self, lengths: list[int], max_tokens: int, seed: int) -> None:
        if max(lengths) > max_tokens:
            raise ValueError(f"--max-tokens {max_tokens} is below the longest sequence ({max(lengths)} tokens): "
                             "raise it or lower --max-length")
        self.lengths, self.max_tokens, self.seed, self.epoch = lengths, max_tokens, seed, 0
        self._n = len(self._batches())

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 10_007 + self.epoch)
        noise = torch.rand(len(self.lengths), generator=g).tolist()
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], noise[i]))
        batches = token_batches(self.lengths, self.max_tokens, order)
        perm = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in perm]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        return self._n


def collate(batch: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Pad a list of ``(src_ids, tgt_ids)``: ``input_ids``/``attention_mask`` [B, S],
    ``decoder_input_ids`` [B, T] (``<pad>`` then the target shifted right), ``labels`` [B, T] (-100 = pad)."""
    s_len = max(len(s) for s, _ in batch)
    t_len = max(len(t) for _, t in batch)
    ids = torch.full((len(batch), s_len), PAD)
    labels = torch.full((len(batch), t_len), -100)
    for i, (s, t) in enumerate(batch):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, : len(t)] = torch.tensor(t)
    dec = torch.full_like(labels, PAD)
    dec[:, 1:] = labels[:, :-1].clamp(min=PAD)  # -100 (pad) -> <pad>
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "decoder_input_ids": dec, "labels": labels}


def translation_loss(model: nn.Module, batch: dict[str, torch.Tensor], label_smoothing: float) -> torch.Tensor:
    """The training loss: label-smoothed cross-entropy of the next target token (padding ignored)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=batch["decoder_input_ids"]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100,
                           label_smoothing=label_smoothing)


# ----------------------------------------------------------------------------- model


def build_model(size: str, vocab_size: int, max_positions: int = 512) -> nn.Module:
    """A ``MarianMTModel`` from a config: post-LN Transformer with ReLU FFNs, sinusoidal positions,
    shared source/target/output embeddings, dropout 0.1."""
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    p = PRESETS[size]
    config = MarianConfig(
        vocab_size=vocab_size, d_model=p["d_model"], encoder_layers=p["layers"], decoder_layers=p["layers"],
        encoder_attention_heads=p["heads"], decoder_attention_heads=p["heads"], encoder_ffn_dim=p["ffn"],
        decoder_ffn_dim=p["ffn"], activation_function="relu", dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.0, max_position_embeddings=max_positions, scale_embedding=True,
        pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, forced_eos_token_id=EOS,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )
    model = MarianMTModel(config)
    model.generation_config = GenerationConfig(decoder_start_token_id=PAD, eos_token_id=EOS, pad_token_id=PAD,
                                               bad_words_ids=[[PAD]], max_length=max_positions)
    return model


def example_inputs(batch: int = 2, length: int = 8) -> dict[str, torch.Tensor]:
    """A probe input for ``linearize.convert`` (token ids of ``<unk>``)."""
    ids = torch.full((batch, length), 2)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": ids}


def load_model(directory: str | Path) -> nn.Module:
    """The ``MarianMTModel`` saved by this recipe (``OUTPUT_DIR/model``), its files checked against the sizes
    and sha256 ``recipe.json`` records, converted and with its units restored bit-identically when it was
    trained linearized (see :func:`load_tokenizer` for the tokenizer).

    Example::

        model = wmt14.load_model("out/model")
        tokenizer = wmt14.load_tokenizer("out/model")
    """
    from transformers import MarianMTModel

    directory = Path(directory)
    meta = common.read_recipe_json(directory, ("linearize",))
    if meta["linearize"] not in common.LINEARIZE_MODES:
        raise linearize.LoadError(f"{directory / 'recipe.json'}: linearize {meta['linearize']!r} is not one of "
                                  f"{common.LINEARIZE_MODES}: the save is damaged or was edited")
    common.check_files(directory, meta)
    if meta["linearize"] == "none":
        return MarianMTModel.from_pretrained(str(directory), use_safetensors=True)
    # loads the weights with the unit tensors expected (no UNEXPECTED-keys table), then the units
    return linearize.from_pretrained(MarianMTModel, directory, use_safetensors=True, example_inputs=example_inputs())


# ----------------------------------------------------------------------------- pruning


class TrainingLoss(nn.Module):
    """:func:`translation_loss` of a batch as a module call, for ``linearize.prune``'s Taylor importance.

    The source mask is passed as ``source_mask``: prune multiplies an ``attention_mask`` input into every
    ``[B, S, C]`` activation, and the decoder's are ``[B, T, C]`` (a batch with ``T == S`` would have its
    decoder positions masked by the source's padding); the loss has no gradient at padding anyway."""

    def __init__(self, model: nn.Module, label_smoothing: float) -> None:
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing

    def forward(self, input_ids, source_mask, decoder_input_ids, labels) -> torch.Tensor:
        batch = dict(input_ids=input_ids, attention_mask=source_mask, decoder_input_ids=decoder_input_ids,
                     labels=labels)
        return translation_loss(self.model, batch, self.label_smoothing)


def loss_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A :func:`collate` batch as :class:`TrainingLoss` takes it."""
    return {("source_mask" if k == "attention_mask" else k): v for k, v in batch.items()}


def prune_budget(size: str, target: float) -> tuple[int, int]:
    """``(channels kept per FFN, the budget)``: the budget is the FFN multiply-adds per token of the model
    linearized to ``target`` and folded, ``L d^2 + 2 d n`` over its ``L`` FFNs (each folds to its nonlinear
    channels plus a ``d x d`` passthrough; ``n = round(target * L * ffn)`` nonlinear channels in all); a
    pruned FFN keeping ``k`` channels costs ``2 d k``, so ``k`` is the budget over ``2 d L``, rounded: within
    half a channel per FFN.

    Example: ``small`` at 0.1: 6 FFNs, d 256, 614 nonlinear channels: 707,584 MACs; 230 channels (706,560).
    """
    p = PRESETS[size]
    d, ffns = p["d_model"], 2 * p["layers"]
    budget = ffns * d * d + 2 * d * round(target * ffns * p["ffn"])
    keep = round(budget / (2 * d * ffns))
    if not 1 <= keep <= p["ffn"]:
        raise ValueError(f"--target {target}: the folded budget ({budget} FFN MACs per token) would keep {keep} of "
                         f"the {p['ffn']} channels per FFN; pruning needs 1 to {p['ffn']}: raise or lower --target")
    return keep, budget


def check_budget(macs: int, budget: int, size: str, below: bool = False) -> None:
    """``AssertionError`` unless ``macs`` (FFN multiply-adds per token) is within half a channel per FFN of the
    ``budget`` of :func:`prune_budget`; ``below``: at most the budget and at most one channel per FFN under it
    (``one_shot(end="hybrid")`` rounds each FFN's nonlinear channels down to fit its share)."""
    p = PRESETS[size]
    half = 2 * p["layers"] * p["d_model"]  # half a channel (2 d multiply-adds) in each of the 2 L FFNs
    low, high = (budget - 2 * half, budget) if below else (budget - half, budget + half)
    if not low <= macs <= high:
        raise AssertionError(f"FFN MACs per token {macs}: not within {low}..{high}, "
                             f"{'one channel per FFN below' if below else 'half a channel per FFN of'} the budget "
                             f"{budget}")


def prune_ffns(run: common.Run, keep: int, importance: str, batches: list[dict[str, torch.Tensor]],
               rebuild: Callable[[nn.Module], tuple]) -> dict[str, list[int]]:
    """Keep ``keep`` intermediate channels of every FFN of the run's model (``linearize.prune``, ranked by
    ``importance`` on ``batches``: the first alone finds the sites), set the config's FFN width to it (the
    saved model loads back), and replace the run's optimizer and LR scheduler by ``rebuild(model)``'s,
    loaded with their states: Adam's moments of the kept channels follow them. Returns the kept indices
    per FFN (its first layer's name)."""
    raw = run.accelerator.unwrap_model(run.model)
    order = optimized_names(run)
    opt_state, lr_state = run.optimizer.state_dict(), run.scheduler.state_dict()
    wrapper = TrainingLoss(raw, run.args.label_smoothing)
    linearize.prune(wrapper, keep, importance, data=[loss_batch(b) for b in batches],
                    example_inputs=loss_batch(batches[0]), loss=lambda loss: loss)
    sites = wrapper.linearize_prune_summary.sites
    raw.config.encoder_ffn_dim = raw.config.decoder_ffn_dim = keep
    cut = {}  # parameter name -> (dimension, kept indices)
    for s in sites.values():
        producer, consumer = (n.removeprefix("model.") for n in (s.producer, s.consumer))
        cut.update({f"{producer}.weight": (0, s.kept), f"{producer}.bias": (0, s.kept),
                    f"{consumer}.weight": (1, s.kept)})
    for i, name in enumerate(order):
        if name in cut and i in opt_state["state"]:
            dim, kept = cut[name]
            opt_state["state"][i] = {k: v.index_select(dim, kept) if v.ndim else v
                                     for k, v in opt_state["state"][i].items()}
    carry_optimizer(run, rebuild, order, opt_state, lr_state)
    return {n.removeprefix("model."): s.kept.tolist() for n, s in sites.items()}


def optimized_names(run: common.Run) -> list[str]:
    """The names of the parameters the run's optimizer holds, in its order (the keys of its state)."""
    names = {id(p): n for n, p in run.accelerator.unwrap_model(run.model).named_parameters()}
    return [names[id(p)] for g in run.optimizer.param_groups for p in g["params"]]


def carry_optimizer(run: common.Run, rebuild: Callable[[nn.Module], tuple], order: list[str], opt_state: dict,
                    lr_state: dict) -> None:
    """Replace the run's optimizer and LR scheduler by ``rebuild(model)``'s, loaded with the old ones' states
    ``opt_state`` (its parameters named ``order``: :func:`optimized_names`) and ``lr_state``: each parameter keeps
    its state by name, one the model gained since (an affine end of ``linearize.one_shot``) starts without, and
    each parameter group keeps its settings (the learning rate)."""
    raw = run.accelerator.unwrap_model(run.model)
    run.optimizer, run.scheduler = rebuild(raw)
    index = {n: i for i, n in enumerate(optimized_names(run))}
    groups = run.optimizer.state_dict()["param_groups"]
    run.optimizer.load_state_dict({
        "state": {index[order[i]]: state for i, state in opt_state["state"].items()},
        "param_groups": [{**old, "params": new["params"]} for old, new in zip(opt_state["param_groups"], groups,
                                                                              strict=True)]})
    run.scheduler.load_state_dict(lr_state)


def one_shot_ffns(run: common.Run, batches: list[dict[str, torch.Tensor]],
                  rebuild: Callable[[nn.Module], tuple]) -> dict:
    """Linearize the FFN channels of the run's model in one step: ``linearize.one_shot`` with ``--one-shot``'s end
    on ``batches``, to the FFN multiply-adds per token of :func:`prune_budget` once folded (``affine`` /
    ``identity``: ``--target`` of each FFN's channels nonlinear, beside a ``d x d`` passthrough; ``constant``: the
    channels pruning keeps, no passthrough; ``hybrid``: each FFN's share of the budget as its FLOP fraction, the
    plan under it). The linear channels are frozen at 1, the others stay frozen at 0. Then the run's optimizer
    and LR scheduler are rebuilt (:func:`carry_optimizer`) for the ends it made learnable. Returns what was done:
    the end, the calibration size, the nonlinear channels per FFN unit, each refit, and a hybrid's plans."""
    args = run.args
    p = PRESETS[args.model_size]
    keep, budget = prune_budget(args.model_size, args.target)
    amount = {"hybrid": {"flops": budget / (2 * p["layers"] * 2 * p["d_model"] * p["ffn"])},
              "constant": {"target": keep / p["ffn"]}}.get(args.one_shot, {"target": args.target})
    raw = run.accelerator.unwrap_model(run.model)
    order = optimized_names(run)
    opt_state, lr_state = run.optimizer.state_dict(), run.scheduler.state_dict()
    # the wrapper's source_mask: a decoder input [B, T, C] is not masked by the source's padding (TrainingLoss)
    sites = linearize.one_shot(TrainingLoss(raw, args.label_smoothing), [loss_batch(b) for b in batches],
                               end=args.one_shot, **amount)
    carry_optimizer(run, rebuild, order, opt_state, lr_state)
    sites = {n.removeprefix("model."): s for n, s in sites.items()}
    record = {"end": args.one_shot, **amount, "calibration_batches": len(batches),
              "calibration_pairs": sum(len(b["input_ids"]) for b in batches), "channels_per_ffn": p["ffn"],
              "nonlinear_channels": {n: s.nonlinear for n, s in sites.items()},
              "refit": {n: s.refit.removeprefix("model.") for n, s in sites.items()}}  # a layer, or why none
    if args.one_shot == "hybrid":
        record["plans"] = {n: {"mode": s.plan.mode, "flops": s.plan.flops, "flops_full": s.plan.flops_full,
                               "errors": s.plan.errors, "refit_errors": s.plan.refit_errors} for n, s in sites.items()}
    return record


def read_one_shot(out_dir: Path) -> dict:
    """What the one-shot step of the run in ``out_dir`` did (``ONE_SHOT_FILE``, written at that step), for a
    run resumed after it; ``ValueError`` naming the file when it is missing or damaged."""
    return common.read_record(out_dir / ONE_SHOT_FILE, "the run's one-shot step wrote it, and the checkpoint resumed "
                              "from comes after that step; restore the file, resume from a checkpoint before the "
                              "step, or start again in a fresh --output_dir")


def calibration_batches(train: list, sampler: TokenBatchSampler, epoch: int, n: int) -> list[dict[str, torch.Tensor]]:
    """The first ``n`` training batches of ``epoch``, collated."""
    sampler.set_epoch(epoch)
    return [collate([train[i] for i in idx]) for idx in list(sampler)[:n]]


def one_shot_batches(train: list, sampler: TokenBatchSampler, epoch: int) -> list[dict[str, torch.Tensor]]:
    """The calibration data of ``--one-shot``: the first training batches of ``epoch`` that hold
    :data:`ONE_SHOT_PAIRS` pairs (all of the epoch's where it has fewer), at most :data:`PRUNE_BATCHES`."""
    sampler.set_epoch(epoch)
    held = itertools.accumulate(len(idx) for idx in list(sampler)[:PRUNE_BATCHES])
    n = next((i + 1 for i, pairs in enumerate(held) if pairs >= ONE_SHOT_PAIRS), PRUNE_BATCHES)
    return calibration_batches(train, sampler, epoch, n)


def late_step(args: argparse.Namespace, total_steps: int) -> int:
    """The step at which ``--prune`` / ``--one-shot`` act: ``--late-start`` as a step (>= 1) or a fraction of
    training (< 1); ``ValueError`` unless it comes before the run's last step."""
    at = int(args.late_start) if args.late_start >= 1 else round(args.late_start * total_steps)
    if at >= total_steps:
        raise ValueError(f"--late-start {args.late_start} {'prunes' if args.prune else 'linearizes'} at step {at}, "
                         f"but the run has {total_steps} steps: give a fraction of training below 1 or a step below "
                         f"{total_steps}")
    return at


# ----------------------------------------------------------------------------- evaluation


def ffn_macs_per_token(model: nn.Module) -> int:
    """Multiply-accumulates of the feed-forward blocks for one token through every encoder and decoder
    layer: ``sum(fc1.in * fc1.out + fc2.in * fc2.out)`` over the layers' ``fc1`` / ``fc2`` (after
    ``fold`` a narrower ``fc1`` plus a passthrough of the ``d`` inputs, and ``fc2`` reading both)."""
    return sum(m.in_features * m.out_features for name, m in model.named_modules()
               if name.rsplit(".", 1)[-1] in ("fc1", "fc2") and hasattr(m, "in_features"))


@torch.no_grad()
def translate(model, tokenizer, encoded: list[tuple[list[int], list[int]]], accelerator, args) -> list[str]:
    """Beam-search translations of every source (sharded over processes, gathered in order); leaves
    ``model`` in eval mode."""
    from accelerate.utils import gather_object

    model = accelerator.unwrap_model(model)
    model.eval()
    lengths = [len(s) for s, _ in encoded]
    order = sorted(range(len(encoded)), key=lambda i: lengths[i])
    batches = token_batches(lengths, args.eval_max_tokens, order)[accelerator.process_index::accelerator.num_processes]
    out: list[tuple[int, str]] = []
    for idx in tqdm(batches, desc="translate", disable=not accelerator.is_local_main_process, leave=False):
        batch = collate([encoded[i] for i in idx])
        src = batch["input_ids"].to(accelerator.device)
        gen = model.generate(input_ids=src, attention_mask=batch["attention_mask"].to(accelerator.device),
                             num_beams=args.num_beams, length_penalty=args.length_penalty, early_stopping=True,
                             max_new_tokens=int(1.5 * src.shape[1]) + 10)
        out += list(zip(idx, tokenizer.batch_decode(gen, skip_special_tokens=True)))
    found = dict(gather_object(out))
    return [found[i].strip() for i in range(len(encoded))]


def bleu(hypotheses: list[str], references: list[str], target_lang: str) -> dict:
    """Detokenized corpus sacreBLEU with its signature."""
    import sacrebleu

    metric = sacrebleu.BLEU(trg_lang=target_lang)
    score = metric.corpus_score(hypotheses, [references])
    return {"bleu": round(score.score, 2), "bleu_signature": str(metric.get_signature()), "bleu_detail": str(score)}


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--dataset", default=None, help="a datasets hub name, e.g. wmt14")
    d.add_argument("--dataset-config", "--dataset_config", dest="dataset_config", default=None, help="e.g. de-en")
    for split in ("train", "validation", "test"):
        d.add_argument(f"--{split}-file", f"--{split}_file", dest=f"{split}_file", default=None,
                       help=f"local {split} JSONL(.gz)/Parquet with {{'translation': {{src, tgt}}}} rows")
    d.add_argument("--source-lang", "--source_lang", dest="source_lang", default="en")
    d.add_argument("--target-lang", "--target_lang", dest="target_lang", default="de")
    d.add_argument("--max-train-samples", "--max_train_samples", dest="max_train_samples", type=int, default=None)
    d.add_argument("--max-eval-samples", "--max_eval_samples", dest="max_eval_samples", type=int, default=None)
    d.add_argument("--max-length", "--max_length", dest="max_length", type=int, default=128,
                   help="truncate sentences to this many tokens")
    d.add_argument("--tokenizer", default=None, help="a tokenizer folder; default: train a joint BPE")
    d.add_argument("--vocab-size", "--vocab_size", dest="vocab_size", type=int, default=None,
                   help=f"of the joint BPE trained without --tokenizer (default {VOCAB_SIZE})")
    m = p.add_argument_group("model and training")
    m.add_argument("--model-size", "--model_size", dest="model_size", choices=list(PRESETS), default="base")
    m.add_argument("--epochs", type=int, default=10)
    m.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=3000,
                   help="padded tokens per batch and process")
    m.add_argument("--eval-max-tokens", "--eval_max_tokens", dest="eval_max_tokens", type=int, default=6000)
    m.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    m.add_argument("--warmup-steps", "--warmup_steps", dest="warmup_steps", type=int, default=None,
                   help="inverse-sqrt warm-up steps (default: the preset's)")
    m.add_argument("--weight-decay", "--weight_decay", dest="weight_decay", type=float, default=0.0)
    m.add_argument("--label-smoothing", "--label_smoothing", dest="label_smoothing", type=float, default=0.1)
    m.add_argument("--clip-grad", "--clip_grad", dest="clip_grad", type=float, default=1.0)
    m.add_argument("--num-beams", "--num_beams", dest="num_beams", type=int, default=4)
    m.add_argument("--length-penalty", "--length_penalty", dest="length_penalty", type=float, default=0.6)
    m.add_argument("--fsdp", action="store_true", help=common.FSDP_HELP)
    m.add_argument("--prune", choices=PRUNE_IMPORTANCES, default=None,
                   help="with --linearize none: at --late-start remove FFN channels ranked by this importance "
                        "(linearize.prune) down to the FFN multiply-adds of the model linearized to --target and "
                        "folded, then train on")
    m.add_argument("--one-shot", "--one_shot", dest="one_shot", choices=ONE_SHOT_ENDS, default=None,
                   help="with --linearize prelu: train the plain model (slopes frozen at 0) up to --late-start, "
                        "then linearize the FFN channels in one step (linearize.one_shot with this end) down to the "
                        "FFN multiply-adds --prune keeps for --target, and train on without sparsity pressure")
    common.add_linearize_args(p, default_select=SELECT_DEFAULT)
    common.add_run_args(p)
    args = p.parse_args(argv)
    if args.target_flops is not None or args.target_latency is not None:
        p.error("--target-flops / --target-latency are recipes/cifar.py's (convolutional sites); for the FFN "
                "channels here, steer the nonlinear fraction with --target")
    common.check_run_args(args)
    if args.one_shot:
        what = f"--one-shot {args.one_shot}"
        if args.prune:
            p.error(f"{what} and --prune {args.prune} both cut the FFNs to the budget of --target at --late-start: "
                    "give one of them")
        if args.linearize != "prelu":
            p.error(f"{what} linearizes slope units, which --linearize {args.linearize} does not have: use "
                    "--linearize prelu (the default)")
        if args.fsdp:
            p.error(f"{what} calibrates and refits the whole FFN layers, which --fsdp shards: drop --fsdp")
        if args.schedule not in (None, "late"):
            p.error(f"{what} linearizes once at --late-start and trains on without sparsity pressure, which "
                    f"--schedule {args.schedule} would start otherwise: drop --schedule")
        if pressure := [k for k in common.PRESSURE_FLAGS if k not in ("target", "late_start")
                        and getattr(args, k) is not None]:
            p.error(f"{common.flag(pressure[0])} steers the sparsity pressure, which {what} replaces (it chooses "
                    f"the linear channels itself): drop {', '.join(common.flag(k) for k in pressure)}")
    if args.prune:
        if args.linearize != "none":
            p.error(f"--prune {args.prune} removes channels of the plain model, and --linearize {args.linearize} "
                    "(the default is prelu) converts its activations: add --linearize none")
        if args.fsdp:
            p.error("--prune slices the FFN layers, which --fsdp shards: drop --fsdp")
        # --prune reads --target (the budget) and --late-start (when); common's check refuses them without units
        given = {k: getattr(args, k) for k in ("target", "late_start")}
        args.target = args.late_start = None
    common.check_linearize_args(args, SELECT_DEFAULT)
    if args.prune:
        args.target = args.target if given["target"] is None else given["target"]
        args.late_start = args.late_start if given["late_start"] is None else given["late_start"]
        if not 0.0 < args.target <= 1.0:
            p.error(f"--target {args.target}: with --prune, the nonlinear fraction whose folded FFN cost the pruned "
                    "FFNs match; give a number in (0, 1]")
        if not args.late_start >= 0:
            p.error(f"--late-start {args.late_start}: with --prune, the step (>= 1) or fraction of training (< 1) "
                    "to prune at; give a number >= 0")
    if args.prune or args.one_shot:
        try:
            prune_budget(args.model_size, args.target)
        except ValueError as e:
            p.error(str(e))
    files = [common.flag(f"{k}_file") for k in ("train", "validation", "test") if getattr(args, f"{k}_file")]
    if args.dataset and files:
        p.error(f"--dataset {args.dataset} and {', '.join(files)} both name the data: give one or the other")
    if args.dataset_config and not args.dataset:
        p.error("--dataset-config is the configuration of a hub --dataset: add --dataset (e.g. wmt14) or drop it")
    if args.tokenizer and args.vocab_size is not None:
        p.error("--vocab-size sizes the tokenizer trained here, which --tokenizer replaces: drop one of them")
    args.vocab_size = VOCAB_SIZE if args.tokenizer is None and args.vocab_size is None else args.vocab_size
    if args.vocab_size is not None and args.vocab_size <= len(SPECIALS):
        p.error(f"--vocab-size must exceed the {len(SPECIALS)} special tokens, got {args.vocab_size}")
    for name in ("max_train_samples", "max_eval_samples", "max_length", "max_tokens", "eval_max_tokens", "num_beams"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"{common.flag(name)} must be >= 1, got {getattr(args, name)}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        p.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    for name in ("lr", "weight_decay", "clip_grad"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            p.error(f"{common.flag(name)} must be a finite number >= 0, got {value}")
    if not 0.0 <= args.label_smoothing < 1.0:
        p.error(f"--label-smoothing must lie in [0, 1), got {args.label_smoothing}")
    if not math.isfinite(args.length_penalty):
        p.error(f"--length-penalty must be a finite number, got {args.length_penalty}")
    preset = PRESETS[args.model_size]
    args.lr = preset["lr"] if args.lr is None else args.lr
    args.warmup_steps = preset["warmup"] if args.warmup_steps is None else args.warmup_steps
    if args.source_lang == args.target_lang:
        p.error("--source-lang and --target-lang must differ")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Train (or resume) one run into ``--output_dir`` and save it; returns its metrics. The folder's run lock
    (taken by ``common.make_accelerator``: a second run into it is refused meanwhile) is released at the end."""
    args = parse_args(argv)
    try:
        return train_run(args, time.time())
    finally:
        common.release_output_dir(args.output_dir)


def train_run(args: argparse.Namespace, start_time: float) -> dict:
    """The run of :func:`main` (``start_time``: when it began)."""
    accelerator = common.make_accelerator(args, split_batches=False)
    common.check_fsdp(accelerator, args)
    if (args.prune or args.one_shot) and accelerator.num_processes > 1:
        what = f"--prune {args.prune}" if args.prune else f"--one-shot {args.one_shot}"
        raise ValueError(f"{what} changes the FFN parameters, which the {accelerator.num_processes} processes' "
                         "DDP wrapper holds: run it in one process (python recipes/wmt14.py)")
    show = accelerator.is_local_main_process
    out_dir = Path(args.output_dir)

    with accelerator.main_process_first():
        pairs = load_pairs(args)
        tok_dir = Path(args.tokenizer) if args.tokenizer else out_dir / "tokenizer"
        if args.tokenizer is None and accelerator.is_main_process:
            prepare_tokenizer(tok_dir, pairs["train"], args, show)
    tokenizer = load_tokenizer(tok_dir)
    train = encode(tokenizer, pairs["train"], args.max_length)
    # BLEU on every evaluation split there is; the test split's is the run's result (metrics "bleu"), the
    # validation split's is reported beside it ("validation_bleu", for choices made without the test split)
    eval_splits = [s for s in ("test", "validation") if s in pairs]
    if not eval_splits:
        raise ValueError("no test or validation split to evaluate on: pass --test-file")
    eval_split = eval_splits[0]

    def build() -> nn.Module:
        model = build_model(args.model_size, len(tokenizer), max_positions=max(512, 2 * args.max_length + 16))
        if args.linearize != "none":  # every activation becomes a unit with a learnable slope (or a gated split)
            model = linearize.convert(model, mode=args.linearize, example_inputs=example_inputs())
        if args.one_shot:  # the plain model up to the one-shot step, and its nonlinear channels after it
            for _, unit in linearize.units(model):
                unit.freeze_(torch.ones(unit.num_channels, dtype=torch.bool), 0.0)
        return model

    torch.manual_seed(args.seed)
    model = build()
    vocab_hash = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:8]
    fingerprint = f"{common.model_fingerprint(model)}-{vocab_hash}"
    if args.fsdp:  # FSDP2: each encoder and decoder layer sharded across the processes, then the rest
        common.shard(model, [*model.model.encoder.layers, *model.model.decoder.layers], accelerator.device)

    sampler = TokenBatchSampler([max(len(s), len(t)) for s, t in train], args.max_tokens, args.seed)
    train_loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, collate_fn=collate)

    def new_optimizer(net: nn.Module) -> torch.optim.Optimizer:
        # no weight decay on slopes (it would pull them back towards the activation), biases and norms
        return torch.optim.AdamW(linearize.param_groups(net, weight_decay=args.weight_decay), lr=args.lr,
                                 betas=(0.9, 0.98), eps=1e-9)

    def new_scheduler(opt) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            opt.optimizer, lambda s: min((s + 1) / warmup, math.sqrt(warmup / (s + 1))))

    def rebuild(net: nn.Module) -> tuple:
        opt = accelerator.prepare_optimizer(new_optimizer(net))
        return opt, new_scheduler(opt)

    model, optimizer, train_loader = common.prepare(accelerator, model, new_optimizer(model), train_loader)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train)} training pairs give no batch per process: lower the number of processes "
                         "or --max-tokens, or use more data")
    total_steps = common.run_length(args, steps_per_epoch)
    warmup = max(1, args.warmup_steps)
    scheduler = new_scheduler(optimizer)
    sparsifier = None
    if args.linearize == "prelu" and args.schedule != "none" and not args.one_shot:  # after every step: slopes to 1
        schedule = linearize.schedules.target(args.target, start=common.schedule_start(args, total_steps),
                                              end=args.ramp_end, flops=args.target_flops, latency=args.target_latency)
        priced = args.target_flops is not None or args.target_latency is not None  # a cost target prices the sites
        sparsifier = linearize.Sparsifier(accelerator.unwrap_model(model), schedule, total_steps, lam=args.lam,
                                          rate=args.rate, select=args.select, linear_end=args.linear_end,
                                          granularity=args.granularity,
                                          example_inputs=example_inputs() if priced else None).attach(optimizer)
    run = common.Run(accelerator, args, model, optimizer, scheduler, sparsifier, out_dir, fingerprint, RECIPE,
                     started=start_time)
    # --prune / --one-shot act after step act_at: a checkpoint after it holds the pruned model or the one-shot ends
    act_at = late_step(args, total_steps) if args.prune or args.one_shot else None
    keep, budget = prune_budget(args.model_size, args.target) if act_at is not None else (None, None)
    one_shot = None  # what --one-shot did (ONE_SHOT_FILE), once it has
    if act_at is not None and args.resume_from_checkpoint:
        common.remove_partial_checkpoints(out_dir)  # as common.start does: the checkpoint it will load
        ckpt = common.resume_checkpoint(args.resume_from_checkpoint, out_dir)[0]
        if ckpt is not None:  # None: `latest` before the run's first checkpoint, which starts at step 0
            common.check_args(ckpt, args)  # before the pre-load: a run of other flags is refused naming them
            if ckpt.step > act_at and args.prune:
                # the pruned shapes (the kept channels do not matter: the checkpoint's weights replace them)
                prune_ffns(run, keep, "magnitude", calibration_batches(train, sampler, 0, 1), rebuild)
            elif ckpt.step > act_at:  # its ends, learnable or fixed as saved, then an optimizer that holds them
                accelerator.unwrap_model(model).load_state_dict(ckpt.model, strict=False)
                run.optimizer, run.scheduler = rebuild(accelerator.unwrap_model(model))
                one_shot = read_one_shot(out_dir)
    step, last_step = common.start(run, total_steps)
    accelerator.print(f"{args.model_size} Transformer, {args.source_lang}->{args.target_lang}: {len(train)} pairs, "
                      f"vocab {len(tokenizer)}, {steps_per_epoch} steps/epoch, {total_steps} steps, "
                      f"{accelerator.num_processes} process(es)")

    def loss_fn(batch: dict) -> torch.Tensor:
        return translation_loss(model, batch, args.label_smoothing)

    if act_at is not None and step <= act_at < last_step:  # train up to the step, prune or one-shot, train on
        if step < act_at:
            step = common.train(run, train_loader, sampler, loss_fn, step, act_at, steps_per_epoch,
                                clip_grad=args.clip_grad)
        if args.prune:
            batches = calibration_batches(train, sampler, act_at // steps_per_epoch,
                                          PRUNE_BATCHES if args.prune == "taylor" else 1)
            kept = prune_ffns(run, keep, args.prune, batches, rebuild)
            if accelerator.is_main_process:
                common.write_kept(out_dir, kept)
            accelerator.print(f"pruned at step {act_at} ({args.prune}): {keep} of {PRESETS[args.model_size]['ffn']} "
                              f"channels per FFN, {ffn_macs_per_token(accelerator.unwrap_model(model))} FFN MACs per "
                              "token")
        else:
            one_shot = {**one_shot_ffns(run, one_shot_batches(train, sampler, act_at // steps_per_epoch), rebuild),
                        "step": act_at, "ffn_macs_budget": budget}
            if accelerator.is_main_process:
                (out_dir / ONE_SHOT_FILE).write_text(json.dumps(one_shot, indent=1))
            accelerator.print(f"one-shot at step {act_at} ({args.one_shot}, {one_shot['calibration_pairs']} pairs): "
                              f"{one_shot['nonlinear_channels']} of {PRESETS[args.model_size]['ffn']} channels per "
                              "FFN nonlinear")
    step = common.train(run, train_loader, sampler, loss_fn, step, last_step, steps_per_epoch,
                        clip_grad=args.clip_grad)

    raw = accelerator.unwrap_model(model)
    if args.fsdp:  # evaluation and saves need the whole model: gathered onto every process
        model = raw = common.gathered(raw, build)
    if args.freeze:  # linear channels (slope >= 1 - tol) set to exactly 1 and no longer trained
        linearize.freeze(raw, tol=args.tol)
    encoded = {s: encode(tokenizer, pairs[s], args.max_length) for s in eval_splits}
    hyps = {s: translate(model, tokenizer, encoded[s], accelerator, args) for s in eval_splits}
    evaluated = encoded[eval_split]
    metrics = {"recipe": RECIPE, "model_size": args.model_size, "pair": f"{args.source_lang}-{args.target_lang}",
               "steps": step, "total_steps": total_steps, "train_pairs": len(train), "eval_split": eval_split,
               "eval_pairs": len(hyps[eval_split]), "num_beams": args.num_beams, "length_penalty": args.length_penalty,
               **bleu(hyps[eval_split], [t for _, t in pairs[eval_split]], args.target_lang),
               **common.unit_stats(raw, args.tol)}
    for s in eval_splits[1:]:
        metrics.update({f"{s}_bleu": bleu(hyps[s], [t for _, t in pairs[s]], args.target_lang)["bleu"],
                        f"{s}_pairs": len(hyps[s])})
    if one_shot is not None:
        metrics["one_shot"] = {**one_shot, "file": str(out_dir / ONE_SHOT_FILE)}
    if accelerator.is_main_process:
        history = out_dir / "sparsifier_history.json"
        # an earlier run's, in a reused --output_dir, that this run does not write again (those it writes below
        # replace the earlier ones: a symlinked folded/ or report/ keeps its link, and its target gets this run's)
        common.remove_earlier_outputs(out_dir, [*(["folded"] * (not args.fold)), *(["report"] * (not args.report)),
                                                history.name, "test_hypotheses.txt",
                                                "validation_hypotheses.txt", *([] if args.prune else [KEPT_FILE]),
                                                *([] if args.one_shot else [ONE_SHOT_FILE])])
        if sparsifier is not None:
            sparsifier.save_history(history)
        accelerator.print(f"sacreBLEU {metrics['bleu']}  ({metrics['bleu_signature']})")
        for s in eval_splits:
            (out_dir / f"{s}_hypotheses.txt").write_text("\n".join(hyps[s]) + "\n")
        save_final(raw, tokenizer, out_dir / "model", args)
        probe = {k: v.to(accelerator.device) for k, v in collate(evaluated[:16]).items() if k != "labels"}
        raw.eval()
        if args.fold:  # linear parts folded into the layers around them (a plain nn.Module, no units left)
            folded = linearize.fold(raw, probe)
            with common.replaced_dir(out_dir / "folded") as stage:  # never a half-written folded/
                linearize.save_folded(folded, stage, builder="plain", example_inputs=probe)
            metrics["fold"] = {**common.fold_metrics(folded, out_dir / "folded"), "ffn_macs_per_token": {
                "before": ffn_macs_per_token(raw), "after": ffn_macs_per_token(folded)}}
            if one_shot is not None:  # within half a channel per FFN of the budget (a hybrid plan: below it)
                check_budget(metrics["fold"]["ffn_macs_per_token"]["after"], budget, args.model_size,
                             below=args.one_shot == "hybrid")
        if args.report:
            linearize.report(raw, probe, tol=args.tol, max_samples=args.report_samples,
                             skip=[m for m in args.report_skip.split(",") if m],
                             history=history if history.exists() else None).save(out_dir / "report")
            metrics["report"] = str(out_dir / "report")
        if args.prune:
            whole = build().to(accelerator.device).eval()
            macs = {"before": ffn_macs_per_token(whole), "after": ffn_macs_per_token(raw),
                    "linearized_folded_at_target": budget}
            preset = PRESETS[args.model_size]
            if step > act_at:
                check_budget(macs["after"], budget, args.model_size)
            metrics["prune"] = {
                "importance": args.prune, "step": act_at, "channels_per_ffn": preset["ffn"],
                "kept_channels": {n: m.out_features for n, m in raw.named_modules() if n.endswith(".fc1")},
                "kept_indices": str(out_dir / KEPT_FILE), "ffn_macs_per_token": macs,
                "flops_before": linearize.count_flops(whole, probe), "flops_after": linearize.count_flops(raw, probe)}
        # last: a metrics.json of the whole schedule marks the run finished (recipes/reproduce's is_done), so a
        # run killed before its outputs are all written is resumed, never taken as finished without them
        common.write_metrics(out_dir, metrics, args, start_time, accelerator.num_processes, str(accelerator.device), run.earlier_s)
        accelerator.print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)}))
    if args.with_tracking:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return metrics


def save_final(model: nn.Module, tokenizer, directory: Path, args: argparse.Namespace) -> None:
    """HF weights + tokenizer, the linearize sidecar and ``recipe.json`` (with the size and sha256 of every
    other file, verified by :func:`load_model`)."""
    with common.writing(directory), common.replaced_dir(directory) as stage:  # all files replace the old ones
        model.save_pretrained(str(stage))
        tokenizer.save_pretrained(str(stage))
        if args.linearize != "none":
            linearize.save_pretrained(model, stage)
        meta = {"model_size": args.model_size, "source_lang": args.source_lang, "target_lang": args.target_lang,
                "linearize": args.linearize, "files": common.file_records(stage)}
        (stage / "recipe.json").write_text(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
