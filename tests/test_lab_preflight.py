"""The lab's checks before any work (fasttrain.lab.preflight, fasttrain.lab.outputs and
config.validate): the Python API refuses what the CLI refuses, before a model is built."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import preflight  # noqa: E402
from fasttrain.lab.config import LabConfig, preset  # noqa: E402
from fasttrain.lab.outputs import CHECKPOINT_FORMAT, check_save_folder, is_lab_checkpoint, save_folder_state  # noqa: E402


def tiny(**kw) -> LabConfig:
    base = dict(max_steps=2, eval_tokens=256, eval_interval=0, log_interval=1, timing_warmup_steps=1, device="cpu")
    return preset("tiny", **{**base, **kw})


@pytest.fixture
def no_training(monkeypatch):
    """Building the trainer fails the test: every refusal must come before it."""
    import fasttrain.lab.train as train

    def refuse(*a, **k):
        raise AssertionError("training started")
    monkeypatch.setattr(train, "Trainer", refuse)


# --- every float flag, bounds ---------------------------------------------------------------------

@pytest.mark.parametrize("field", ["learning_rate", "min_lr", "weight_decay", "adam_beta1", "adam_beta2",
                                   "adam_epsilon", "max_grad_norm", "dropout", "lora_alpha", "lora_dropout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_float_flag_refuses_nan_and_inf_naming_that_flag(field, value):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(FasttrainError) as exc:
        tiny(**{field: value})
    assert str(exc.value).startswith(f"{flag} must be a finite number"), exc.value
    assert "lower --learning-rate" not in str(exc.value)


@pytest.mark.parametrize("changes,message", [
    (dict(adam_beta1=1.0), "--adam-beta1 must be in [0, 1)"),
    (dict(adam_beta2=-0.1), "--adam-beta2 must be in [0, 1)"),
    (dict(adam_epsilon=0.0), "--adam-epsilon must be > 0"),
    (dict(adam_epsilon=-1e-8), "--adam-epsilon must be > 0"),
    (dict(lora_r=4, lora_alpha=0.0), "--lora-alpha must be > 0"),
    (dict(lora_r=4, lora_dropout=1.5), "--lora-dropout must be in [0, 1)"),
    (dict(dropout=1.0), "--dropout must be in [0, 1)"),
    (dict(seed=-1), "--seed must be an integer from 0"),
    (dict(pad_vocab_to_multiple_of=10 ** 9), "--pad-vocab-to-multiple-of 1000000000"),
    (dict(device="cuda:abc"), "the GPU index must be a whole number"),
    (dict(device="cuda:-1"), "the GPU index must be a whole number"),
    (dict(device="tpu"), "unknown --device 'tpu'"),
    (dict(preload=True, max_steps=100_000_000), "--preload draws every step's window starts"),
])
def test_bounds_are_refused_with_the_flag_and_fix(changes, message):
    with pytest.raises(FasttrainError, match=None) as exc:
        tiny(**changes)
    assert message in str(exc.value), exc.value


def test_the_python_api_refuses_what_the_cli_refuses(no_training, corpus):
    """lab.train.run(cfg) on a config built without preset()'s validation refuses the same values."""
    from fasttrain.lab.train import run

    for bad in (dict(adam_beta1=1.0), dict(learning_rate=float("nan")), dict(seed=-3), dict(device="cuda:x")):
        cfg = LabConfig(name="api", layers=1, heads=2, width=16, context=16, per_device_train_batch_size=2,
                        max_steps=2, **{"device": "cpu", **bad})
        with pytest.raises(FasttrainError):
            run(cfg, corpus=corpus)


def test_preload_cap_names_the_largest_step_count():
    with pytest.raises(FasttrainError) as exc:
        tiny(preload=True, max_steps=10 ** 8)
    most = int(str(exc.value).split("--max-steps <= ")[1].split(" ")[0].replace(",", ""))
    tiny(preload=True, max_steps=most)          # the named count itself passes


# --- devices --------------------------------------------------------------------------------------

def test_a_gpu_the_machine_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(FasttrainError, match=r"--device cuda:7: this machine has 2 GPUs \(cuda:0 .. cuda:1\)"):
        preflight.check_device("cuda:7")
    preflight.check_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FasttrainError, match="no CUDA GPU here"):
        preflight.check_device("cuda:0")


