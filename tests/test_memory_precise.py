"""precise mode: each difference from the widget (D1-D21 in fasttrain/memory/precise.py), the
published parameter counts, and the whole model checked on the CPU against the live tensor bytes
of the reference PyTorch implementation (fasttrain.lab.model) counted op by op."""

from __future__ import annotations

import random

import pytest

from fasttrain.memory import Setup, estimate, preset
from fasttrain.memory.precise import layer_terms
from fasttrain.memory.training_state import dims, param_counts

MiB = 1024 ** 2


@pytest.mark.parametrize("name, count", [
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800),
    ("gpt2-124m", 124_439_808),
])
def test_published_parameter_counts(name, count):
    assert param_counts(preset(name), 1)["total"] == count
    assert estimate(preset(name)).params == count


SMALL = Setup(heads=4, kv_heads=2, micro_batch=2, hidden=16, ffn=24, layers=3, seq=8, vocab=50, precision="fp32",
              ffn_act="swiglu", norm="rms", pos="rope", tied=False, bias=False, dropout=False, attention="eager",
              optimizer="foreach", workspace_mib=0.0)


def test_d1_feed_forward_weights_from_h_ff():
    swiglu = param_counts(SMALL)
    assert swiglu["mlp_w"] == 3 * 16 * 24
    assert param_counts(SMALL.with_(ffn_act="gelu"))["mlp_w"] == 2 * 16 * 24
    assert param_counts(SMALL.with_(ffn_act="relu"))["mlp_w"] == 2 * 16 * 24


def test_d2_untied_output_projection():
    assert param_counts(SMALL)["head"] == 50 * 16
    assert param_counts(SMALL.with_(tied=True))["head"] == 0
    assert param_counts(SMALL)["total"] - param_counts(SMALL.with_(tied=True))["total"] == 50 * 16


def test_d3_grouped_query_attention():
    d = 16 // 4
    assert param_counts(SMALL)["attn_w"] == 16 * (16 + 2 * 2 * d) + 16 * 16
    assert param_counts(SMALL.with_(kv_heads=4))["attn_w"] == 4 * 16 * 16


def test_d4_positions_biases_and_norms():
    p = param_counts(SMALL)
    assert p["pos"] == 0 and p["attn_b"] == 0 and p["mlp_b"] == 0 and p["norm"] == 16
    q = param_counts(SMALL.with_(pos="learned", bias=True, norm="layer"))
    assert q["pos"] == 8 * 16
    assert q["attn_b"] == (16 + 2 * 8) + 16 and q["mlp_b"] == 2 * 24 + 16 and q["norm"] == 2 * 16
    assert p["total"] == 3 * p["layer"] + 50 * 16 + 50 * 16 + 16


def test_d5_tensor_parallel_shards_weights_gradients_optimizer():
    s = SMALL.with_(kv_heads=4, bias=True, vocab=51)
    one, four = param_counts(s, 1), param_counts(s.with_(tp=4), 4)
    assert four["attn_w"] == one["attn_w"] / 4 and four["mlp_w"] == one["mlp_w"] / 4
    assert four["attn_b"] == (16 + 2 * 16) / 4 + 16         # column bias sharded, row bias replicated
    assert four["norm"] == one["norm"]                        # norms replicated
    assert four["embed"] == 13 * 16                           # vocabulary padded to 52, / 4
    b1 = estimate(s.with_(tp=1))
    b4 = estimate(s.with_(tp=4))
    assert b4.line("parameters").bytes == 4 * four["total"] < b1.line("parameters").bytes
    assert b4.line("optimizer").bytes == 8 * four["total"]
    assert estimate(s.with_(tp=4, kv_heads=2)).params == estimate(s.with_(tp=1, kv_heads=2)).params
    assert dims(s.with_(tp=4, kv_heads=2))["kvl"] == 16 // 4      # t > g: one KV head per rank (replicated)


