"""``playbook`` mode: the Ultra-Scale Playbook memory widget, formula for formula.

Reimplemented from the widget's source (``src/memory.js`` of the Hugging Face space
``nanotron/ultrascale-playbook``; read from a public copy, not copied). Everything the widget
does is kept, including what it gets wrong, so that this mode reproduces its numbers. The
quirks, numbered as in MODEL.md and tested one by one in ``tests/test_memory_playbook.py``:

Q1  Parameter count ``n = h(v + s) + L(12h^2 + 13h) + 2h``: a GPT-2-style model with learned
    position embeddings of the *training* length s (the count moves with the sequence slider),
    tied input/output embeddings, LayerNorm and biases everywhere.
Q2  The per-layer ``12h^2`` assumes a 4h two-matrix MLP: the feed-forward width h_ff and the
    activation (SwiGLU has three matrices) never enter the parameter count.
Q3  No grouped-query attention: K and V are h x h.
Q4  Tensor parallelism divides activations only; parameters, gradients and optimizer state are
    not sharded by t.
Q5  Mixed precision: 2-byte parameters and gradients, and the fp32 master copy folded into the
    optimizer (k + 4 bytes); fp32 training: 4-byte parameters and gradients, k bytes of optimizer.
Q6  ZeRO: stage >= 1 divides the optimizer state by d, >= 2 the gradients, >= 3 the parameters.
Q7  Activations follow Korthikanti et al. (arXiv:2205.05198) with dropout masks (1 byte per
    element) always counted, although Llama-style models have no dropout.
Q8  With sequence parallelism the attention-score term ``(2B + 1) a s^2 b`` is NOT divided by t
    (it is without sequence parallelism): a bug of the widget, kept.
Q9  The output logits are counted in fp32 (``4 s b v``) and divided by t only with sequence
    parallelism.
Q10 Full recomputation keeps ``s b h B`` per layer (the layer inputs), never divided by t, not even
    with sequence parallelism, and nothing for the layer being recomputed during backward.
Q11 ReLU stores only the input of the second linear (its output); GELU also stores its input;
    SwiGLU stores 3 s b h_ff B for the activation (gate, up and silu(gate)) plus the product.
Q12 Bytes are shown 1024-based under the labels KB/MB/GB/TB/PB, with two decimals rounded
    half-up like JavaScript's ``toFixed`` (Python would round half-even); below 1 byte or at
    1024^6 bytes and above the unit is ``undefined``, as in JavaScript.
Q13 The widget's presets are not the real Llama 3 models (4h feed-forward, BERT's vocabulary
    30522, s = 256, b = 32; see ``config.PRESETS['playbook-*']``), and its vocabulary slider stops
    at 100000, below Llama 3's 128256.
Q14 The total is the plain sum of parameters, gradients, optimizer state and activations, as if
    all were alive at once.

Here B (``bytes_per_value``) is 2 with mixed precision, else 4.
"""

from __future__ import annotations

import math

from fasttrain.memory.breakdown import Breakdown, Line, to_fixed
from fasttrain.memory.config import Setup, check


def param_count(s: Setup) -> float:
    """Q1-Q3: ``h(v + s) + L(12h^2 + 13h) + 2h`` (as a float, like the widget's JavaScript numbers)."""
    h, v, sl, L = float(s.hidden), float(s.vocab), float(s.seq), float(s.layers)
    embeddings = h * (v + sl)                   # token + learned position embeddings, tied head
    one_layer = 12 * h ** 2 + 13 * h            # QKV+O (4h^2) + 4h MLP (8h^2); biases + 2 LayerNorms (13h)
    final_norm = 2 * h
    return embeddings + L * one_layer + final_norm


def param_grad_opt(s: Setup) -> dict[str, float]:
    """Q4-Q6: bytes of parameters, gradients and optimizer state on one GPU."""
    n = param_count(s)
    k = float(s.opt_bytes) + (4 if s.mixed else 0)  # fp32 master weights ride with the optimizer
    per_param = 2.0 if s.mixed else 4.0
    d = float(s.dp)
    return {
        "parameters": per_param * n / d if s.zero >= 3 else per_param * n,
        "gradients": per_param * n / d if s.zero >= 2 else per_param * n,
        "optimizer": k * n / d if s.zero >= 1 else k * n,
    }


