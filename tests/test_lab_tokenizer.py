"""The lab's tokenizers: characters (over 256 of them), a byte-level BPE trained here (loadable by
``hf:DIR`` and by transformers), tiktoken's offline and missing cases, and describe/load round trips."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from tests_support import run_cli, toy_text
from fasttrain.errors import FasttrainError
from fasttrain.lab import tokenizer as T

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    (root / "text.txt").write_text(toy_text() + "Ünïcödé ✓ 漢字\n")
    T.train_bpe(root / "text.txt", 320, root / "tok")
    return root / "tok"


def test_char_tokenizer_over_256_symbols_uses_wide_ids():
    text = "".join(chr(0x400 + i) for i in range(300)) * 2 + "ab"
    tok = T.CharTokenizer.fit(text)
    ids = tok.encode(text)
    assert tok.vocab_size == 302 and ids.dtype == np.uint16 and tok.decode(ids) == text
    again = T.load_tokenizer(json.loads(json.dumps(tok.describe())))
    assert again.chars == tok.chars and np.array_equal(again.encode(text), ids)
    with pytest.raises(FasttrainError, match="not in the corpus vocabulary"):
        tok.encode("z")


def test_id_dtype_is_the_narrowest_that_holds_the_vocabulary():
    assert T.id_dtype(256) == np.uint8 and T.id_dtype(257) == np.uint16
    assert T.id_dtype(65536) == np.uint16 and T.id_dtype(65537) == np.int32


def test_bpe_folder_loads_through_hf_and_transformers(bpe_dir):
    tok = T.load_tokenizer_spec(f"hf:{bpe_dir}")
    text = "the king shall speak, Ünïcödé ✓ 漢字 and unseen: Ω"
    ids = tok.encode(text)
    assert 256 < tok.vocab_size <= 320 and tok.decode(ids) == text and ids.max() < tok.vocab_size
    assert len(tok.encode("the king shall speak")) < len("the king shall speak")      # merges learned
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(bpe_dir), local_files_only=True)
    for other in (fast, auto):
        assert other.encode(text, add_special_tokens=False) == ids.tolist()
    assert auto.eos_token == T.END_OF_TEXT
    same = T.load_tokenizer_spec(f"hf:{bpe_dir / 'tokenizer.json'}")
    assert np.array_equal(same.encode(text), ids)


def test_hf_description_and_checkpoint_folder_round_trip(bpe_dir, tmp_path):
    tok = T.load_tokenizer_spec(f"hf:{bpe_dir}")
    desc = json.loads(json.dumps(tok.describe()))
    assert desc["kind"] == "hf" and desc["vocab_size"] == tok.vocab_size and len(desc["sha256"]) == 64
    ck = tmp_path / "ck"
    ck.mkdir()
    T.save_tokenizer(tok, ck)
    desc_elsewhere = {**desc, "path": str(tmp_path / "gone")}        # the original folder moved away
    again = T.load_tokenizer(desc_elsewhere, ck)
    assert np.array_equal(again.encode(toy_text(500)), tok.encode(toy_text(500)))
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoTokenizer.from_pretrained(str(ck), local_files_only=True).encode(
        "the king", add_special_tokens=False) == tok.encode("the king").tolist()
    with pytest.raises(FasttrainError, match="is not the one recorded"):
        T.load_tokenizer({**desc, "sha256": "0" * 64}, ck)


def test_long_texts_are_encoded_in_pieces_that_decode_back(bpe_dir, monkeypatch):
    tok = T.load_tokenizer_spec(f"hf:{bpe_dir}")
    text = toy_text(5000)
    monkeypatch.setattr(T, "CHUNK_CHARS", 700)
    assert len(T._pieces(text)) > 5 and "".join(T._pieces(text)) == text
    assert tok.decode(tok.encode(text)) == text


def test_tiktoken_missing_or_offline_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(FasttrainError, match="needs tiktoken: pip install tiktoken"):
        T.load_tokenizer_spec("tiktoken:gpt2")

    def offline(name):
        raise ConnectionError("no route to host")
    fake = types.SimpleNamespace(list_encoding_names=lambda: ["gpt2", "cl100k_base"], get_encoding=offline)
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    with pytest.raises(FasttrainError, match="needs to download the gpt2 encoding.*offline"):
        T.load_tokenizer_spec("tiktoken:gpt2")
    with pytest.raises(FasttrainError, match="unknown tiktoken encoding 'nope'"):
        T.load_tokenizer_spec("tiktoken:nope")


def test_tiktoken_encoding_in_its_cache_tokenizes():
    tiktoken = pytest.importorskip("tiktoken")
    try:
        tiktoken.get_encoding("gpt2")
    except Exception:
        pytest.skip("tiktoken's gpt2 encoding is not cached here (offline)")
    tok = T.load_tokenizer_spec("tiktoken:gpt2")
    assert tok.vocab_size == 50257 and tok.decode(tok.encode("hello world")) == "hello world"
    assert T.load_tokenizer(tok.describe()).vocab_size == 50257


def test_cli_trains_a_tokenizer(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(toy_text())
    out = tmp_path / "tok"
    code, stdout, stderr = run_cli(["lab", "tokenizer", "train", "--vocab-size", "300", "--train-file",
                                    str(tmp_path / "t.txt"), "--out", str(out)], capsys)
    assert code == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert f"--tokenizer hf:{out}" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt", "tok"]       # no temporary left


@pytest.mark.parametrize("args,message", [
    (["--vocab-size", "100", "--train-file", "{tmp}/t.txt", "--out", "{tmp}/new"], "--vocab-size must be at least 257"),
    (["--vocab-size", "300", "--train-file", "{tmp}/missing.txt", "--out", "{tmp}/new"], "no such file"),
    (["--vocab-size", "300", "--train-file", "{tmp}/t.txt", "--out", "{tmp}/exists"], "the folder exists"),
    (["--vocab-size", "300", "--train-file", "{tmp}/t.txt", "--out", "{tmp}/no/such/dir"], "does not exist; create it"),
])
def test_cli_tokenizer_bad_input_is_one_line(tmp_path, capsys, args, message):
    (tmp_path / "t.txt").write_text(toy_text(500))
    (tmp_path / "exists").mkdir()
    code, _, stderr = run_cli(["lab", "tokenizer", "train", *[a.format(tmp=tmp_path) for a in args]], capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and message in lines[0], stderr
    assert not (tmp_path / "new").exists() and not (tmp_path / "no").exists()


@pytest.mark.parametrize("tail", [b"caf\xe9 au lait\n", b"ends inside \xc3"])
def test_cli_tokenizer_train_on_non_utf8_text_is_one_line(tmp_path, capsys, tail):
    """Latin-1 text (or a file cut inside a character) made the tokenizers library panic with a trace."""
    (tmp_path / "t.txt").write_bytes(toy_text(500).encode() + tail)
    code, _, stderr = run_cli(["lab", "tokenizer", "train", "--vocab-size", "300", "--train-file",
                               str(tmp_path / "t.txt"), "--out", str(tmp_path / "new")], capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and "not UTF-8 text" in lines[0] and "t.txt" in lines[0], stderr
    assert not (tmp_path / "new").exists()
