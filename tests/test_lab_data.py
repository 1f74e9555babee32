"""The lab's corpus beyond Tiny Shakespeare: the user's text (--train-file, --val-file, --val-fraction),
token files (--train-bin, --val-bin, --bin-dtype), vocabularies over 256 symbols, the recorded SHA-256,
the vocabulary check, and one-line errors for bad data flags."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests_support import run_cli, toy_text  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import train as lab  # noqa: E402
from fasttrain.lab.config import preset  # noqa: E402
from fasttrain.lab.data import (check_vocab, corpus_for, corpus_from_description, load_user_corpus,  # noqa: E402
                                train_batches)


def tiny(**kw):
    base = dict(max_steps=3, eval_tokens=256, eval_interval=0, log_interval=1, timing_warmup_steps=1, device="cpu")
    return preset("tiny", **{**base, **kw})


def wide_text(n_symbols: int = 300, n: int = 20000, seed: int = 0) -> str:
    """Words over ``n_symbols`` CJK characters and the toy words: more distinct characters than a byte holds."""
    rng = np.random.default_rng(seed)
    symbols = [chr(0x4E00 + i) for i in range(n_symbols)]
    words = ["".join(rng.choice(symbols, size=3)) for _ in range(400)] + toy_text(2000).split()
    out = []
    while sum(map(len, out)) < n:
        out.append(words[rng.integers(len(words))] + (",\n" if rng.random() < 0.1 else " "))
    text = "".join(out) + "".join(symbols)          # every symbol occurs
    assert len(set(text)) > 256
    return text


@pytest.fixture(scope="module")
def wide_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide") / "corpus.txt"
    path.write_text(wide_text(), encoding="utf-8")
    return path


# --- a user's text ------------------------------------------------------------------------------

def test_character_corpus_over_256_symbols_trains_and_records_its_sha256(wide_file):
    cfg = tiny(train_file=str(wide_file), preload=True)
    corpus = corpus_for(cfg)
    text = wide_file.read_text(encoding="utf-8")
    assert corpus.vocab_size == len(set(text)) > 256 and corpus.chars == "".join(sorted(set(text)))
    assert corpus.train.dtype == np.uint16 and corpus.train.max() > 255
    assert corpus.decode(np.concatenate([corpus.train, corpus.val])) == text
    assert len(corpus.train) == int(0.9 * len(text))                       # the default --val-fraction 0.1
    assert corpus.sha256 == hashlib.sha256(wide_file.read_bytes()).hexdigest()
    desc = json.loads(json.dumps(corpus.describe()))
    assert desc["source"] == "text" and desc["files"][0]["sha256"] == corpus.sha256
    assert desc["tokenizer"]["kind"] == "char" and desc["tokenizer"]["chars"] == corpus.chars
    rec = lab.run(cfg)
    assert rec["model"]["vocab"] == corpus.vocab_size and np.isfinite(rec["final"]["val_loss"])


def test_bpe_corpus_trains_from_a_tokenizer_trained_here(wide_file, tmp_path):
    from fasttrain.lab.tokenizer import train_bpe

    tok = train_bpe(wide_file, 400, tmp_path / "tok")
    cfg = tiny(train_file=str(wide_file), tokenizer=f"hf:{tmp_path / 'tok'}", val_fraction=0.2)
    corpus = corpus_for(cfg)
    assert corpus.chars is None and corpus.vocab_size == tok.vocab_size > 256
    assert corpus.train.dtype == np.uint16 and corpus.val.dtype == np.int32
    assert corpus.decode(np.concatenate([corpus.train, corpus.val])) == wide_file.read_text(encoding="utf-8")
    assert corpus.describe()["tokenizer"]["kind"] == "hf"
    rec = lab.run(cfg)
    assert rec["model"]["vocab"] == tok.vocab_size and np.isfinite(rec["final"]["val_loss"])


def test_wide_ids_give_the_same_batches_preloaded_and_loaded(wide_file):
    corpus = corpus_for(tiny(train_file=str(wide_file)))
    kw = dict(seed=3, micro_batch=4, context=16, steps=3, device="cpu")
    pre = list(train_batches(corpus.train, preload=True, **kw))
    loaded = list(train_batches(corpus.train, preload=False, **kw))
    for [(xp, yp)], [(xl, yl)] in zip(pre, loaded):
        assert xp.dtype == torch.int64 and torch.equal(xp, xl) and torch.equal(yp, yl)
    assert max(int(x.max()) for [(x, _)] in pre) > 255


@pytest.mark.parametrize("preload", [True, False])
def test_ranks_micro_batches_are_the_one_process_draw(preload):
    """The seeded-stream contract (lab/parallel/distributed.py): N ranks at global batch B see exactly
    the windows one process at B sees -- rank r's micro-batch j is column r of the one draw's (k, N, b)
    grid -- and a step's k micro-batches are the k slices of one batch of k b."""
    import torch

    ids = np.arange(5000, dtype=np.int32) % 251
    kw = dict(seed=5, context=8, steps=3, device="cpu", preload=preload, start=2)
    k, n, b = 2, 3, 4
    whole = list(train_batches(ids, micro_batch=n * b, accumulation=k, **kw))          # one process
    ranks = [list(train_batches(ids, micro_batch=b, accumulation=k, ranks=n, rank=r, **kw)) for r in range(n)]
    big = list(train_batches(ids, micro_batch=k * n * b, **kw))                        # no accumulation
    for step in range(3):
        assert [x.shape for x, _ in ranks[0][step]] == [(b, 8)] * k
        for j in range(k):
            mine = torch.cat([ranks[r][step][j][0] for r in range(n)])
            assert torch.equal(mine, whole[step][j][0])
        [(x_big, _)] = big[step]
        assert torch.equal(torch.cat([x for x, _ in whole[step]]), x_big)


