"""``precise`` mode: the peak memory of one GPU, tensor by tensor, phase by phase.

Where ``playbook`` sums four numbers, ``precise`` follows one training step of the reference
implementation (``fasttrain.lab.model``; validated against ``torch.cuda.max_memory_allocated``
by ``fasttrain.memory.validate``) and reports the largest amount alive at any moment. The
differences from the widget (D1-D14 in MODEL.md, each tested in ``tests/test_memory_precise.py``;
the parameters, what trains and the optimizer's state are counted in ``training_state.py``):

D1  Feed-forward weights from h_ff: 2 h h_ff (ReLU/GELU) or 3 h h_ff (SwiGLU).
D2  Untied output projection: + v h (``tied`` keeps the widget's single matrix).
D3  Grouped-query attention: K and V projections are h x (g d), d = h / a.
D4  Position embeddings only when learned (RoPE has none); biases and norm weights as the model
    has them (Llama: none, and h per RMSNorm).
D5  Tensor parallelism shards weights, gradients and optimizer state: column/row-parallel matrices
    and the vocabulary (padded to a multiple of t) / t (where split: D23); norms, row-parallel biases and position
    embeddings stay replicated. Key/value heads are replicated when t > g.
D6  Sequence parallelism divides every activation by t, the attention scores too (Q8), and the
    layer inputs kept by full recomputation (Q10).
D7  Vocabulary-parallel cross-entropy: logits / t with or without sequence parallelism (Q9) (where split: D23).
D8  Activations as the implementation keeps them: norm inputs in the residual dtype (fp32 under
    autocast) plus fp32 row statistics; softmax output in fp32 under autocast plus its bf16 copy;
    dropout masks only with dropout (Llama has none); K and V repeated to all heads in eager
    attention with GQA; with flash attention no s^2 term, but the fused QKV output, the rotated
    q and k, the output and the fp32 log-sum-exp; autocast's bf16 copies of the weights.
D9  Output layer: fp32 log-probabilities kept for backward; at the start of backward the
    log-softmax gradient needs two more fp32 s b v tensors. Under autocast, cross_entropy keeps
    bf16 log-probabilities and nll_loss their fp32 copy (6 bytes per logit), and the backward
    adds one fp32 gradient.
D10 Phases: the total is the peak over the moments of a step (end of forward, each backward
    stage, the optimizer step), with gradients alive only from their backward stage to the
    optimizer step (``zero_grad(set_to_none=True)``) unless ``grad_buffers``.
D11 Backward working memory of the layer being differentiated: the gradients of the attention
    scores (eager: P, dP, dS and, on CUDA, one more s^2 buffer inside the softmax backward), the
    flash-attention gradient buffers, the MLP intermediates' gradients, the norm backward and
    the residual gradient stream.
D12 Full recomputation: the layer being recomputed holds all its activations during its
    backward (the widget counts only the layer inputs).
D13 Optimizer step temporaries: PyTorch's foreach AdamW allocates one fp32 copy of the
    parameters (sqrt of the second moment) of the group it steps, one group at a time; fused AdamW
    none. Under tensor parallelism the groups are split by mesh (the split tensors, the replicated
    ones): 4 max(n_split, n_replicated), not 4 n (``training_state.step_groups``).
D14 Framework overhead: cuBLAS workspaces (32 MiB per thread and stream on Hopper; forward and
    autograd threads), buffers (causal mask s^2 bytes, RoPE tables) and the token ids. The CUDA
    context (about 0.5 GiB) and allocator fragmentation are outside ``max_memory_allocated`` and
    are not counted.
D15 Optimizer state by kind (``optim``): AdamW k bytes per parameter (8: fp32 m and v);
    torchao's AdamW8bit per state 1 byte per value + one fp32 scale per 256 values + a 1 KiB code
    book, for tensors of >= 4096 values that 256 divides (others fp32); Adafactor fp32 row and
    column second moments of each matrix, the full one of a vector, no first moment; SGD none, or
    an fp32 momentum buffer. Temporaries: foreach Adafactor one fp32 variance estimate per tensor.
D16 LoRA (peft) on a frozen base: A (r x in) and B (out x r) per target train; only they have
    gradients and optimizer state. A frozen linear keeps no input (only a weight's gradient needs
    it); A keeps its input (with lora_dropout its dropped copy and the mask), B keeps the r-wide
    A output. With frozen embeddings nothing before the first target in layer 1 is kept.
D17 Soft prompt: P trainable vectors (P x h) prepended after the embedding: every layer's
    tensors have s + P positions; the prompt's outputs are cut before the head (logits keep s);
    the base is frozen as in D16, but every activation needs a gradient from the embedding on.
    A transformers model (peft's ``PromptTuningConfig``) keeps logits at all s + P positions
    (the prompt's targets -100). LoRA on a transformers model names its modules (q_proj, v_proj,
    c_attn, ...: ``training_state.lora_linears``); what its frozen base keeps is ``hf_activations``'
    (``_frozen``), layer 1's eager attention and gated MLP when only some of q, k, v (gate, up) need
    a gradient, and peft's fp32 cast of a bf16 LoRA input, whose gradient passes through fp32 too.
D18 torch.compile of a transformers model (``compiled``: ``model`` or ``blocks``): what AOT
    autograd's min-cut partitioner keeps (``hf_activations``), the loss's backward straight from the
    kept logits (d(logits) in their dtype; the Llama families one more logits-sized buffer), the
    norms' and the softmax's backward fused. The lab's GPT compiled is counted as eager (measured within about 1%).
D19 liger-kernel on a transformers model (``liger``): its RMSNorm keeps input and rstd and writes dx over dy,
    its SwiGLU/GeGLU keeps gate and up and writes their gradients over them, its RoPE keeps what eager's does,
    its fused linear cross-entropy keeps the d(input) and d(weight) it makes in the forward (no logits, no
    log-probabilities); the step's peak moves into that forward's chunk buffers (``hf_activations``).

D20 CUDA graphs (``cuda_graphs``: torch.compile's reduce-overhead and max-autotune, the cudagraphs backend): the
    captured forward and backward allocate from a private pool that stays reserved for the next replay, and the caching
    allocator serves nothing outside the graphs from it (nor the graphs from the rest). The two arenas peak apart
    and add: the pool at the graphs' own peak (what the forward keeps, the backward's working memory and the
    gradients it has output, which live in the pool until the trainer takes them into its buffers, or as the
    ``.grad`` itself without accumulation), the rest at the optimizer step (gradient buffers and the optimizer's
    temporaries, made while the pool still holds its peak). A per-block scope is counted the same way (its eager
    head then shares the regular arena: this is an upper bound there).

D21 FSDP2's layout (``fsdp``): fp32 shards (the master weights), the root group's compute copy from
    the forward's first all-gather to the backward's end, the blocks' gathered (ZeRO-2: from a
    block's forward to its backward's end; ZeRO-3: the running one and the prefetched one) with the
    all-gather output buffers beside them, a block's gradients unsharded until its post-backward
    copies them into the reduce-scatter's input (``reduce_dtype``), held to the next one; gradient
    shards in fp32; without sync over micro-batches every unsharded gradient summed in the reduce
    dtype (MODEL.md's table, checked on the CPU allocator in a fake process group).
D22 Partial recomputation (``recompute_layers`` k of L under ``full``): layers 1..k keep their input
    (D12), layers k+1..L all their activations. The backward meets the kept layers first and frees
    each before it reaches a recomputed one, so the recomputation's moments are D12's with fewer
    layers kept; the autocast cache (D12's bf16 weight copies) holds the k recomputed layers' copies.
D23 The vocabulary under tensor parallelism (``vocab_split``, among embedding, head, logits): D5 and D7 are
    Megatron's layout, the default, where all three are split t ways. Whatever is not split is whole on every
    rank, v in place of ceil(v / t): the embedding's rows (its weight, gradient and optimizer state, and the tied
    embedding's gradient sum), the output layer's rows (the same, and its autocast bf16 copy 2 v h), the logits'
    columns (the logits C N v, their fp32 copy, the fp32 log-probabilities and the loss's backward, 8 N v). A
    transformers model's plan (``hf_config.vocab_split_of``) splits the untied output layer's rows and gathers its
    logits whole on every rank (``colwise_gather_output``: the loss is one process's), splits an untied embedding
    without a padding row, and keeps tied embeddings whole; the lab's GPT splits none (its tensor parallelism
    splits the blocks only).
D24 torchao's float8 training of a transformers model's layers (``float8``: tensorwise, rowwise): no bf16 weight
    copies under autocast (Float8Linear casts the fp32 weight itself); per-block compiled layers keep neither the
    norms' bf16 outputs nor the SwiGLU product (2 C h + C f a token less: their backward GEMMs read float8 casts,
    recomputed from the norm's input and gate's and up's outputs, which are kept anyway; ``hf_activations``).

Not modelled: pipeline parallelism, context parallelism, communication buffers (NCCL, DDP buckets;
FSDP's: D21), HSDP's all-reduce buffer, activation offloading, fp8 beyond D24. The widget's ZeRO-3 adds two
gathered layers (current + prefetch).
"""

