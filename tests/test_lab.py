"""The efficiency lab on the CPU: techniques that must not change the function trained,
PEFT's parameter counts, optimizer state sizes, data loading, checkpoints, the CLI and bad input.
A synthetic character corpus stands in for Tiny Shakespeare except where the real file is named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests_support import no_compile, run_cli, toy_text  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab.config import LabConfig, preset  # noqa: E402
from fasttrain.lab.data import eval_windows, load_corpus, train_batches, windows  # noqa: E402
from fasttrain.lab.model import build  # noqa: E402
from fasttrain.lab import adapters as lab_adapters  # noqa: E402
from fasttrain.lab import batchsize as lab_batchsize  # noqa: E402
from fasttrain.lab import checkpoint as lab_checkpoint  # noqa: E402
from fasttrain.lab import optim as lab_optim  # noqa: E402
from fasttrain.lab.experiments import pitfall as lab_pitfall  # noqa: E402
from fasttrain.lab import train as lab  # noqa: E402
from fasttrain.lab import evaluate as lab_evaluate  # noqa: E402
from fasttrain.lab.build import make_trainer  # noqa: E402

SHAKESPEARE_SHA = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def tiny(**kw) -> LabConfig:
    base = dict(max_steps=3, eval_tokens=256, eval_interval=0, log_interval=1, timing_warmup_steps=1, device="cpu")
    return preset("tiny", **{**base, **kw})


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _model(style="gpt2", **kw):
    cfg = tiny(style=style, **({"kv_heads": 1} if style == "llama" else {}), **kw)
    return build(lab.model_config(cfg, 40), "cpu", seed=0), cfg


def _xy(n=8, s=32, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, v, (n, s), generator=g), torch.randint(0, v, (n, s), generator=g)


# --- techniques that must train the same function -----------------------------------------------

@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_gradient_accumulation_equals_the_big_batch(style):
    model, _ = _model(style)
    x, y = _xy(16)
    lab.accumulate_gradients(model, [(x, y)])
    big = _grads(model)
    model.zero_grad(set_to_none=True)
    lab.accumulate_gradients(model, list(zip(x.chunk(4), y.chunk(4))))     # 4 micro-batches of 4
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, big[name], rtol=1e-5, atol=1e-6, msg=name)


def test_accumulation_run_follows_the_same_loss_curve(corpus):
    one = lab.run(tiny(per_device_train_batch_size=8), corpus=corpus)
    two = lab.run(tiny(per_device_train_batch_size=4, gradient_accumulation_steps=2), corpus=corpus)
    assert one["batch"]["tokens_per_step"] == two["batch"]["tokens_per_step"]
    np.testing.assert_allclose([p["loss"] for p in one["loss_curve"]], [p["loss"] for p in two["loss_curve"]],
                               rtol=1e-5)
    assert two["final"]["val_loss"] == pytest.approx(one["final"]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradient_checkpointing_gives_the_same_gradients(style, mode):
    # dropout on: the recomputation must replay the same masks (checkpoint restores the RNG state)
    ref, _ = _model(style, dropout=0.2)
    ckpt, _ = _model(style, dropout=0.2, gradient_checkpointing=mode)
    assert ckpt.config.recompute == mode
    ckpt.load_state_dict(ref.state_dict())
    x, y = _xy()
    for m in (ref, ckpt):
        torch.manual_seed(5)
        m.train()
        m(x, y).backward()
    g_ckpt = _grads(ckpt)
    for name, g in _grads(ref).items():
        torch.testing.assert_close(g_ckpt[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_sdpa_and_eager_attention_agree():
    eager, _ = _model("llama")
    sdpa, _ = _model("llama", attn_implementation="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    x, y = _xy()
    torch.testing.assert_close(sdpa(x, y), eager(x, y), rtol=1e-5, atol=1e-5)


def test_padded_vocabulary_rounds_up_and_evaluates_the_real_characters(corpus):
    cfg = tiny(pad_vocab_to_multiple_of=64)
    assert lab.model_config(cfg, corpus.vocab_size).vocab == 64
    rec = lab.run(cfg, corpus=corpus)
    assert rec["model"]["vocab"] == 64 and np.isfinite(rec["final"]["val_loss"])


# --- PEFT --------------------------------------------------------------------------------------

def test_lora_freezes_the_base_and_trains_r_times_in_plus_out_per_target():
    pytest.importorskip("peft")
    model, cfg = _model("llama", lora_r=4, lora_target_modules=("qkv", "proj", "down"))
    linears = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("qkv", "proj", "down")}
    expected = sum(4 * (m.in_features + m.out_features) for m in linears.values())
    model = lab_adapters.apply_lora(cfg, model)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(p.numel() for p in trainable.values()) == expected
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = lab_optim.build_optimizer(cfg, model)
    x, y = _xy(v=cfg.vocab_size or 40)
    for _ in range(2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    assert lab_optim.optimizer_state_bytes(opt, include_scalars=False) == 8 * expected


def test_lora_unknown_target_is_one_line():
    pytest.importorskip("peft")
    model, cfg = _model("gpt2", lora_r=2, lora_target_modules=("head",))
    with pytest.raises(FasttrainError, match="tied model has no separate head"):
        lab_adapters.apply_lora(cfg, model)


def test_prompt_tuning_trains_only_the_prompt(corpus):
    model, cfg = _model("llama", prompt_tuning_tokens=5)
    lab_adapters.freeze_for_prompt_tuning(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["prompt"] and model.prompt.shape == (5, cfg.width)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = lab_optim.build_optimizer(cfg, model)
    x, y = _xy()
    model(x, y).backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n != "prompt"), n
    assert model(x).shape == (8, 32, model.config.vocab)      # logits for the real tokens only


def test_checkpoint_then_lora_prompt_and_full_fine_tuning(corpus, tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("safetensors")
    ck = tmp_path / "pre"
    pre = lab.run(tiny(style="llama", kv_heads=1, save=str(ck)), corpus=corpus)
    assert (ck / "model.safetensors").exists() and json.loads((ck / "config.json").read_text())["model"]["norm"] == "rms"
    # the saved model alone reproduces the recorded validation loss, exactly
    again = lab_evaluate.evaluate_checkpoint(ck, eval_tokens=256, device="cpu", corpus=corpus)
    assert again["val_loss"] == pre["final"]["val_loss"] == again["recorded_val_loss"]
    runs = {}
    for name, kw in {"full": {}, "lora": dict(lora_r=2), "prompt": dict(prompt_tuning_tokens=4)}.items():
        runs[name] = lab.run(tiny(init_from=str(ck), **kw), corpus=corpus)
        assert runs[name]["model"]["layers"] == 2 and runs[name]["model"]["norm"] == "rms"   # the checkpoint's shape
    assert runs["lora"]["params"]["trainable"] < runs["full"]["params"]["trainable"]
    assert runs["prompt"]["params"]["trainable"] == 4 * 32
    # fine-tuning starts from the pretrained model: its first loss is near the pretrained one
    assert runs["full"]["loss_curve"][0]["loss"] < pre["loss_curve"][0]["loss"]


# --- optimizer state ---------------------------------------------------------------------------

def _state_after_step(optim, shapes=((64, 256), (256,))):
    # torchao's 8-bit AdamW compiles its step; the state it makes does not depend on that, so its torch.compile
    # is the identity here (compiling costs 5-25 s of CPU)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "compile", no_compile)
        return _step_once(optim, shapes)


def _step_once(optim, shapes):
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    m = torch.nn.Module()
    for i, p in enumerate(params):
        m.register_parameter(f"p{i}", p)
    opt = lab_optim.build_optimizer(tiny(optim=optim), m)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize("optim,bytes_fn", [
    ("adamw_torch", lambda n, m: 8 * n * m),                  # exp_avg + exp_avg_sq in fp32
    ("adamw_torch_fused", lambda n, m: 8 * n * m),
    ("sgd", lambda n, m: 0),                                  # no momentum: no state
    ("adafactor", lambda n, m: 4 * (n + m) if m > 1 else 4 * n),   # factored second moment: a row and a column
])
def test_optimizer_state_bytes_per_parameter(optim, bytes_fn):
    opt = _state_after_step(optim)
    expected = bytes_fn(64, 256) + bytes_fn(256, 1)
    assert lab_optim.optimizer_state_bytes(opt, include_scalars=False) == expected


def test_adamw_8bit_state_is_two_bytes_per_parameter_plus_block_scales():
    pytest.importorskip("torchao")
    opt = _state_after_step("adamw_8bit")
    # the 64 x 256 matrix: 2 x (1 byte + one fp32 scale per block of 256) + the shared 256-entry code
    # table(s); the 256-vector is below torchao's 4096-element threshold and stays fp32 (8 B/param)
    n = 64 * 256
    quantized = 2 * (n + 4 * n // 256)
    got = lab_optim.optimizer_state_bytes(opt, include_scalars=False)
    assert quantized + 8 * 256 <= got <= quantized + 8 * 256 + 2 * 256 * 4


# --- data ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers,pin", [(0, False), (2, True)])
def test_preload_and_dataloader_give_the_same_batches(corpus, workers, pin):
    kw = dict(seed=7, micro_batch=3, accumulation=2, context=16, steps=4, device="cpu")
    pre = list(train_batches(corpus.train, preload=True, **kw))
    loaded = list(train_batches(corpus.train, preload=False, num_workers=workers, pin_memory=pin,
                                prefetch_factor=2 if workers else None, **kw))
    assert len(pre) == len(loaded) == 4
    for step_pre, step_loaded in zip(pre, loaded):
        assert len(step_pre) == len(step_loaded) == 2             # the step's 2 micro-batches
        for (xp, yp), (xl, yl) in zip(step_pre, step_loaded):
            assert xp.shape == (3, 16) and torch.equal(xp, xl) and torch.equal(yp, yl)
            assert torch.equal(xp[:, 1:], yp[:, :-1])             # targets are the next characters
    other = list(train_batches(corpus.train, preload=True, **{**kw, "seed": 8}))
    assert not torch.equal(other[0][0][0], pre[0][0][0])


def test_validation_windows_predict_every_character_once():
    wins = eval_windows(np.zeros(1001, dtype=np.uint8), 64)
    assert sum(n for _, n in wins) == 1000 and wins[-1] == (960, 40)
    assert all(s == i * 64 for i, (s, _) in enumerate(wins))
    assert sum(n for _, n in eval_windows(np.zeros(1001, dtype=np.uint8), 64, tokens=100)) == 100


def test_char_corpus_split_and_round_trip(corpus):
    assert len(corpus.train) == int(0.9 * (len(corpus.train) + len(corpus.val)))
    w = windows(corpus.train, np.array([0, 5]), 8)
    assert corpus.decode(w[0]) == toy_text()[:9]


def test_tiny_shakespeare_split_and_vocabulary(shakespeare_dir):
    c = load_corpus(shakespeare_dir)
    assert c.vocab_size == 65 and len(c.train) == 1_003_854 and len(c.val) == 111_540


def test_missing_and_corrupt_corpus_are_one_line_errors(tmp_path):
    from fasttrain.errors import DataError

    with pytest.raises(DataError, match="download it with: fasttrain data download --dataset tinyshakespeare"):
        load_corpus(tmp_path)
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("not shakespeare")
    with pytest.raises(DataError, match="checksum mismatch"):
        load_corpus(tmp_path)


def test_download_writes_only_a_verified_file(tmp_path, monkeypatch):
    from fasttrain.data import datasets, text
    from fasttrain.errors import DataError

    good = toy_text().encode()
    monkeypatch.setitem(text.TEXT_DATASETS, "tinyshakespeare",
                        text.TEXT_DATASETS["tinyshakespeare"].__class__(
                            "tinyshakespeare", "Tiny Shakespeare", "input.txt",
                            __import__("hashlib").sha256(good).hexdigest(), len(good), ("http://a/", "http://b/")))
    served = {"http://a/": b"wrong bytes", "http://b/": good}
    monkeypatch.setattr(datasets, "_fetch", lambda url, dest, *args: Path(dest).write_bytes(served[url]))
    report = datasets.download_dataset("tinyshakespeare", tmp_path, progress=False)
    assert report[0][1] == "downloaded from http://b/"
    assert (tmp_path / "tinyshakespeare" / "input.txt").read_bytes() == good
    assert sorted(p.name for p in (tmp_path / "tinyshakespeare").iterdir()) == ["input.txt"]
    served["http://b/"] = b"also wrong"
    with pytest.raises(DataError, match="could not download"):
        datasets.download_dataset("tinyshakespeare", tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()   # nothing half-written, and no folder the failed download made


# --- the run record, the estimator, batch search, the pitfall ----------------------------------------

def test_run_record_has_timing_memory_estimate_and_losses(corpus):
    rec = lab.run(tiny(max_steps=4, eval_interval=2, optim="adamw_torch_fused", torch_empty_cache_steps=1),
                  corpus=corpus)
    assert rec["step_ms"]["n"] == 3 and len(rec["warmup_ms"]) == 1
    assert rec["step_ms"]["p20"] <= rec["step_ms"]["p50"] <= rec["step_ms"]["p80"]
    assert [e["step"] for e in rec["eval"]] == [2, 4] and rec["eval"][0]["tokens"] == 256
    assert rec["tokens_per_s"] > 0 and rec["environment"]["python"]
    kinds = rec["memory"]["by_kind"]
    n = rec["params"]["total"]
    assert kinds["parameters"] == 4 * n and kinds["gradients"] == 4 * n
    assert 8 * n <= kinds["optimizer_state"] <= 8 * n + 64 * 4
    est = rec["estimate"]
    assert est["precise_bytes"] > kinds["parameters"] + kinds["optimizer_state"]
    assert est["setup"]["optimizer"] == "fused" and est["setup"]["vocab"] == corpus.vocab_size


def test_lab_setup_maps_the_configuration():
    s = lab.lab_setup(preset("shakespeare-char", bf16=True, gradient_checkpointing="selective",
                             attn_implementation="sdpa", gradient_accumulation_steps=2))
    assert (s.layers, s.heads, s.hidden, s.ffn, s.seq, s.vocab, s.micro_batch) == (6, 6, 384, 1536, 256, 65, 64)
    assert (s.norm, s.pos, s.tied, s.bias, s.dropout, s.ffn_act) == ("layer", "learned", True, False, True, "gelu")
    assert (s.precision, s.recompute, s.attention, s.grad_buffers) == ("amp", "selective", "flash", True)
    big = lab.lab_setup(preset("char-100m"))
    assert big.g == 4 and big.norm == "rms"
    from fasttrain.memory.training_state import param_counts

    assert 95e6 < param_counts(big)["total"] < 110e6


def test_find_batch_size_halves_then_bisects():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 37

    assert lab_batchsize.find_batch_size(256, fits) == 37
    assert tried[:4] == [256, 128, 64, 32]
    assert lab_batchsize.find_batch_size(16, lambda b: True) == 16
    assert lab_batchsize.find_batch_size(16, lambda b: False) == 0


def test_timing_pitfall_reports_both_ways(corpus):
    res = lab_pitfall.timing_pitfall(tiny(), repeats=2, warmup=1, corpus=corpus)
    assert res["with_sync_ms"]["n"] == res["without_sync_ms"]["n"] == 2


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = preset("shakespeare-char")
    assert lab_optim.lr_at(cfg, 0) < lab_optim.lr_at(cfg, 50) < lab_optim.lr_at(cfg, 99) <= cfg.learning_rate
    assert lab_optim.lr_at(cfg, 100) == pytest.approx(cfg.learning_rate)
    assert lab_optim.lr_at(cfg, cfg.max_steps) == pytest.approx(cfg.min_lr)


# --- the CLI and bad input ---------------------------------------------------------------------------


def test_cli_trains_tiny_with_several_techniques(fake_corpus, tmp_path, capsys):
    out = tmp_path / "run.json"
    code, stdout, stderr = run_cli(["lab", "--preset", "tiny", "--max-steps", "4", "--device", "cpu",
                                 "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2",
                                 "--gradient-checkpointing", "--optim", "adafactor", "--preload",
                                 "--style", "llama", "--kv-heads", "1", "--attn-implementation", "sdpa",
                                 "--pad-vocab-to-multiple-of", "64", "--eval-tokens", "128", "--out", str(out)], capsys)
    assert code == 0, stderr
    rec = json.loads(out.read_text())
    assert rec["config"]["gradient_checkpointing"] == "full" and rec["config"]["optim"] == "adafactor"
    assert rec["model"]["recompute"] == "full" and rec["model"]["attention"] == "sdpa"
    assert "val loss" in stdout and "memory by kind" in stdout


def test_cli_dataloader_workers_and_fp16_autocast(fake_corpus, tmp_path, capsys):
    code, stdout, stderr = run_cli(["lab", "--preset", "tiny", "--max-steps", "2", "--device", "cpu", "--quiet",
                                 "--dataloader-num-workers", "1", "--dataloader-prefetch-factor", "2",
                                 "--bf16", "--out", str(tmp_path / "r.json")], capsys)
    assert code == 0, stderr
    assert json.loads((tmp_path / "r.json").read_text())["precision"] == "bf16"


def test_cli_pitfall(fake_corpus, capsys):
    code, stdout, stderr = run_cli(["lab", "pitfall", "--preset", "tiny", "--device", "cpu", "--repeats", "2"], capsys)
    assert code == 0, stderr
    assert "synchronize" in stdout


@pytest.mark.parametrize("args,message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--optim", "adam9"], "'adam9' is not one of"),
    (["--no-such-flag"], "No such option '--no-such-flag'"),
    (["--fp16", "--bf16"], "give --fp16 or --bf16, not both"),
    (["--heads", "5"], "must divide --width"),
    (["--per-device-train-batch-size", "0"], "must be a positive integer"),
    (["--use-liger-kernel"], "needs a CUDA GPU"),
    (["--init-from", "/nonexistent/ck"], "is not a lab checkpoint"),
    (["--lora-r", "2", "--prompt-tuning-tokens", "3"], "not both"),
])
def test_cli_bad_input_is_one_line_without_output_file(fake_corpus, tmp_path, capsys, args, message):
    out = tmp_path / "run.json"
    code, stdout, stderr = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", *args, "--out", str(out)]
                                if args[0] != "--preset" else ["lab", *args, "--quiet", "--out", str(out)], capsys)
    assert code != 0
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], stderr
    assert "Traceback" not in stderr and not out.exists()


@pytest.mark.parametrize("where,message", [
    (["--out", ""], "--out is empty"),
    (["--out", "{tmp}/"], "is a directory"),      # click refuses it as the option is parsed
    (["--out", "{tmp}/missing/run.json"], "does not exist; create it first"),
    (["--save", "{tmp}/missing/ck"], "does not exist; create it first"),
    (["--save", "{tmp}/a-file"], "that is a file, not a folder"),
])
def test_cli_output_paths_are_checked_before_training(fake_corpus, tmp_path, capsys, monkeypatch, where, message):
    import fasttrain.lab.train as train

    (tmp_path / "a-file").write_text("keep me")
    monkeypatch.setattr(train, "Trainer", None)       # training must not start
    args = [w.format(tmp=tmp_path) for w in where]
    code, stdout, stderr = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", *args], capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and message in lines[0], stderr
    assert not (tmp_path / "missing").exists() and (tmp_path / "a-file").read_text() == "keep me"


def test_cli_run_record_is_strict_json_with_the_usual_mode(fake_corpus, tmp_path, capsys):
    from fasttrain.files import default_file_mode

    out = tmp_path / "run.json"
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--max-steps", "2", "--device", "cpu", "--quiet",
                               "--out", str(out)], capsys)
    assert code == 0, stderr
    assert out.stat().st_mode & 0o777 == default_file_mode()
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_cli_eval_of_a_saved_checkpoint(fake_corpus, tmp_path, capsys):
    pytest.importorskip("safetensors")
    ck = tmp_path / "ck"
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--max-steps", "2",
                            "--eval-tokens", "300", "--save", str(ck), "--out", str(tmp_path / "r.json")], capsys)
    assert code == 0, stderr
    recorded = json.loads((tmp_path / "r.json").read_text())["final"]["val_loss"]
    code, stdout, stderr = run_cli(["lab", "eval", str(ck), "--device", "cpu", "--eval-tokens", "300"], capsys)
    assert code == 0, stderr
    assert f"val loss {recorded:.6f}" in stdout and f"recorded at save: {recorded:.6f}" in stdout
    code, _, stderr = run_cli(["lab", "eval", str(tmp_path / "nothing")], capsys)
    assert code == 1 and "is not a lab checkpoint" in stderr


def test_cli_missing_data_is_one_line(tmp_path, capsys):
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--data-dir", str(tmp_path)],
                           capsys)
    assert code == 1 and stderr.startswith("error: Tiny Shakespeare file not found") and stderr.count("\n") == 1


def test_missing_optional_library_names_the_extra(fake_corpus, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)          # import peft -> ImportError
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--lora-r", "2"], capsys)
    assert code == 1 and 'pip install -e ".[lab]"' in stderr and stderr.count("\n") == 1


def test_cli_help_lists_the_trainingarguments_flags(capsys):
    code, stdout, _ = run_cli(["lab", "--help"], capsys)
    assert code == 0
    for flag in ("--per-device-train-batch-size", "--auto-find-batch-size", "--gradient-accumulation-steps",
                 "--gradient-checkpointing", "--fp16", "--bf16", "--tf32", "--optim", "--preload",
                 "--dataloader-num-workers", "--dataloader-pin-memory", "--dataloader-prefetch-factor",
                 "--torch-empty-cache-steps", "--torch-compile", "--torch-compile-mode", "--lora-r", "--lora-alpha",
                 "--lora-target-modules", "--prompt-tuning-tokens", "--attn-implementation", "--use-liger-kernel",
                 "--pad-vocab-to-multiple-of", "--init-from", "--save"):
        assert flag in stdout, flag


def test_runs_without_the_optional_libraries(fake_corpus, monkeypatch, tmp_path, capsys):
    import sys

    for name in ("peft", "liger_kernel", "torchao", "safetensors", "bitsandbytes"):
        monkeypatch.setitem(sys.modules, name, None)
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--max-steps", "2",
                            "--gradient-checkpointing", "selective", "--out", str(tmp_path / "r.json")], capsys)
    assert code == 0, stderr
    code, _, stderr = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--save", str(tmp_path / "ck")],
                           capsys)
    assert code == 1 and "safetensors" in stderr and not (tmp_path / "ck").exists()


def test_every_optimizer_follows_the_learning_rate_schedule(corpus, monkeypatch):
    """The schedule sets each step's lr on every optimizer, torchao's 8-bit AdamW included (it keeps
    lr as a tensor and refuses a float: seen on the GPU)."""
    pytest.importorskip("torchao")
    from fasttrain.lab.optim import lr_at
    from fasttrain.lab.build import make_trainer

    cfg = tiny(optim="adamw_8bit", max_steps=3, warmup_steps=2)
    trainer = make_trainer(cfg, corpus, torch.device("cpu"))
    monkeypatch.setattr(torch, "compile", no_compile)       # torchao's step, eager: the schedule is the same
    for step, micro_batches in zip(range(2), trainer.batches(2)):
        trainer.train_step(micro_batches)
        lrs = [float(g["lr"]) for g in trainer.optimizer.param_groups]
        assert lrs == pytest.approx([lr_at(cfg, step)] * len(lrs))
