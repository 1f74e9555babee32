"""The lab on a GPU: every technique runs and trains, liger's kernels compute what ours do, the
largest batch is found by trying, an oversized batch is one clear line, the timing pitfall shows,
and the memory estimator's ``precise`` prediction holds against the measured peak.
Run on the device machine: ``python3 -m pytest -q -m gpu tests/test_lab_gpu.py``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab.experiments import pitfall as lab_pitfall  # noqa: E402
from fasttrain.lab import train as lab  # noqa: E402
from fasttrain.lab.config import preset  # noqa: E402
from fasttrain.lab.data import corpus_from_text  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def corpus():
    from fasttrain.lab.data import load_corpus

    try:
        return load_corpus()
    except FasttrainError:
        # a learnable stand-in when Tiny Shakespeare is not on the machine
        rng = np.random.default_rng(0)
        words = ["the", "king", "shall", "speak", "to", "thee", "my", "lord", "and", "we", "will", "go"]
        return corpus_from_text(" ".join(words[i] for i in rng.integers(0, len(words), 200_000)))


def small(**kw):
    base = dict(layers=4, heads=4, width=128, context=128, per_device_train_batch_size=16, max_steps=30,
                warmup_steps=5, eval_interval=0, eval_tokens=8192, log_interval=5, timing_warmup_steps=3,
                dropout=0.0, device="cuda", learning_rate=3e-3, min_lr=3e-4)
    return preset("shakespeare-char", **{**base, **kw})


TECHNIQUES = {
    "fp32": {}, "tf32": dict(tf32=True), "bf16": dict(bf16=True), "fp16": dict(fp16=True),
    "fused-adamw": dict(optim="adamw_torch_fused"), "adafactor": dict(optim="adafactor", learning_rate=1e-2),
    "adamw-8bit": dict(optim="adamw_8bit"), "sgd": dict(optim="sgd", learning_rate=0.5, min_lr=0.05),
    "sdpa": dict(attn_implementation="sdpa"), "ckpt-full": dict(gradient_checkpointing="full"),
    "ckpt-selective": dict(gradient_checkpointing="selective"), "accumulation": dict(gradient_accumulation_steps=4,
                                                                                       per_device_train_batch_size=4),
    "preload": dict(preload=True), "workers": dict(dataloader_num_workers=2, dataloader_pin_memory=True,
                                                   dataloader_prefetch_factor=2),
    "empty-cache": dict(torch_empty_cache_steps=1), "compile": dict(torch_compile=True, timing_warmup_steps=5),
    "liger-gpt2": dict(use_liger_kernel=True, bf16=True), "liger-llama": dict(style="llama", kv_heads=2,
                                                                              use_liger_kernel=True, bf16=True),
    "llama-sdpa-bf16": dict(style="llama", kv_heads=2, attn_implementation="sdpa", bf16=True),
    "pad-vocab": dict(pad_vocab_to_multiple_of=64),
}


@pytest.mark.parametrize("name", list(TECHNIQUES))
def test_every_technique_trains_on_the_gpu(corpus, name):
    if name == "adamw-8bit":
        pytest.importorskip("torchao")
    if name.startswith("liger"):
        pytest.importorskip("liger_kernel")
    rec = lab.run(small(**TECHNIQUES[name]), corpus=corpus)
    first, last = rec["loss_curve"][0]["loss"], rec["loss_curve"][-1]["loss"]
    assert np.isfinite(rec["final"]["val_loss"]) and last < first, rec["loss_curve"]
    mem = rec["memory"]
    assert mem["peak_allocated_bytes"] > 0 and mem["peak_reserved_bytes"] >= mem["peak_allocated_bytes"]
    assert mem["by_kind"]["activations"] > 0
    assert rec["step_ms"]["n"] == 30 - rec["config"]["timing_warmup_steps"] and rec["tokens_per_s"] > 0


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_liger_kernels_compute_what_the_reference_model_does(style):
    pytest.importorskip("liger_kernel")
    from fasttrain.lab.model import build

    kw = dict(style=style, kv_heads=2 if style == "llama" else None)
    ref_cfg, lig_cfg = small(**kw), small(use_liger_kernel=True, **kw)
    ref = build(lab.model_config(ref_cfg, 65), "cuda", seed=0)
    lig = build(lab.model_config(lig_cfg, 65), "cuda", seed=0)
    lig.load_state_dict(ref.state_dict())
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randint(0, 65, (8, 128), device="cuda", generator=g)
    y = torch.randint(0, 65, (8, 128), device="cuda", generator=g)
    losses = []
    for m in (ref, lig):
        loss = m(x, y)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    ref_grads = dict(ref.named_parameters())
    for n, p in lig.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n].grad, rtol=2e-3, atol=2e-4, msg=n)


def test_cuda_graphs_with_accumulation_replay_what_they_recorded_and_train_as_default_compile(corpus, monkeypatch):
    """reduce-overhead at 4 micro-batches a step: after the warm-up steps no step records a CUDA graph (a
    recording per step was 8-25x slower steps on the H100), and the losses are default compile's."""
    from fasttrain.lab.build import make_trainer
    from fasttrain.lab.trainer import Metrics

    captures = []
    real_end = torch.cuda.CUDAGraph.capture_end
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", lambda self: captures.append(1) or real_end(self))
    curves, per_step = {}, {}
    for mode in ("default", "reduce-overhead"):
        cfg = small(torch_compile=True, torch_compile_mode=mode, per_device_train_batch_size=16,
                    gradient_accumulation_steps=4, max_steps=6, timing_warmup_steps=3, log_interval=1)
        trainer = make_trainer(cfg, corpus, torch.device("cuda"))
        metrics = Metrics(cfg, torch.device("cuda"), curve=True)
        counts = []
        trainer.train(metrics=metrics, evaluate=False, on_step=lambda step: counts.append(len(captures)))
        curves[mode] = [p["loss"] for p in metrics.loss_curve]
        per_step[mode] = counts
        torch._dynamo.reset()
    recorded = per_step["reduce-overhead"]
    assert recorded[-1] > 0, "reduce-overhead recorded no CUDA graph: it did not run as CUDA graphs"
    assert recorded[2:] == [recorded[2]] * len(recorded[2:]), f"graphs recorded after warm-up: {recorded}"
    np.testing.assert_allclose(curves["reduce-overhead"], curves["default"], rtol=2e-3)