def test_d6_sequence_parallelism_divides_every_activation():
    s = SMALL.with_(tp=2, kv_heads=4)
    no_sp, sp = layer_terms(s), layer_terms(s.with_(seq_parallel=True))
    for part in ("attn", "mlp"):
        for key, value in no_sp[part].items():
            if key in ("norm1", "norm2", "qkv_input", "mlp_input", "dropout_mask"):
                assert sp[part][key] == value / 2, key      # replicated without SP
            else:
                assert sp[part][key] == value, key          # already / t (scores included: contrast Q8)
    assert sp["checkpoint"] == no_sp["checkpoint"] / 2       # full recomputation's inputs too (contrast Q10)


def test_d7_vocabulary_parallel_logits_without_sequence_parallelism():
    s = SMALL.with_(tp=2, kv_heads=4, vocab=64)
    b = estimate(s)
    logp = next(c for c in b.line("activations at the end of forward").children if c.name == "output: log probs")
    assert logp.bytes == 4 * 16 * 64 / 2


def test_d23_the_vocabulary_split_or_whole_under_tensor_parallelism():
    """D23: the embedding, the output layer and the logits are each split t ways (ceil(v / t)) only where
    ``vocab_split`` names them; whole (v) on every rank otherwise: parameters, gradients, optimizer state, the bf16
    head copy, the log-probabilities and the loss's backward. Megatron's layout (all three) is the default."""
    from fasttrain.errors import FasttrainError
    from fasttrain.memory.config import VOCAB_SPLITS, check

    s = SMALL.with_(kv_heads=4, vocab=51, tp=4)
    N, h, v, v4 = 16, 16, 51, 13
    assert s.vocab_split == VOCAB_SPLITS
    split, whole, head_only = (param_counts(s.with_(vocab_split=x)) for x in (VOCAB_SPLITS, (), ("embedding", "head")))
    assert (split["embed"], split["head"]) == (v4 * h, v4 * h)
    assert (whole["embed"], whole["head"]) == (v * h, v * h)
    assert (head_only["embed"], head_only["head"]) == (v4 * h, v4 * h)
    assert whole["total"] - split["total"] == 2 * (v - v4) * h
    assert (dims(s)["v_l"], dims(s.with_(vocab_split=("embedding", "head")))["v_l"]) == (v4, v)

    def output(b, name):
        return next(c.bytes for c in b.line("activations at the end of forward").children if c.name == name)
    for x, rows, cols in ((VOCAB_SPLITS, v4, v4), ((), v, v), (("embedding", "head"), v4, v)):
        b = estimate(s.with_(vocab_split=x))
        n = param_counts(s.with_(vocab_split=x))["total"]
        assert b.line("parameters").bytes == 4 * n and b.line("optimizer").bytes == 8 * n
        assert output(b, "output: log probs") == 4 * N * cols
        loss_back = next(m for m in b.extra["moments"] if m["name"] == "backward: log-softmax")["transient"]
        assert loss_back == 8 * N * cols                                  # two fp32 logits-sized gradients (D9)
        amp = estimate(s.with_(vocab_split=x, precision="amp"))
        assert output(amp, "output: head weight copy") == 2 * rows * h
    # tied: one matrix, split both ways or neither; split logits need a split output layer
    tied = s.with_(tied=True, vocab_split=())
    assert param_counts(tied)["embed"] == v * h and param_counts(tied)["head"] == 0
    for bad, text in ((dict(tied=True, vocab_split=("embedding",)), "tied embeddings are one matrix"),
                      (dict(vocab_split=("embedding", "logits")), "split logits come from a split output layer"),
                      (dict(vocab_split=("vocab",)), "vocab_split must be distinct names")):
        with pytest.raises(FasttrainError, match=text):
            check(s.with_(**bad))
    # one rank: nothing to split, the same estimate whatever the field says
    one = SMALL.with_(vocab=51)
    assert estimate(one.with_(vocab_split=())).total == estimate(one).total


