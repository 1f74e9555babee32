"""``fasttrain lab`` as a new user meets it (fasttrain.lab.cli): bad input is one line, a non-zero
exit and nothing lost; what a run says about its checkpoint, its timing columns and its expected
time."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from tests_support import one_error_line, run_cli  # noqa: E402

LAB = ["lab", "--preset", "tiny", "--device", "cpu", "--max-steps", "2", "--eval-tokens", "200"]



@pytest.fixture
def no_training(monkeypatch):
    import fasttrain.lab.train as train

    def refuse(*a, **k):
        raise AssertionError("training started")
    monkeypatch.setattr(train, "Trainer", refuse)


def test_save_into_a_folder_of_other_files_is_refused_and_nothing_is_lost(fake_corpus, tmp_path, capsys, no_training):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious")
    (victim / "data.bin").write_bytes(b"\x00\x01")
    code, _, stderr = run_cli([*LAB, "--quiet", "--save", str(victim)], capsys)
    assert code == 1
    line = one_error_line(stderr)
    assert f"--save {victim}: the folder holds other files (data.bin, notes.txt)" in line
    assert sorted(p.name for p in victim.iterdir()) == ["data.bin", "notes.txt"]
    assert (victim / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize("args,message", [
    (["--out", "{tmp}/same", "--save", "{tmp}/same"], "name the same path"),
    (["--out", "{tmp}/ck/run.json", "--save", "{tmp}/ck"], "is inside the --save folder"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number, got nan"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number, got inf"),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1)"),
    (["--seed", "-1"], "--seed must be an integer from 0"),
    (["--device", "cuda:abc"], "the GPU index must be a whole number"),
    (["--vocab-size", "3"], "is smaller than the corpus'"),
    (["--nproc-per-node", "2", "--strategy", "ddp", "--nnodes", "abc"], "--nnodes must be a number of machines"),
])
def test_bad_input_is_one_line_before_training(fake_corpus, tmp_path, capsys, no_training, args, message):
    (tmp_path / "ck").mkdir()
    code, _, stderr = run_cli([*LAB, "--quiet", *[a.format(tmp=tmp_path) for a in args]], capsys)
    assert code == 1 and message in one_error_line(stderr), stderr
    assert not (tmp_path / "same").exists()


def test_a_quoted_tilde_is_expanded_for_out_and_save(fake_corpus, tmp_path, capsys, monkeypatch):
    pytest.importorskip("safetensors")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "..")
    code, _, stderr = run_cli([*LAB, "--quiet", "--out", "~/run.json", "--save", "~/ck"], capsys)
    assert code == 0, stderr
    assert (tmp_path / "run.json").exists() and (tmp_path / "ck" / "model.safetensors").exists()
    assert not (tmp_path.parent / "~").exists()


def test_an_existing_checkpoint_is_replaced_whole_and_the_run_says_so(fake_corpus, tmp_path, capsys):
    pytest.importorskip("safetensors")
    ck = tmp_path / "ck"
    code, _, stderr = run_cli([*LAB, "--quiet", "--save", str(ck)], capsys)
    assert code == 0, stderr
    first = (ck / "model.safetensors").read_bytes()
    code, _, stderr = run_cli([*LAB, "--seed", "9", "--save", str(ck)], capsys)      # another run's: refused
    assert code == 1 and "holds another run's checkpoint" in one_error_line(stderr), stderr
    code, stdout, stderr = run_cli([*LAB, "--seed", "9", "--save", str(ck), "--overwrite-output-dir"], capsys)
    assert code == 0, stderr
    assert "holds a lab checkpoint; it is replaced whole when this run ends" in stderr
    assert f"checkpoint: {ck} (replaced the earlier one)" in stdout
    assert (ck / "model.safetensors").read_bytes() != first
    assert json.loads((ck / "config.json").read_text())["lab"]["seed"] == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_crash_during_training_leaves_the_earlier_checkpoint(fake_corpus, tmp_path, capsys, monkeypatch):
    pytest.importorskip("safetensors")
    ck = tmp_path / "ck"
    assert run_cli([*LAB, "--quiet", "--save", str(ck)], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    import fasttrain.lab.train as train

    def interrupted(self, micro_batches):
        raise KeyboardInterrupt
    monkeypatch.setattr(train.Trainer, "train_step", interrupted)
    code, _, stderr = run_cli([*LAB, "--quiet", "--save", str(ck), "--overwrite-output-dir"], capsys)
    assert code == 130                  # Ctrl-C: click says "aborted"
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before


def test_a_run_of_warm_up_steps_only_says_why_its_step_columns_are_empty(fake_corpus, capsys):
    code, stdout, stderr = run_cli([*LAB, "--timing-warmup-steps", "2"], capsys)
    assert code == 0, stderr
    assert "step times empty: all 2 steps were timing warm-up (--timing-warmup-steps 2" in stdout
    code, stdout, _ = run_cli([*LAB, "--max-steps", "4", "--timing-warmup-steps", "1"], capsys)
    assert "step times empty" not in stdout


def test_a_long_run_prints_its_expected_time_after_the_first_steps(fake_corpus, capsys, monkeypatch):
    """A run measured at 2 s a step for 5,000 steps says so once its first steps are timed."""
    import fasttrain.lab.progress as progress

    ticks = iter(range(0, 10 ** 6, 2))
    monkeypatch.setattr(progress, "CLOCK", lambda: float(next(ticks)))
    monkeypatch.setattr(progress, "WORTH_SAYING_S", 5.0)
    code, _, stderr = run_cli([*LAB, "--max-steps", "6", "--timing-warmup-steps", "1"], capsys)
    assert code == 0, stderr
    assert "expected: about 12 s for 6 steps (2 s a step over steps 2-4, cpu" in stderr, stderr
