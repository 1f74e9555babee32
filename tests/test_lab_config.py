"""Each setting declared once (lab/config.py), resolved once with where it came from (lab/settings.py):
the grouped --help, other names, validation once, the config file and --print-config, --resume DIR
alone, a transformers model's own defaults, and the micro-batch that lives in the config alone."""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")

from tests_support import one_error_line, run_cli, toy_text  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import config as C  # noqa: E402
from fasttrain.lab.config import GROUPS, LabConfig, training_arguments_of  # noqa: E402

TINY = ["lab", "--preset", "tiny", "--device", "cpu", "--eval-tokens", "200"]



@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(toy_text(6000))
    return path


# --- each setting declared once ------------------------------------------------------------------

def test_every_field_declares_its_help_and_group():
    for f in dataclasses.fields(LabConfig):
        assert f.metadata.get("help"), f.name
        assert f.metadata.get("group") in GROUPS, f.name
    assert C.setting_meta("optim")["choices"] == C.OPTIMS
    assert "micro_batch" in C.setting_meta("per_device_train_batch_size")["aliases"]


def test_help_lists_the_settings_in_groups_with_their_defaults(capsys):
    code, out, _ = run_cli(["lab", "--help"], capsys)
    assert code == 0
    for group in ("Model options", "Data options", "Batch options", "Precision options", "Memory options",
                  "Speed options", "Parallel options", "Output options"):
        assert group in out, group
    batch = out[out.index("Batch options"):out.index("Optimizer options")]
    assert "--per-device-train-batch-size" in batch and "default: (64)" in " ".join(batch.split())
    assert "--strategy" in out[out.index("Parallel options"):]
    assert "--micro-batch " not in out                  # another name: said on its setting, not listed twice


def test_training_arguments_come_from_the_declarations():
    cfg = LabConfig(gradient_checkpointing="full", min_lr=3e-5, tf32=True, liger_kernels="fused_linear_cross_entropy")
    args = training_arguments_of(cfg)
    assert args["per_device_train_batch_size"] == 64 and args["gradient_checkpointing"] is True
    assert args["lr_scheduler_type"] == "cosine_with_min_lr" and args["lr_scheduler_kwargs"] == {"min_lr": 3e-5}
    assert args["tf32"] is True and args["liger_kernel_config"]["fused_linear_cross_entropy"] is True
    assert "layers" not in args and "preload" not in args
    assert "tf32" not in training_arguments_of(LabConfig())


def test_another_name_is_read_as_the_setting_and_says_so(capsys):
    code, out, err = run_cli([*TINY, "--micro-batch", "4", "--seq", "16", "--print-config"], capsys)
    assert code == 0, err
    assert "per_device_train_batch_size: 4" in out and "context: 16" in out
    assert "--micro-batch is another name of --per-device-train-batch-size" in err
    assert "--seq is another name of --context" in err
    code, _, err = run_cli([*TINY, "--micro-batch", "4", "--per-device-train-batch-size", "8"], capsys)
    assert code == 1 and "name the same setting with different values" in one_error_line(err)


def test_a_config_is_validated_once_per_run(monkeypatch, capsys, text_file):
    calls = []
    real = C.validate

    def counting(cfg):
        calls.append(cfg)
        return real(cfg)
    import fasttrain.lab.settings as S

    monkeypatch.setattr(C, "validate", counting)
    monkeypatch.setattr(S, "validate", counting)
    code, _, err = run_cli([*TINY, "--max-steps", "1", "--train-file", str(text_file), "--quiet"], capsys)
    assert code == 0, err
    assert len(calls) == 1
    # a config changed after it was validated is checked again where a run starts
    cfg = real(LabConfig(device="cpu"))
    assert C.is_validated(cfg) and not C.is_validated(cfg.with_(max_steps=2))
    cfg.max_steps = -1
    with pytest.raises(FasttrainError, match="--max-steps"):
        C.ensure_valid(cfg)


