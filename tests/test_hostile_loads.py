"""Hostile cases of head/base loading, functional sites in folded saves, Sparsifier copies, recipe folder
recovery and integer tensors in average_path_length: each was a defect a second "break it" review found
(now fixed); each test states its truth. Small models only."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import linearize
from linearize import LoadError
from linearize.measures import average_path_length
from zoo import save_folded_functional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))

import common  # noqa: E402


class _Ids(nn.Module):
    """ids -> embedding -> linear -> ReLU (width 4) -> linear; ``prep`` turns the ids into the embedding
    input, ``mask`` (optional) gives a mask multiplied into the hidden state."""

    def __init__(self, prep, mask=None) -> None:
        super().__init__()
        self.prep, self.mask = prep, mask
        self.emb, self.f, self.act, self.o = nn.Embedding(10, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.act(self.f(self.emb(self.prep(ids))))
        if self.mask is not None:
            h = h * self.mask(ids).unsqueeze(-1)
        return self.o(h)


def test_apl_record_follows_ids_cast_with_long():
    """Truth: one all-nonlinear unit (initial slope 0) on the only path: APL 1.0 (as fx gives, and as
    ``record`` gives for ``ids.to(torch.long)``). Observed: ``ids.long()`` (and ``F.pad``, ``flip``,
    ``type``, ``index_select`` of the ids) drops the tag: ValueError 'no output tensor derives'."""
    ids = torch.randint(0, 10, (2, 5), dtype=torch.int32)
    model = linearize.convert(_Ids(lambda i: i.long()), example_inputs=ids)
    assert average_path_length(model, ids, method="fx") == 1.0  # the truth the other method gives
    assert average_path_length(model, ids, method="record") == 1.0


def test_apl_mask_from_ids_to_bool_is_a_constant():
    """Truth (module docstring: masks are constants): ``h * mask`` with a mask of the ids keeps the one
    path through the all-nonlinear unit, APL 1.0, as ``ids != 0`` and ``ids.bool()`` give. Observed:
    ``ids.to(torch.bool)`` is tagged as a layout op, the product merges with a 0-unit path: 0.5."""
    ids = torch.randint(0, 10, (2, 5))
    for mask in (lambda i: i != 0, lambda i: i.bool()):  # the same mask: a constant
        model = linearize.convert(_Ids(lambda i: i, mask), example_inputs=ids)
        assert average_path_length(model, ids, method="record") == 1.0
    model = linearize.convert(_Ids(lambda i: i, lambda i: i.to(torch.bool)), example_inputs=ids)
    assert average_path_length(model, ids, method="record") == 1.0


def test_apl_mask_shaped_like_the_ids_is_a_constant():
    """Truth: ``(ids != 0)`` is a constant mask (APL 1.0, as without the shape call); ``expand_as(ids)``,
    ``view_as(ids)``, ``to(ids)`` take only the shape/dtype of ``ids``, not its values. Observed: the
    layout op tags the mask with the ids' node, ``h * mask`` merges with a 0-unit path: 0.5."""
    ids = torch.randint(0, 10, (2, 5))
    for shaped in (lambda i: (i != 0).expand_as(i), lambda i: (i != 0).view_as(i), lambda i: (i != 0).to(i)):
        model = linearize.convert(_Ids(lambda i: i, shaped), example_inputs=ids)
        assert average_path_length(model, ids, method="record") == 1.0


def _shift_right(ids: torch.Tensor) -> torch.Tensor:
    """BART's ``shift_tokens_right``: the ids moved one place into a fresh buffer (decoder inputs)."""
    shifted = ids.new_zeros(ids.shape)
    shifted[:, 1:] = ids[:, :-1].clone()
    return shifted


def test_apl_record_follows_ids_shifted_right():
    """Truth: the shifted ids feed the only path, through one all-nonlinear unit: APL 1.0. ``__setitem__``
    only moves the ids (BART/T5 build decoder inputs this way). Observed: the integer result of
    ``__setitem__`` is not tagged: ValueError 'no output tensor of the model derives from the source'."""
    ids = torch.randint(0, 10, (2, 5))
    model = linearize.convert(_Ids(_shift_right), example_inputs=ids)
    assert average_path_length(model, ids, method="record") == 1.0


