"""Lab checkpoints (fasttrain.lab.checkpoint): a corrupt config.json is one line naming config.json
and the field; weights that do not match say so; a checkpoint is replaced whole, and a failure
while writing leaves the earlier one as it was."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from tests_support import run_cli  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import checkpoint as ck  # noqa: E402
from fasttrain.lab.config import preset  # noqa: E402
from fasttrain.lab.model import build  # noqa: E402
from fasttrain.lab import train as lab  # noqa: E402


def _model(corpus, **kw):
    cfg = preset("tiny", device="cpu", **kw)
    return build(lab.model_config(cfg, corpus.vocab_size), "cpu", seed=cfg.seed)


@pytest.fixture
def saved(tmp_path, corpus):
    folder = tmp_path / "ck"
    ck.save_checkpoint(_model(corpus), folder, chars=corpus.chars, lab={})
    return folder


def _edit(folder, change):
    meta = json.loads((folder / "config.json").read_text())
    meta = change(meta)
    (folder / "config.json").write_text(json.dumps(meta))


TRAINING_FLAGS = ("--heads", "--width", "--layers", "--context", "--kv-heads", "--learning-rate")


@pytest.mark.parametrize("change,field", [
    (lambda m: [1, 2], "must be a JSON object"),
    (lambda m: {**m, "model": None}, '"model" must be an object'),
    (lambda m: {k: v for k, v in m.items() if k != "model"}, '"model" field is missing'),
    (lambda m: {**m, "model": {"layers": 2}}, "model.heads is missing"),
    (lambda m: {**m, "model": {**m["model"], "layers": "two"}}, 'model.layers must be a positive integer, got "two"'),
    (lambda m: {**m, "model": {**m["model"], "hidden": 33}}, "model.heads (2) must divide model.hidden (33)"),
    (lambda m: {**m, "model": {**m["model"], "norm": "batch"}}, "model.norm must be one of rms, layer"),
    (lambda m: {**m, "model": {**m["model"], "tied": "yes"}}, "model.tied must be true or false"),
    (lambda m: {**m, "model": {**m["model"], "kv_heads": 0}}, "model.kv_heads must be a positive integer or null"),
    (lambda m: {**m, "model": {**m["model"], "wings": 2}}, "unknown field model.wings"),
    (lambda m: {**m, "chars": 5}, '"chars" must be the vocabulary'),
    (lambda m: {**m, "eval": {"eval_batch_size": "big"}}, "eval.eval_batch_size must be a positive integer"),
])
def test_a_bad_config_json_is_one_line_naming_the_file_and_field(fake_corpus, saved, capsys, change, field):
    _edit(saved, change)
    for args in (["lab", "eval", str(saved), "--device", "cpu"],
                 ["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--max-steps", "1", "--init-from",
                  str(saved)])[:1 if field.startswith("eval.") else 2]:     # the eval record: lab eval's alone
        code, stdout, stderr = run_cli(args, capsys)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr
        assert "config.json" in lines[0] and field in lines[0], lines[0]
        assert not any(flag in lines[0] for flag in TRAINING_FLAGS), lines[0]


def test_unreadable_json_names_the_file_and_the_place(saved):
    (saved / "config.json").write_text('{"model": ')
    with pytest.raises(FasttrainError, match=r"config.json: unreadable JSON \(Expecting value at line 1\)"):
        ck.read_checkpoint(saved)


def test_weights_that_do_not_match_config_json_name_the_tensor(saved, corpus):
    # config.json claims a wider model than the weights hold
    _edit(saved, lambda m: {**m, "model": {**m["model"], "hidden": 64, "ffn": 256}})
    meta = ck.read_checkpoint(saved)
    from fasttrain.lab.model import GPTConfig

    model = build(GPTConfig.from_dict(meta["model"]), "cpu", seed=0)
    with pytest.raises(FasttrainError) as exc:
        ck.load_weights(model, saved)
    text = str(exc.value)
    assert "model.safetensors: tensor " in text and "config.json does not match the weights" in text, text
    assert "..." not in text


def test_a_corrupt_weights_file_is_one_line_not_cut_mid_word(saved, corpus):
    (saved / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + b"x" * 400)
    with pytest.raises(FasttrainError) as exc:
        ck.load_weights(_model(corpus), saved)
    text = str(exc.value)
    assert "not a readable safetensors file" in text and text.endswith("fasttrain lab --save DIR"), text
    inner = text.split("(", 1)[1].rsplit(")", 1)[0]
    assert len(inner) <= 124 and (not inner.endswith("...") or inner[-4] == " "), inner


def test_a_checkpoint_is_replaced_whole(saved, corpus):
    before = (saved / "model.safetensors").read_bytes()
    ck.save_checkpoint(_model(corpus, seed=5), saved, chars=corpus.chars, lab={"seed": 5})
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]
    assert (saved / "model.safetensors").read_bytes() != before
    assert json.loads((saved / "config.json").read_text())["lab"] == {"seed": 5}
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]        # no .old or .tmp left


def test_save_refuses_a_folder_of_other_files_even_from_the_api(tmp_path, corpus):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious")
    with pytest.raises(FasttrainError, match="holds other files"):
        ck.save_checkpoint(_model(corpus), victim, chars=corpus.chars, lab={})
    assert [p.name for p in victim.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_a_failure_while_writing_leaves_the_earlier_checkpoint(saved, corpus, monkeypatch, failure):
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    import safetensors.torch as st

    def broken(model, filename, *a, **k):
        open(filename, "wb").write(b"half")
        raise failure
    monkeypatch.setattr(st, "save_model", broken)
    with pytest.raises(failure if isinstance(failure, type) else OSError):
        ck.save_checkpoint(_model(corpus, seed=7), saved, chars=corpus.chars, lab={})
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]


def test_a_save_killed_mid_write_leaves_a_temporary_that_the_next_save_removes(tmp_path, corpus):
    """A --save killed while writing left ck.XXXX.tmp beside the checkpoint; the next save removes it."""
    from fasttrain.lab.config import preset
    from fasttrain.lab.train import run

    (tmp_path / "ck.k1ll3d.tmp").mkdir()
    (tmp_path / "ck.k1ll3d.tmp" / "model.safetensors").write_bytes(b"half")
    (tmp_path / "other.k1ll3d.tmp").mkdir()           # another folder's temporary: not ours to remove
    run(preset("tiny", device="cpu", max_steps=2, eval_interval=0, save=str(tmp_path / "ck")), corpus=corpus)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "other.k1ll3d.tmp"]
