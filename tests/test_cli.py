"""The console script: --help lists the subcommands, inspect prints the conversion plan, and no file a
user passes runs code unless --trust-pickle says so."""

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import linearize
from linearize.cli import main
from linearize.models import load_model
import argparse


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "linearize.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "inspect", "report"):
        assert command in out.stdout


def test_inspect_prints_the_sites_of_a_torchvision_model(capsys):
    assert main(["inspect", "resnet18"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("17 sites, 3904 channels converted")  # 64 + 4 * (64 + 128 + 256 + 512)
    assert "layer4.1.relu.calls.1" in out


def test_inspect_rejects_an_unknown_model(cli_refusal):
    assert "neither a Hugging Face model directory" in cli_refusal(["inspect", "no_such_model"])


@pytest.mark.parametrize("argv, says", [
    (["inspect", "{d}"], r"has no config.json: not a Hugging Face model directory"),
    (["inspect", "resnet18", "--example-inputs", "{d}/missing.safetensors"], r"missing.safetensors: no such file"),
    (["inspect", "resnet18", "--example-inputs", "{d}/junk.safetensors"], r"junk.safetensors is not a safetensors"),
    (["report", "resnet18", "--data", "{d}/nowhere"], r"--data .*nowhere: no such file or directory"),
    (["report", "resnet18", "--data", "{d}/empty.tar.gz"], r"empty.tar.gz: not a readable tar archive of images"),
    (["report", "{d}/mlp.pt", "--trust-pickle", "--data", "digits", "--history", "{d}/junk.json"],
     r"sparsifier history .*junk.json.*not an integer"),
    (["report", "--compare", "{d}/nowhere"], r"nowhere has no metrics.json"),
])
def test_files_that_cannot_be_read_are_one_line_errors_naming_them(tmp_path, cli_refusal, argv, says):
    """A file or folder the command was given that cannot be read is named in one line, exit status 2."""
    (tmp_path / "junk.safetensors").write_text("garbage")
    (tmp_path / "junk.json").write_text('{"bogus": 1}')
    (tmp_path / "empty.tar.gz").write_bytes(b"")
    torch.save(nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10)), tmp_path / "mlp.pt")
    argv = [a.format(d=tmp_path) for a in argv] + (["--output-dir", str(tmp_path / "out")] if argv[0] == "report"
                                                      and "--compare" not in argv else [])
    assert re.search(says, cli_refusal(argv))


def _cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _as_bin(folder: Path) -> Path:
    """The folder's weights moved from model.safetensors to pytorch_model.bin (torch.save of the same tensors)."""
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder / "pytorch_model.bin"


@pytest.mark.parametrize("damage", ["safetensors cut in half", "safetensors header", "bin cut in half",
                                    "bin holding an object", "bin empty"])