def test_val_file_validates_on_its_own_text_with_the_union_of_characters(tmp_path):
    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    train.write_text("abc abc abc\n" * 50)
    val.write_text("xyz cab\n" * 10)
    corpus = corpus_for(tiny(train_file=str(train), val_file=str(val)))
    assert corpus.chars == " \nabcxyz".replace(" \n", "\n ") and corpus.decode(corpus.val) == val.read_text()
    assert len(corpus.train) == len(train.read_text()) and [f["role"] for f in corpus.files] == ["train", "val"]


def test_an_own_input_txt_is_not_checked_against_tiny_shakespeare(tmp_path):
    from fasttrain.errors import DataError
    from fasttrain.lab.data import load_corpus

    own = tmp_path / "tinyshakespeare" / "input.txt"
    own.parent.mkdir()
    own.write_text(toy_text())
    corpus = corpus_for(tiny(train_file=str(own)))
    assert corpus.sha256 == hashlib.sha256(own.read_bytes()).hexdigest() and corpus.source == "text"
    with pytest.raises(DataError, match="checksum mismatch.*fasttrain lab --train-file"):
        load_corpus(tmp_path)      # found as Tiny Shakespeare it is still checked, and the fix is named


def test_description_rebuilds_the_corpus_and_notices_a_changed_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(toy_text())
    corpus = corpus_for(tiny(train_file=str(path), val_fraction=0.25))
    again = corpus_from_description(json.loads(json.dumps(corpus.describe())))
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)
    assert again.chars == corpus.chars
    path.write_text(toy_text(seed=1))
    with pytest.raises(FasttrainError, match="changed since it was recorded"):
        corpus_from_description(corpus.describe())


# --- token files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_files_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    top = 60_000 if dtype == "uint16" else 100_000
    train_ids, val_ids = rng.integers(0, top, 5000), rng.integers(0, top, 700)
    train_ids[0] = top - 1
    train_ids.astype(dtype).tofile(tmp_path / "train.bin")
    val_ids.astype(dtype).tofile(tmp_path / "val.bin")
    cfg = tiny(train_bin=str(tmp_path / "train.bin"), val_bin=str(tmp_path / "val.bin"), bin_dtype=dtype)
    corpus = corpus_for(cfg)
    assert np.array_equal(corpus.train, train_ids) and np.array_equal(corpus.val, val_ids)
    assert corpus.vocab_size == top and corpus.tokenizer is None and corpus.chars is None
    assert corpus.sha256 == hashlib.sha256((tmp_path / "train.bin").read_bytes()).hexdigest()
    assert corpus.describe()["files"][1]["sha256"] == hashlib.sha256((tmp_path / "val.bin").read_bytes()).hexdigest()
    [(x, y)] = next(train_batches(corpus.train, seed=0, micro_batch=2, context=8, steps=1, device="cpu", preload=True))
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(FasttrainError, match="without a tokenizer"):
        corpus.decode([1, 2])