def activation_terms(s: Setup) -> dict[str, float]:
    """Q7-Q11: per-layer and output activation bytes (the widget's treemap leaves).

    Floats, in the widget's order of operations, so that the sums match it to the last bit.
    """
    a, b, h, f = float(s.heads), float(s.micro_batch), float(s.hidden), float(s.ffn)
    sl, v, t = float(s.seq), float(s.vocab), float(s.tp)
    B = 2.0 if s.mixed else 4.0
    sp = s.seq_parallel
    # Attention (eq. 2 and Table 2 of arXiv:2205.05198): QKV input, Q, K, V, output-projection
    # input and dropout mask: sbh(4B/t + B + 1); scores: softmax + its dropout mask + the dropped
    # scores, (2B + 1) a s^2 b.
    if s.recompute in ("none", "full"):
        if sp:
            attention = sl * b * h / t * (B * 5 + 1) + ((2 * B + 1) * a * sl * sl * b)        # Q8: no / t
        else:
            attention = sl * b * h * (B * 4 / t + B + 1) + ((2 * B + 1) * a * sl * sl * b / t)
    else:  # selective: the a s^2 b term is recomputed
        attention = sl * b * h / t * (B * 5 + 1) if sp else sl * b * h * (B * 4 / t + B + 1)
    # Feed-forward: input of the first linear (sbhB, replicated unless SP), input of the second
    # (s b h_ff B / t), activation-function inputs (Q11), dropout mask (sbh, 1 byte).
    if sp:
        first, drop = sl * b * h * B / t, sl * b * h / t
    else:
        first, drop = sl * b * h * B, sl * b * h
    second = sl * b * f * B / t
    if s.ffn_act == "relu":
        ffn = first + second + drop
    elif s.ffn_act == "gelu":
        ffn = first + second + sl * b * f * B / t + drop
    else:  # swiglu
        ffn = first + second + sl * b * f * B * 3 / t + drop
    layer_norm = sl * b * h * B / t if sp else sl * b * h * B
    out = {
        "input_dropout": sl * b * h / t if sp else sl * b * h,                 # embedding dropout mask
        "output_layernorm": sl * b * h * B / t if sp else sl * b * h * B,
        "output_projection": sl * b * h * B / t if sp else sl * b * h * B,
        "cross_entropy": sl * b * v * 4 / t if sp else sl * b * v * 4,         # Q9: fp32 logits
    }
    if s.recompute == "full":
        return {"layer_input": sl * b * h * B * float(s.layers), **out}       # Q10
    return {"attention": attention, "feedforward": ffn, "layernorm": 2 * layer_norm, **out}


def activation_total(s: Setup) -> float:
    """The widget's ``activationMemory`` node, summed in d3's order (layer by layer, then the outputs)."""
    terms = activation_terms(s)
    total = 0.0
    if s.recompute == "full":
        for name in ("layer_input", "input_dropout", "output_layernorm", "output_projection", "cross_entropy"):
            total += terms[name]
        return total
    for _ in range(s.layers):
        total += 0 + terms["attention"] + terms["feedforward"] + terms["layernorm"]
    for name in ("input_dropout", "output_layernorm", "output_projection", "cross_entropy"):
        total += terms[name]
    return total


def estimate(s: Setup) -> Breakdown:
    """The widget's breakdown: parameters, gradients, optimizer, activations; total = their sum (Q14)."""
    check(s, "playbook")
    pgo = param_grad_opt(s)
    terms = activation_terms(s)
    activations = activation_total(s)
    L = s.layers
    if s.recompute == "full":
        children = [Line("layer inputs (x L)", terms["layer_input"])]
    else:
        children = [Line("attention (x L)", terms["attention"] * L), Line("feed-forward (x L)", terms["feedforward"] * L),
                    Line("layer norms (x L)", terms["layernorm"] * L)]
    children += [Line("input dropout", terms["input_dropout"]), Line("output layer norm", terms["output_layernorm"]),
                 Line("output projection", terms["output_projection"]),
                 Line("cross-entropy logits (fp32)", terms["cross_entropy"])]
    # Total: d3 sums activationMemory first, then Parameters, Gradients, OptimizerAverages.
    pgo_sum = 0.0 + pgo["parameters"] + pgo["gradients"] + pgo["optimizer"]
    total = 0.0 + activations + pgo_sum
    lines = [
        Line("parameters", pgo["parameters"], "2 B/param mixed, 4 fp32; / d at ZeRO-3; never / t (Q4)"),
        Line("gradients", pgo["gradients"], "/ d at ZeRO-2"),
        Line("optimizer", pgo["optimizer"], f"k{' + 4 (fp32 master)' if s.mixed else ''} B/param; / d at ZeRO-1"),
        Line("activations", activations, "Korthikanti et al. 2022 with dropout masks", children=children),
    ]
    return Breakdown(mode="playbook", setup=s, lines=lines, total=total, params=param_count(s),
                     notes=["total = sum of all lines, as the widget shows it (Q14)"])


def format_bytes(value: float) -> str:
    """The widget's ``formatBytes``: 1024-based, KB/MB/... labels, 2 decimals half-up (Q12)."""
    sizes = ["Bytes", "KB", "MB", "GB", "TB", "PB"]
    if value == 0:
        return "0 Bytes"
    i = math.floor(math.log(value) / math.log(1024))
    unit = sizes[i] if 0 <= i < len(sizes) else "undefined"
    return f"{to_fixed(value / 1024 ** i, 2)} {unit}"