def _bert_config():
    hf = pytest.importorskip("transformers")
    return hf.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32)


def test_mlm_save_loads_into_token_classification(tmp_path):
    """Truth: BertForMaskedLM's ``bert.*`` units equal BertForTokenClassification's (transformers loads an
    MLM checkpoint into any head, the standard fine-tuning start); the loaded encoder reproduces the saved
    one's output. Observed: ValueError '1 site(s) differ ... cls.predictions...'."""
    hf = pytest.importorskip("transformers")
    x = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    mlm = linearize.convert(hf.BertForMaskedLM(_bert_config()).eval())
    torch.manual_seed(0)
    with torch.no_grad():
        for _, unit in linearize.units(mlm):
            unit.slope.uniform_(0, 1)
        ref = mlm.bert(input_ids=x).last_hidden_state
    mlm.save_pretrained(tmp_path)
    tok = linearize.from_pretrained(hf.BertForTokenClassification, tmp_path)
    with torch.no_grad():
        assert torch.equal(tok.eval().bert(input_ids=x).last_hidden_state, ref)


def test_second_model_from_the_same_config_object_converts():
    """Truth: ``GPT2Model(cfg)`` is a fresh plain model; converting it works whatever another model built
    from ``cfg`` went through. Observed: after ``convert(GPT2Model(cfg))`` the config object (shared, not
    copied, by transformers) is marked, and ``convert(GPT2Model(cfg))`` raises LoadError 'was saved after
    linearize.convert ... loaded by a plain from_pretrained' (neither happened)."""
    hf = pytest.importorskip("transformers")
    cfg = hf.GPT2Config(vocab_size=60, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    linearize.convert(hf.GPT2Model(cfg))
    second = linearize.convert(hf.GPT2Model(cfg))
    assert len(linearize.units(second)) == 1


def _edit_sites(tmp_path: Path, **args) -> None:
    meta = json.loads((tmp_path / "folded.json").read_text())
    entry = next(e for e in meta["modules"] if e["class"].endswith("FunctionalSites"))
    entry["args"].update(args)
    (tmp_path / "folded.json").write_text(json.dumps(meta))


def test_crafted_functional_channels_raise_load_error(tmp_path):
    """Truth (load_folded's contract: a damaged or crafted folded.json is a LoadError naming the file):
    ``channels: [[1], ...]`` is refused with LoadError. Observed: IndexError 'list index out of range'."""
    from zoo import FunctionalNet

    save_folded_functional(tmp_path)
    _edit_sites(tmp_path, channels=[[1]] * 3)
    with pytest.raises(LoadError):
        linearize.load_folded(tmp_path, base=FunctionalNet())


def test_functional_slots_must_name_their_children(tmp_path):
    """Truth: a record whose slots are all null while its children (relu_0, gelu_1, relu_2, with weights)
    are present does not describe the saved model: refused, or the loaded model computes the saved one.
    Observed: it loads, the children are never called, the output differs by ~0.14 from the model."""
    from zoo import FunctionalNet

    model, x = save_folded_functional(tmp_path)
    _edit_sites(tmp_path, slots=[None, None, None])
    try:
        loaded = linearize.load_folded(tmp_path, base=FunctionalNet())
    except LoadError:
        return
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=1e-5)