@pytest.mark.parametrize("command", ["inspect", "report"])
def test_a_damaged_hugging_face_weights_file_is_a_one_line_error_naming_it(tmp_path, text_model, cli_refusal, damage,
                                                                          command):
    """An interrupted download or copy, a damaged header, a .bin torch.load(weights_only=True) refuses: one line
    naming the weights file, exit status 2 (not a safetensors / unpickler traceback); the intact folder loads."""
    folder = Path(shutil.copytree(text_model, tmp_path / "model"))
    weights = folder / "model.safetensors" if damage.startswith("safetensors") else _as_bin(folder)
    argv = ["inspect", str(folder)] if command == "inspect" else \
        _report_on(folder, tmp_path / "texts.jsonl", tmp_path / "out", "--max-length", "8", "--segments", "0")
    (tmp_path / "texts.jsonl").write_text('{"text": "a b"}\n{"text": "c d"}\n')
    assert main(argv) == 0  # the intact folder
    if damage.endswith("cut in half"):
        _cut_in_half(weights)
    elif damage == "safetensors header":
        weights.write_bytes(weights.read_bytes()[:8] + b"{{{{" + weights.read_bytes()[12:])
    elif damage == "bin empty":
        weights.write_bytes(b"")
    else:
        torch.save({"w": WritesMarker(tmp_path / "marker")}, weights)
    line = cli_refusal(argv)
    assert f"error: {weights}: not a readable weights file (" in line and "save the model again" in line, line
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_a_damaged_shard_of_a_sharded_hugging_face_save_is_named(tmp_path, cli_refusal, safe):
    """A sharded save with one shard cut short (an interrupted download): the error used to name the intact
    index (model.safetensors.index.json), so the user downloaded the wrong file again. Truth: the shard cut here."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32)
    folder = tmp_path / "model"
    transformers.BertModel(cfg).save_pretrained(folder, max_shard_size="20KB")
    if not safe:  # transformers 5 writes safetensors only: the same shards torch.save'd, and their index
        from safetensors.torch import load_file

        index = json.loads((folder / "model.safetensors.index.json").read_text())
        for shard in sorted(folder.glob("model-*.safetensors")):
            torch.save(load_file(shard), folder / f"pytorch_{shard.stem}.bin")
            shard.unlink()
        index["weight_map"] = {k: "pytorch_" + v.replace("safetensors", "bin") for k, v in index["weight_map"].items()}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
        (folder / "model.safetensors.index.json").unlink()
    shards = sorted(folder.glob("model-*.safetensors" if safe else "pytorch_model-*.bin"))
    assert len(shards) == 3 and main(["inspect", str(folder)]) == 0  # the intact folder
    _cut_in_half(shards[1])
    line = cli_refusal(["inspect", str(folder)])
    assert f"error: {shards[1]}: not a readable weights file (" in line, line


# ----------------------------------------------------------------------------- no code runs from user files


class WritesMarker:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for any code a crafted file could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def crafted(tmp_path: Path, writer: str) -> tuple[Path, Path]:
    """``(file, marker)``: a ``.pt`` file whose unpickling creates ``marker``."""
    marker, path = tmp_path / "marker", tmp_path / "model.pt"
    if writer == "torch.save":  # the zip format torch.save writes
        torch.save(WritesMarker(marker), path)
    else:  # a plain pickle stream (torch.load's legacy format)
        path.write_bytes(pickle.dumps(WritesMarker(marker)))
    return path, marker


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
@pytest.mark.parametrize("command", ["inspect", "report", "report --checkpoint", "load_model"])
def test_a_crafted_pickle_runs_no_code(tmp_path, cli_refusal, command, writer):
    path, marker = crafted(tmp_path, writer)
    out = tmp_path / "out"
    label = re.escape(f"--checkpoint {path}" if "checkpoint" in command else str(path))
    refused = rf"{label}: refused to unpickle it.*pass --trust-pickle"
    if command == "load_model":
        with pytest.raises(linearize.LoadError, match=refused):
            load_model(path)
    else:
        argv = {"inspect": ["inspect", str(path)],
                "report": ["report", str(path), "--data", "digits", "--output-dir", str(out)],
                "report --checkpoint": ["report", "resnet18", "--checkpoint", str(path), "--data", "digits",
                                        "--output-dir", str(out)]}[command]
        assert re.search(refused, cli_refusal(argv))
    assert not marker.exists() and not out.exists()


def test_the_console_script_refuses_a_crafted_pickle(tmp_path):
    path, marker = crafted(tmp_path, "torch.save")
    run = subprocess.run([sys.executable, "-m", "linearize.cli", "inspect", str(path)], capture_output=True,
                         text=True, cwd=tmp_path)
    assert run.returncode != 0 and "--trust-pickle" in run.stderr and str(path) in run.stderr
    assert not marker.exists()
    torch.load(path, weights_only=False).close()  # the control: a full unpickle of this file does run its code
    assert marker.exists()


def test_trust_pickle_loads_a_pickled_module(tmp_path, capsys, cli_refusal):
    path = tmp_path / "mlp.pt"
    torch.save(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)), path)
    refused = rf"{re.escape(str(path))}: refused to unpickle it.*GLOBAL torch.nn.modules.container.Sequential"
    assert re.search(refused + ".*pass --trust-pickle", cli_refusal(["inspect", str(path)]))
    assert main(["inspect", str(path), "--trust-pickle"]) == 0
    assert capsys.readouterr().out.startswith("1 sites, 6 channels converted")
    assert isinstance(load_model(path, trust_pickle=True), nn.Sequential)
    torch.save(nn.Linear(4, 2).state_dict(), path)  # tensors only: still read without the flag
    with pytest.raises(TypeError, match=rf"{re.escape(str(path))} holds a \w+, not a pickled nn.Module"):
        load_model(path)



def test_input_shape_refuses_absurd_sizes_before_allocating():
    import argparse

    from linearize.cli import input_shape

    assert input_shape("1,3,224,224") == (1, 3, 224, 224)
    for text, why in (("100000,3,224,224", r"15,052,800,000 values"), ("1,1,1,1,1,1,1,1,1", r"in 9 dims"),
                      ("0,3", "positive sizes"), ("a,b", "positive sizes")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            input_shape(text)


def test_the_demo_runs_on_the_threads_asked_and_restores_torchs(monkeypatch):
    import torch

    import linearize.demo as demo

    seen = []
    monkeypatch.setattr(demo, "_run_demo", lambda *a: seen.append(torch.get_num_threads()) or {})
    before = torch.get_num_threads()
    main(["demo", "--epochs", "1"])
    main(["demo", "--epochs", "1", "--threads", "2"])
    assert seen == [1, 2] and torch.get_num_threads() == before


@pytest.mark.parametrize("bad", ["slope 3", "slope -1", "frozen 0.5", "frozen off its slope"])
def test_report_checkpoint_with_invalid_unit_state_is_refused(tmp_path, bad):
    """``linearize report MODEL --checkpoint FILE`` loads a state_dict a user passes: slopes outside
    [0, 1] (counted as linear: a >= 1 - tol) or a broken frozen buffer must be refused like
    linearize.from_pretrained refuses them, not reported on."""
    from linearize.cli import report as cli_report

    model = torch.nn.Sequential(torch.nn.Linear(64, 20), torch.nn.ReLU(), torch.nn.Linear(20, 10))
    torch.save(model, tmp_path / "mlp.pt")
    linearize.convert(model, example_inputs=torch.randn(2, 64))
    state = model.state_dict()
    (slope,) = [k for k in state if k.endswith(".slope")]
    frozen = slope[: -len("slope")] + "frozen"
    if bad == "slope 3":
        state[slope][0] = 3.0
    elif bad == "slope -1":
        state[slope][1] = -1.0
    elif bad == "frozen 0.5":
        state[frozen][2] = 0.5
    else:
        state[frozen][3], state[slope][3] = 1.0, 0.2
    torch.save(state, tmp_path / "ckpt.pt")
    parser = argparse.ArgumentParser(prog="linearize")
    cli_report.register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(tmp_path / "mlp.pt"), "--trust-pickle", "--checkpoint",
                              str(tmp_path / "ckpt.pt"), "--data", "digits", "--num-samples", "16", "--segments",
                              "0", "--output-dir", str(tmp_path / "out"), "--no-progress"])
    with pytest.raises(linearize.LoadError, match=r"--checkpoint .*ckpt.pt: unit '1'"):
        args.func(args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("other, says", [
    ("head size", r"\(2 tensor\(s\) of another shape, e.g. 2.weight \[5, 8\] vs \[10, 8\]\)"),
    ("architecture", r"2 key\(s\) missing, e.g. 2.weight; 2 unexpected key\(s\), e.g. 1.weight"),
])
def test_a_checkpoint_of_another_head_or_architecture_is_a_one_line_error(tmp_path, cli_refusal, other, says):
    """A valid state_dict that does not fit MODEL (trained with another number of classes, or of another
    architecture): one line naming --checkpoint, the mismatch and the fix, exit 2, not load_state_dict's traceback.
    Truth: the shapes and keys of the two models built here."""
    torch.save(nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10)), tmp_path / "mlp.pt")
    ckpt = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 5)) if other == "head size" else \
        nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 10))
    torch.save(ckpt.state_dict(), tmp_path / "ckpt.pt")
    line = cli_refusal(["report", str(tmp_path / "mlp.pt"), "--trust-pickle", "--checkpoint", str(tmp_path / "ckpt.pt"),
                        "--data", "digits", "--output-dir", str(tmp_path / "out")])
    assert f"--checkpoint {tmp_path / 'ckpt.pt'} does not fit {tmp_path / 'mlp.pt'} (" in line, line
    assert re.search(says, line) and line.endswith("pass the MODEL (and --num-classes) it was trained with"), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_checkpoint_that_is_a_folder_or_fifo_is_named_as_such(tmp_path, cli_refusal, kind):
    """``--checkpoint`` naming a folder (a recipe's ``step_N/``) or a FIFO: the path exists, so the error says what
    it is, where it said 'no such file'; nothing waits on the FIFO."""
    torch.save(nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10)), tmp_path / "mlp.pt")
    ckpt = tmp_path / "step_3.pt"
    ckpt.mkdir() if kind == "folder" else os.mkfifo(ckpt)
    line = cli_refusal(["report", str(tmp_path / "mlp.pt"), "--trust-pickle", "--checkpoint", str(ckpt), "--data",
                        "digits", "--output-dir", str(tmp_path / "out")])
    what = "a folder" if kind == "folder" else "not a regular file (a FIFO"
    assert f"{ckpt} is {what}" in line and "where a --checkpoint file" in line and "no such file" not in line, line


@pytest.mark.parametrize("argv, why", [
    (["demo", "--epochs", "0"], r"--epochs must be an int from 1 to 10000, got 0"),
    (["demo", "--epochs", "-3"], r"--epochs must be an int from 1 to 10000, got -3"),
    (["demo", "--threads", "0"], r"--threads must be an int from 1 to 1024, got 0"),
    (["demo", "--target", "0"], r"--target must lie in \(0, 1\], got 0"),
    (["demo", "--target", "1.5"], r"--target must lie in \(0, 1\], got 1.5"),
    (["demo", "--target", "nan"], r"--target must be a finite number"),
    (["report", "resnet18", "--data", "digits", "--num-classes", "0"], r"--num-classes must be an int from 1 to 100000, got 0"),
    (["report", "resnet18", "--data", "digits", "--num-classes", "100000000000"], r"--num-classes must be an int from 1 to 100000, got 100000000000"),
    (["demo", "--threads", "3000000000"], r"--threads must be an int from 1 to 1024, got 3000000000"),
    (["demo", "--seed", "-1"], r"--seed must be an int from 0 to 4294967295, got -1"),
    (["demo", "--epochs", "10000000000"], r"--epochs must be an int from 1 to 10000"),
])
def test_numbers_out_of_range_are_usage_errors_before_anything_runs(monkeypatch, capsys, argv, why):
    import linearize.demo as demo

    monkeypatch.setattr(demo, "_run_demo", lambda *a: pytest.fail("the demo ran"))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and re.search(why, capsys.readouterr().err)


@pytest.mark.parametrize("argv, given", [
    (["inspect", "resnet18", "--input-shape", "1,5,32,32"], r"--input-shape 1,5,32,32, Tensor\(1, 5, 32, 32\)"),
    (["inspect", "resnet18", "--input-shape", "1,3"], r"--input-shape 1,3, Tensor\(1, 3\)"),
    (["report", "resnet18", "--data", "digits"], r"--data digits, Tensor\(2, 1, 8, 8\)"),
])
def test_a_model_that_fails_on_the_input_of_its_flags_is_named_with_the_flags(tmp_path, capsys, argv, given):
    """One line naming the model, the flag and the input, with the fix; no traceback, exit status 2."""
    assert main(argv + (["--output-dir", str(tmp_path)] if argv[0] == "report" else [])) == 2
    err = capsys.readouterr().err
    assert re.search(rf"^linearize {argv[0]}: error: the model resnet18 \(ResNet\) fails on the input of {given}: "
                     r"RuntimeError: .*channels|RuntimeError: .*input", err)
    assert re.search(given, err) and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_console_script_prints_no_traceback_for_a_bad_input_shape():
    out = subprocess.run([sys.executable, "-m", "linearize.cli", "inspect", "resnet18", "--input-shape", "2,1,16,16"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "--input-shape 2,1,16,16" in out.stderr


class _Failing(nn.Module):
    """A model whose forward fails on every input, with the error ``error``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.fc, self.error = nn.Linear(4, 2), error

    def forward(self, x):
        raise self.error


def test_only_errors_of_the_kind_a_wrong_input_raises_are_blamed_on_the_flags(monkeypatch):
    """A bug in the model (NameError) or out of memory keeps its own traceback; an input error's message is
    flattened to the one line the CLI promises."""
    import linearize.cli as cli
    from linearize.cli.readers import check_model_takes

    for error in (NameError("name 'scale' is not defined"), torch.OutOfMemoryError("CUDA out of memory"),
                  MemoryError(), KeyboardInterrupt(), RecursionError("maximum recursion depth exceeded"),
                  NotImplementedError('Module [Net] is missing the required "forward" function'),
                  RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")):
        with pytest.raises(type(error)):
            check_model_takes(_Failing(error), torch.randn(1, 4), "m.pt", "--input-shape 1,4", "fix it")
    with pytest.raises(cli.InputMismatch) as err:
        check_model_takes(_Failing(RuntimeError("shapes\n  (1x4)\n and (3x2)")), torch.randn(1, 4), "m.pt",
                          "--input-shape 1,4", "fix it")
    assert "\n" not in str(err.value) and "RuntimeError: shapes (1x4) and (3x2); fix it" in str(err.value)


@pytest.mark.parametrize("name", ["", " "])
def test_a_blank_model_name_is_a_one_line_error(cli_refusal, name):
    assert repr(name) in cli_refusal(["inspect", name])


# ----------------------------------------------------------------------------- JSONL text data


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> Iterator[Path]:
    """A Hugging Face model directory: a tiny BERT classifier and a word-level tokenizer (lowercase letters)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("text_model")
    vocab = {"[PAD]": 0, "[UNK]": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                         pad_token="[PAD]").save_pretrained(directory)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    transformers.BertForSequenceClassification(cfg).save_pretrained(directory)
    transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar: stderr holds the refusal alone
    yield directory
    transformers.utils.logging.enable_progress_bar()


def _report_on(model: Path, data: Path, out: Path, *flags: str) -> list[str]:
    return ["report", str(model), "--data", str(data), "--output-dir", str(out), "--num-samples", "2",
            "--no-progress", *flags]


def _opens_write_end_once_read(fifo: Path, stop: threading.Event) -> None:
    """Open the write end of ``fifo`` as soon as a reader waits on it, and close it: a reader blocked in ``open``
    then reads an empty file, so a test of a reader that waits on FIFOs fails instead of hanging."""
    while not stop.wait(0.05):
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while no reader has it open
            return
        except OSError:
            pass


@pytest.mark.parametrize("kind", ["fifo", "link to a device", "folder"])
def test_jsonl_data_that_is_no_regular_file_is_refused_without_waiting(tmp_path, text_model, cli_refusal, kind):
    """``--data x.jsonl`` that is a FIFO (opening it for reading would wait for a writer forever), a link to a
    device, or a folder: one line naming it, nothing read, no report written."""
    path = tmp_path / "texts.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to(os.devnull)
    stop = threading.Event()
    unblock = threading.Thread(target=_opens_write_end_once_read, args=(path, stop), daemon=True)
    if kind == "fifo":
        unblock.start()
    try:
        err = cli_refusal(_report_on(text_model, path, tmp_path / "out"))
    finally:
        stop.set()
    what = "a folder" if kind == "folder" else r"not a regular file \(a FIFO, device or socket\)"
    assert re.search(rf"error: {re.escape(str(path))} is {what}: refusing to read it; --data takes a JSONL", err)
    assert not (tmp_path / "out").exists()


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that Python's parser cannot nest into


@pytest.mark.parametrize("record, flags, problem", [
    ('{"title": "a b"}', [], r"no text field in the record \(its keys: \['title'\]\): pass --text-field"),
    ('{"text": "a b"}', ["--text-field", "body.en"], r"no field 'body.en' in the record \(its keys: \['text'\]\)"),
    ("42", [], r"a JSON int, not an object"),
    ('["a b"]', [], r"a JSON list, not an object"),
    ('{"text": 5}', [], r"its field 'text' holds a JSON int, not a string"),
    ('{"body": {"en": null}}', ["--text-field", "body.en"], r"its field 'body.en' holds a JSON NoneType, not a string"),
    ('{"text": ["a", "b"]}', ["--text-field", "text"], r"its field 'text' holds a JSON list, not a string"),
    ('{"text": {"en": "a"}}', ["--text-field", "text"], r"its field 'text' holds a JSON dict, not a string"),
    ('{"translation": "a b"}', [], r"no text field in the record"),
    ('{"text": "a b"', [], r"not valid JSON \(Expecting"),
    (DEEP, [], r"not valid JSON for this reader: it nests deeper than Python can parse"),
    ('{"text": "a", "id": ' + "9" * 5000 + "}", [], r"not valid JSON for this reader: it holds an integer of more "
                                                    r"than 4,300 digits"),
    (b'{"text": "\xff"}', [], r"not valid JSON \('utf-8' codec can't decode"),
])
def test_jsonl_records_not_of_the_expected_form_are_one_line_errors_naming_the_line(tmp_path, text_model, cli_refusal,
                                                                                     record, flags, problem):
    """A record that is not one JSON object with its text in the expected field: one line naming the file, the
    line (a blank line counted) and the form a record takes; exit status 2, no report written."""
    path = tmp_path / "texts.jsonl"
    first = b'{"text": "a b c", "body": {"en": "c d"}}\n\n'
    path.write_bytes(first + (record if isinstance(record, bytes) else record.encode()) + b"\n")
    err = cli_refusal(_report_on(text_model, path, tmp_path / "out", *flags))
    assert re.search(rf"error: {re.escape(str(path))}, line 3: {problem}.*; a JSONL record is one JSON object per line "
                     r"with its text in a field: text, sentence or translation.en, or the field --text-field names$",
                     err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_jsonl_blank_lines_are_skipped_in_bulk_within_seconds(tmp_path, text_model, monkeypatch, end):
    """A small .gz of 16 M blank lines between its records (LF, CR LF or CR: a gzip bomb of blank lines) is read in
    seconds, where a Python turn per line took ~1-4 us each: the texts written, an error naming the line a split at
    every line end gives; and refused as fast, naming the file and the limit, when those lines take more than
    MAX_TEXT_BYTES."""
    import gzip
    import time

    from transformers import AutoTokenizer

    from linearize.cli import build_parser, readers

    blanks = 2**24
    path = tmp_path / "texts.jsonl.gz"
    args = build_parser().parse_args(_report_on(text_model, path, tmp_path / "out", "--max-length", "8"))
    for second in (b'{"sentence": "d e"}', b"[1]"):
        with gzip.open(path, "wb", compresslevel=9) as f:
            f.write(b'{"text": "a b c"}' + end * blanks + second + end)
        start = time.monotonic()
        if second == b"[1]":
            with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}, line {blanks + 1}: a JSON list"):
                readers.load_data(args, None, text_model)
        else:
            expected = AutoTokenizer.from_pretrained(text_model)(["a b c", "d e"], padding="max_length",
                                                                 max_length=8, return_tensors="pt")
            assert torch.equal(readers.load_data(args, None, text_model)["input_ids"], expected["input_ids"])
        assert time.monotonic() - start < 8
    monkeypatch.setattr(readers, "MAX_TEXT_BYTES", blanks // 2)
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: more than {blanks // 2:,} bytes read before"):
        readers.load_data(args, None, text_model)
    assert time.monotonic() - start < 8


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_jsonl_records_end_at_any_line_end(tmp_path, text_model, cli_refusal, end):
    """Unix, Windows and old-Mac line ends (a CR alone) give the same texts; an error names the same line."""
    from transformers import AutoTokenizer

    from linearize.cli import build_parser, readers

    path = tmp_path / "texts.jsonl"
    path.write_bytes(end.join([b'{"text": "a b c"}', b"", b'{"sentence": "d e"}', b""]))
    args = build_parser().parse_args(_report_on(text_model, path, tmp_path / "out", "--max-length", "8"))
    expected = AutoTokenizer.from_pretrained(text_model)(["a b c", "d e"], padding="max_length", max_length=8,
                                                         return_tensors="pt")
    assert torch.equal(readers.load_data(args, None, text_model)["input_ids"], expected["input_ids"])
    path.write_bytes(end.join([b'{"text": "a b c"}', b"", b"[1]", b""]))
    assert re.search(rf"error: {re.escape(str(path))}, line 3: a JSON list, not an object",
                     cli_refusal(_report_on(text_model, path, tmp_path / "out")))


@pytest.mark.parametrize("name", ["texts.jsonl", "texts.jsonl.gz"])
def test_jsonl_reading_stops_after_the_records_used_and_at_the_byte_budget(tmp_path, text_model, cli_refusal,
                                                                             monkeypatch, name):
    """The first --num-samples records are read, whatever follows them (here a line without end); records that
    take more than MAX_TEXT_BYTES before that many are read (a line without end, a gzip bomb of newlines) are
    refused naming the file. The texts read are those written: the tokenizer's own encoding of them."""
    import gzip

    from transformers import AutoTokenizer

    from linearize.cli import build_parser, readers

    monkeypatch.setattr(readers, "MAX_TEXT_BYTES", 1000)
    path = tmp_path / name
    write = gzip.open if name.endswith(".gz") else open
    with write(path, "wt") as f:
        f.write('{"text": "a b c"}\n{"sentence": "d e"}\n' + "x" * 5000)
    args = build_parser().parse_args(_report_on(text_model, path, tmp_path / "out", "--max-length", "8"))
    batch = readers.load_data(args, None, text_model)
    expected = AutoTokenizer.from_pretrained(text_model)(["a b c", "d e"], padding="max_length", max_length=8,
                                                         return_tensors="pt")
    assert torch.equal(batch["input_ids"], expected["input_ids"])
    for body in ('{"text": "a b c"}\n' + "x" * 5000, "\n" * 10**6):
        with write(path, "wt") as f:
            f.write(body)
        assert re.search(rf"error: {re.escape(str(path))}: more than 1,000 bytes read before its first 2 records",
                         cli_refusal(_report_on(text_model, path, tmp_path / "out")))