def test_d8_activation_dtypes_under_autocast():
    fp32, amp = layer_terms(SMALL), layer_terms(SMALL.with_(precision="amp"))
    N, h = 16, 16
    assert amp["attn"]["norm1"] == fp32["attn"]["norm1"] == 4 * N * h + 4 * N     # fp32 residual + rstd
    assert amp["attn"]["qkv_input"] == 2 * N * h and fp32["attn"]["qkv_input"] == 4 * N * h
    unit = 4 * 8 * 8 * 2                                                          # a s^2 b
    assert fp32["attn"]["core"] - 3 * 4 * N * h == 4 * unit                       # fp32 softmax output
    assert amp["attn"]["core"] - 3 * 2 * N * h == (4 + 2) * unit                  # fp32 softmax + its bf16 copy
    assert amp["attn"]["weight_copies"] == 2 * (param_counts(SMALL)["attn_w"])
    mixed = layer_terms(SMALL.with_(precision="mixed"))
    assert mixed["attn"]["core"] - 3 * 2 * N * h == 2 * unit
    drop = layer_terms(SMALL.with_(dropout=True))
    assert drop["attn"]["core"] - fp32["attn"]["core"] == (1 + 4) * unit          # mask + dropped scores
    flash = layer_terms(SMALL.with_(attention="flash"))
    assert flash["attn"]["core"] == 4 * N * (16 + 2 * 8) + 4 * N * (16 + 8) + 4 * 4 * 2 * 8   # no s^2 term


def test_d9_log_softmax_backward_needs_two_more_fp32_logits():
    s = SMALL.with_(vocab=5000, seq=64, micro_batch=8)      # the output layer dominates
    b = estimate(s)
    m = {x["name"]: x["bytes"] for x in b.extra["moments"]}
    assert b.extra["peak_moment"] == "backward: log-softmax"
    N = 64 * 8
    assert m["backward: log-softmax"] - m["end of forward (loss)"] == 8 * N * 5000 - 4 * N * 5000


def test_d10_phases_gradients_alive_only_from_their_backward():
    b = estimate(SMALL.with_(vocab=5000, seq=64, micro_batch=8))
    assert b.line("gradients").bytes == 0               # the peak is before any gradient exists
    g = estimate(SMALL.with_(vocab=5000, seq=64, micro_batch=8, grad_buffers=True))
    assert g.line("gradients").bytes == 4 * g.params
    assert g.total - b.total == pytest.approx(4 * g.params)
    assert b.total < b.extra["all_at_once"]


def test_d11_backward_working_memory_of_eager_attention():
    s = SMALL.with_(seq=256, vocab=50, kv_heads=4)        # attention dominates
    b = estimate(s)
    assert b.extra["peak_moment"] == "backward layer 3: attention"
    unit = 4 * 256 * 256 * 2                               # a s^2 b elements
    # op level (what the CPU counter sees): softmax backward holds P, dP and dS, i.e. beyond the
    # kept P two fp32 s^2 tensors (fp32), 12 - 6 bytes under autocast (P fp32 + its bf16 copy
    # kept), two bf16 ones in pure bf16
    op = lambda x: layer_terms(x, kernel_temps=False)["attn_extra"]
    assert op(s) == 8 * unit
    assert op(s.with_(precision="amp")) == 6 * unit
    assert op(s.with_(precision="mixed")) == 4 * unit
    # on CUDA one more softmax-dtype buffer during that call (measured on the H200)
    assert layer_terms(s)["attn_extra"] == 12 * unit
    assert layer_terms(s.with_(precision="amp"))["attn_extra"] == 10 * unit
    assert layer_terms(s.with_(precision="mixed"))["attn_extra"] == 6 * unit
    # with dropout, op level: the worst moment is P V's backward: kept 4 + 1 + 4, dP_d, dO and dV
    assert op(s.with_(dropout=True)) == 4 * unit + 2 * 4 * 512 * 16
    assert layer_terms(s.with_(dropout=True))["attn_extra"] == 7 * unit


