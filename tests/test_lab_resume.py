"""Training-state checkpoints: --save-steps writes them atomically keeping the newest k; a run killed
with SIGKILL after one and resumed with --resume follows the uninterrupted run's loss curve bit for
bit (dropout on: the random generators are restored too)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''
import json, sys, time
from pathlib import Path
from fasttrain.lab.config import preset
from fasttrain.lab.data import corpus_from_text
from fasttrain.lab.train import run
from tests_support import toy_text

out_dir, record_path, resume, hang_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = preset("tiny", device="cpu", max_steps=12, eval_interval=4, dropout=0.1, save_steps=4, save_total_limit=1,
             output_dir=out_dir, resume=resume or None)

def progress(step, total):
    if step == hang_at:          # a checkpoint of step 8 is written: stop here until killed
        Path(record_path + ".hanging").write_text(str(step))
        time.sleep(600)

rec = run(cfg, corpus=corpus_from_text(toy_text()), progress=progress)
Path(record_path).write_text(json.dumps({"loss_curve": rec["loss_curve"], "eval": rec["eval"]}))
'''


def _python(tmp_path, *args):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _curve(path):
    data = json.loads(Path(path).read_text())
    return [(p["step"], p["loss"], p["lr"]) for p in data["loss_curve"]], [(e["step"], e["val_loss"]) for e in data["eval"]]


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_bit_for_bit(tmp_path):
    whole = _python(tmp_path, tmp_path / "whole", tmp_path / "whole.json", "", 0)
    killed = _python(tmp_path, tmp_path / "ck", tmp_path / "killed.json", "", 10)
    deadline = time.time() + 300
    while not (tmp_path / "killed.json.hanging").exists():
        assert killed.poll() is None, killed.stderr.read()[-2000:]
        assert time.time() < deadline
        time.sleep(0.2)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "killed.json").exists()
    # save_total_limit 1: the newest only, written whole (no temporary folder left)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["checkpoint-8"]
    resumed = _python(tmp_path, tmp_path / "ck", tmp_path / "resumed.json", tmp_path / "ck", 0)
    assert resumed.wait(300) == 0, resumed.stderr.read()[-2000:]
    assert whole.wait(300) == 0, whole.stderr.read()[-2000:]
    a, b = _curve(tmp_path / "whole.json"), _curve(tmp_path / "resumed.json")
    assert [s for s, *_ in a[0]] == list(range(1, 13))
    assert a == b                                         # every loss, lr and validation loss, exactly


def test_resume_refuses_what_it_cannot_continue(tmp_path, corpus):
    from fasttrain.errors import FasttrainError
    from fasttrain.lab.config import preset
    from fasttrain.lab.train import run

    with pytest.raises(FasttrainError, match="--save-steps needs --output-dir"):
        preset("tiny", save_steps=2)
    with pytest.raises(FasttrainError, match="no such folder"):
        run(preset("tiny", device="cpu", resume=str(tmp_path / "nothing")), corpus=corpus)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FasttrainError, match="no checkpoint in it"):
        run(preset("tiny", device="cpu", resume=str(tmp_path / "empty")), corpus=corpus)
    cfg = preset("tiny", device="cpu", max_steps=4, eval_interval=0, save_steps=2, output_dir=str(tmp_path / "o"))
    run(cfg, corpus=corpus)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["checkpoint-2"]
    with pytest.raises(FasttrainError, match="saved with other settings: learning_rate"):
        run(cfg.with_(resume=str(tmp_path / "o"), learning_rate=0.5), corpus=corpus)
    (tmp_path / "o" / "checkpoint-2" / "state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(FasttrainError, match="cannot read state.pt") as info:
        run(cfg.with_(resume=str(tmp_path / "o")), corpus=corpus)
    assert "\n" not in str(info.value)


def test_resume_refuses_changed_text_naming_the_file(tmp_path):
    """Changed text resumed with shifted ids at exit 0; the checkpoint's data SHA-256 is compared now."""
    from fasttrain.errors import FasttrainError
    from fasttrain.lab.config import preset
    from fasttrain.lab.train import run
    from tests_support import toy_text

    text = tmp_path / "t.txt"
    text.write_text(toy_text(6000))
    cfg = preset("tiny", device="cpu", max_steps=4, eval_interval=0, save_steps=2, output_dir=str(tmp_path / "o"),
                 train_file=str(text))
    run(cfg)
    text.write_text(toy_text(6000, seed=3))
    with pytest.raises(FasttrainError) as info:
        run(cfg.with_(resume=str(tmp_path / "o")))
    line = str(info.value)
    assert "\n" not in line and f"the train file {text} changed since" in line and "--resume" in line
    text.write_text(toy_text(6000))                       # restored: it resumes
    run(cfg.with_(resume=str(tmp_path / "o")))


def test_a_save_killed_mid_write_leaves_a_temporary_that_the_next_save_removes(tmp_path, corpus):
    """SIGKILL inside save_state left checkpoint-N.XXXX.tmp for ever; the next save removes it."""
    from fasttrain.lab.config import preset
    from fasttrain.lab.train import run

    states = tmp_path / "o"
    (states / "checkpoint-2.k1ll3d.tmp").mkdir(parents=True)
    (states / "checkpoint-2.k1ll3d.tmp" / "state.pt").write_bytes(b"half")
    cfg = preset("tiny", device="cpu", max_steps=3, eval_interval=0, save_steps=2, output_dir=str(states))
    run(cfg, corpus=corpus)                 # the temporary is not "another run's files"
    assert sorted(p.name for p in states.iterdir()) == ["checkpoint-2"]


def test_resume_and_from_record_refuse_a_changed_model_config(tmp_path, capsys):
    """A transformers model's config.json changed between a run and its resume (or --from-record rerun):
    today's architecture would load the saved state into another model; refused in one line naming it."""
    transformers = pytest.importorskip("transformers")
    from fasttrain.errors import FasttrainError
    from fasttrain.lab.config import preset
    from fasttrain.lab.train import run
    from tests_support import run_cli, toy_text

    text = tmp_path / "t.txt"
    text.write_text(toy_text(6000))
    folder = tmp_path / "m"
    transformers.LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64).save_pretrained(folder)
    cfg = preset("tiny", model=f"hf:{folder}", device="cpu", max_steps=4, eval_interval=0, save_steps=2,
                 output_dir=str(tmp_path / "o"), train_file=str(text))
    run(cfg)
    original = (folder / "config.json").read_text()
    changed = json.loads(original)
    changed["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(changed))
    with pytest.raises(FasttrainError) as info:
        run(cfg.with_(resume=str(tmp_path / "o")))
    line = str(info.value)
    assert "\n" not in line and "--resume" in line and f"the model's config.json {folder / 'config.json'} changed" in line
    # --from-record: the same comparison, against what the record read
    (folder / "config.json").write_text(original)
    record = tmp_path / "run.json"
    code, _, err = run_cli(["lab", "--preset", "tiny", "--model", f"hf:{folder}", "--device", "cpu", "--quiet",
                            "--max-steps", "2", "--train-file", str(text), "--out", str(record)], capsys)
    assert code == 0, err
    (folder / "config.json").write_text(json.dumps(changed))
    code, _, err = run_cli(["lab", "--from-record", str(record), "--quiet"], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 1 and len(lines) == 1 and "--from-record" in lines[0] and "config.json" in lines[0], err
    (folder / "config.json").write_text(original)           # restored: the resume goes on
    run(cfg.with_(resume=str(tmp_path / "o")))