# --- the config file and --print-config ----------------------------------------------------------

def test_print_config_round_trips_through_a_file(tmp_path, capsys):
    flags = [*TINY, "--learning-rate", "0.02", "--lora-target-modules", "qkv,up", "--kv-heads", "none", "--bf16"]
    code, yaml_text, err = run_cli([*flags, "--print-config"], capsys)
    assert code == 0, err
    assert yaml_text.startswith("preset: tiny\n") and "learning_rate: 0.02" in yaml_text
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    code, again, err = run_cli(["lab", "--config", str(path), "--print-config"], capsys)
    assert code == 0 and again == yaml_text, err
    # TOML, with flags' spellings; a flag on the command line wins over the file
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\nmax-steps = 7\nlearning_rate = 0.05\n')
    code, out, err = run_cli(["lab", "--config", str(toml), "--max-steps", "9", "--print-config"], capsys)
    assert code == 0, err
    assert "max_steps: 9" in out and "learning_rate: 0.05" in out


def test_the_file_and_flags_are_named_as_sources(tmp_path, capsys, monkeypatch):
    import fasttrain.lab.cli as cli

    path = tmp_path / "run.yaml"
    path.write_text("max-steps: 3\nstrategy: none\n")
    seen = {}
    monkeypatch.setattr(cli, "_train", lambda cfg, parallel, out, quiet, main, resolved: seen.update(r=resolved))
    code, _, err = run_cli([*TINY, "--config", str(path), "--learning-rate", "0.03"], capsys)
    assert code == 0, err
    sources = seen["r"].sources
    assert sources["max_steps"] == f"file {path}" and sources["learning_rate"] == "flag"
    assert sources["layers"] == "preset tiny"
    lines = seen["r"].lines()
    assert lines[0].startswith("configuration (values other than LabConfig's defaults")
    assert f"  max_steps                    3                        file {path}" in lines


@pytest.mark.parametrize("text, suffix, message", [
    (None, ".yaml", "no such file"),
    ("max-steps: [\n", ".yaml", "not valid YAML (line 2"),
    ("bogus-flag: 1\n", ".yaml", "unknown key 'bogus-flag'"),
    ("max-steps: many\n", ".yaml", "max-steps: --max-steps 'many': give an integer"),
    ("max_steps = \n", ".toml", "not valid TOML"),
    ("- a\n- b\n", ".yaml", "give a mapping of flags"),
    ("max-steps: 3\n", ".json", "give a .yaml, .yml or .toml file"),
])
def test_a_bad_config_file_is_one_line_naming_the_file_and_key(tmp_path, capsys, text, suffix, message):
    path = tmp_path / f"run{suffix}"
    if text is not None:
        path.write_text(text)
    code, _, err = run_cli([*TINY, "--config", str(path)], capsys)
    line = one_error_line(err)
    assert code == 1 and str(path) in line and message in line, line


# --- --resume DIR alone ----------------------------------------------------------------------------

def test_resume_from_a_folder_alone_continues_bit_for_bit(tmp_path, capsys, text_file):
    base = [*TINY, "--train-file", str(text_file), "--max-steps", "4", "--eval-interval", "0",
            "--save-steps", "2", "--output-dir", str(tmp_path / "run"), "--quiet"]
    code, _, err = run_cli([*base, "--out", str(tmp_path / "whole.json")], capsys)
    assert code == 0, err
    whole = json.loads((tmp_path / "whole.json").read_text())
    # the run killed after step 2 leaves checkpoint-2 (the newest one): resumed from the folder alone
    code, _, err = run_cli(["lab", "--resume", str(tmp_path / "run"), "--quiet", "--out", str(tmp_path / "r.json")],
                           capsys)
    assert code == 0, err
    resumed = json.loads((tmp_path / "r.json").read_text())
    def losses(record):
        return [(p["step"], p["loss"]) for p in record["loss_curve"]], [(e["step"], e["val_loss"]) for e in record["eval"]]
    assert losses(resumed) == losses(whole)
    assert resumed["config_sources"]["learning_rate"] == "saved"
    # a flag that would change the trajectory is refused, naming it; one that does not (max-steps) is taken
    code, _, err = run_cli(["lab", "--resume", str(tmp_path / "run"), "--learning-rate", "0.5"], capsys)
    line = one_error_line(err)
    assert code == 1 and "--learning-rate 0.5 differs from the saved run's 0.01" in line, line
    code, out, err = run_cli(["lab", "--resume", str(tmp_path / "run"), "--max-steps", "6", "--print-config"], capsys)
    assert code == 0 and "max_steps: 6" in out, err
    code, _, err = run_cli(["lab", "--resume", str(tmp_path / "none")], capsys)
    assert code == 1 and "no such folder" in one_error_line(err)