def test_token_files_with_their_tokenizer_decode_to_the_text(tmp_path):
    from fasttrain.lab.tokenizer import train_bpe

    (tmp_path / "t.txt").write_text(toy_text())
    tok = train_bpe(tmp_path / "t.txt", 300, tmp_path / "tok")
    ids = tok.encode(toy_text())
    ids.astype(np.uint16).tofile(tmp_path / "train.bin")
    corpus = corpus_for(tiny(train_bin=str(tmp_path / "train.bin"), tokenizer=f"hf:{tmp_path / 'tok'}"))
    assert corpus.vocab_size == tok.vocab_size
    assert corpus.decode(np.concatenate([corpus.train, corpus.val])) == toy_text()
    assert len(corpus.train) == int(0.9 * len(ids))


def test_check_vocab_names_both_sizes():
    check_vocab(65, 65)
    with pytest.raises(FasttrainError, match="the corpus has 300 token ids but the model's vocabulary holds 256"):
        check_vocab(300, 256)


# --- bad input: one line, non-zero exit, nothing trained ------------------------------------------------

def _bad_files(tmp):
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "folder").mkdir()
    (tmp / "text.txt").write_text(toy_text(2000))
    (tmp / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp / "no-tokenizer").mkdir()
    (tmp / "no-tokenizer" / "readme.md").write_text("hello")
    (tmp / "not-a-tokenizer.json").write_text('{"hello": 1}')
    np.arange(3, dtype=np.uint16).tofile(tmp / "odd.bin")              # 6 bytes: not uint32
    np.arange(1, 101, dtype=np.uint32).tofile(tmp / "wide.bin")        # uint32 ids
    np.arange(1, 101, dtype=np.uint16).tofile(tmp / "narrow.bin")      # uint16 ids, even count


@pytest.mark.parametrize("args,message", [
    (["--train-file", "{tmp}/missing.txt"], "--train-file {tmp}/missing.txt: no such file"),
    (["--train-file", "{tmp}/folder"], "that is a folder, not a file"),
    (["--train-file", "{tmp}/empty.txt"], "the file is empty"),
    (["--train-file", "{tmp}/latin1.txt"], "not UTF-8 text"),
    (["--train-file", "{tmp}/text.txt", "--tokenizer", "hf:{tmp}/missing"], "no such file or folder"),
    (["--train-file", "{tmp}/text.txt", "--tokenizer", "hf:{tmp}/no-tokenizer"], "the folder holds no tokenizer"),
    (["--train-file", "{tmp}/text.txt", "--tokenizer", "hf:{tmp}/not-a-tokenizer.json"], "is not a tokenizers file"),
    (["--train-file", "{tmp}/text.txt", "--tokenizer", "bpe"], "unknown --tokenizer 'bpe'"),
    (["--train-file", "{tmp}/text.txt", "--val-fraction", "0"], "--val-fraction must be in (0, 1)"),
    (["--train-file", "{tmp}/text.txt", "--val-fraction", "1.5"], "--val-fraction must be in (0, 1)"),
    (["--train-file", "{tmp}/text.txt", "--val-file", "{tmp}/text.txt", "--val-fraction", "0.2"],
     "give --val-file or --val-fraction, not both"),
    (["--train-file", "{tmp}/text.txt", "--train-bin", "{tmp}/wide.bin"], "give --train-file (text) or --train-bin"),
    (["--val-file", "{tmp}/text.txt"], "--val-file needs --train-file"),
    (["--train-bin", "{tmp}/odd.bin", "--bin-dtype", "uint32"], "6 bytes is not a whole number of uint32 ids"),
    (["--train-bin", "{tmp}/wide.bin"], "every other id is 0, as uint32 ids read as uint16 show"),
    (["--train-bin", "{tmp}/narrow.bin", "--bin-dtype", "uint32"], "give --bin-dtype uint16"),
    (["--train-bin", "{tmp}/wide.bin", "--bin-dtype", "uint64"], "'uint64' is not one of"),
    (["--train-bin", "{tmp}/wide.bin", "--bin-dtype", "uint32", "--tokenizer", "char"], "--tokenizer char builds"),
    (["--train-file", "{tmp}/text.txt", "--vocab-size", "8"], "--vocab-size 8 is smaller than the corpus' 20"),
])
def test_bad_data_flags_are_one_line_before_training(tmp_path, capsys, monkeypatch, args, message):
    _bad_files(tmp_path)
    monkeypatch.setattr(lab, "Trainer", None)         # training must not start
    out = tmp_path / "run.json"
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet",
                               *[a.format(tmp=tmp_path) for a in args], "--out", str(out)], capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert message.format(tmp=tmp_path) in lines[0], lines[0]
    assert "Traceback" not in stderr and not out.exists()


