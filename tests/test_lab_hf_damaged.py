"""A damaged Hugging Face model folder is one line, before any work, in ``lab``, ``lab eval`` and
``lab sample`` (issue 40): null or string fields, heads that key/value heads do not divide, zero
heads, a config that does not match the weights, truncated, empty or random ``model.safetensors``,
a ``fasttrain.json`` that is not an object; an encoder (BERT) is refused as a causal LM."""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests_support import run_cli, toy_text  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama with weights, the text to train it on, and a lab-saved copy (fasttrain.json)."""
    root = tmp_path_factory.mktemp("hf")
    (root / "t.txt").write_text(toy_text(6000))
    config = transformers.LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "good")
    return root


def _damaged(root, name, *, config=None, weights=None, record=None, source="good"):
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(root / source, folder)
    if config is not None:
        data = json.loads((folder / "config.json").read_text())
        data.update(config)
        (folder / "config.json").write_text(json.dumps(data))
    if weights is not None:
        path = folder / "model.safetensors"
        path.write_bytes(weights(path.read_bytes()))
    if record is not None:
        (folder / "fasttrain.json").write_text(record)
    return folder


DAMAGES = [
    ("null_heads", dict(config={"num_attention_heads": None}), "num_attention_heads must be a positive integer, got null"),
    ("string_width", dict(config={"hidden_size": "32"}), 'hidden_size must be a positive integer, got "32"'),
    ("kv_3", dict(config={"num_key_value_heads": 3}), r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"),
    ("zero_heads", dict(config={"num_attention_heads": 0}), "num_attention_heads must be a positive integer, got 0"),
    ("other_ffn", dict(config={"intermediate_size": 96}), "config.json does not match the weights"),
    ("truncated", dict(weights=lambda b: b[:1000]), "not a readable safetensors file"),
    ("empty", dict(weights=lambda b: b""), "not a readable safetensors file"),
    ("random", dict(weights=lambda b: os.urandom(4096)), "not a readable safetensors file"),
]


def _one_line(code, stderr, pattern):
    import re

    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    assert "Traceback" not in stderr and re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("name,damage,pattern", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_a_damaged_model_folder_is_one_line_before_training(folders, capsys, name, damage, pattern, monkeypatch):
    import fasttrain.lab.data as data

    def no_corpus(*a, **k):
        raise AssertionError("the corpus was read before the model folder was checked")
    monkeypatch.setattr(data, "corpus_for", no_corpus)
    folder = _damaged(folders, name, **damage)
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--model", f"hf:{folder}", "--train-file",
                               str(folders / "t.txt"), "--max-steps", "1", "--device", "cpu", "--quiet"], capsys)
    _one_line(code, stderr, pattern)


def test_an_encoder_config_is_refused_as_a_causal_lm(folders, capsys):
    """BERT trained as a causal LM (bidirectional attention: it sees the tokens it predicts)."""
    transformers.BertConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64).save_pretrained(folders / "bert")
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--model", f"hf:{folders / 'bert'}", "--train-file",
                               str(folders / "t.txt"), "--max-steps", "1", "--device", "cpu", "--quiet"], capsys)
    _one_line(code, stderr, "model_type 'bert' is an encoder")


@pytest.fixture(scope="module")
def saved(folders):
    """The tiny Llama trained two steps by the lab and saved (config.json, weights, fasttrain.json)."""
    from fasttrain.lab.config import preset
    from fasttrain.lab.train import run

    run(preset("tiny", model=f"hf:{folders / 'good'}", train_file=str(folders / "t.txt"), max_steps=2,
               device="cpu", context=16, eval_interval=0, save=str(folders / "saved")))
    return folders


SAVED_DAMAGES = [
    ("list_record", dict(record="[1, 2]"), "fasttrain.json: must be a JSON object"),
    ("string_record", dict(record='"hello"'), "fasttrain.json: must be a JSON object"),
    ("s_null_heads", dict(config={"num_attention_heads": None}), "num_attention_heads must be a positive integer"),
    ("s_truncated", dict(weights=lambda b: b[:500]), "not a readable safetensors file"),
    ("s_other_width", dict(config={"intermediate_size": 128}), "config.json does not match the weights"),
]


@pytest.mark.parametrize("command", ["eval", "sample"])
@pytest.mark.parametrize("name,damage,pattern", SAVED_DAMAGES, ids=[d[0] for d in SAVED_DAMAGES])
def test_a_damaged_saved_folder_is_one_line_in_eval_and_sample(saved, capsys, command, name, damage, pattern):
    folder = _damaged(saved, name, source="saved", **damage)
    args = ["lab", "eval", str(folder), "--device", "cpu"] if command == "eval" else \
        ["lab", "sample", str(folder), "--prompt", "the ", "--device", "cpu", "--max-new-tokens", "2"]
    code, _, stderr = run_cli(args, capsys)
    _one_line(code, stderr, pattern)


def test_a_damaged_model_folder_under_ddp_is_one_line_before_the_launch(folders, capsys, monkeypatch):
    """Under DDP each rank printed its own traceback; the launcher refuses before starting any."""
    from fasttrain.lab.parallel import launch as L

    def no_launch(*a, **k):
        raise AssertionError("torchrun was started")
    monkeypatch.setattr(L, "launch", no_launch)
    folder = _damaged(folders, "ddp_kv", config={"num_key_value_heads": 3})
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--model", f"hf:{folder}", "--train-file",
                               str(folders / "t.txt"), "--max-steps", "1", "--device", "cpu", "--quiet",
                               "--strategy", "ddp", "--nproc-per-node", "2"], capsys)
    _one_line(code, stderr, r"num_key_value_heads \(3\) must divide")