def test_d22_partial_recomputation_lies_between_none_and_full_and_peaks_at_the_end_of_forward():
    s = SMALL.with_(seq=256, layers=6)
    full, none = estimate(s.with_(recompute="full")), estimate(s)
    lt = layer_terms(s)
    one_layer = sum(lt["attn"].values()) + sum(lt["mlp"].values())
    ends = []
    for k in range(1, 6):
        part = estimate(s.with_(recompute="full", recompute_layers=k))
        assert full.total <= part.total <= none.total
        end = {m["name"]: m["kept"] for m in part.extra["moments"]}["end of forward (loss)"]
        ends.append(end)
        # every layer past the k-th keeps all its activations; the first k their input
        assert end - {m["name"]: m["kept"] for m in full.extra["moments"]}["end of forward (loss)"] \
            == pytest.approx((6 - k) * (one_layer - lt["checkpoint"]))
        # a recomputation's moment for layers 1..k only
        names = [m["name"] for m in part.extra["moments"]]
        assert [n for n in names if n.endswith("recompute")] == [f"backward layer {i}: recompute"
                                                                 for i in range(k, 0, -1)]
    assert ends == sorted(ends, reverse=True)
    assert estimate(s.with_(recompute="full", recompute_layers=6)).total == full.total


@pytest.mark.parametrize("changes, message", [(dict(recompute_layers=2), "goes with --recompute full"),
                                              (dict(recompute="full", recompute_layers=7), "between 0"),
                                              (dict(recompute="full", recompute_layers=-1), "between 0")])
def test_recompute_layers_out_of_range_is_one_line(changes, message):
    from fasttrain.errors import FasttrainError
    from fasttrain.memory.config import check

    with pytest.raises(FasttrainError, match=message):
        check(SMALL.with_(layers=6, **changes), "precise")


def test_d12_full_recomputation_holds_one_layer_during_its_backward():
    s = SMALL.with_(seq=256, layers=6)
    full, none = estimate(s.with_(recompute="full")), estimate(s)
    lt = layer_terms(s)
    one_layer = sum(lt["attn"].values()) + sum(lt["mlp"].values())
    assert full.total < none.total
    # the peak holds one whole layer beyond the checkpoints: far above the widget's inputs-only count
    assert full.line("activations").bytes >= sum(lt["attn"].values()) - lt["attn"]["proj_input"]
    assert full.total - full.line("activations").bytes < none.total
    assert one_layer > 6 * lt["checkpoint"]


def test_d13_foreach_adamw_temporary():
    s = SMALL.with_(hidden=256, heads=4, kv_heads=4, ffn=1024, seq=4, micro_batch=1)   # parameters dominate
    fe, fu = estimate(s), estimate(s.with_(optimizer="fused"))
    assert fe.extra["peak_moment"] == "optimizer step"
    m_fe = {x["name"]: x["bytes"] for x in fe.extra["moments"]}["optimizer step"]
    m_fu = {x["name"]: x["bytes"] for x in fu.extra["moments"]}["optimizer step"]
    assert m_fe - m_fu == 4 * fe.params


def test_d14_framework_buffers_and_ids():
    b = estimate(SMALL.with_(workspace_mib=64.0))
    assert b.line("framework").bytes == 64 * MiB
    d = 16 // 4
    assert b.line("buffers + token ids").bytes == 8 * 8 + 2 * 8 * d * 4 + 16 * 16     # mask, cos/sin, ids
    flash = estimate(SMALL.with_(attention="flash", pos="learned"))
    assert flash.line("buffers + token ids").bytes == 16 * 16