# --- a transformers model's own defaults -----------------------------------------------------------

def _llama(folder, positions=64):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=positions).save_pretrained(folder)
    return folder


def test_a_transformers_model_takes_its_own_defaults_not_the_preset(tmp_path, capsys, text_file):
    folder = _llama(tmp_path / "llama")
    model = ["lab", "--model", f"hf:{folder}", "--train-file", str(text_file), "--device", "cpu"]
    code, out, err = run_cli([*model, "--print-config"], capsys)
    assert code == 0, err
    assert "preset" not in out and "context: 64" in out and "per_device_train_batch_size: 8" in out
    assert "adam_beta2: 0.95" in out and "max_steps: 5000" in out and "warmup_steps: 100" in out
    assert "layers" not in out and "dropout" not in out
    # a run inside its warm-up says so
    code, _, err = run_cli([*model, "--max-steps", "3", "--warmup-steps", "5", "--print-config"], capsys)
    assert code == 0 and "all 3 steps sit inside the learning-rate warm-up (5 steps)" in err, err
    # a preset named beside it: its schedule over the model's defaults, never the GPT's shape
    code, out, err = run_cli([*model, "--preset", "tiny", "--print-config"], capsys)
    assert code == 0 and "max_steps: 20" in out and "context: 32" in out and "layers" not in out, err


def test_the_models_context_is_lowered_to_what_the_corpus_allows(tmp_path, capsys):
    folder = _llama(tmp_path / "llama", positions=4096)
    text = tmp_path / "short.txt"
    text.write_text(toy_text(400))
    out_json = tmp_path / "r.json"
    code, _, err = run_cli(["lab", "--model", f"hf:{folder}", "--train-file", str(text), "--device", "cpu",
                            "--max-steps", "1", "--eval-tokens", "64", "--timing-warmup-steps", "0",
                            "--out", str(out_json)], capsys)
    assert code == 0, err
    record = json.loads(out_json.read_text())
    assert "context 4096 (the model's positions) lowered to" in err
    assert record["config"]["context"] == record["corpus"]["train_tokens"] - 2
    assert record["config"]["name"] == "llama" and "layers" not in record["config"]
    assert record["config_sources"]["context"] == "model"
    assert "(the model's positions" in err and "shakespeare" not in err


def test_the_python_api_takes_the_models_defaults_too(tmp_path):
    import fasttrain.lab

    folder = _llama(tmp_path / "llama", positions=48)
    record = fasttrain.lab.run(model=f"hf:{folder}", data=toy_text(3000), max_steps=1, device="cpu", eval_tokens=64,
                               timing_warmup_steps=0)
    config = record.to_dict()["config"]
    assert config["context"] == 48 and config["name"] == "llama" and config["per_device_train_batch_size"] == 8
    assert config["adam_beta2"] == 0.95 and "dropout" not in config


