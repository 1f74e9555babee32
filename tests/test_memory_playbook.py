"""playbook mode: every formula term of the Ultra-Scale Playbook widget and each documented quirk
(Q1-Q14 in fasttrain/memory/playbook.py), checked against hand-derived values and against the
equations of Korthikanti et al. 2022 (arXiv:2205.05198) that the widget implements."""

from __future__ import annotations

import pytest

from fasttrain.memory import Setup, estimate, preset
from fasttrain.memory.playbook import activation_terms, activation_total, format_bytes, param_count, param_grad_opt

# a small GPT-2-like setup for the hand calculations
BASE = Setup(heads=4, kv_heads=None, micro_batch=2, hidden=8, ffn=32, layers=3, seq=5, vocab=11, tp=1, dp=1,
             opt_bytes=8, precision="mixed", seq_parallel=False, recompute="none", zero=0, ffn_act="gelu")


def test_q1_parameter_count_formula_and_its_dependence_on_sequence_length():
    # h(v + s) + L(12h^2 + 13h) + 2h = 8*16 + 3*(768 + 104) + 16
    assert param_count(BASE) == 8 * 16 + 3 * (12 * 64 + 13 * 8) + 16 == 2760
    assert param_count(BASE.with_(seq=105)) - param_count(BASE) == 8 * 100      # learned positions of length s


def test_q2_q3_feed_forward_size_activation_and_kv_heads_do_not_enter_the_parameter_count():
    for change in (dict(ffn=12345), dict(ffn_act="swiglu"), dict(ffn_act="relu"), dict(kv_heads=1)):
        assert param_count(BASE.with_(**change)) == param_count(BASE)


def test_q4_tensor_parallelism_divides_activations_only():
    t4 = BASE.with_(tp=4)
    assert param_grad_opt(t4) == param_grad_opt(BASE)
    assert activation_total(t4) < activation_total(BASE)


def test_q5_bytes_per_parameter_fp32_and_mixed():
    n = param_count(BASE)
    assert param_grad_opt(BASE) == {"parameters": 2 * n, "gradients": 2 * n, "optimizer": 12 * n}
    fp32 = BASE.with_(precision="fp32")
    assert param_grad_opt(fp32) == {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}
    assert param_grad_opt(BASE.with_(opt_bytes=4))["optimizer"] == 8 * n


@pytest.mark.parametrize("zero, sharded", [(0, ()), (1, ("optimizer",)), (2, ("optimizer", "gradients")),
                                           (3, ("optimizer", "gradients", "parameters"))])
def test_q6_zero_stages_shard_over_dp(zero, sharded):
    full = param_grad_opt(BASE.with_(dp=8))
    got = param_grad_opt(BASE.with_(dp=8, zero=zero))
    for key in ("parameters", "gradients", "optimizer"):
        assert got[key] == (full[key] / 8 if key in sharded else full[key])


def korthikanti_per_layer(s, b, h, a, t):
    """Eq. (2)/(4) of arXiv:2205.05198 (bf16, GELU MLP of 4h, dropout): sbh(10 + 24/t + 5as/(ht))."""
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("t", [1, 2, 4])
def test_q7_activations_per_layer_are_korthikanti_eq_4_with_dropout_masks(t):
    s = Setup(heads=8, micro_batch=3, hidden=64, ffn=256, layers=2, seq=16, vocab=100, tp=t, precision="mixed",
              ffn_act="gelu", recompute="none")
    terms = activation_terms(s)
    per_layer = terms["attention"] + terms["feedforward"] + terms["layernorm"]
    assert per_layer == pytest.approx(korthikanti_per_layer(16, 3, 64, 8, t), rel=1e-12)


def test_q7_selective_with_sequence_parallelism_is_34sbh_over_t():
    s = Setup(heads=8, micro_batch=3, hidden=64, ffn=256, layers=2, seq=16, vocab=100, tp=4, precision="mixed",
              ffn_act="gelu", recompute="selective", seq_parallel=True)
    terms = activation_terms(s)
    assert terms["attention"] + terms["feedforward"] + terms["layernorm"] == pytest.approx(16 * 3 * 64 * 34 / 4)