def test_d20_cuda_graphs_pool_adds_to_the_optimizer_step():
    """CUDA graphs: the pool, held at the graphs' own peak (the largest forward or backward moment), adds to the
    optimizer step's temporaries (made outside it); without them the step's peak is the larger of the two."""
    from fasttrain.errors import FasttrainError

    opt_heavy = SMALL.with_(hidden=256, heads=4, kv_heads=4, ffn=1024, seq=4, micro_batch=1, compiled="model")
    act_heavy = SMALL.with_(seq=64, micro_batch=8, compiled="model")
    for s in (opt_heavy, act_heavy):
        plain, graphs = estimate(s), estimate(s.with_(cuda_graphs=True))
        moments = {m["name"]: m["bytes"] for m in plain.extra["moments"]}
        persistent = sum(plain.line(n).bytes for n in ("parameters", "optimizer", "buffers + token ids", "framework"))
        opt_temp = moments.pop("optimizer step") - persistent - plain.extra["grad_bytes"]
        assert opt_temp == 4 * plain.params                        # foreach AdamW's one fp32 copy (D13)
        # no gradient buffers: the graphs' gradients are the pool's own, counted in its moments
        assert graphs.total == max(moments.values()) + opt_temp >= plain.total
        # the optimizer's temporaries no longer fit into the activations' freed memory, or the pool holds only
        # what the optimizer step holds anyway (its gradients, at the end of backward)
        assert (graphs.total > plain.total) == (s is act_heavy)
        assert graphs.total == pytest.approx(sum(l.bytes for l in graphs.lines if l.in_total), rel=1e-12)
        assert graphs.extra["peak_moment"].startswith("optimizer step beside the CUDA-graph pool")
    # accumulating: the buffers outside the pool, the gradients the backward has output so far inside it
    plain, graphs = (estimate(act_heavy.with_(grad_buffers=True, cuda_graphs=c)) for c in (False, True))
    made = graphs.line("gradients").bytes - plain.extra["grad_bytes"]
    assert 0 < made < plain.extra["grad_bytes"] and graphs.total >= plain.total + 4 * plain.params + made
    with pytest.raises(FasttrainError, match="give the compiled scope too"):
        estimate(SMALL.with_(cuda_graphs=True))


def test_zero_stages_shard_over_dp():
    s = SMALL.with_(dp=4)
    base = estimate(s)
    z1, z2, z3 = (estimate(s.with_(zero=z)) for z in (1, 2, 3))
    assert z1.line("optimizer").bytes == base.line("optimizer").bytes / 4
    assert z1.line("parameters").bytes == base.line("parameters").bytes
    assert z3.line("parameters").bytes == base.line("parameters").bytes / 4
    all_grads = lambda b: max(x["bytes"] for x in b.extra["moments"] if x["name"] == "optimizer step")
    assert all_grads(z2) < all_grads(z1)


def test_total_is_the_sum_of_the_lines_in_it():
    rng = random.Random(3)
    for _ in range(50):
        s = SMALL.with_(precision=rng.choice(["fp32", "mixed", "amp"]), recompute=rng.choice(["none", "selective", "full"]),
                        attention=rng.choice(["eager", "flash"]), dropout=rng.random() < .5, zero=rng.randint(0, 3),
                        dp=rng.choice([1, 4]), seq=rng.choice([8, 64, 300]))
        b = estimate(s)
        assert b.total == pytest.approx(sum(l.bytes for l in b.lines if l.in_total), rel=1e-12)
        assert b.total == pytest.approx(max(m["bytes"] for m in b.extra["moments"]), rel=1e-12)


# --------------------------------------------------------------------------------------------
# The model against reality, on the CPU: the reference implementation trained one step under a
# live-tensor counter (parameters, buffers and optimizer state added). fp32 only: CPU autocast
# has other op lists than CUDA's; CPU dropout keeps float masks (mask_bytes=4).

torch = pytest.importorskip("torch")


def _measure(setup):
    from fasttrain.lab.experiments import memory_check

    torch.set_num_threads(2)
    row = memory_check.run_case("cpu", device="cpu", setup=setup, steps=2)
    return row