def test_a_pretrained_folder_is_a_fine_tune_and_a_config_a_pre_training_run(tmp_path):
    from fasttrain.lab.defaults import hf_defaults, pretrain_lr

    folder = _llama(tmp_path / "llama")
    fresh = hf_defaults(f"hf:{folder}", {})
    assert fresh["learning_rate"][0] == pytest.approx(1e-3) and "pre-training" in fresh["learning_rate"][1]
    (folder / "model.safetensors").write_bytes(b"")
    tuned = hf_defaults(f"hf:{folder}", {"max_steps": 200})
    assert tuned["learning_rate"][0] == 2e-5 and tuned["weight_decay"][0] == 0.0
    assert tuned["warmup_steps"][0] == 6                      # 3% of the run's own 200 steps
    assert pretrain_lr(125_000_000) == pytest.approx(6e-4) and pretrain_lr(500_000_000) == pytest.approx(3e-4)
    assert pretrain_lr(10 ** 11) == 1.5e-4


# --- the micro-batch lives in the config ---------------------------------------------------------

def test_auto_find_returns_the_config_the_run_trains(corpus):
    from fasttrain.lab.batchsize import auto_find

    cfg = C.preset("tiny", device="cpu", auto_find_batch_size=True, per_device_train_batch_size=6)
    found, info = auto_find(cfg, corpus, torch.device("cpu"))
    assert found.per_device_train_batch_size == 6 and info["found"] == 6 and "no GPU" in info["note"]
    assert auto_find(cfg.with_(auto_find_batch_size=False), corpus, torch.device("cpu"))[1] is None


def test_the_trainer_draws_this_ranks_micro_batches_from_the_config(corpus):
    import inspect

    from fasttrain.lab.build import make_trainer
    from fasttrain.lab.trainer import Trainer

    assert "batch" not in inspect.signature(Trainer).parameters
    cfg = C.preset("tiny", device="cpu", per_device_train_batch_size=3, gradient_accumulation_steps=2)
    trainer = make_trainer(cfg, corpus, torch.device("cpu"))
    step = next(trainer.batches(1))
    assert [tuple(x.shape) for x, _ in step] == [(3, cfg.context)] * 2


@pytest.mark.slow
def test_the_readmes_your_model_commands_run_as_written(tmp_path):
    """The README's "Your model and your data" commands, word for word (a tiny Llama from a config, the
    run, its settings as a file, a run from the file with checkpoints, and that run continued from its
    folder alone), in a fresh folder holding only the text file they name."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Your model and your data", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 2 and "--print-config" in blocks[1] and "--resume ckpt" in blocks[1]
    (tmp_path / "my.txt").write_text(toy_text(20000))
    # `fasttrain` is the installed entry point; this interpreter's module runs the same code
    script = "set -e\nfasttrain() { \"$PY\" -m fasttrain \"$@\"; }\n" + "\n".join(blocks)
    env = {**os.environ, "PY": sys.executable, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = (json.loads((tmp_path / name).read_text()) for name in ("run.json", "run2.json"))
    assert first["config"]["context"] == 128 and first["batch"]["per_device_train_batch_size"] == 8
    assert first["config_sources"]["context"].startswith("model") and first["loss_curve"]
    assert second["config"]["max_steps"] == 20 and (tmp_path / "ckpt").is_dir()
    assert "max_steps: 20" in (tmp_path / "run.yaml").read_text()


@pytest.mark.parametrize("changes, message", [
    (dict(checkpoint_blocks=2), "--checkpoint-blocks 2 counts the blocks .* add --gradient-checkpointing full"),
    (dict(checkpoint_blocks=-1, gradient_checkpointing="full"), "--checkpoint-blocks must be a whole number >= 0"),
    (dict(checkpoint_blocks=7, gradient_checkpointing="full", layers=6), "the model has 6 blocks; give at most 6"),
])
def test_checkpoint_blocks_out_of_range_is_one_line(changes, message):
    from fasttrain.lab.config import validate

    with pytest.raises(FasttrainError, match=message):
        validate(LabConfig(device="cpu", **changes))