from __future__ import annotations

from fasttrain.memory.breakdown import Breakdown, Line
from fasttrain.memory.config import Setup, check
from fasttrain.memory.training_state import (biases, dims, dtypes, linear_shapes, lora_kinds, lora_linears, lora_shapes,
                                             numel,
                                             optimizer_state_bytes, optimizer_temp_bytes, param_counts,
                                             trainable_shapes)

MiB = 1024 ** 2


def _eager_core(Dsm: int, C: int, cast: bool, dropout: bool, mask: int = 1, kernel_temps: bool = True):
    """Eager attention core: ``(kept, events, fwd)``.

    ``kept``: bytes per a s^2 b element kept for backward. ``events``: the moments of its backward
    as (bytes per a s^2 b element alive, extra s b h/t tensors of C bytes alive beside what is
    kept). ``fwd``: extra bytes per element during its forward.

    forward: S = q k^T (C); S*scale (C); masked (C); [autocast: fp32 copy]; P = softmax (Dsm, kept);
             [dropout: mask (kept), P_d]; [autocast: bf16 copy of P or P_d, kept by P V];
             without dropout or autocast P itself is what P V keeps.
    backward: P V gives dP (in the kept operand's dtype) and dV while dO and V are still alive;
              then V is released and dO freed, dV waits; [cast dP to fp32]; [dropout backward];
              softmax backward dS = P (dP - sum dP P) holds P, dP, dS at once; [dS back to
              bf16]; masked_fill backward and the scale's backward each make one new C tensor.
    """
    pv = C if cast else Dsm                       # dtype of the operand P V keeps
    kept = Dsm + (mask + pv if dropout else (C if cast else 0))
    events = [(kept + pv, 2)]                     # dP, with dO and dV beside it (V still kept)
    live = kept - (pv if (dropout or cast) else 0) + pv   # the P V operand is released (P stays if shared)
    if cast:
        events.append((live + Dsm, 0))            # dP cast to fp32
        live = live - pv + Dsm
    if dropout:
        events.append((live + Dsm, 0))            # dP = dP_d * mask * scale
        live = live - Dsm - mask + Dsm            # frees dP_d and the mask
    # dS: P, dP, dS alive; on CUDA one more softmax-dtype s^2 buffer during that call (measured on
    # an H200 with torch 2.11, fp32 and autocast alike; allocated inside the op, so the CPU
    # op-level counter never sees it)
    events.append((live + Dsm + (Dsm if kernel_temps else 0), 0))
    live = Dsm                                    # P and dP released
    if cast:
        events.append((live + C, 0))              # dS back to bf16
    events.append((2 * C, 0))                     # masked_fill backward, then the scale's backward
    fwd = C + (Dsm if cast else 0)                # masked scores (+ their fp32 copy) beside P
    if dropout and cast:
        fwd = max(fwd, Dsm)                       # fp32 dropped scores before their bf16 copy
    return kept, events, fwd