def test_q8_sequence_parallelism_leaves_the_score_term_undivided():
    s = BASE.with_(tp=4, heads=4)
    sp = activation_terms(s.with_(seq_parallel=True))["attention"]
    B, a, sl, b, h = 2, 4, 5, 2, 8
    assert sp == sl * b * h / 4 * (B * 5 + 1) + (2 * B + 1) * a * sl * sl * b          # not / 4
    no_sp = activation_terms(s)["attention"]
    assert no_sp == sl * b * h * (B * 4 / 4 + B + 1) + (2 * B + 1) * a * sl * sl * b / 4


def test_q9_logits_fp32_divided_by_t_only_with_sequence_parallelism():
    s = BASE.with_(tp=4)
    assert activation_terms(s)["cross_entropy"] == 5 * 2 * 11 * 4
    assert activation_terms(s.with_(seq_parallel=True))["cross_entropy"] == 5 * 2 * 11 * 4 / 4


def test_q10_full_recomputation_keeps_layer_inputs_never_divided_by_t():
    for change in (dict(), dict(tp=4), dict(tp=4, seq_parallel=True)):
        terms = activation_terms(BASE.with_(recompute="full", **change))
        assert terms["layer_input"] == 5 * 2 * 8 * 2 * 3


def test_q11_feed_forward_activation_terms():
    relu = activation_terms(BASE.with_(ffn_act="relu"))["feedforward"]
    gelu = activation_terms(BASE.with_(ffn_act="gelu"))["feedforward"]
    swiglu = activation_terms(BASE.with_(ffn_act="swiglu"))["feedforward"]
    sbf_B = 5 * 2 * 32 * 2
    assert relu == 5 * 2 * 8 * 2 + sbf_B + 5 * 2 * 8          # input, hidden, dropout mask
    assert gelu - relu == sbf_B
    assert swiglu - relu == 3 * sbf_B


@pytest.mark.parametrize("value, text", [
    (0, "0 Bytes"), (1023, "1023.00 Bytes"), (1024, "1.00 KB"), (1.125 * 1024 ** 3, "1.13 GB"),   # half-up, JS
    (0.125 * 1024 ** 2, "128.00 KB"), (1024 ** 5, "1.00 PB"), (3 * 1024 ** 6, "3.00 undefined"),
    (0.5, "512.00 undefined"), (2.675 * 1024, "2.67 KB"),                                         # exact binary value
])
def test_q12_format_bytes_like_the_widget(value, text):
    assert format_bytes(value) == text


def test_q13_widget_presets_are_not_the_real_llama():
    p = preset("playbook-8b")
    assert (p.heads, p.micro_batch, p.hidden, p.ffn, p.layers, p.seq, p.vocab) == (32, 32, 4096, 16384, 32, 256, 30522)
    assert (p.zero, p.tp, p.dp, p.ffn_act, p.precision) == (1, 1, 1, "swiglu", "mixed")
    p = preset("playbook-405b")
    assert (p.heads, p.hidden, p.ffn, p.layers, p.tp, p.dp) == (128, 16384, 65536, 126, 8, 8)
    tiny = preset("playbook-tiny")
    assert (tiny.layers, tiny.seq, tiny.micro_batch, tiny.ffn_act) == (1, 7, 3, "gelu")
    real = preset("llama3-8b")
    assert (real.ffn, real.vocab, real.g) == (14336, 128256, 8)


def test_q14_total_is_the_sum_of_the_four_lines():
    for name in ("playbook-tiny", "playbook-8b", "playbook-70b", "playbook-405b", "llama3-8b"):
        b = estimate(preset(name), "playbook")
        assert [l.name for l in b.lines] == ["parameters", "gradients", "optimizer", "activations"]
        assert b.total == pytest.approx(sum(l.bytes for l in b.lines), rel=1e-15)


def test_activation_total_sums_layers_then_outputs():
    terms = activation_terms(BASE)
    expected = 3 * (terms["attention"] + terms["feedforward"] + terms["layernorm"]) + sum(
        terms[k] for k in ("input_dropout", "output_layernorm", "output_projection", "cross_entropy"))
    assert activation_total(BASE) == expected


def test_playbook_rejects_amp():
    from fasttrain.errors import FasttrainError

    with pytest.raises(FasttrainError, match="only in --mode precise"):
        estimate(BASE.with_(precision="amp"), "playbook")