def test_auto_find_batch_size_finds_a_batch_that_fits(corpus):
    cfg = preset("char-100m", per_device_train_batch_size=4096, max_steps=4, eval_tokens=4096, eval_interval=0,
                 auto_find_batch_size=True, timing_warmup_steps=1, device="cuda")
    rec = lab.run(cfg, corpus=corpus)
    found = rec["batch"]["auto_find_batch_size"]["found"]
    assert 1 <= found < 4096 and rec["batch"]["per_device_train_batch_size"] == found
    free = torch.cuda.get_device_properties(0).total_memory
    assert rec["memory"]["peak_reserved_bytes"] <= free


def test_a_batch_that_does_not_fit_is_refused_on_its_prediction_naming_one_that_fits(corpus):
    # the estimator predicts the peak before anything is allocated; the line gives a batch that fits
    cfg = preset("char-100m", per_device_train_batch_size=4096, max_steps=2, device="cuda")
    with pytest.raises(FasttrainError, match=r"the memory estimator predicts a peak of .* GiB .*; try "
                                             r"--per-device-train-batch-size \d+"):
        lab.run(cfg, corpus=corpus)
    assert torch.cuda.memory_allocated() < 2**30          # everything freed


def test_timing_pitfall_unsynchronized_step_looks_faster(corpus):
    res = lab_pitfall.timing_pitfall(preset("shakespeare-char", device="cuda"), repeats=5, corpus=corpus)
    assert res["without_sync_ms"]["p50"] < res["with_sync_ms"]["p50"]


ESTIMATE_CASES = {
    "shakespeare-char fp32": ("shakespeare-char", {}),
    "shakespeare-char bf16": ("shakespeare-char", dict(bf16=True)),
    "shakespeare-char bf16 sdpa": ("shakespeare-char", dict(bf16=True, attn_implementation="sdpa")),
    "char-100m bf16": ("char-100m", dict(bf16=True)),
    "char-100m bf16 selective": ("char-100m", dict(bf16=True, gradient_checkpointing="selective")),
    "char-100m fp32 b4": ("char-100m", dict(per_device_train_batch_size=4)),
}


@pytest.mark.parametrize("case", list(ESTIMATE_CASES))
def test_precise_estimate_within_5_percent_of_the_lab_peak(corpus, case):
    name, kw = ESTIMATE_CASES[case]
    rec = lab.run(preset(name, max_steps=4, eval_interval=0, eval_tokens=4096, timing_warmup_steps=1, device="cuda",
                         **kw), corpus=corpus)
    est = rec["estimate"]
    assert abs(est["error_pct"]) <= 5.0, (case, rec["memory"], est)