CPU_CASES = [
    dict(),
    dict(recompute="selective", seq=64),
    dict(recompute="full", seq=64, layers=4),
    dict(recompute="full", seq=64, layers=4, recompute_layers=2),     # D22: the first 2 of 4 recompute
    dict(seq=96, micro_batch=1, kv_heads=4, pos="learned"),
    dict(ffn_act="gelu", norm="layer", tied=True, bias=True, pos="learned", dropout=True, kv_heads=4),
    dict(ffn_act="relu", ffn=256, seq=16, vocab=64),
    dict(attention="flash", kv_heads=4, seq=64),
    dict(hidden=128, ffn=352, seq=8, micro_batch=1, optimizer="fused"),
]


@pytest.mark.parametrize("changes", CPU_CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "base" for c in CPU_CASES])
def test_precise_matches_live_tensor_bytes_of_the_reference_model_on_cpu(changes):
    s = SMALL.with_(hidden=64, heads=4, kv_heads=2, ffn=176, seq=32, micro_batch=4, vocab=500, layers=3).with_(**changes)
    row = _measure(s)
    assert row["error"] == ""
    assert abs(row["error_pct"]) < 2.0, row


def test_committed_gpu_validation_is_the_current_model():
    """results/memory/validation.csv holds the H200 measurements with this model's estimates:
    rescoring the device run must give the committed numbers, every case within 10%."""
    import csv
    from pathlib import Path

    from fasttrain.memory import validate

    root = Path(__file__).resolve().parent.parent / "results" / "memory"
    rows, _ = validate.rescore(str(root / "device-run-2" / "validation.json"))
    with open(root / "validation.csv") as fh:
        committed = list(csv.DictReader(fh))
    assert [r["case"] for r in rows] == [c["case"] for c in committed] == [c[0] for c in validate.CASES]
    for r, c in zip(rows, committed):
        assert float(c["measured_mib"]) == r["measured_mib"] > 0
        assert float(c["estimate_mib"]) == r["estimate_mib"], r["case"]
        assert abs(r["error_pct"]) <= 10.0, r


def _measured_peak(log: str) -> int:
    """The measured total of a committed recompute-peaks log (``measured 35,141,587,536 (baseline ...``)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "results" / "memory" / "recompute-peaks" / log
    line = next(x for x in path.read_text().splitlines() if x.startswith("measured "))
    return int(line.split()[1].replace(",", ""))


@pytest.mark.parametrize("compiled, batch, log", [("model", 64, "recompute-model-b64.log"),
                                                  ("model", 128, "recompute-model-b128.log"),
                                                  ("blocks", 64, "recompute-blocks-b64.log"),
                                                  ("blocks", 128, "recompute-blocks-b128.log")])
def test_gpt2_compiled_with_every_block_recomputed_peaks_where_the_gpus_allocator_did(compiled, batch, log):
    """D27: GPT-2 compiled whole, eager attention, every block recomputed, bf16 autocast: the compiled backward
    recomputes the last block beside d(logits), above the loss's backward -- within 1.5% of the H200's measured
    peaks (results/memory/recompute-peaks/); compiled per block the head is eager and the loss's backward stays the
    peak. Neither sdpa nor fp32 nor a per-block compile gets the moment."""
    s = Setup(heads=12, micro_batch=batch, hidden=768, ffn=3072, layers=12, seq=1024, vocab=50304, opt_bytes=8,
              precision="amp", recompute="full", ffn_act="gelu", norm="layer", pos="learned", tied=True, bias=True,
              attention="eager", optimizer="fused", modules="hf-gpt2", compiled=compiled)
    got = estimate(s)
    measured = _measured_peak(log)
    assert got.total == pytest.approx(measured, rel=0.015)
    beside = "backward layer 12: recompute beside d(logits)"
    assert (got.extra["peak_moment"] == beside) == (compiled == "model")
    for other in (s.with_(attention="flash"), s.with_(precision="fp32")):
        assert estimate(other).extra["peak_moment"] != beside
