"""hf_activations: what a transformers model's layers keep under torchao's float8 training (Setup.float8, D24)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.memory import estimate
from fasttrain.memory.config import Setup, check
from fasttrain.memory.hf_activations import hf_terms
from fasttrain.memory.hf_config import setup_from_hf_config
from fasttrain.memory.training_state import param_counts

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
# the lab's Llama 1B shape (dev/dist/bench_scale.py's llama-1b)
LLAMA_1B = dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=2048)


def one_b(**changes) -> Setup:
    return setup_from_hf_config(LLAMA_1B, **{**dict(micro_batch=4, seq=2048, precision="bf16", attention="sdpa",
                                                    compiled="blocks"), **changes})


def layer_bytes(t: dict) -> int:
    return sum(t["attn"].values()) + sum(t["mlp"].values())


def test_a_compiled_float8_layer_keeps_neither_the_norms_outputs_nor_the_product_nor_weight_copies():
    """Per token and layer 2 C h + C f less (the norms' bf16 outputs, the SwiGLU product: recomputed for the float8
    casts) and, under autocast, no bf16 weight copy (2 bytes a matrix entry)."""
    s = one_b()
    N, h, f = 4 * 2048, 2048, 8192
    P = param_counts(s)
    bf16, tw, rw = (hf_terms(s.with_(float8=r)) for r in ("none", "tensorwise", "rowwise"))
    assert layer_bytes(tw) == layer_bytes(rw)
    assert layer_bytes(bf16) - layer_bytes(tw) == N * (2 * 2 * h + 2 * f) + 2 * (P["attn_w"] + P["mlp_w"])
    # 39,424 bytes a token a layer for this shape (the weight copies: 2 x 60,817,408 bytes over 8,192 tokens)
    assert (layer_bytes(bf16) - layer_bytes(tw)) / N == 39424
    assert tw["mlp"]["mlp_hidden"] == 2 * 2 * N * f and tw["attn"]["qkv_input"] == tw["mlp"]["mlp_input"] == 0
    # what the partitioner needs anyway stays: the block's fp32 input, sdpa's tensors, the projection's output
    for part in ("attn", "mlp"):
        for name in ("norm1", "core", "norm2"):
            if name in bf16[part]:
                assert tw[part][name] == bf16[part][name], name


def test_eager_float8_layers_keep_bf16_s_activations_without_the_weight_copies():
    eager = one_b(compiled="none")
    bf16, f8 = hf_terms(eager), hf_terms(eager.with_(float8="tensorwise"))
    P = param_counts(eager)
    assert layer_bytes(bf16) - layer_bytes(f8) == 2 * (P["attn_w"] + P["mlp_w"])
    assert f8["mlp"]["mlp_hidden"] == bf16["mlp"]["mlp_hidden"]
    # bf16 weights (FSDP's param_dtype, ``mixed``): no copies to drop, the eager layer is unchanged
    mixed = one_b(compiled="none", precision="mixed")
    assert layer_bytes(hf_terms(mixed)) == layer_bytes(hf_terms(mixed.with_(float8="rowwise")))
    # checkpointing under autocast: autocast's cache holds no copies of float8 layers at the end of the forward
    full = one_b(compiled="none", recompute="full")
    moment = lambda s: {m["name"]: m["bytes"] for m in estimate(s, "precise").extra["moments"]}["end of forward (loss)"]
    assert moment(full) - moment(full.with_(float8="tensorwise")) == 2 * 16 * (P["attn_w"] + P["mlp_w"])


def test_gpt2_s_conv1d_layers_are_not_converted():
    gpt2 = dict(model_type="gpt2", n_embd=256, n_layer=2, n_head=4, vocab_size=512, n_positions=128)
    s = setup_from_hf_config(gpt2, micro_batch=2, seq=128, precision="bf16", compiled="blocks")
    assert estimate(s.with_(float8="tensorwise"), "precise").total == estimate(s, "precise").total


def _measured_setup(path: str) -> tuple[Setup, int]:
    record = json.loads((ROOT / path).read_text())
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record["estimate"]["setup"].items()}
    return Setup(**fields), record["memory"]["peak_allocated_bytes"]


def test_float8_peaks_of_the_1b_on_an_h100_and_the_8b_on_4_h200():
    """The two GPU runs the rule was checked against (not fitted to): the Llama 1B shape on one H100, float8
    tensorwise and rowwise 22,169 MiB (bf16 27,095); Llama-3-8B, FSDP2 ZeRO-2 on 4 H200, tensorwise 63,831 MiB
    (bf16 75,011). The 8B's 84 MiB left are float8's backward casts, not modelled (MODEL.md, D24)."""
    bf16, measured_bf16 = _measured_setup("dev/memory/float8-h100/1b-f8-none.json")
    rowwise, measured_rowwise = _measured_setup("dev/memory/float8-h100/1b-f8-rowwise.json")
    assert rowwise == bf16                              # the record's setup did not know float8
    assert abs(estimate(bf16, "precise").total - measured_bf16) < 0.001 * measured_bf16
    for recipe in ("tensorwise", "rowwise"):
        est = estimate(bf16.with_(float8=recipe), "precise").total
        assert abs(est - measured_rowwise) < 0.001 * measured_rowwise, (recipe, est / MiB)   # 22,167 vs 22,169
    eight_b, measured = _measured_setup("results/dist/nvidia-h200-x4/raw/llama3-8b/float8-tensorwise.json")
    assert abs(estimate(eight_b, "precise").total / MiB - 75011) < 1   # bf16's estimate (and measured peak)
    est = estimate(eight_b.with_(float8="tensorwise"), "precise").total
    assert abs(est - measured) < 0.002 * measured, est / MiB           # 63,747 vs 63,831


@pytest.mark.parametrize("changes, text", [
    (dict(float8="fp8"), "float8 must be one of"),
    (dict(modules="lab"), "not the lab's GPT"),
    (dict(precision="fp32"), "bf16 autocast or bf16 weights"),
    (dict(compiled="model"), "not a whole compiled model"),
    (dict(liger=("rms_norm",)), "liger's RMSNorm or SwiGLU"),
    (dict(compiled="none", lora_rank=8, lora_targets=("q_proj",)), "frozen base"),
    (dict(tp=2), "one tensor-parallel rank"),
    (dict(dp=4, zero=2, fsdp=True, precision="mixed", float8_all_gather=True), "all-gathered in float8"),
    (dict(ffn=8200), "multiples of 16"),
])
def test_float8_outside_what_was_measured_is_refused_in_one_line(changes, text):
    s = one_b().with_(float8="tensorwise")
    check(s)
    with pytest.raises(FasttrainError, match=text):
        check(s.with_(**changes))


def test_float8_beside_liger_s_fused_cross_entropy_is_modelled():
    s = one_b(liger=("fused_linear_cross_entropy",))
    assert estimate(s.with_(float8="tensorwise"), "precise").total < estimate(s, "precise").total


# --------------------------------------------------------------------------------------------
# What a per-block compiled Llama layer keeps under float8, counted on the CPU: inductor compiles each layer, one
# forward runs under saved-tensor hooks (dev/memory/float8_saved.py prints it tensor by tensor). torchao's
# Float8Linear reads CUDA's autocast state only; it is pointed at the CPU's here so its input is cast to bf16 as on
# the GPU. ``torch._scaled_mm`` runs on the CPU, tensorwise and rowwise.

TINY = dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def _cpu_autocast_float8(monkeypatch):
    torch = pytest.importorskip("torch")
    fl = pytest.importorskip("torchao.float8.float8_linear")

    def forward(self, input):
        if torch.is_autocast_enabled(input.device.type):
            input = input.to(torch.get_autocast_dtype(input.device.type))
        out = fl.matmul_with_hp_or_float8_args.apply(input, self.weight.t(), self.linear_mm_config, self.config)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    monkeypatch.setattr(fl.Float8Linear, "forward", forward)


def saved_by_compiled_layers(recipe: str, amp: bool, batch: int, seq: int) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from fasttrain.lab.parallelize import float8_filter
    from fasttrain.memory.tracker import saved_tensor_bytes

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY),
                                                          attn_implementation="sdpa")
    model.train()
    if not amp:
        model.to(torch.bfloat16)
    if recipe != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=float8_filter)
    for layer in model.model.layers:
        layer.compile()
    ids = torch.randint(0, TINY["vocab_size"], (batch, seq))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            return model(input_ids=ids, labels=ids, use_cache=False).loss

    forward().backward()                             # compiles
    n, _ = saved_tensor_bytes(forward, exclude=[*model.parameters(), *model.buffers(), ids])
    return n


@pytest.mark.slow
@pytest.mark.parametrize("amp", [True, False], ids=["autocast", "bf16-weights"])
def test_compiled_float8_layers_keep_what_the_rule_says_on_cpu(monkeypatch, amp):
    """What the float8 layers keep less than bf16's, measured, is the rule's difference (tensorwise keeps its
    scalar scales beside: at most 14 x 4 bytes a layer); rowwise keeps tensorwise's bytes less those scales."""
    pytest.importorskip("torchao")
    _cpu_autocast_float8(monkeypatch)
    batch, seq = 2, 64
    setup = setup_from_hf_config(TINY, micro_batch=batch, seq=seq, precision="bf16" if amp else "mixed",
                                 attention="sdpa", compiled="blocks", workspace_mib=0.0)
    rule = lambda r: layer_bytes(hf_terms(setup.with_(float8=r), cpu=True))
    bf16 = saved_by_compiled_layers("none", amp, batch, seq)
    for recipe in ("tensorwise", "rowwise"):
        f8 = saved_by_compiled_layers(recipe, amp, batch, seq)
        expected = TINY["num_hidden_layers"] * (rule("none") - rule(recipe))
        assert 0 <= expected - (bf16 - f8) <= TINY["num_hidden_layers"] * 14 * 4, (recipe, bf16 - f8, expected)