def layer_terms(s: Setup, mask_bytes: int = 1, kernel_temps: bool = True) -> dict:
    """Bytes one transformer layer keeps for backward, by part, and its backward working memory.

    ``mask_bytes``: a dropout mask's bytes per element: 1 (bool) with CUDA's fused dropout; the
    CPU tests pass 4 (PyTorch's CPU dropout keeps a float mask). ``kernel_temps``: count buffers
    that CUDA kernels allocate inside one op call (False for the CPU op-level counter)."""
    D, T = dims(s), dtypes(s)
    N, r, hl, kvl, f_l, a_l = D["N"], D["r"], D["hl"], D["kvl"], D["f_l"], D["a_l"]
    h, R, C, Dsm, cast = s.hidden, T["R"], T["C"], T["Dsm"], T["cast"]
    P = param_counts(s)
    nh = N * h / r                                   # a replicated (or sequence-parallel) s b h tensor
    unit = a_l * s.seq * s.seq * s.micro_batch       # one a s^2 b tensor on this rank
    drop = mask_bytes if s.dropout else 0
    rope = s.pos == "rope"
    flash = s.attention == "flash"
    qkv_out = C * N * (hl + 2 * kvl)                  # fused QKV output (kept whole by a view of v)
    rotated = C * N * (hl + kvl) if rope else 0       # rotated q and k (new tensors)
    # a compiled transformers model's softmax backward is one fused kernel: no buffer inside it
    compiled_hf = s.compiled != "none" and s.modules != "lab"
    kept_p, events_p, fwd_p = _eager_core(Dsm, C, cast, s.dropout, mask_bytes, kernel_temps and not compiled_hf)
    # q, k, v as q k^T and P V keep them. The batched matmuls copy an operand they cannot view
    # as (b a) batches, which happens unless b = 1; repeating K and V for GQA copies them unless
    # there is one KV head (a stride-0 view). RoPE makes new q and k. What is not copied is kept
    # as a view: of the rotated q or k, or of the fused QKV output, which then stays whole.
    b1 = s.micro_batch == 1
    g_l = kvl // D["d"]
    k_copied = (g_l > 1 and kvl < hl) or not b1       # also V
    q_view_qkv = b1 and not rope
    k_view_qkv = not k_copied and not rope
    eager_qkv = C * N * hl * (int(not b1) + 2 * int(k_copied))
    if b1 and rope:
        eager_qkv += C * N * hl                       # rotated q kept itself
    if not k_copied and rope:
        eager_qkv += C * N * kvl                      # rotated k kept itself
    if q_view_qkv or k_view_qkv or not k_copied:
        eager_qkv += qkv_out                          # views of the fused output (v at least)
    if k_copied:
        v_release = C * N * hl                        # P V's backward frees its copy of V
    else:
        v_release = 0 if (q_view_qkv or k_view_qkv) else qkv_out
    eager_core = eager_qkv + kept_p * unit
    if s.recompute == "selective":
        # the core recomputed from its kept inputs: only the copies are new
        recomputed = C * N * hl * (int(not b1) + 2 * int(k_copied)) + kept_p * unit
        v_release = C * N * hl if k_copied else 0
    else:
        recomputed = eager_core
    if flash:
        core = qkv_out + rotated + 4 * a_l * s.micro_batch * s.seq      # + fp32 log-sum-exp
    elif s.recompute == "selective":
        core = qkv_out + rotated                      # checkpoint keeps only its inputs q, k, v
    else:
        core = eager_core
    weight_copies = 2 if cast else 0
    norm = R * nh + T["stat"] * N / r
    # a linear keeps its input only for its weight's gradient: with a frozen base, only where LoRA's
    # A sits (A keeps the same input, or with lora_dropout its dropped copy and the mask)
    adapted = lora_kinds(s)
    keeps = {k: not s.frozen or k in adapted for k in LORA_KINDS}
    lora = {k: lora_kept(s, k, mask_bytes) if k in adapted else 0 for k in LORA_KINDS}
    lin = linear_shapes(s)
    if s.frozen:
        # autocast caches casts of trainable leaves only; a frozen weight's bf16 copy is made per call
        # and kept by the matmul for d(input) (the bias needs none); LoRA's A and B are cached
        copies = {k: weight_copies * (numel(lin[k]) + (sum(numel(x) for x in lora_shapes(s, k)) if lora[k] else 0))
                  for k in LORA_KINDS}
        attn_copies, mlp_copies = copies["qkv"] + copies["proj"], copies["up"] + copies["down"]
    else:
        attn_copies = weight_copies * (P["attn_w"] + P["attn_b"])
        mlp_copies = weight_copies * (P["mlp_w"] + P["mlp_b"])
    attn = {
        "norm1": norm,
        "qkv_input": C * nh if keeps["qkv"] else 0,
        "core": core,
        # attention output (flash: the same storage as O, which the kernel keeps anyway)
        "proj_input": C * N * hl if (keeps["proj"] or flash) else 0,
        "dropout_mask": drop * nh,
        "weight_copies": attn_copies,
    }
    n_mlp = {"relu": 1, "gelu": 2, "swiglu": 4}[s.ffn_act]
    if not keeps["down"] and s.ffn_act != "relu":
        n_mlp -= 1                                    # the down projection's input (ReLU's output is kept anyway)
    mlp = {
        "norm2": norm,
        "mlp_input": C * nh if keeps["up"] else 0,
        "mlp_hidden": n_mlp * C * N * f_l,            # relu: y; gelu: z, gelu(z); swiglu: gate|up, silu, product
        "dropout_mask": drop * nh,
        "weight_copies": mlp_copies,
    }
    if s.lora_rank:
        attn["lora"] = lora["qkv"] + lora["proj"]
        mlp["lora"] = lora["up"] + lora["down"]
    # backward working memory (beyond what is kept), per part
    # MLP backward: step 1, the down projection's backward, makes d(hidden) while the gradient of
    # its output is alive (a new tensor when dropout or autocast made one); step 2, the
    # activation's backward: ReLU and SwiGLU hold two hidden-size gradients beyond what is kept,
    # GELU one (its kept output was released in step 1).
    # Under autocast the down projection's weight gradient is first bf16, then cast to fp32.
    branch = C * nh if (s.dropout or cast) else 0
    wgrad16 = 2 * (P["mlp_w"] // ({"swiglu": 3}.get(s.ffn_act, 2))) if cast and not s.frozen else 0
    mlp_extra = max(C * N * f_l + branch + wgrad16, {"relu": 2, "gelu": 1, "swiglu": 2}[s.ffn_act] * C * N * f_l)
    if flash:
        # dO beside dq, dk, dv and the fp32 row sums of dO * O
        attn_extra = C * N * hl + C * N * (hl + 2 * kvl) + 4 * a_l * s.micro_batch * s.seq
        if C == 2:
            attn_extra += 4 * N * hl                  # flash-attention's fp32 dq accumulator
        if kvl < hl:
            attn_extra += 2 * C * N * hl              # dk, dv for every query head, then summed
        attn_fwd = 0.0
    else:
        # the worst moment of the core's backward: dO and dV beside dP at P V's backward, then
        # dV alone, with what releasing V freed
        attn_extra = max((u - kept_p) * unit + (2 * C * N * hl if n else C * N * hl - v_release)
                         for u, n in events_p)
        if compiled_hf and cast:
            # the fused softmax backward under autocast reads the bf16 dP and writes dS: no fp32 copy of dP
            attn_extra -= C * unit
        attn_fwd = fwd_p * unit
    stream = R * nh                                   # the residual stream's gradient
    # norm backward: its output's gradient dy (the norm's output dtype, R) beside the new dx;
    # RMSNorm's reference backward also holds xhat, dy*w and two fp32 temporaries (4 x 4 bytes),
    # LayerNorm's fused kernel only dx
    norm_extra = (4 * 4 if s.norm == "rms" else R) * nh + R * nh
    # LoRA's backward: d(input) through A (N x in) made beside the base's, then added
    lora_back = {k: C * N * lin[k][1] if lora[k] else 0 for k in LORA_KINDS}
    out = {"attn": attn, "mlp": mlp, "eager_core": eager_core, "recomputed_core": recomputed,
            "mlp_extra": mlp_extra + max(lora_back["up"], lora_back["down"]),
            "attn_extra": attn_extra + max(lora_back["qkv"], lora_back["proj"]), "attn_fwd": attn_fwd,
            "stream": stream, "norm_extra": norm_extra, "checkpoint": R * nh, "norm": norm,
            "keeps": keeps, "lora": lora}
    if s.modules != "lab":
        # transformers' modules keep other tensors (hf_activations.py); the backward working memory
        # above is the lab's, the same computation
        from fasttrain.memory.hf_activations import hf_terms

        hf = hf_terms(s, mask_bytes, cpu=not kernel_temps)
        out.update(attn=hf["attn"], mlp=hf["mlp"], checkpoint=hf["checkpoint"], norm=hf["norm"], hf=hf)
        if "rms_norm" in s.liger:
            # liger's RMSNorm backward writes d(input) over d(output): the moment holds d(output) alone
            out["norm_extra"] = R * nh
        if "glu" in s.liger:
            # liger's SwiGLU/GeGLU backward writes d(gate) and d(up) over the kept gate and up: only step 1 (down's
            # backward making d(product)) allocates
            out["mlp_extra"] = C * N * f_l + branch + wgrad16 + max(lora_back["up"], lora_back["down"])
        if s.compiled != "none":
            # compiled backward kernels fuse the norms' and activations' pointwise chains: a norm's
            # backward holds its output's gradient and the new input gradient only
            out["norm_extra"] = 2 * R * nh
            if s.modules == "hf-gpt2" and s.ffn_act == "gelu" and cast:
                # gelu_new's fused backward under autocast: d(c_proj's input) and the new d(c_fc's output), both
                # bf16 (in fp32 the kernel writes over its dead input; measured on the CPU allocator)
                out["mlp_extra"] = max(mlp_extra, 2 * C * N * f_l)
        elif s.modules == "hf-gpt2" and s.ffn_act == "gelu":
            # gelu_new's backward through its Python ops holds two hidden-size gradients beyond what is
            # kept (measured on the CPU); under CUDA autocast that chain runs in fp32
            chain = 4 if cast and kernel_temps else C
            out["mlp_extra"] = max(mlp_extra, 2 * chain * N * f_l) + max(lora_back["up"], lora_back["down"])
        if s.frozen and cast:
            # peft casts a LoRA module's input to A's dtype (fp32) before A's autocast matmul: where that
            # input is bf16 (the attention output, the MLP's down input) its gradient passes through an
            # fp32 copy too (the norms' outputs are fp32 already)
            # (GPT-2's MLP under CUDA autocast computes gelu_new in fp32: c_proj's input is fp32 there)
            for k in ("proj", "down"):
                bf16_input = not (k == "down" and s.modules == "hf-gpt2" and kernel_temps and s.ffn_act == "gelu")
                lora_back[k] += 4 * N * lin[k][1] if lora[k] and bf16_input else 0
            out["attn_extra"] = attn_extra + max(lora_back["qkv"], lora_back["proj"])
        if s.frozen:
            # a frozen base (compiled is refused): the MLP's backward moment by moment. The down projection's
            # backward makes d(input) (and LoRA's own through B and A, then summed); the activation's backward
            # holds its gradients beside what is kept, counted as if the down projection's kept input were
            # freed by then: a frozen down projection never kept it, one hidden-size tensor more
            chain = 4 if cast and kernel_temps and s.modules == "hf-gpt2" else C
            act = {"relu": 2, "gelu": 1, "swiglu": 2}[s.ffn_act] * C * N * f_l
            if s.modules == "hf-gpt2" and s.ffn_act == "gelu":
                act = max(act, 2 * chain * N * f_l)
            if "down" not in adapted and s.ffn_act != "relu":
                act += C * N * f_l
            out["mlp_extra"] = max(C * N * f_l + branch + lora_back["down"], act, lora_back["up"] + C * nh)
    return out


LORA_KINDS = ("qkv", "proj", "up", "down", "head")


def lora_kept(s: Setup, kind: str, mask_bytes: int = 1) -> float:
    """What peft's LoRA on one linear keeps beyond the base: B's input (A's output, N x r) and,
    with lora_dropout, the dropout mask of A's input (A keeps the dropped copy instead of x)."""
    T = dtypes(s)
    N = s.seq * s.micro_batch
    in_f = linear_shapes(s)[kind][1]
    return T["C"] * N * s.lora_rank + (mask_bytes * N * in_f if s.lora_dropout > 0 else 0)


def _first_layer(s: Setup, lt: dict) -> tuple[dict, dict, set]:
    """Layer 1 under LoRA alone (frozen embeddings): nothing before the first LoRA target requires
    a gradient, so autograd keeps nothing there and its backward stops at that target.
    Returns layer 1's (attn, mlp) kept dicts and the backward stages that do not run."""
    attn, mlp = dict(lt["attn"]), dict(lt["mlp"])
    adapted = lora_kinds(s)
    order = [k for k in ("qkv", "proj", "up", "down") if k in adapted]
    if not s.lora_rank or s.prompt_tokens:
        return attn, mlp, set()
    first = order[0] if order else "head"
    T = dtypes(s)
    C, N = T["C"], s.seq * s.micro_batch
    lin = linear_shapes(s)
    copy = lambda k: (2 * numel(lin[k])) if T["cast"] else 0      # a frozen weight's bf16 copy
    attn["norm1"] = 0
    attn["weight_copies"] -= copy("qkv")
    skipped = {"norm 1"}
    if first == "qkv" and lt.get("hf") and lt["hf"]["first_core"] is not None:
        attn["core"] = lt["hf"]["first_core"]         # only some of q, k, v need a gradient (hf_activations)
    if first in ("proj", "up", "down", "head"):
        attn["core"] = 0
        skipped.add("attention core")
    if first in ("up", "down", "head"):
        attn.update(proj_input=0, dropout_mask=0)
        attn["weight_copies"] -= copy("proj")
        mlp["norm2"] = 0
        skipped |= {"attention", "norm 2"}
    if first in ("down", "head"):
        mlp["mlp_hidden"] = C * N * lin["down"][1] if first == "down" else 0    # only down's input, by A
        mlp["weight_copies"] -= copy("up")
    if first == "head":
        mlp = {k: 0 for k in mlp}
        attn = {k: 0 for k in attn}
        skipped.add("MLP")
    elif lt.get("hf"):
        # a transformers model (learned on the CPU): the first adapted kind's frozen weights keep no bf16 copy
        # either (their input needs no gradient), nor do its LoRA A matrices; B's copies stay (A's output
        # needs one)
        if first == "proj":
            attn["weight_copies"] -= copy("proj")
            if not attn["proj_input"]:
                attn["proj_input"] = C * N * lin["proj"][1]     # sdpa keeps nothing: A keeps its output
        elif first in ("up", "down"):
            mlp["weight_copies"] -= copy(first)
        a_copies = 2 * s.lora_rank * sum(i for _, i in lora_linears(s, first)) if T["cast"] else 0
        (attn if first in ("qkv", "proj") else mlp)["weight_copies"] -= a_copies
        if first == "up" and s.modules in ("hf-llama", "hf-gemma"):
            # the gated MLP when only some of gate_proj, up_proj need a gradient: act(gate) keeps the gate
            # output when gate_proj is adapted, act * up keeps up's output for the same reason and the
            # activation when up_proj is adapted; down's input only for down_proj's A
            names = set(s.lora_targets)
            gate, up, down = "gate_proj" in names, "up_proj" in names, "down_proj" in names
            mlp["mlp_hidden"] = C * N * lin["down"][1] * (2 * gate + up + down)
    return attn, mlp, skipped


def sdpa_runs_the_math_kernel(s: Setup, kernel_temps: bool = True) -> bool:
    """transformers' sdpa on a GPU in fp32 with grouped key/value heads: without a mask it passes
    ``enable_gqa`` (heads not repeated), which neither flash attention (16-bit only), the memory-efficient
    kernel nor cuDNN's take in fp32 (torch 2.11 on an H100, ``dev/memory/sdpa_backend.py``), so torch runs
    its math kernel, which keeps the (b, a, s, s) fp32 probabilities as eager attention does: a Llama of
    0.5B parameters in fp32 measured 46,905 MiB with sdpa and with eager. A whole compiled model passes a
    mask and repeated heads (the efficient kernel takes those); heads wider than 256 are repeated too."""
    return (kernel_temps and s.modules.startswith("hf-") and s.attention == "flash" and s.precision == "fp32"
            and s.g < s.heads and s.d <= 256 and s.compiled != "model")


def _beside_the_graph_pool(moments, buffers: float, opt_temp: float) -> tuple[str, float, float, float]:
    """The step's peak under CUDA graphs (D20) as ``(name, kept, gradients, transient)``: the optimizer step's
    gradient ``buffers`` and temporaries beside the pool held at the graphs' own peak, which is the largest
    forward or backward moment's kept bytes, the gradients the backward has output by then (they are the graph's
    outputs, in the pool) and its working memory."""
    graph = [m for m in moments if m[0] != "optimizer step"]
    name, kept, made, transient = max(graph, key=lambda m: m[1] + m[2] + m[3])
    return (f"optimizer step beside the CUDA-graph pool (held at its peak, {name})", kept, buffers + made,
            transient + opt_temp)


def estimate(s: Setup, mask_bytes: int = 1, kernel_temps: bool = True) -> Breakdown:
    """The peak bytes on one GPU during a training step, with the lines alive at that moment."""
    check(s, "precise")
    requested = s                                    # what the Breakdown reports (sdpa stays sdpa there)
    math_sdpa = sdpa_runs_the_math_kernel(s, kernel_temps)
    if math_sdpa:
        s = s.with_(attention="eager")
    asked = s
    if s.prompt_tokens:
        # the soft prompt is prepended: every sequence-sized tensor has s + P positions
        s = s.with_(seq=s.seq + s.prompt_tokens)
    D, T, P = dims(s), dtypes(s), param_counts(asked)
    N, r, v_l, h = D["N"], D["r"], D["v_l"], s.hidden
    N_out = asked.seq * s.micro_batch                # positions with logits (the prompt's are cut off)
    if s.modules != "lab":
        N_out = s.seq * s.micro_batch                # peft's soft prompt: logits at every position (labels -100)
    C = T["C"]
    L = s.layers
    dpz = s.dp
    lt = layer_terms(s, mask_bytes, kernel_temps)
    attn_part = sum(lt["attn"].values())
    mlp_part = sum(lt["mlp"].values())
    full = s.recompute == "full"
    k_re = (s.recompute_layers or L) if full else 0     # the first k_re layers recompute (D22)
    nh = N * h / r
    frozen = s.frozen
    lora_only = s.lora_rank > 0
    attn_1, mlp_1, skipped_1 = _first_layer(s, lt)
    if lt.get("hf") and lt["hf"]["first_norm1"] is not None and s.recompute != "full":
        attn_1["norm1"] = lt["hf"]["first_norm1"]    # compiled GPT-2: layer 1's input recomputed
    if lt.get("hf") and lt["hf"]["first_attn"] and s.recompute != "full":
        attn_1["core"] += lt["hf"]["first_attn"]     # compiled GPT-2 under autocast: layer 1's scores kept

    def lora_n(kind):        # LoRA parameters on one linear of ``kind``
        return sum(numel(x) for x in lora_shapes(s, kind))

    # --- persistent: parameters, optimizer state, buffers, inputs, workspaces -------------------
    n_local = P["total"]
    train_shapes = trainable_shapes(s)
    n_train = sum(numel(x) for x in train_shapes)
    n_adapters = n_train if frozen else 0
    params_b = T["param"] * (n_local + n_adapters) / (dpz if s.zero >= 3 else 1)
    opt_b = optimizer_state_bytes(s, train_shapes) / (dpz if s.zero >= 1 else 1)
    grad_scale = T["grad"] / (dpz if s.zero >= 2 else 1)     # bytes per parameter of gradient on this rank
    if s.fsdp:
        # FSDP2: every parameter lives as an fp32 shard (under mixed the master weights: the optimizer line leaves
        # them out) and every gradient lands in one; the compute copies it gathers are counted by moment (below)
        params_b = 4 * (n_local + n_adapters) / dpz
        grad_scale = 4 / dpz
    if s.offload:
        # the sharded weights (ZeRO-3: all of them between uses; ZeRO-2 keeps the gathered copy on the
        # GPU; FSDP: its shards, the gathered copies counted by moment), their gradient shards and the
        # optimizer state live in host memory; the optimizer steps there
        params_b = 0 if s.zero >= 3 or s.fsdp else params_b
        opt_b = 0
        grad_scale = 0
    grads_all = grad_scale * n_train
    d_head = s.d
    hf = lt.get("hf")
    buffers = (s.seq * s.seq if s.attention == "eager" else 0)            # bool causal mask
    if s.pos == "rope":
        buffers += 2 * s.seq * d_head * 4 + (2 * s.seq * d_head * 2 if C == 2 else 0)   # cos, sin (+ bf16)
    if hf:
        # transformers builds the mask and RoPE's cos and sin in each forward (kept: ``hf["once"]``);
        # its buffers are the fp32 inverse frequencies (d / 2) only
        buffers = 2 * d_head if s.pos == "rope" else 0
    inputs = 8 * asked.seq * s.micro_batch + 8 * N_out   # int64 token ids and targets (a soft prompt's -100 too)
    workspace = s.workspace_mib * MiB
    persistent = params_b + opt_b + buffers + inputs + workspace

    # --- kept for backward at the end of the forward pass --------------------------------------
    head_part = {
        "final_norm": lt["norm"] if not (lora_only and skipped_1 and "MLP" in skipped_1) else 0,
        "head_input": C * N_out * h / r if lt["keeps"]["head"] else 0,
        "head_weight_copy": (2 * D["v_h"] * h) if T["cast"] else 0,
        # fp32 and mixed: fp32 log-probabilities (kept by log_softmax and nll_loss alike). Autocast:
        # cross_entropy asks log_softmax for the logits' own dtype (bf16, kept) and autocast casts
        # that to fp32 for nll_loss, which keeps its input too.
        "log_probs": (2 + 4 if T["cast"] else 4) * N_out * v_l,
    }
    if lt["lora"]["head"]:
        head_part["lora"] = lt["lora"]["head"] + (2 * lora_n("head") if T["cast"] else 0)
    # the embedding's dropout mask: kept when its output requires a gradient
    emb_part = (mask_bytes if s.dropout and not lora_only else 0) * nh
    if hf:
        head_part = dict(hf["head"])
        emb_part = sum(hf["once"].values())
        if lora_only and "MLP" in skipped_1:
            # LoRA on lm_head alone: nothing before the head needs a gradient; its B keeps A's output
            head_part.update(final_norm=0, head_weight_copy=0, lora=C * N_out * s.lora_rank
                             + (2 * s.lora_rank * D["v_h"] if T["cast"] else 0))
            emb_part -= hf["once"].get("RoPE cos and sin", 0)
    n_first = L if "MLP" in skipped_1 else 1
    # (recomputation: the checkpoint holds the layer's input, the first one's too -- but a compiled GPT-2's
    # layer 1 recomputes its input from the embeddings)
    ckpt_1 = 0 if full and hf and hf["first_norm1"] is not None else lt["checkpoint"]
    plain_1 = sum(attn_1.values()) + sum(mlp_1.values())

    def kept_of(i: int) -> float:
        """Layer i's activations kept from its forward to its backward (1-based; LoRA on the head alone:
        every layer is like layer 1)."""
        like_first = i == 1 or n_first > 1
        if i <= k_re:
            return ckpt_1 if like_first else lt["checkpoint"]
        return plain_1 if like_first else attn_part + mlp_part

    saved_all = sum(kept_of(i) for i in range(1, L + 1)) + sum(head_part.values()) + emb_part
    logits_c = C * N_out * v_l

    fsdp = s.fsdp
    # the widget's ZeRO-3: two gathered layers (current + prefetch) as working memory; FSDP's: by moment, below
    zero3 = 2 * P["layer"] * T["param"] if s.zero >= 3 and not fsdp else 0
    moments: list[tuple[str, float, float, float, float]] = []  # (name, kept, grads, transient, gathered)
    # FSDP2 (fsdp): the compute copies (cp bytes an element) of the root group -- embeddings, final norm, output
    # layer: gathered by the forward's first all-gather, resharded after the whole backward -- and of the blocks;
    # a block's gradients unsharded in cp bytes (u) until its post-backward copies them into the reduce-scatter's
    # input (rb bytes an element), which lives until the next block's post-backward frees it
    cp, rb = T["param"], 2 if s.reduce_dtype == "bf16" else 4
    layer_n = P["layer"]
    root_n = n_local - L * layer_n
    u = cp if fsdp else grad_scale          # bytes an element of a gradient not yet reduced

    def gathered(zero2_layers, zero3_layers, root=True):
        """FSDP's compute copies alive: the root group's and the blocks' -- ZeRO-2 holds each from its forward to
        the end of its backward, ZeRO-3 the one running and the one prefetched."""
        if not fsdp:
            return 0
        return cp * ((root_n if root else 0) + layer_n * (zero2_layers if s.zero == 2 else zero3_layers))

    made: list[float] = []    # each moment's gradients output so far, in order (D20: the pool holds these)

    def grads(now, fresh=0):
        """Gradient bytes alive: ``now``, this step's (``fresh`` of them FSDP's unsharded ones); all of them when
        gradients are kept between steps (DDP's buckets, accumulation). Called once for each moment, in order."""
        made.append(now)
        if fsdp and s.grad_buffers:
            # FSDP accumulating over micro-batches without sync: every parameter's unsharded gradient summed in
            # the reduce dtype until the last micro-batch reduces it; a micro-batch's fresh ones beside them
            # when their dtype differs (else autograd adds into them in place)
            return rb * n_train + (fresh if rb != cp else 0)
        return grads_all if s.grad_buffers else now

    def reduce_scatter(n_grads):
        """A group's post-backward under FSDP: the reduce-scatter's input (rb per element) beside the group's
        unsharded gradients as they are copied in, then beside its output (rb / d; a bf16 output cast into an
        fp32 shard beside it)."""
        inp = rb * n_grads
        copy_in = inp + (cp * n_grads if not s.grad_buffers else 0)
        return max(copy_in, inp + rb * n_grads / dpz + (4 * n_grads / dpz if rb != 4 else 0))

    if frozen:
        head_g, final_norm_g = lora_n("head"), 0
        down_g, mlp_g = lora_n("down"), lora_n("up") + lora_n("down")
        proj_g, attn_g = lora_n("proj"), lora_n("qkv") + lora_n("proj")
        embed_g = n_train if s.prompt_tokens else 0
    else:
        head_g, final_norm_g = (P["head"] if not s.tied else P["embed"]), P["final_norm"]
        _, proj_bias, mlp_bias = biases(s)
        down_g, mlp_g = D["f_l"] * h + (h if mlp_bias else 0), P["mlp_w"] + P["mlp_b"] + P["norm"]
        proj_g, attn_g = D["hl"] * h + (h if proj_bias else 0), P["attn_w"] + P["attn_b"] + P["norm"]
        embed_g = P["pos"] + (P["embed"] if not s.tied else 0)

    # end of forward: the loss's working memory beside what is kept -- the logits (and their fp32 copy)
    # beside the log-probs -- and, under autocast with full recomputation, the autocast cache's bf16 copies
    # of every layer's weights
    fwd_extra = logits_c + (4 * N_out * v_l if C == 2 and not T["cast"] else 0)   # + the fp32 copy (mixed)
    if hf:
        # ``logits.float()`` beside the logits; under autocast the fp32 last hidden state (the model's
        # output object holds it while the loss runs; without autocast it is the head's kept input)
        fwd_extra = logits_c + (4 * N_out * v_l if C == 2 else 0) + (4 * N_out * h if T["cast"] else 0)
    # liger's fused cross-entropy: the head and the loss eager, beside eager, per-block compiled layers, or (GPT-2's
    # fused head) a whole compiled model whose graph ends at the last hidden state
    fused_ce = bool(hf) and "fused_linear_cross_entropy" in s.liger
    whole = bool(hf) and s.compiled == "model" and not fused_ce     # the loss inside the compiled graph
    if whole:
        # the loss inside the compiled graph: one fused kernel reads the kept logits, nothing more is made
        fwd_extra = 0
    elif fused_ce:
        # liger's fused linear cross-entropy: no logits; its forward's chunk buffers beside what it keeps
        from fasttrain.memory.hf_activations import liger_flce_forward_bytes

        fwd_extra = liger_flce_forward_bytes(s)
        logits_c = 0                                  # nothing for the trainer to hold either (keep_logits)
    # (the cache is filled by eager casts only: a transformers model's compiled layers -- per block or whole --
    # cast inside their graphs. llama3-8b on 2 H200, zero1 with per-block compile and full recomputation under
    # bf16 autocast: 100,653 MiB measured, 113,965 estimated with these 13,312 MiB of copies, 100,653 without)
    # (nor do float8 layers fill it: Float8Linear casts its weight itself, D24)
    from fasttrain.memory.hf_activations import float8_layers

    if T["cast"] and full and not frozen and not (hf and s.compiled != "none") and not float8_layers(s):
        fwd_extra += 2 * k_re * (P["attn_w"] + P["attn_b"] + P["mlp_w"] + P["mlp_b"])
    if fsdp:
        # the forward's last all-gather: block L's output buffer (a flat cp copy of the block) arrives beside
        # block L - 1's, held until this one's copy-out into the block's own parameters; the blocks before
        # keep their activations. Block L's buffer is then held to the root's post-forward, after the loss
        last = kept_of(L)
        moments.append((f"forward layer {L}: all-gather", saved_all - sum(head_part.values()) - last, grads(0), 0,
                        gathered(L, 1) + 2 * cp * layer_n))
    moments.append(("end of forward (loss)", saved_all, grads(0), fwd_extra,
                    gathered(L, 0) + (cp * layer_n if fsdp else 0)))
    # backward of the loss: d(log-probs) and d(logits) in fp32 beside the kept log-probs
    # fp32/mixed: d(log-probs) and d(logits) in fp32; autocast: nll_loss's fp32 gradient, the rest in bf16;
    # whole-model compiled: d(logits) in the logits' dtype, straight from the kept logits and row statistics
    loss_grad = (C if whole else 4 if T["cast"] and not hf else 8) * N_out * v_l
    if whole and s.modules != "hf-gpt2":
        # the Llama-style families' compiled backward holds a second logits-sized buffer in the matmul's dtype
        # beside d(logits) (measured on the CPU with tied and untied heads; GPT-2's does not)
        loss_grad += C * N_out * v_l
    g_now = u * head_g
    g_fresh = g_now if fsdp else 0          # (FSDP: the root group's gradients stay unsharded to the end)
    if fused_ce and T["cast"]:
        # the lab's head under autocast: the kernel's bf16 gradients are cast to the fp32 weight's gradient (the
        # bf16 one alive beside it) and then to the fp32 last hidden state's (the bf16 d(weight) freed by then)
        moments.append(("backward: fused linear cross-entropy", saved_all, grads(g_now, g_fresh), 0, gathered(L, 1)))
        moments.append(("backward: fused linear cross-entropy, d(input) to fp32",
                        saved_all - head_part["fused_CE_grad_weight"], grads(g_now, g_fresh), 4 * N * h,
                        gathered(L, 1)))
    elif fused_ce:
        # its backward hands on the gradients it made in the forward: d(weight) becomes the head's gradient
        # (the same tensor), d(input) the final norm's d(output)
        moments.append(("backward: fused linear cross-entropy", saved_all - head_part["fused_CE_grad_weight"],
                        grads(g_now, g_fresh), 0, gathered(L, 1)))
    else:
        # (FSDP's ZeRO-3: the loss's gradient reaching the root's output starts block L's all-gather, held from
        # here on)
        moments.append(("backward: log-softmax", saved_all, grads(0), loss_grad, gathered(L, 1)))
        if whole and s.modules == "hf-gpt2" and s.attention == "eager" and T["cast"] and not s.dropout and k_re == L:
            # GPT-2 compiled whole, every block recomputed, under autocast: its compiled backward recomputes
            # block L before the output projection's backward, so d(logits) (C N v) is alive beside every
            # block's checkpointed input, the final norm's input and block L's recomputed attention at its
            # softmax -- the fp32 scores and two bf16 copies (2 x 4 a s^2 b) beside the bf16 tensors made on
            # the way there (by size: four N h, one N f and one N 3h). Read off the allocator's history on an
            # H200 at micro-batches 64 and 128 (results/memory/recompute-peaks/): -1.0% and -0.9% with this
            # moment, -5.6% and -5.5% with the log-softmax one above as the peak
            in_flight = 2 * lt["attn_extra"] + C * N * (4 * h + D["f_l"] + 3 * D["hl"])
            moments.append((f"backward layer {L}: recompute beside d(logits)",
                            saved_all - sum(head_part.values()) + head_part["final_norm"], grads(0),
                            loss_grad + in_flight, gathered(L, 1)))
        # (a soft prompt cut from the output: a zero-padded s + P gradient)
        moments.append(("backward: output projection",
                        saved_all - head_part.get("log_probs", head_part.get("logits", 0)), grads(g_now, g_fresh),
                        logits_c + C * N_out * h / r + (2 * D["v_h"] * h if T["cast"] else 0) + zero3 / 2
                        + (C * nh if s.prompt_tokens and not hf else 0), gathered(L, 1)))
    saved = saved_all - sum(head_part.values()) + head_part["final_norm"]
    g_now += u * final_norm_g
    g_fresh += u * final_norm_g if fsdp else 0
    moments.append(("backward: final norm", saved, grads(g_now, g_fresh), lt["norm_extra"] + zero3 / 2,
                    gathered(L, 1)))
    held = 0                                # FSDP: the last reduce-scatter's input, until the next one
    saved -= head_part["final_norm"]
    for i in range(L, 0, -1):
        tag = f"layer {i}"
        # LoRA on the head alone: no layer needs a gradient, every layer is like layer 1
        first_like = i == 1 or "MLP" in skipped_1
        attn_i, mlp_i = (attn_1, mlp_1) if first_like else (lt["attn"], lt["mlp"])
        skip = skipped_1 if first_like else set()
        a_part, m_part = sum(attn_i.values()), sum(mlp_i.values())
        on = gathered(i, 2)
        fresh = g_fresh if fsdp else 0
        if i <= k_re:
            # recomputation: the layer's forward again, all its activations kept again
            saved += a_part + m_part - lt["checkpoint"]
            moments.append((f"backward {tag}: recompute", saved - m_part, grads(g_now, fresh),
                            lt["attn_fwd"] + zero3 + held, on))
        if "MLP" not in skip:
            moments.append((f"backward {tag}: MLP", saved - mlp_i["dropout_mask"],
                            grads(g_now + u * down_g, fresh + (u * down_g if fsdp else 0)),
                            lt["mlp_extra"] + lt["stream"] + zero3 + held, on))
        saved -= m_part - mlp_i["norm2"]
        g_now += u * mlp_g
        fresh += u * mlp_g if fsdp else 0
        if "norm 2" not in skip:
            moments.append((f"backward {tag}: norm 2", saved, grads(g_now, fresh),
                            lt["norm_extra"] + lt["stream"] + zero3 + held, on))
        saved -= mlp_i["norm2"]
        if "attention" not in skip:
            extra = lt["attn_extra"] + lt["stream"] + zero3 + held
            if s.recompute == "selective" and s.attention == "eager" and "attention core" not in skip:
                extra += lt["recomputed_core"]          # the core's forward again, kept for its backward
            # eager: the output projection's backward has released its input before the core's
            # (and the residual dropout's backward, first of all, its mask)
            done = attn_i["dropout_mask"] + (0 if s.attention == "flash" else attn_i["proj_input"])
            moments.append((f"backward {tag}: attention", saved - done,
                            grads(g_now + u * proj_g, fresh + (u * proj_g if fsdp else 0)), extra, on))
        saved -= a_part - attn_i["norm1"]
        g_now += u * attn_g
        fresh += u * attn_g if fsdp else 0
        if "norm 1" not in skip:
            moments.append((f"backward {tag}: norm 1", saved, grads(g_now, fresh),
                            lt["norm_extra"] + lt["stream"] + zero3 + held, on))
        saved -= attn_i["norm1"]
        if fsdp and mlp_g + attn_g:
            # the block's post-backward: its compute copies resharded, its gradients reduce-scattered (the
            # previous block's input freed first) into fp32 shards
            layer_g = mlp_g + attn_g
            g_now -= u * layer_g
            moments.append((f"backward {tag}: reduce-scatter", saved, grads(g_now, g_fresh), reduce_scatter(layer_g),
                            gathered(i - 1, 1)))
            g_now += grad_scale * layer_g
            held = rb * layer_g
    g_now += u * embed_g
    g_fresh += u * embed_g if fsdp else 0
    # tied: the embedding's gradient is added out of place to the output projection's (new + sum)
    if not lora_only:
        moments.append(("backward: embedding", saved, grads(g_now, g_fresh),
                        (2 * u * P["embed"] if s.tied and not frozen else 0) + held, gathered(0, 0)))
    root_g = head_g + final_norm_g + embed_g
    if fsdp and root_g:
        # the root group's post-backward, the backward's last: its copies resharded, its gradients reduced
        g_now -= g_fresh
        moments.append(("backward: reduce-scatter of the root group", saved, grads(g_now), reduce_scatter(root_g), 0))
    opt_temp = 0 if s.offload else optimizer_temp_bytes(s, train_shapes) / (dpz if s.zero >= 1 else 1)
    moments.append(("optimizer step", 0, grads_all, opt_temp, 0))

    if s.keep_logits:
        # the model's output holds the logits until the trainer drops it (after the optimizer step)
        moments = [m if i == 0 else (m[0], m[1], m[2], m[3] + logits_c, m[4]) for i, m in enumerate(moments)]
    peak_name, kept, g_peak, transient, gathered_peak = max(moments, key=lambda m: m[1] + m[2] + m[3] + m[4])
    if s.cuda_graphs:
        # every moment but the optimizer step's (the last, the one grads() was not called for) with the gradients
        # it has output
        assert len(made) == len(moments) - 1 and moments[-1][0] == "optimizer step"
        graph = [(m[0], m[1], g, m[3] + m[4]) for m, g in zip(moments, made)]
        peak_name, kept, g_peak, transient = _beside_the_graph_pool(graph, grads_all if s.grad_buffers else 0,
                                                                    opt_temp)
        gathered_peak = 0
    total = persistent + kept + g_peak + transient + gathered_peak
    activations_all = saved_all
    trained = ("" if not frozen else f" + {n_adapters:,.0f} trainable ("
               + ("LoRA r=" + str(s.lora_rank) if lora_only else f"{s.prompt_tokens} prompt tokens") + ")")
    if fsdp:
        shards = 4 * (n_local + n_adapters) / dpz
        params_line = Line("parameters", params_b + gathered_peak,
                           f"4 B x {n_local:,.0f} params / d: FSDP's fp32 shards ({shards / MiB:,.1f} MiB"
                           + (", in host memory" if s.offload else "") + ")" + (" (frozen)" if frozen else "")
                           + trained + f"; {cp} B compute copies gathered at the peak: {gathered_peak / MiB:,.1f} MiB")
    else:
        params_line = Line("parameters", params_b, f"{T['param']} B x {n_local:,.0f} params on this rank"
                           + (" (frozen)" if frozen else "") + trained + (" / d (ZeRO-3)" if s.zero >= 3 else ""))
    lines = [
        params_line,
        Line("gradients", g_peak, f"alive at the peak; all {grads_all / MiB:,.1f} MiB at the optimizer step"),
        Line("optimizer", opt_b, (f"{T['opt']} B/param" if s.optim == "adamw" else
                                  f"{s.optim}: {opt_b * (dpz if s.zero >= 1 else 1) / max(n_train, 1):.3g} B/param")
             + (" incl. fp32 master" if s.precision == "mixed" and not fsdp else "")
             + (" / d (ZeRO-1)" if s.zero >= 1 else "") + (": in host memory (offload)" if s.offload else "")),
        Line("activations", kept, f"kept for backward at the peak; {activations_all / MiB:,.1f} MiB at the end of forward"),
        Line("temporaries", transient, f"working memory at the peak ({peak_name})"),
        Line("buffers + token ids", buffers + inputs, "causal mask, RoPE tables, int64 ids and targets"),
        Line("framework", workspace, "cuBLAS workspaces (PyTorch's caching allocator)"),
    ]
    per = {"layer inputs (checkpoints)": (lt["checkpoint"], k_re)} if full else {}
    per.update({f"attention: {k.replace('_', ' ')}": (v, L - k_re) for k, v in lt["attn"].items()})
    per.update({f"MLP: {k.replace('_', ' ')}": (v, L - k_re) for k, v in lt["mlp"].items()})
    children = [Line(f"{k} (x {n})", v * n) for k, (v, n) in per.items() if v and n]
    first_gap = sum(kept_of(i) for i in range(1, n_first + 1)) \
        - sum(lt["checkpoint"] if i <= k_re else attn_part + mlp_part for i in range(1, n_first + 1))
    if first_gap:
        children.append(Line(("every layer" if n_first > 1 else "layer 1") + ": not kept (no gradient needed "
                             "before the first LoRA target)", first_gap))
    children += [Line(f"output: {k.replace('_', ' ')}", v) for k, v in head_part.items() if v]
    if hf:
        children += [Line(k, v) for k, v in hf["once"].items() if v]
    elif emb_part:
        children.append(Line("embedding dropout mask", emb_part))
    lines.append(Line("activations at the end of forward", activations_all, "not part of the total unless the "
                      "peak is there", children=children, in_total=False))
    notes = [f"peak at: {peak_name}",
             "total = the largest sum alive at one moment of a step (not the sum of every line's maximum)",
             "CUDA context (~0.5 GiB) and allocator fragmentation not included"]
    if math_sdpa:
        notes.append("sdpa in fp32 with grouped key/value heads runs torch's math kernel on a GPU: counted as "
                     "eager attention (it keeps the s^2 probabilities)")
    extra = {"peak_moment": peak_name,
             "moments": [{"name": n, "bytes": persistent + k + g + x + c, "kept": k, "grads": g, "transient": x,
                          "gathered": c} for n, k, g, x, c in moments]
             + ([{"name": peak_name, "bytes": total, "kept": kept, "grads": g_peak, "transient": transient,
                  "gathered": 0}] if s.cuda_graphs else []),
             "all_at_once": persistent + grads_all + activations_all + max(m[3] for m in moments)
             + max(m[4] for m in moments),
             "trainable_params": n_train, "param_bytes": params_b, "grad_bytes": grads_all,
             "optimizer_bytes": opt_b}
    return Breakdown(mode="precise", setup=requested, lines=lines, total=total, params=param_counts(asked, 1)["total"],
                     notes=notes, extra=extra)
