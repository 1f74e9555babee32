"""``fasttrain lab sample``: text from a lab GPT checkpoint and from a saved Hugging Face model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from tests_support import fasttrain_cli, one_line_error, toy_text  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab.config import LabConfig, preset  # noqa: E402
from fasttrain.lab.sample import sample  # noqa: E402


@pytest.fixture(scope="module")
def gpt_checkpoint(corpus, tmp_path_factory):
    from fasttrain.lab import train

    ck = tmp_path_factory.mktemp("gpt") / "ck"
    cfg = preset("tiny", max_steps=60, eval_tokens=256, eval_interval=0, timing_warmup_steps=1, device="cpu",
                 save=str(ck))
    train.run(cfg, corpus=corpus)
    return ck


def test_gpt_checkpoint_samples_its_corpus_seeded(gpt_checkpoint, corpus):
    a = sample(gpt_checkpoint, "the king", max_new_tokens=40, temperature=0.8, seed=1, device="cpu")
    b = sample(gpt_checkpoint, "the king", max_new_tokens=40, temperature=0.8, seed=1, device="cpu")
    c = sample(gpt_checkpoint, "the king", max_new_tokens=40, temperature=0.8, seed=2, device="cpu")
    assert a == b != c
    assert a.startswith("the king") and len(a) == len("the king") + 40
    assert set(a) <= set(corpus.chars)
    # beyond the context (32): the window slides over the last 32 tokens
    assert len(sample(gpt_checkpoint, "the", max_new_tokens=50, temperature=0, device="cpu")) == 53
    # 60 steps on the toy language: greedy continuation produces its words
    greedy = sample(gpt_checkpoint, "the lord ", max_new_tokens=30, temperature=0, device="cpu")
    words = {"the", "king", "shall", "speak", "to", "thee", "my", "lord", "and", "we", "will", "go"}
    assert sum(w.strip(",") in words for w in greedy.split()[2:-1]) >= 2


def test_hf_checkpoint_generates_with_chars_and_with_a_tokenizer(tmp_path, corpus):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from fasttrain.lab import hf

    transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(tmp_path / "cfg")
    m = hf.build_hf_model(f"hf:{tmp_path / 'cfg'}", LabConfig(device="cpu", context=16), corpus.vocab_size, "cpu")
    hf.save_hf(m.module, tmp_path / "chars", extra={"chars": corpus.chars})
    text = sample(tmp_path / "chars", "the king", max_new_tokens=12, temperature=1.0, seed=3, device="cpu")
    assert text.startswith("the king") and len(text) == 20 and set(text) <= set(corpus.chars)
    assert text == sample(tmp_path / "chars", "the king", max_new_tokens=12, temperature=1.0, seed=3, device="cpu")
    # a BPE tokenizer trained here, saved beside the model
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator([toy_text(5000)], tokenizers.trainers.BpeTrainer(vocab_size=90, special_tokens=["[UNK]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="[UNK]")
    hf.save_hf(m.module, tmp_path / "bpe", tokenizer=fast)
    text = sample(tmp_path / "bpe", "the king", max_new_tokens=5, temperature=0, device="cpu")
    assert text.startswith("the king") and len(text) > len("the king")
    with pytest.raises(FasttrainError, match="exceed the model's 64 positions"):
        sample(tmp_path / "bpe", "the king", max_new_tokens=100, device="cpu")


def test_bad_input_is_one_line(gpt_checkpoint, tmp_path):
    with pytest.raises(FasttrainError, match="never saw"):
        sample(gpt_checkpoint, "the king ∑", device="cpu")
    with pytest.raises(FasttrainError, match="no such checkpoint folder"):
        sample(tmp_path / "missing", "the", device="cpu")
    with pytest.raises(FasttrainError, match="--max-new-tokens must be a positive"):
        sample(gpt_checkpoint, "the", max_new_tokens=0, device="cpu")
    with pytest.raises(FasttrainError, match="--prompt is empty"):
        sample(gpt_checkpoint, "", device="cpu")
    with pytest.raises(FasttrainError, match="unknown --device"):
        sample(gpt_checkpoint, "the", device="tpu")


def test_cli_samples_and_refuses_in_one_line(gpt_checkpoint, tmp_path):
    ok = fasttrain_cli("lab", "sample", gpt_checkpoint, "--prompt", "the king", "--max-new-tokens", "10",
                       "--temperature", "0", "--device", "cpu")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("the king") and len(ok.stdout.rstrip("\n")) == 18
    one_line_error(fasttrain_cli("lab", "sample", tmp_path / "nothing", "--prompt", "x"), "no such checkpoint")


def test_the_lab_gpt_trained_with_a_bpe_tokenizer_is_saved_with_it_and_samples(tmp_path):
    """The GPT saved after a BPE run held no characters and no tokenizer: sample could not encode."""
    pytest.importorskip("tokenizers")
    from fasttrain.lab import train
    from fasttrain.lab.tokenizer import train_bpe

    (tmp_path / "t.txt").write_text(toy_text(6000))
    train_bpe(tmp_path / "t.txt", 300, tmp_path / "bpe")
    ck = tmp_path / "ck"
    train.run(preset("tiny", device="cpu", max_steps=2, eval_interval=0, train_file=str(tmp_path / "t.txt"),
                     tokenizer=f"hf:{tmp_path / 'bpe'}", save=str(ck)))
    assert (ck / "tokenizer.json").is_file()
    (tmp_path / "bpe" / "tokenizer.json").unlink()          # the checkpoint alone is enough
    text = sample(ck, "the king", max_new_tokens=5, temperature=0.0, device="cpu")
    assert text.startswith("the king") and len(text) > len("the king")
