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


# --- outputs against inputs, and against files the run did not write (issue 40) --------------------

@pytest.fixture
def text_files(tmp_path):
    from tests_support import toy_text

    (tmp_path / "train.txt").write_text(toy_text(4000))
    (tmp_path / "val.txt").write_text(toy_text(1000, seed=1))
    return tmp_path


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("name", ["train.txt", "val.txt"])
def test_out_naming_an_input_file_is_refused_and_the_file_kept(no_training, text_files, name):
    """``--out`` naming the train or validation text replaced it with the record (exit 0)."""
    before = (text_files / name).read_bytes()
    cfg = tiny(train_file=str(text_files / "train.txt"), val_file=str(text_files / "val.txt"))
    with pytest.raises(FasttrainError) as exc:
        preflight.check_run(cfg, str(text_files / name))
    flag = "--train-file" if name == "train.txt" else "--val-file"
    assert f"is the {flag} this run reads" in _one_line(exc)
    with pytest.raises(FasttrainError, match="this run reads"):
        preflight.check_outputs(cfg, str(text_files / name))
    assert (text_files / name).read_bytes() == before


def test_out_naming_a_state_pt_or_a_stranger_file_is_refused(tmp_path, corpus):
    """A checkpoint's state.pt (or any file that is not a run record) is never replaced by --out."""
    from fasttrain.lab.train import run

    states = tmp_path / "o"
    cfg = tiny(max_steps=3, save_steps=2, output_dir=str(states))
    run(cfg, corpus=corpus)
    state = states / "checkpoint-2" / "state.pt"
    before = state.read_bytes()
    for out, message in ((state, "inside the --resume folder"), (tmp_path / "notes.txt", "is not the record")):
        if out.name == "notes.txt":
            out.write_text("my notes")
        with pytest.raises(FasttrainError) as exc:
            preflight.check_outputs(cfg.with_(resume=str(states), max_steps=4), str(out))
        assert message in _one_line(exc)
    with pytest.raises(FasttrainError, match="training-state checkpoint"):
        preflight.check_outputs(cfg, str(state))
    assert state.read_bytes() == before and (tmp_path / "notes.txt").read_text() == "my notes"
    (tmp_path / "run.json").write_text(json.dumps({"kind": "lab-run", "config": {}}))
    preflight.check_outputs(cfg, str(tmp_path / "run.json"))      # a run record: a rerun replaces it


def test_save_holding_an_input_is_refused(tmp_path, text_files):
    cfg = tiny(train_file=str(text_files / "train.txt"))
    with pytest.raises(FasttrainError):
        preflight.check_run(cfg.with_(save=str(text_files)))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(FasttrainError) as exc:
        preflight.check_output_folders(tiny().with_(model=f"hf:{tmp_path / 'model'}", save=str(tmp_path / "model")))
    assert "--save" in _one_line(exc) and "is the --model" in str(exc.value)


def test_an_output_dir_of_another_run_is_refused_unless_overwrite_and_never_pruned(tmp_path, corpus):
    """Another run's checkpoints in --output-dir were written into and pruned by --save-total-limit."""
    from fasttrain.lab.train import run

    states = tmp_path / "o"
    first = tiny(max_steps=5, save_steps=2, output_dir=str(states))
    run(first, corpus=corpus)
    assert sorted(p.name for p in states.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    other = first.with_(seed=5, max_steps=7, save_steps=3, save_total_limit=1)
    with pytest.raises(FasttrainError) as exc:
        run(other, corpus=corpus)
    line = _one_line(exc)
    assert "--output-dir" in line and "holds another run's checkpoints (checkpoint-2, checkpoint-4)" in line
    assert "--overwrite-output-dir" in line
    run(other.with_(overwrite_output_dir=True), corpus=corpus)
    # the first run's two checkpoints are kept; this run keeps only its newest (checkpoint-6)
    assert sorted(p.name for p in states.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(FasttrainError, match=r"holds other files \(notes.txt\)"):
        preflight.check_run(first.with_(output_dir=str(tmp_path / "mine")))


def test_output_dir_inside_save_is_refused_before_training(no_training, tmp_path, corpus):
    """--output-dir inside --save was refused only after training (the final save would delete it)."""
    from fasttrain.lab.train import run

    cfg = tiny(save_steps=1, output_dir=str(tmp_path / "ck" / "states"), save=str(tmp_path / "ck"))
    with pytest.raises(FasttrainError) as exc:
        run(cfg, corpus=corpus)
    assert "is inside the --save folder" in _one_line(exc)
    assert not (tmp_path / "ck").exists()


def test_save_of_another_run_is_refused_unless_overwrite(tmp_path, corpus):
    """A rerun (--from-record keeps --save) replaced the earlier run's checkpoint silently."""
    pytest.importorskip("safetensors")
    from fasttrain.lab.train import run

    cfg = tiny(save=str(tmp_path / "ck"))
    run(cfg, corpus=corpus)
    before = (tmp_path / "ck" / "model.safetensors").read_bytes()
    with pytest.raises(FasttrainError) as exc:
        run(cfg.with_(seed=3), corpus=corpus)
    assert "holds another run's checkpoint" in _one_line(exc) and "--overwrite-output-dir" in str(exc.value)
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == before
    run(cfg.with_(seed=3, overwrite_output_dir=True), corpus=corpus)
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() != before


def test_two_runs_with_one_save_at_once_the_second_refuses(tmp_path, corpus):
    """Two runs given one --save at once both said they saved; the lock refuses the second."""
    from fasttrain.lab.outputs import hold_outputs
    from fasttrain.lab.train import run

    cfg = tiny(save=str(tmp_path / "ck"))
    with hold_outputs(cfg):                 # a first run holds the folder
        with pytest.raises(FasttrainError) as exc:
            run(cfg, corpus=corpus)
        assert "another run is writing to this folder right now" in _one_line(exc)
        assert not (tmp_path / "ck").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []          # the lock goes with the run
    states = tiny(save_steps=1, output_dir=str(tmp_path / "o"))
    with hold_outputs(states):
        with pytest.raises(FasttrainError, match="--output-dir .* another run is writing"):
            run(states, corpus=corpus)
