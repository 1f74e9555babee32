"""What trains, counted for real: the optimizer kinds (AdamW, torchao AdamW8bit, Adafactor, SGD),
peft's LoRA on a frozen base and a soft prompt. The reference model is built on the CPU, the
optimizer takes one step, and the bytes of the real parameter, gradient and optimizer-state
tensors must equal ``precise``'s count exactly; the whole step's live-tensor peak must agree
within 2%. The page's JavaScript port is checked against Python on the same setups (node)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.memory import Setup, estimate, preset
from fasttrain.memory.precise import estimate as precise_estimate
from fasttrain.memory.training_state import optimizer_state_bytes, param_counts, param_shapes, trainable_shapes
from tests_support import no_compile

SMALL = Setup(heads=4, kv_heads=2, micro_batch=4, hidden=64, ffn=176, layers=2, seq=32, vocab=500, precision="fp32",
              ffn_act="swiglu", norm="rms", pos="rope", tied=False, bias=False, dropout=False, attention="eager",
              optimizer="foreach", workspace_mib=0.0)


def test_param_shapes_add_up_to_the_parameter_count():
    rng = random.Random(4)
    for _ in range(40):
        s = SMALL.with_(ffn_act=rng.choice(["relu", "gelu", "swiglu"]), norm=rng.choice(["rms", "layer"]),
                        bias=rng.random() < .5, tied=rng.random() < .5, pos=rng.choice(["rope", "learned"]),
                        layers=rng.randint(1, 5), kv_heads=rng.choice([1, 2, 4]))
        n = sum(a * (b if len(sh) > 1 else 1) for _, sh in param_shapes(s) for a, b in [(sh[0], sh[-1])])
        assert n == param_counts(s, 1)["total"]


def test_optimizer_state_bytes_per_parameter_as_documented():
    big = [(512, 1024)]                           # 524288 values: quantized by AdamW8bit, factored by Adafactor
    n = 512 * 1024
    s = SMALL
    assert optimizer_state_bytes(s, big) == 8 * n
    assert optimizer_state_bytes(s.with_(optim="sgd"), big) == 0
    assert optimizer_state_bytes(s.with_(optim="sgd_momentum"), big) == 4 * n
    # 8-bit: 1 B code + 4/256 B scale per value and state, + two 1 KiB code books: ~2.03 B/param
    assert optimizer_state_bytes(s.with_(optim="adamw_8bit"), big) == 2 * (n + 4 * n // 256 + 1024)
    assert 2.03 < optimizer_state_bytes(s.with_(optim="adamw_8bit"), big) / n < 2.04
    # small or odd-sized tensors keep fp32 state
    assert optimizer_state_bytes(s.with_(optim="adamw_8bit"), [(4095,)]) == 8 * 4095
    assert optimizer_state_bytes(s.with_(optim="adamw_8bit"), [(4097 * 2,)]) == 8 * 4097 * 2
    # Adafactor: row + column second moments of a matrix, the full one of a vector
    assert optimizer_state_bytes(s.with_(optim="adafactor"), big + [(64,)]) == 4 * (512 + 1024) + 4 * 64
    # mixed precision adds the fp32 master weights
    assert optimizer_state_bytes(s.with_(optim="sgd", precision="mixed"), big) == 4 * n


def test_trainable_shapes_lora_and_prompt():
    s = SMALL.with_(lora_rank=8, lora_targets=("qkv", "down"))
    h, qkv_out, f = 64, 64 + 2 * 2 * 16, 176
    assert trainable_shapes(s) == [(8, h), (qkv_out, 8), (8, f), (h, 8)] * 2
    # r (in + out) per target and layer
    b = estimate(s)
    assert b.extra["trainable_params"] == 2 * 8 * ((h + qkv_out) + (f + h))
    assert trainable_shapes(SMALL.with_(prompt_tokens=10)) == [(10, 64)]
    assert estimate(SMALL.with_(prompt_tokens=10)).extra["trainable_params"] == 640


@pytest.mark.parametrize("bad, message", [
    (dict(optim="adam"), "--optim must be one of"),
    (dict(lora_rank=-1), "--lora-r must be a non-negative integer"),
    (dict(lora_rank=4, lora_targets=("qkv", "mlp")), "--lora-targets must be distinct names"),
    (dict(lora_rank=4, prompt_tokens=3), "give --lora-r or --prompt-tokens, not both"),
    (dict(lora_rank=4, lora_targets=()), "--lora-targets is empty"),
    (dict(lora_rank=4, lora_targets=("head",), tied=True), "LoRA on the head needs an untied"),
    (dict(optim="adafactor", opt_bytes=4), "--opt-bytes is AdamW's k"),
    (dict(optim="adamw_8bit", optimizer="fused"), "has no fused implementation"),
    (dict(prompt_tokens=4, tp=2), "one tensor-parallel rank"),
    (dict(lora_dropout=1.5), "--lora-dropout must be in"),
])
def test_bad_training_setups_give_one_line(bad, message):
    with pytest.raises(FasttrainError, match=message.replace("(", r"\(")):
        estimate(SMALL.with_(**bad))


def test_playbook_mode_refuses_what_the_widget_does_not_know():
    with pytest.raises(FasttrainError, match="exist only in --mode precise"):
        estimate(preset("playbook-8b").with_(lora_rank=8), "playbook")


def test_frozen_base_lora_keeps_less_and_trains_little():
    s = preset("val-llama")
    full, lora = estimate(s), estimate(s.with_(lora_rank=16, lora_targets=("qkv", "proj", "up", "down")))
    assert lora.extra["grad_bytes"] < 0.02 * full.extra["grad_bytes"]
    assert lora.line("optimizer").bytes < 0.02 * full.line("optimizer").bytes
    act = lambda b: b.line("activations at the end of forward").bytes
    assert act(lora) < act(full)
    # a soft prompt: a frozen base keeps less, but the sequence grows by P for every activation
    p, p8 = estimate(s.with_(prompt_tokens=64)), estimate(s.with_(prompt_tokens=8))
    assert act(full) > act(p) > act(p8) and p.extra["trainable_params"] == 64 * s.hidden


# --------------------------------------------------------------------------------------------
# Against the real tensors on the CPU

torch = pytest.importorskip("torch")


def _one_step(s: Setup, track: bool = False):
    import memory_support as adapters
    from fasttrain.memory.tracker import tracked_peak_step

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = adapters.attach(adapters.build_model(s), s)
    opt = adapters.make_optimizer([p for p in model.parameters() if p.requires_grad], s)
    idx = torch.randint(0, s.vocab, (s.micro_batch, s.seq))
    tgt = torch.randint(0, s.vocab, (s.micro_batch, s.seq))
    model(idx, tgt).backward()
    opt.step()
    counted = adapters.tensor_bytes(model, opt)
    opt.zero_grad(set_to_none=True)
    peak = None
    if track:
        peak, _, _ = tracked_peak_step(model, opt, idx, tgt)
        peak -= counted["steps"]            # the 4-byte step counters are not modelled
    return counted, peak


EXACT = [
    dict(),
    dict(optim="sgd"),
    dict(optim="sgd_momentum"),
    dict(optim="adafactor", bias=True, norm="layer"),
    dict(optimizer="fused"),
    dict(lora_rank=4),
    dict(lora_rank=8, lora_targets=("qkv", "proj", "up", "down", "head"), optim="adafactor"),
    dict(prompt_tokens=8, pos="learned"),
    dict(prompt_tokens=8, optim="sgd_momentum"),
]


@pytest.mark.parametrize("changes", EXACT, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "adamw" for c in EXACT])
def test_parameter_gradient_optimizer_bytes_equal_the_real_tensors(changes):
    s = SMALL.with_(**changes)
    counted, _ = _one_step(s)
    b = estimate(s)
    assert counted["params"] == b.extra["param_bytes"]
    assert counted["grads"] == b.extra["grad_bytes"]
    assert counted["optimizer"] == b.extra["optimizer_bytes"]
    assert counted["trainable"] == b.extra["trainable_params"]


def test_adamw_8bit_state_bytes_equal_torchao():
    """The state of every trainable tensor as torchao's AdamW8bit makes it (``_new_buffer``, the
    initialisation its ``step`` runs; one real step is checked in the next test) against the count."""
    pytest.importorskip("torchao.optim", reason="torchao not installed: pip install --no-deps torchao")
    import memory_support as adapters

    # qkv 128x64, proj 64x64, up 352x64, down 64x176, embedding 500x64 are quantized (>= 4096
    # values, multiples of 256); the norms keep fp32 state
    for s in (SMALL.with_(optim="adamw_8bit"), SMALL.with_(optim="adamw_8bit", lora_rank=32, lora_targets=("up",))):
        model = adapters.attach(adapters.build_model(s), s)
        opt = adapters.make_optimizer([p for p in model.parameters() if p.requires_grad], s)
        for p in (p for p in model.parameters() if p.requires_grad):
            opt.state[p].update(exp_avg=opt._new_buffer(p, True), exp_avg_sq=opt._new_buffer(p, False))
        assert adapters.tensor_bytes(model, opt)["optimizer"] == estimate(s).extra["optimizer_bytes"]


def test_adamw_8bit_state_after_a_real_step(monkeypatch):
    torch = pytest.importorskip("torch")
    optim = pytest.importorskip("torchao.optim", reason="torchao not installed: pip install --no-deps torchao")
    # torchao compiles its step; the state it makes does not depend on that: torch.compile is the identity here
    # (compiling costs half a minute of CPU)
    monkeypatch.setattr(torch, "compile", no_compile)
    ps = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(64))]
    opt = optim.AdamW8bit(ps, lr=1e-3)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()

    def nbytes(t):   # a quantized state is a tensor subclass: the bytes of the plain tensors it holds
        if type(t) is not torch.Tensor:
            return sum(nbytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    measured = sum(nbytes(v) for st in opt.state.values() for k, v in st.items() if k != "step")
    assert measured == optimizer_state_bytes(SMALL.with_(optim="adamw_8bit"), [(64, 128), (64,)])
    assert measured == 2 * (8192 + 4 * 32 + 1024) + 2 * 4 * 64


PEAKS = [
    dict(lora_rank=4),
    dict(lora_rank=4, lora_targets=("up",)),
    dict(lora_rank=4, lora_targets=("down",), ffn_act="gelu", norm="layer", bias=True, pos="learned", tied=True),
    dict(lora_rank=4, lora_targets=("head",)),
    dict(lora_rank=4, lora_dropout=0.1),
    dict(lora_rank=4, attention="flash", recompute="selective"),
    dict(prompt_tokens=8),
    dict(prompt_tokens=8, pos="learned", dropout=True, tied=True),
    dict(optim="adafactor"),
    dict(optim="sgd_momentum"),
]


@pytest.mark.parametrize("changes", PEAKS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in PEAKS])
def test_peak_of_a_step_matches_the_live_tensor_bytes(changes):
    s = SMALL.with_(layers=3, **changes)
    _, peak = _one_step(s, track=True)
    est = precise_estimate(s, mask_bytes=4, kernel_temps=False)        # CPU: float dropout masks, no in-kernel buffers
    P = s.prompt_tokens
    total = est.total - 16 * s.micro_batch * s.seq              # ids made outside the counter
    assert abs(total - peak) / peak < 0.02, (total, peak, est.extra["peak_moment"])


# --------------------------------------------------------------------------------------------
# The page's JavaScript, run by node, against Python

def _random(rng):
    s = Setup(heads=4, kv_heads=rng.choice([1, 2, 4]), hidden=64 * rng.choice([1, 2]), ffn=rng.randint(16, 600),
              layers=rng.randint(1, 6), seq=rng.choice([16, 128, 1024]), vocab=rng.randint(50, 70000),
              micro_batch=rng.choice([1, 2, 8]), dp=rng.choice([1, 8]), zero=rng.randint(0, 3),
              precision=rng.choice(["fp32", "mixed", "amp"]), recompute=rng.choice(["none", "selective", "full"]),
              ffn_act=rng.choice(["relu", "gelu", "swiglu"]), norm=rng.choice(["rms", "layer"]),
              pos=rng.choice(["rope", "learned"]), tied=rng.random() < .5, bias=rng.random() < .5,
              dropout=rng.random() < .4, attention=rng.choice(["eager", "flash"]),
              optimizer=rng.choice(["foreach", "fused"]), workspace_mib=0.0, grad_buffers=rng.random() < .2,
              optim=rng.choice(["adamw", "adamw_8bit", "adafactor", "sgd", "sgd_momentum"]))
    kind = rng.choice(["full", "lora", "prompt"])
    if kind == "lora":
        targets = tuple(t for t in ("qkv", "proj", "up", "down", "head") if rng.random() < .5)
        s = s.with_(lora_rank=rng.choice([1, 8, 64]), lora_targets=targets, lora_dropout=rng.choice([0.0, 0.1]))
    elif kind == "prompt":
        s = s.with_(prompt_tokens=rng.choice([1, 20, 100]))
    return s


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed (apt-get install nodejs)")
def test_js_port_equals_python_with_optimizers_and_peft(tmp_path):
    from test_memory_page import compare

    rng = random.Random(13)
    setups = [_random(rng) for _ in range(300)]
    js_file = Path(__file__).resolve().parent.parent / "src" / "fasttrain" / "memory" / "assets" / "memory.js"
    cases = []
    for s in setups:
        d = asdict(s)
        d["kv_heads"] = s.g
        d["lora_targets"] = list(s.lora_targets)
        cases.append(d)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = (f"const M = require({json.dumps(str(js_file))}); const fs = require('fs');"
              f"const cases = JSON.parse(fs.readFileSync({json.dumps(str(tmp_path / 'cases.json'))}));"
              "console.log(JSON.stringify(cases.map((s) => { try { return M.precise(s); } catch (e) { return {error: e.message}; } })));")
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True).stdout
    results = json.loads(out)
    checked = errors = 0
    for s, js in zip(setups, results):
        try:
            py = estimate(s)
        except FasttrainError as exc:
            assert js.get("error") == str(exc), (s, js)
            errors += 1
            continue
        assert "error" not in js, (s, js)
        compare(js, py, str(s))
        for key in ("trainable_params", "param_bytes", "grad_bytes", "optimizer_bytes"):
            assert js[key] == pytest.approx(py.extra[key], rel=1e-12), key
        checked += 1
    assert checked > 200 and errors > 0


# --------------------------------------------------------------------------------------------
# The CLI flags

def test_cli_flags_reach_the_setup():
    from test_memory_cli import one_line_error, run

    r = run("--preset", "val-llama", "--optim", "adamw_8bit", "--lora-r", 16, "--lora-targets", "qkv,up",
            "--lora-dropout", 0.05, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    s = preset("val-llama", optim="adamw_8bit", optimizer="foreach", lora_rank=16, lora_targets=("qkv", "up"),
               lora_dropout=0.05)
    assert d["total"] == estimate(s).total and d["setup"]["lora_targets"] == ["qkv", "up"]
    r = run("--preset", "llama3-8b", "--optim", "adamw_torch", "--prompt-tokens", 20, "--json")
    assert json.loads(r.stdout)["total"] == estimate(preset("llama3-8b", optimizer="foreach", prompt_tokens=20)).total
    one_line_error(run("--optim", "lion"), "--optim must be one of adamw, adamw_8bit")
    one_line_error(run("--lora-r", 8, "--prompt-tokens", 4), "not both")
    one_line_error(run("--mode", "playbook", "--lora-r", 8), "only in --mode precise")


def test_the_estimator_takes_offload_off_the_gpu():
    """FSDP's CPUOffloadPolicy: the sharded weights, their gradients and the optimizer state in
    host memory, none of them in the per-GPU peak."""
    sharded = preset("llama3-8b", dp=4, zero=3, recompute="full")
    on_gpu, offloaded = estimate(sharded, "precise"), estimate(sharded.with_(offload=True), "precise")
    lines = {line.name: line.bytes for line in offloaded.lines}
    assert lines["optimizer"] == 0 and lines["parameters"] == 0
    # 8B over 4 ranks: ~2B params a rank; fp32 master + bf16 copy + 8 B of Adam state = 14 B a param
    saved = on_gpu.total - offloaded.total
    assert 2.0e9 * 12 < saved < 2.0e9 * 16
    with pytest.raises(FasttrainError, match="offload .* --zero 2 or 3"):
        estimate(sharded.with_(offload=True, zero=1), "precise")