def test_shallow_copy_of_attached_sparsifier():
    """Truth: ``copy.copy`` of an object does not raise; the original stays the one attached (it still
    runs once per optimizer step). Observed: __setstate__ re-attaches the copy to the same optimizer and
    attach raises 'another Sparsifier is already attached'."""
    model = linearize.convert(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sparsifier = linearize.Sparsifier(model, total_steps=10).attach(optimizer)
    clone = copy.copy(sparsifier)
    assert clone is not sparsifier and sparsifier._hook is not None


def test_restore_aside_with_glob_characters_in_the_name(tmp_path, dead_pid):
    """Truth: a folder ``run[a]`` set aside as ``.tmp-run[a]-old-5`` by a killed replaced_dir is put
    back. Observed: ``glob('.tmp-run[a]-*')`` reads ``[a]`` as a character class: None, folder lost."""
    aside = tmp_path / f"{common.TMP_PREFIX}run[a]-old-{dead_pid}"
    aside.mkdir()
    (aside / "recipe.json").write_text("{}")
    assert common.restore_aside(tmp_path / "run[a]") == tmp_path / "run[a]"
    assert (tmp_path / "run[a]" / "recipe.json").is_file()


def test_read_recipe_json_through_a_symlink_after_a_kill(tmp_path, dead_pid):
    """Truth: replaced_dir(link) writes the link's target; killed between its two renames it leaves the
    target aside as ``.tmp-real-old-<pid>``; read_recipe_json(link) puts it back and reads it. Observed:
    the link is dangling, restore_aside(link) returns at ``is_symlink()``: FileNotFoundError."""
    real, link = tmp_path / "real", tmp_path / "model"
    real.mkdir()
    (real / "recipe.json").write_text('{"old": 1}')
    link.symlink_to(real)
    with common.replaced_dir(link) as stage:  # the resolved target is what gets replaced
        assert stage.name.startswith(f"{common.TMP_PREFIX}real-")
    (link / "recipe.json").write_text('{"old": 1}')
    real.rename(tmp_path / f"{common.TMP_PREFIX}real-old-{dead_pid}")  # the state a SIGKILL between the renames leaves
    assert common.read_recipe_json(link) == {"old": 1}


def test_checkpoint_written_after_a_clock_step_back_is_readable(tmp_path):
    """Truth: save_checkpoint writes an intact checkpoint that read_checkpoint accepts, whatever the wall
    clock did (time.time() steps back under NTP; here by 30 s after the process began, before its first
    checkpoint). Observed: elapsed_s = earlier_s + time.time() - started is -30 s, written as is, and the
    reader refuses it as 'damaged or was edited': no intact checkpoint to resume from."""
    from test_hostile import tiny_run

    run = tiny_run(tmp_path, keep=2)
    run.started += 30  # the same as time.time() now reading 30 s less than when the process began
    path = common.save_checkpoint(run, 10)
    assert common.read_checkpoint(path).elapsed_s >= 0


def test_reader_between_the_renames_of_a_live_save(tmp_path, monkeypatch):
    """Truth: a reader (read_recipe_json, e.g. an evaluation process) that looks while a save is between its
    two renames does not break that save: the new folder lands. ``.tmp-model-old-<pid>`` of a *running*
    process is not a leftover. Observed: the reader renames it back to ``model``, the writer's second
    rename fails, its fallback rename of the (gone) old folder raises, and the new model is deleted."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "recipe.json").write_text('{"v": "old"}')
    rename = Path.rename

    def rename_then_read(self, target):
        out = rename(self, target)
        if Path(target).name.startswith(f"{common.TMP_PREFIX}model-old-"):  # between the two renames
            with pytest.raises(FileNotFoundError):  # the reader finds no model for that instant, and says so
                common.read_recipe_json(directory)
        return out

    monkeypatch.setattr(Path, "rename", rename_then_read)
    with common.replaced_dir(directory) as stage:
        (stage / "recipe.json").write_text('{"v": "new"}')
    assert json.loads((directory / "recipe.json").read_text()) == {"v": "new"}


def test_recipe_json_missing_keys_named(tmp_path):
    """Truth (read_recipe_json: 'a clear error' naming the folder for a damaged save): a recipe.json that
    parses but lacks ``arch`` is refused with an error naming the file and the key. Observed: cifar's
    load_model raises ``KeyError: 'arch'``."""
    import cifar

    (tmp_path / "recipe.json").write_text('{"linearize": "none"}')
    with pytest.raises(ValueError, match="recipe.json"):
        cifar.load_model(tmp_path)
