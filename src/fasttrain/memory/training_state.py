"""The training state of one rank, as ``precise`` counts it: per-rank sizes and bytes per element,
the parameters (counts and shapes, D1-D5), the tensors that train (every parameter, peft's LoRA
pairs on a frozen base, or a soft prompt: D16, D17) and what the optimizer keeps and borrows for
them by kind (AdamW, torchao AdamW8bit, Adafactor, SGD: D13, D15).

The activations, the phases of a step and the peak are :mod:`fasttrain.memory.precise`'s; the
D-numbers refer to its list of differences from the widget.
"""

from __future__ import annotations

from fasttrain.memory.config import HF_LINEARS, Setup


def vocab_rows(s: Setup, t: int | None = None) -> dict:
    """The vocabulary's share on one rank of t (D23): ``embed`` rows of the embedding, ``head`` rows of the output
    layer, ``logits`` columns of the logits. Split: ceil(v / t) (the vocabulary padded to a multiple of t, or the
    first ranks' larger chunk); whole (not in ``s.vocab_split``): v."""
    t = s.tp if t is None else t
    share = lambda what: -(-s.vocab // t) if what in s.vocab_split else s.vocab
    return {"embed": share("embedding"), "head": share("head"), "logits": share("logits")}


def dims(s: Setup) -> dict:
    """Per-rank sizes: local heads, widths and vocabulary under tensor parallelism t (``v_l``: the logits' columns,
    ``v_h``: the output layer's rows, ``v_e``: the embedding's; D23)."""
    t = s.tp
    d = s.d
    g_local = s.g // t if s.g % t == 0 else 1          # KV heads replicated when t > g
    v = vocab_rows(s, t)
    return {
        "t": t, "r": t if s.seq_parallel else 1, "d": d,
        "a_l": s.heads // t, "hl": (s.heads // t) * d, "kvl": g_local * d,
        "f_l": s.ffn // t, "v_l": v["logits"], "v_h": v["head"], "v_e": v["embed"], "N": s.seq * s.micro_batch,
    }


def dtypes(s: Setup) -> dict:
    """Bytes per element of each kind of tensor under the precision setting."""
    mixed, amp = s.precision == "mixed", s.precision == "amp"
    return {
        # (FSDP: its fp32 shards are the master weights, counted as the parameters)
        "param": 2 if mixed else 4, "grad": 2 if mixed else 4, "opt": s.opt_bytes + (4 if mixed and not s.fsdp else 0),
        "R": 2 if mixed else 4,          # residual stream (norm inputs): fp32 under autocast
        "C": 4 if s.precision == "fp32" else 2,   # matmul inputs and everything bf16
        "Dsm": 2 if mixed else 4,        # softmax output: autocast runs softmax in fp32
        "cast": amp,                     # autocast makes bf16 copies (weights, softmax output, logits)
        "stat": 4 * (1 if s.norm == "rms" else 2),  # fp32 rstd (RMSNorm) or mean + rstd (LayerNorm)
    }


def biases(s: Setup) -> tuple[bool, bool, bool]:
    """Which linears have biases: (q/k/v, attention output, MLP); each follows ``bias`` unless set."""
    pick = lambda x: s.bias if x is None else x
    return pick(s.qkv_bias), pick(s.proj_bias), pick(s.mlp_bias)


def param_counts(s: Setup, t: int | None = None) -> dict:
    """Parameters per rank (``t`` = tensor-parallel size; 1 gives the whole model)."""
    t = s.tp if t is None else t
    h, d, f = s.hidden, s.d, s.ffn // t
    hl, g_l = (s.heads // t) * d, (s.g // t if s.g % t == 0 else 1)
    kvl, v = g_l * d, vocab_rows(s, t)
    n_up = 2 if s.ffn_act == "swiglu" else 1
    qkv_b, proj_b, mlp_b = biases(s)
    attn_w = h * (hl + 2 * kvl) + hl * h                         # fused QKV (column) + output (row)
    mlp_w = n_up * h * f + f * h                                 # up/gate (column) + down (row)
    attn_b = ((hl + 2 * kvl) if qkv_b else 0) + (h if proj_b else 0)   # column bias / t, row bias replicated
    mlp_b = n_up * f + h if mlp_b else 0
    norm = h + (h if s.norm == "layer" and s.bias else 0)
    layer = attn_w + attn_b + mlp_w + mlp_b + 2 * norm
    embed = v["embed"] * h
    pos = (s.seq if s.positions is None else s.positions) * h if s.pos == "learned" else 0
    head = 0 if s.tied else v["head"] * h
    total = s.layers * layer + embed + pos + head + norm
    return {"attn_w": attn_w, "attn_b": attn_b, "mlp_w": mlp_w, "mlp_b": mlp_b, "norm": norm, "layer": layer,
            "embed": embed, "pos": pos, "head": head, "final_norm": norm, "total": total}


def linear_shapes(s: Setup) -> dict:
    """(out, in) of each linear kind of one rank: the LoRA targets' widths."""
    D = dims(s)
    n_up = 2 if s.ffn_act == "swiglu" else 1
    return {"qkv": (D["hl"] + 2 * D["kvl"], s.hidden), "proj": (s.hidden, D["hl"]),
            "up": (n_up * D["f_l"], s.hidden), "down": (s.hidden, D["f_l"]), "head": (D["v_h"], s.hidden)}


def param_shapes(s: Setup) -> list[tuple[str, tuple]]:
    """Every parameter tensor of one rank in the reference model's order, as (name, shape)."""
    h = s.hidden
    lin = linear_shapes(s)
    norm = [("weight", (h,))] + ([("bias", (h,))] if s.norm == "layer" and s.bias else [])
    out = [("tok", (dims(s)["v_e"], h))]
    if s.pos == "learned":
        out.append(("pos", (s.seq if s.positions is None else s.positions, h)))
    has_bias = dict(zip(("qkv", "proj", "up"), biases(s)), down=biases(s)[2])
    for i in range(s.layers):
        out += [(f"blocks.{i}.norm1.{n}", sh) for n, sh in norm]
        for kind, part in (("qkv", "attn"), ("proj", "attn")):
            out.append((f"blocks.{i}.{part}.{kind}.weight", lin[kind]))
            if has_bias[kind]:
                out.append((f"blocks.{i}.{part}.{kind}.bias", (lin[kind][0],)))
        out += [(f"blocks.{i}.norm2.{n}", sh) for n, sh in norm]
        for kind in ("up", "down"):
            out.append((f"blocks.{i}.mlp.{kind}.weight", lin[kind]))
            if has_bias[kind]:
                out.append((f"blocks.{i}.mlp.{kind}.bias", (lin[kind][0],)))
    out += [(f"norm.{n}", sh) for n, sh in norm]
    if not s.tied:
        out.append(("head.weight", lin["head"]))
    return out




def lora_linears(s: Setup, kind: str) -> list[tuple]:
    """(out, in) of each LoRA-adapted linear of ``kind`` in one layer (the head: in the model). The lab's
    GPT: its one linear of that kind when targeted; a transformers model: every module its
    ``lora_targets`` (the model's own names, e.g. q_proj, v_proj) names of that kind (q_proj: a d rows,
    k_proj and v_proj: g d, gate_proj and up_proj: half of the gated MLP's up matrix)."""
    if not s.lora_rank:
        return []
    out_f, in_f = linear_shapes(s)[kind]
    if s.modules == "lab":
        return [(out_f, in_f)] if kind in s.lora_targets else []
    D = dims(s)
    rows = {"all": out_f, "q": D["hl"], "kv": D["kvl"], "half": out_f // 2}
    table = HF_LINEARS[s.modules]
    return [(rows[part], in_f) for name in s.lora_targets for k, part in table.get(name, ()) if k == kind]


def lora_kinds(s: Setup) -> set:
    """The kinds of linear (qkv, proj, up, down, head) that carry at least one LoRA pair."""
    return {k for k in ("qkv", "proj", "up", "down", "head") if lora_linears(s, k)}


def lora_shapes(s: Setup, kind: str) -> list[tuple]:
    """peft's LoRA pairs on the linears of ``kind`` (one layer): A (r x in), B (out x r) each."""
    return [sh for out_f, in_f in lora_linears(s, kind) for sh in ((s.lora_rank, in_f), (out_f, s.lora_rank))]


def trainable_shapes(s: Setup) -> list[tuple]:
    """The shapes of the tensors that train (one rank): every parameter, or the LoRA pairs of the
    targets (peft's order: per layer qkv, proj, up, down, then the head), or the soft prompt."""
    if s.lora_rank:
        per_layer = [sh for kind in ("qkv", "proj", "up", "down") for sh in lora_shapes(s, kind)]
        return per_layer * s.layers + lora_shapes(s, "head")
    if s.prompt_tokens:
        return [(s.prompt_tokens, s.hidden)]
    return [sh for _, sh in param_shapes(s)]


def numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


AO_BLOCK = 256          # torchao AdamW8bit: one fp32 scale per 256 values
AO_MIN_NUMEL = 4096     # smaller tensors (or a size not a multiple of the block) keep fp32 state
AO_QMAP = 256 * 4       # each quantized state tensor carries its own 256-entry fp32 code book


def optimizer_state_bytes(s: Setup, shapes) -> float:
    """Bytes the optimizer keeps for the trainable tensors ``shapes`` (one rank, before ZeRO).

    adamw: k (``opt_bytes``, 8 = fp32 m and v) per parameter. adamw_8bit (torchao AdamW8bit):
    per state (m, v) of a tensor of n values: n uint8 codes + 4 n/256 bytes of fp32 block scales
    + a 1 KiB code book, if n >= 4096 and 256 divides n; else fp32 (4 n). adafactor
    (torch.optim.Adafactor): a tensor of shape (..., R, C) keeps fp32 row and column second moments
    (4 (prod(...) R + prod(...) C)); a 1-D tensor a full fp32 second moment; no first moment.
    sgd: nothing; sgd_momentum: an fp32 momentum buffer. Mixed precision adds the fp32 master
    copy (4 B per trainable parameter), except under FSDP, whose fp32 shards are the master weights
    (counted as its parameters). The 4-byte step counters are not counted.
    """
    n = sum(numel(sh) for sh in shapes)
    master = 4 * n if s.mixed and not s.fsdp else 0
    if s.optim == "adamw":
        return s.opt_bytes * n + master
    if s.optim == "sgd":
        return master
    if s.optim == "sgd_momentum":
        return 4 * n + master
    total = 0
    for sh in shapes:
        k = numel(sh)
        if s.optim == "adafactor":
            total += 4 * (numel(sh[:-1]) + numel(sh[:-2]) * sh[-1]) if len(sh) >= 2 else 4 * k
        elif k >= AO_MIN_NUMEL and k % AO_BLOCK == 0:           # adamw_8bit, quantized
            total += 2 * (k + 4 * (k // AO_BLOCK) + AO_QMAP)
        else:                                                  # adamw_8bit, fp32 fallback
            total += 2 * 4 * k
    return total + master


# the parameters tensor parallelism splits: DTensors on the tp mesh (every linear of a block, its biases too -- a
# row-parallel layer's bias is a replicated DTensor), beside the plain tensors it leaves whole
TP_SPLIT = (".attn.qkv.", ".attn.proj.", ".mlp.up.", ".mlp.down.")


def step_groups(s: Setup, shapes) -> list[list]:
    """The trainable ``shapes`` as the optimizer steps them, group by group (D13).

    Under tensor parallelism (t > 1) a for-each kernel takes tensors of one kind, so the optimizer's groups are
    split by mesh (``lab/parallel/distributed.split_param_groups``; FSDP over dp beside it makes 2-D DTensors of
    the split ones and 1-D of the rest, still two kinds): the tensors t splits (the blocks' linears, and the
    embedding and output layer where ``vocab_split`` names them) in one group, the replicated ones (norms, learned
    positions, a whole vocabulary) in another. One process, or LoRA's and a soft prompt's tensors: one group."""
    if s.tp == 1 or s.lora_rank or s.prompt_tokens:
        return [list(shapes)]
    vocab = {"tok": "embedding", "head.weight": "head"}
    split, whole = [], []
    for name, sh in param_shapes(s):
        (split if any(k in name for k in TP_SPLIT) or vocab.get(name) in s.vocab_split else whole).append(sh)
    return [g for g in (split, whole) if g]


def optimizer_temp_bytes(s: Setup, shapes) -> float:
    """Working memory of one optimizer step (one rank, before ZeRO).

    foreach AdamW: one fp32 copy of the parameters of one group (sqrt of the second moment; the
    largest of :func:`step_groups`); fused AdamW and SGD: none. foreach Adafactor: the variance
    estimate of every matrix (fp32, full size) and, for the 1-D tensors, the squared gradient
    beside it. adamw_8bit: torchao steps one parameter at a time in one compiled kernel; the fp32 m
    and v of the largest quantized tensor are taken as its working memory (not measured)."""
    if s.optim == "adamw":
        # the for-each kernels step one parameter group at a time: the largest group's copy (D13)
        return 4 * max(sum(numel(sh) for sh in g) for g in step_groups(s, shapes)) if s.optimizer == "foreach" else 0
    if s.optim == "adafactor":
        return sum(4 * numel(sh) * (1 if len(sh) >= 2 else 2) for sh in shapes)
    if s.optim == "adamw_8bit":
        quantized = [numel(sh) for sh in shapes if numel(sh) >= AO_MIN_NUMEL and numel(sh) % AO_BLOCK == 0]
        return 2 * 4 * max(quantized, default=0)
    return 0