# --- output folders -------------------------------------------------------------------------------

def _our_checkpoint(folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "model": {}}))
    (folder / "model.safetensors").write_bytes(b"weights")


def test_save_refuses_a_folder_holding_other_files(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious")
    with pytest.raises(FasttrainError, match=r"--save .*victim: the folder holds other files \(notes.txt\)"):
        tiny(save=str(victim))
    # our checkpoint plus someone's file: not ours to replace either
    ck = tmp_path / "ck"
    _our_checkpoint(ck)
    assert is_lab_checkpoint(ck) and save_folder_state(ck) == "checkpoint"
    (ck / "notes.txt").write_text("mine")
    with pytest.raises(FasttrainError, match="holds other files"):
        check_save_folder(ck)
    # a config.json without our marker is not ours
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors").write_bytes(b"x")
    assert not is_lab_checkpoint(other)
    with pytest.raises(FasttrainError, match="holds other files"):
        check_save_folder(other)
    assert (victim / "notes.txt").read_text() == "precious"


def test_save_accepts_new_empty_and_our_checkpoint_and_expands_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert check_save_folder("~/new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert save_folder_state(tmp_path / "empty") == "new"
    _our_checkpoint(tmp_path / "ours")
    check_save_folder(tmp_path / "ours")
    with pytest.raises(FasttrainError, match="--save is empty"):
        check_save_folder("  ")


def test_out_and_save_may_not_collide(tmp_path):
    cfg = tiny(save=str(tmp_path / "ck"))
    with pytest.raises(FasttrainError, match="name the same path"):
        preflight.check_outputs(cfg, str(tmp_path / "ck"))
    with pytest.raises(FasttrainError, match="inside the --save folder"):
        preflight.check_outputs(cfg, str(tmp_path / "ck" / "run.json"))
    preflight.check_outputs(cfg, str(tmp_path / "run.json"))


# --- the corpus and the memory --------------------------------------------------------------------

def test_vocabulary_smaller_than_the_corpus_is_refused_before_training(no_training, corpus):
    from fasttrain.lab.train import run

    with pytest.raises(FasttrainError, match=f"--vocab-size 10 is smaller than the corpus' {corpus.vocab_size}"):
        run(tiny(vocab_size=10), corpus=corpus)


def test_a_run_that_cannot_fit_is_refused_with_the_prediction_and_flags(no_training, corpus, monkeypatch):
    from fasttrain.lab.train import run

    # a machine of 1 GiB: the tiny preset at width 1024, batch 64, context 512 predicts more
    monkeypatch.setattr(preflight, "device_memory", lambda device: (2 ** 30, 2 ** 30, "this machine's memory (CPU)"))
    cfg = tiny(width=1024, heads=8, context=512, per_device_train_batch_size=64)
    with pytest.raises(FasttrainError) as exc:
        run(cfg, corpus=corpus)
    text = str(exc.value)
    assert text.startswith("the memory estimator predicts a peak of ") and "(1.0 GiB)" in text, text
    assert "--per-device-train-batch-size" in text or "--gradient-checkpointing full" in text, text
    # the flags it names do fit by the same estimate
    if "--per-device-train-batch-size" in text:
        b = int(text.split("--per-device-train-batch-size ")[1].split()[0])
        assert preflight.predicted_peak(cfg.with_(per_device_train_batch_size=b), corpus.vocab_size) <= 2 ** 30


def test_a_gpu_run_compares_with_free_memory(corpus, monkeypatch):
    cfg = tiny(width=256, heads=4, context=256, per_device_train_batch_size=32)
    peak = preflight.predicted_peak(cfg, corpus.vocab_size)
    dev = torch.device("cuda")
    monkeypatch.setattr(preflight, "device_memory", lambda device: (peak // 2, 80 * 2 ** 30, "H100"))
    with pytest.raises(FasttrainError, match=r"more than H100 has \(.* GiB free of 80.0 GiB\)"):
        preflight.check_fits(cfg, corpus.vocab_size, dev)
    # --auto-find-batch-size searches for what fits: no refusal
    assert preflight.check_fits(cfg.with_(auto_find_batch_size=True), corpus.vocab_size, dev) is None


def test_the_device_form_is_checked_on_a_gpu_machine_too(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(FasttrainError, match="the GPU index must be a whole number"):
        preflight.check_device("cuda:abc")