def test_token_ids_beyond_the_tokenizer_are_refused(tmp_path):
    from fasttrain.lab.tokenizer import CharTokenizer

    np.array([0, 1, 70_000 % 65536, 5], dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(FasttrainError, match="id 4,464 is beyond the tokenizer's vocabulary of 3"):
        load_user_corpus(train_bin=str(tmp_path / "t.bin"), tokenizer=CharTokenizer("abc"))


def test_cli_trains_on_a_train_file(tmp_path, capsys, wide_file):
    out = tmp_path / "run.json"
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--max-steps", "2",
                               "--eval-tokens", "128", "--train-file", str(wide_file), "--val-fraction", "0.05",
                               "--out", str(out)], capsys)
    assert code == 0, stderr
    rec = json.loads(out.read_text())
    assert rec["config"]["train_file"] == str(wide_file) and rec["config"]["val_fraction"] == 0.05
    assert rec["model"]["vocab"] == len(set(wide_file.read_text(encoding="utf-8")))


def test_the_models_own_tokenizer_is_the_default_and_char_overrides_it(tmp_path):
    from fasttrain.lab.tokenizer import model_tokenizer, train_bpe

    (tmp_path / "t.txt").write_text(toy_text())
    model_dir = tmp_path / "model"
    train_bpe(tmp_path / "t.txt", 300, model_dir)
    (model_dir / "config.json").write_text("{}")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    assert model_tokenizer(model_dir) == f"hf:{model_dir}" and model_tokenizer(tmp_path / "bare") is None
    own = corpus_for(tiny(train_file=str(tmp_path / "t.txt")), default_tokenizer=model_tokenizer(model_dir))
    assert own.tokenizer.kind == "hf" and own.chars is None
    chars = corpus_for(tiny(train_file=str(tmp_path / "t.txt"), tokenizer="char"),
                       default_tokenizer=model_tokenizer(model_dir))
    assert chars.chars == "".join(sorted(set(toy_text())))


def test_a_split_too_small_to_predict_is_one_line(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefghij")
    with pytest.raises(FasttrainError, match="the validation split holds 1 token"):
        corpus_for(tiny(train_file=str(tmp_path / "t.txt")))
    assert len(corpus_for(tiny(train_file=str(tmp_path / "t.txt"), val_fraction=0.5)).val) == 5


def test_tiny_shakespeare_keeps_its_split_and_rebuilds_from_its_description(shakespeare_dir):
    root = shakespeare_dir
    corpus = corpus_for(tiny(data_dir=root))
    assert corpus.source == "tinyshakespeare" and corpus.train.dtype == np.uint8 and corpus.vocab_size == 65
    assert corpus.sha256 == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    again = corpus_from_description(json.loads(json.dumps(corpus.describe())), data_dir=root)
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_wide_token_files_preload_and_train_on_the_gpu(tmp_path, dtype):
    ids = np.random.default_rng(0).integers(0, 70_000 if dtype == "uint32" else 60_000, 20_000)
    ids.astype(dtype).tofile(tmp_path / "t.bin")
    cfg = tiny(train_bin=str(tmp_path / "t.bin"), bin_dtype=dtype, device="cuda", preload=True)
    corpus = corpus_for(cfg)
    kw = dict(seed=1, micro_batch=4, context=16, steps=2)
    pre = list(train_batches(corpus.train, preload=True, device="cuda", **kw))
    host = list(train_batches(corpus.train, preload=False, device="cpu", **kw))
    for [(xp, yp)], [(xh, yh)] in zip(pre, host):
        assert torch.equal(xp.cpu(), xh) and torch.equal(yp.cpu(), yh)
    rec = lab.run(cfg)
    assert rec["model"]["vocab"] == corpus.vocab_size and np.isfinite(rec["final"]["val_loss"])


def test_lab_eval_scores_a_checkpoint_on_the_corpus_it_was_trained_on(wide_file, tmp_path):
    """A checkpoint records its corpus (files with their SHA-256, split, tokenizer): lab eval reads the
    same text again, not Tiny Shakespeare, and gives the recorded loss exactly."""
    pytest.importorskip("safetensors")
    from fasttrain.lab.evaluate import evaluate_checkpoint
    from fasttrain.lab.tokenizer import train_bpe

    train_bpe(wide_file, 400, tmp_path / "tok")
    for name, extra in (("char", {}), ("bpe", {"tokenizer": f"hf:{tmp_path / 'tok'}"})):
        cfg = tiny(train_file=str(wide_file), val_fraction=0.2, save=str(tmp_path / name), **extra)
        rec = lab.run(cfg)
        res = evaluate_checkpoint(tmp_path / name, device="cpu")
        assert res["val_loss"] == rec["final"]["val_loss"], name
