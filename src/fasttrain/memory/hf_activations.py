"""What transformers' modules keep for backward (``Setup.modules`` = ``hf-*``), per layer and at the output.

The lab's GPT (``fasttrain.lab.model``) and transformers' modeling code compute the same function
but keep other tensors. Learned on the CPU with ``torch.autograd.graph.saved_tensors_hooks``
(``tracker.saved_tensor_bytes``) for tiny Llama, Qwen2 and GPT-2 models (fp32 and autocast, eager
and sdpa; ``tests/test_memory_hf_config.py``) and written here as formulas, with the CUDA
autocast op lists where the CPU's differ (the ``cpu`` argument selects the CPU's). Letters as in
``precise``: N = s b tokens, a heads, g key/value heads, d head size, f feed-forward width, C the
matmul-input dtype's bytes, R = 4 (the residual stream and norms are fp32 except in ``mixed``).

Llama, Mistral, Qwen2, Phi-3, Gemma (``hf-llama``, ``hf-phi3``, ``hf-gemma``):
- RMSNorm upcasts to fp32 and is written out in ops: ``x.pow(2)`` keeps the fp32 input, ``x * rsqrt``
  keeps the fp32 row statistic, ``weight * xhat`` keeps xhat: 4 N h + 4 N h + 4 N (the lab's fused
  RMSNorm keeps x and rstd only). In ``mixed`` xhat is cast back to bf16 first (4 + 2).
- separate q, k, v (and gate, up) linears: under autocast each casts its input to bf16 by itself
  (the cast cache holds only leaf tensors), so 3 (2 for gate/up) bf16 copies of the norm output
  are kept; Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` make one each. In fp32 one tensor.
- RoPE's cos and sin are computed once per forward in the embeddings' dtype (fp32 under autocast)
  and kept by every layer's ``q * cos``: 2 s d R' once for the model, not per layer. ``q * cos``
  with fp32 cos makes the rotated q and k fp32 under autocast; the attention casts them back.
- eager attention: ``softmax(dtype=float32)`` keeps fp32 P (all precisions but ``mixed``); under
  autocast ``P V`` casts P to bf16 and keeps that copy too (4 + 2 per score, as the lab's amp);
  q, k and v are kept as C N a d each (copies made by ``repeat_kv`` for GQA or by the batched
  matmul's reshape, or views of tensors of that size).
- sdpa: q (C N a d), k and v with their g heads (C N g d each, GQA in the kernel), the output
  (C N a d, also the output projection's input) and the fp32 log-sum-exp (4 a b s).
- gated MLP: gate output, activation output, up output, product: 4 C N f (SwiGLU and Gemma's GeGLU).
- autocast's bf16 weight copies of every matrix (biases are cast but not kept).
- head: final RMSNorm as above, the head's input, ``logits.float()`` then ``cross_entropy``: fp32
  log-probabilities (4 N v) in every precision, the shifted labels (int64, 8 N) and nll_loss's total
  weight (4 bytes).

GPT-2 (``hf-gpt2``): LayerNorm keeps its input and fp32 mean and rstd (4 N h + 8 N); Conv1D is
``addmm`` (keeps its input); c_attn's output split into q, k, v (eager: 3 C N h, copies or views);
eager scores: the fp32 causal mask added to bf16 scores promotes them to fp32, so P is fp32 under
autocast, and ``.type(value.dtype)`` makes the bf16 copy P V keeps (the lab's amp again); dropout
(attn, resid, embd) keeps a mask per site (1 byte on CUDA, the input's dtype on the CPU) and the
dropped scores. ``gelu_new`` is written in Python ops: ``pow`` keeps its input, ``tanh`` its
output, the product both factors: fp32 4 x 4 N f, plus c_proj's input (20 N f); under CUDA
autocast ``pow`` runs in fp32 (a fp32 copy of its input) and so does what follows: 4 + 4 + 2 + 4
+ 2 = 16 N f; under CPU autocast (no ``pow`` in its fp32 list) 5 x 2 N f; ``mixed`` 5 x 2 N f.

Parameter-efficient fine-tuning (``Setup.lora_rank`` with ``lora_targets`` in the model's own names,
or ``prompt_tokens``: peft's LoRA and soft prompt as the lab applies them, the base frozen; learned
as above, every family, fp32 and autocast, eager and sdpa; ``_frozen``): a frozen linear keeps no
input, RMSNorm no xhat (4 N h + 4 N), the gated MLP not down_proj's input (3 C N f), GPT-2's
``gelu_new`` not c_proj's (4 C N f); LoRA's A keeps its input (under autocast its own bf16 copy per
module), B A's output (C N r); layer 1 keeps nothing before its first adapted module. Not modelled
with a frozen base: torch.compile, gradient checkpointing, lora_dropout, ``mixed``.

``torch.compile`` (``Setup.compiled``: ``model`` = the whole module, the loss inside the graph;
``blocks`` = each decoder layer alone, embeddings, head and loss eager). AOT autograd's min-cut
partitioner saves the fewest bytes from which the backward can be computed, recomputing pointwise
ops (casts, norms' normalisation, activations) but not matmuls, reductions or random ops. Learned
on the CPU as the eager terms were (compile, then one forward under the hooks; every family, both
scopes, fp32 and bf16 autocast, eager and sdpa; ``tests/test_memory_hf_config.py``). What changes
from eager (the rest is as above):
- RMSNorm keeps its input and rstd only: R N h + 4 N (xhat and the weight's product recomputed);
  one bf16 cast of its output feeds q, k, v (gate, up): one C N h each, not 3 and 2.
- gated MLP: gate's and up's outputs and their product, 3 C N f (the activation recomputed);
  GPT-2's ``gelu_new`` chain fused: c_fc's output and c_proj's input, 2 C N f in every precision
  (on CUDA too: what the chain computes in fp32 stays inside the fused kernel).
- dropout masks are bool (1 byte) on every device (the compiled ``rand < p``), never regenerated.
- eager attention under autocast, ``blocks``: the bf16 scores S and P (P V's input) and the fp32
  row max and sum (8 a b s): 2 C per score instead of 4 + 2 (fp32 P recomputed), and each block
  keeps its additive fp32 mask input (R b s^2, once); the residual entering norm 2 is recomputed
  from the block's input and the bf16 output projection, which is kept instead (C not R N h).
  ``model``: Llama layers keep eager's fp32 and bf16 P; GPT-2 does the S and P trade in its first
  layer only and keeps the bool causal mask (b s^2).
- sdpa, ``model``: tracing makes transformers materialize the causal mask, which sdpa keeps (C b
  s^2), and with a mask k and v are repeated to all heads (no ``enable_gqa``): q, k, v, output
  C N a d each (one KV head: the repeat is a view, g d) + the fp32 log-sum-exp. ``blocks`` get no
  mask: eager's sdpa terms. Phi-3: the kernel's output is the projection's input (no copy).
- the loss in the graph (``model``): the logits in the head's dtype (C N v, bf16 under autocast,
  not fp32 log-probabilities) and log-softmax's fp32 row max and log-sum-exp (8 N); the padded
  (b, s + 1) int64 labels; RoPE's cos and sin recomputed from the inverse frequencies; Llama under
  autocast: the final norm's input recomputed from the bf16 MLP output (C N h kept). GPT-2: the
  position embeddings' output (R s h) kept, LayerNorm keeps rstd only (4 N, not 8 N), and with one
  sequence layer 1's input is recomputed from them. Backward of the loss: d(logits) in C bytes
  straight from the logits (eager: 8 N v), and in the Llama families a second C N v buffer beside
  it (the peak for a large vocabulary; measured at the CPU allocator).
- gradient checkpointing, ``model``: each layer's input (R N h), GPT-2's first recomputed from the
  embeddings; eager attention keeps the bool causal mask (b s^2), sdpa its materialized one (C b
  s^2); Llama under autocast or sdpa recomputes the final norm's input with the last layer; on the
  CPU each checkpoint's generator state is a 5056-byte tensor (host memory on a GPU run).
- backward working memory (measured at the CPU allocator): the norms' backward fused (their
  output's and input's gradients only); the softmax backward one fused kernel (no buffer inside it
  and, under autocast, no fp32 copy of dP); GPT-2's ``gelu_new`` backward under autocast holds
  d(c_proj's input) and d(c_fc's output) in bf16 (in fp32 the kernel writes over its dead input);
  the rest as eager.
liger-kernel (``Setup.liger``: the kernels patched in; the lab patches all four of a family liger
knows, or its fused linear cross-entropy alone, on any family's head: GPT-2's through the lab's own forward,
the same kernel on the same last hidden state). Its kernels are Triton (CUDA only): what they keep is read
from their ``save_for_backward`` and in-place writes, the transformers code around them is eager's. What
changes from eager:
- ``rms_norm`` (LigerRMSNorm; Gemma's with offset 1 and its casting mode): one kernel keeps its
  input and the fp32 row statistic, R N h + 4 N (eager: 8 N h + 4 N, Gemma's 4 h more); its output
  is new, in the input's dtype. Backward writes d(input) over d(output) in place: the moment holds
  d(output) alone (eager: 4 fp32 temporaries and a new d(input) beside it), plus a (SMs x h) fp32
  partial sum of d(weight) (under 1 MiB; not counted).
- ``glu`` (LigerSwiGLUMLP, Phi-3's on chunks of gate_up's output, Gemma's GeGLU): silu(gate) * up in
  one kernel that keeps gate's and up's outputs; its product is down's input: 3 C N f (eager: 4).
  Backward writes d(gate) and d(up) over the kept gate and up: no hidden-size buffer beyond d(product)
  from down's backward (eager: two more).
- ``rope``: rotates q and k in place in q_proj's and k_proj's outputs (made (b, s, heads, d)-contiguous
  first: a copy only for Phi-3's views of its fused qkv output) and keeps cos and sin (the same tensors
  eager's ``q * cos`` keeps): nothing kept changes, except that Phi-3 under sdpa gets the Llama
  layout back (the kernel's output is the output projection's input: no C N a d copy). Under
  autocast the rotated q and k stay bf16, which eager's attention casts back to anyway.
- ``fused_linear_cross_entropy`` (the lab's fused head, ``lab/hf/liger.py``, in training with labels): the head and
  the loss in one autograd function that never materializes the (N, v) logits. Its forward splits the
  N tokens into chunks of n_c = min(N, 2^ceil(log2 ceil(N / ceil(v / h)))) rows (about N h logits
  each) and computes, chunk by chunk, the logits, the loss and their gradients: d(input) (N x h, the
  input's dtype R) and d(weight) (v x h, the weight's dtype; none when the head is frozen) exist from
  the forward on and are what it keeps; nothing else (no log-probabilities, no head input, no labels,
  no bf16 head weight). Its backward scales them by the loss's gradient in place and hands them on:
  d(weight) becomes the head's gradient (autograd takes the tensor, no copy), d(input) the final
  norm's d(output). Working memory of its forward, beside everything kept (often the step's peak,
  where eager's was the loss's backward): the final norm's output (its input, R N h), the fp32 loss per
  token (4 N) and the mask of counted targets (N); fp32: one (n_c, v) fp32 logits buffer reused by
  every chunk and d(weight)'s chunk product, a new fp32 v x h added into d(weight); bf16 weights
  (``mixed``): one (n_c, v) bf16 buffer, the product added in place. Autocast (fp32 weights): the lab's
  head (``lab/hf/liger.py``) casts the input and the weight to bf16 once (liger's own forward would
  cast the weight at every chunk, from a view that autocast does not cache) and has d(weight) summed
  in fp32 (``accum_dtype``); the kernel returns both gradients in its inputs' dtype, bf16 (C N h and
  C v h kept), and its working memory is the two copies, one (n_c, v) bf16 logits buffer and the fp32
  sum: 2 N h + 2 v h + 2 n_c v + 4 v h. In the backward the bf16 d(weight) is cast to the fp32
  parameter's gradient while it is still alive, then d(input) to fp32 (4 N h) after it is freed.
GPU (H100, torch 2.11, liger-kernel 0.8.5; a Llama of 0.5B parameters, b 64 x s 256, fp32, eager
attention): all four kernels measured 34,239.2 MiB, estimated 34,237.2 (the peak inside the fused
cross-entropy's forward); RMSNorm, RoPE and SwiGLU with the plain loss 39,641.2, estimated 39,641.3
(``tests/test_memory_hf_config.py``). The autocast and bf16-weight paths of the fused cross-entropy
are read from its code, not yet measured.
liger's kernels inside per-block compiled layers (``compiled`` = ``blocks``; the head and the loss stay eager, so
the fused cross-entropy is its eager self): the compiled layer's terms, except where the tensors cross liger's
RMSNorm. Its kernel is a Triton launch inside an autograd function, which the partitioner does not recompute
across: what crosses it is kept as it crosses, in the dtype the kernel reads and writes, R. The second norm's
input (the residual sum, R N h) is kept whole where the compiled layer without liger recomputed it from the bf16
output projection (C N h), and each norm's output (R N h, in its input's dtype) is kept where the compiled layer
without liger kept the one bf16 cast the linears after it read (C N h): 3 (R - C) N h a layer more, 6 N h under
autocast, nothing in fp32 or ``mixed`` (R = C). liger's SwiGLU keeps gate, up and their product (the compiled
layer's 3 C N f) and its RoPE the rotated q and k: no change. This reading was identified on the H100 and H200
Llama 1B tune rows it now fits (sdpa, no checkpointing: 6.0 h bytes a token and a layer above the compiled layers
with the fused cross-entropy, at three micro-batches), not by a measurement made to test it; those rows count as
in-sample in ``results/memory/heldout.json``.

torchao's float8 training (``Setup.float8``: ``tensorwise`` or ``rowwise``, the lab's ``--float8``: the layers'
Linear layers converted by ``convert_to_float8_training``, the head left alone; GPT-2's layers are Conv1D, none
converted, nothing changes). Its ``matmul_with_hp_or_float8_args`` keeps the high-precision input and the weight
parameter itself and casts both to float8 in the forward and again in the backward (a cast is an amax, a
reduction, then a pointwise scale, round and clamp). What changes:
- every layer under autocast: no bf16 weight copies (Float8Linear casts the fp32 weight straight to float8; its
  input it casts to bf16 itself, one copy per module as autocast's linear made): 2 bytes a matrix entry less,
  and none in autocast's cache under checkpointing. Eager layers keep everything else as bf16's.
- per-block compiled layers (AOT autograd's min-cut partitioner): the two norms' bf16 outputs (q, k, v's and
  gate, up's input, C N h each) and the SwiGLU product (down's input, C N f) are no longer kept. In bf16 each is
  a matmul's input in the backward, which must exist whole, and the partitioner keeps it; under float8 the
  backward's GEMM reads its float8 cast, a pointwise kernel in which the recomputation fuses, so the input is
  recomputed from tensors kept anyway (the norm's input and fp32 row statistic; gate's and up's outputs), and no
  float8 copy is kept (any bytes are more than none). Tensorwise keeps the scalar scales (4 bytes each, seven to
  fourteen a layer: not counted); rowwise recomputes its scales. Per token and layer: 2 C h + C f bytes less
  (measured on the CPU and the GPU: MODEL.md, "torchao float8 training").

Not matched (CPU, measured): sdpa with dropout (the CPU's compiled math path keeps s^2 tensors;
CUDA's kernel keeps its RNG state), and checkpointing under ``model``: the saved bytes match, but
the peak of the backward is 4 to 22% above the estimate, growing with the layers (the compiled
backward recomputes ahead of need). What the partitioner keeps can tie between cuts of equal
bytes; which one it picks may differ between PyTorch versions.
"""

from __future__ import annotations

from fasttrain.memory.config import Setup
from fasttrain.memory.training_state import dims, dtypes, param_counts


def hf_terms(s: Setup, mask_bytes: int = 1, cpu: bool = False) -> dict:
    """One layer's kept bytes by part (``attn``, ``mlp``), the output's (``head``) and what the whole
    model keeps once (``once``: RoPE's cos and sin, the embedding's dropout mask, GPT-2's position ids).

    ``mask_bytes``: a dropout mask's bytes per element on CUDA (1, bool); ``cpu`` models PyTorch's
    CPU instead: masks in their input's dtype and the CPU autocast op list (``pow`` stays bf16)."""
    D, T = dims(s), dtypes(s)
    N, hl, kvl, f, a = D["N"], D["hl"], D["kvl"], D["f_l"], D["a_l"]
    h, C, cast, mixed = s.hidden, T["C"], T["cast"], s.precision == "mixed"
    R = 2 if mixed else 4                    # the residual stream's dtype (the parameters')
    unit = a * s.seq * s.seq * s.micro_batch
    flash = s.attention == "flash"
    P = param_counts(s)
    copies_attn = 2 * P["attn_w"] if cast else 0
    copies_mlp = 2 * P["mlp_w"] if cast else 0
    gpt2 = s.modules == "hf-gpt2"
    drop = s.dropout
    # compiled code makes its dropout masks bool (1 byte) on every device
    mask = (lambda dtype_bytes: dtype_bytes) if cpu and s.compiled == "none" else \
        (lambda dtype_bytes: 1 if s.compiled != "none" else mask_bytes)
    if gpt2:
        norm = R * N * h + 8 * N              # LayerNorm: input + fp32 mean and rstd
        qkv_in = mlp_in = C * N * h           # c_attn's and c_fc's input (its autocast copy or itself)
        Dsm = 2 if mixed else 4               # softmax of scores promoted by the fp32 mask (bf16 in mixed)
        if flash:
            core = C * N * 3 * hl + C * N * hl + 4 * a * s.micro_batch * s.seq    # c_attn output, out, lse
        else:
            pv = C if cast else Dsm
            kept_p = Dsm + (mask(pv) + pv if drop else (C if cast else 0))
            core = 3 * C * N * hl + kept_p * unit
        proj_in = 0 if flash else C * N * hl  # sdpa's output is the projection's input
        resid_mask = mask(C if cast or mixed else 4) * N * h if drop else 0
        if s.ffn_act == "relu":
            mlp_hidden = C * N * f
        elif cast and not cpu:
            mlp_hidden = 16 * N * f           # gelu_new under CUDA autocast (see above)
        else:
            mlp_hidden = 5 * C * N * f        # gelu_new: pow's input, tanh, 0.5 x, 1 + tanh, c_proj's input
        attn = {"norm1": norm, "qkv_input": qkv_in, "core": core, "proj_input": proj_in,
                "dropout_mask": resid_mask, "weight_copies": copies_attn}
        mlp = {"norm2": norm, "mlp_input": mlp_in, "mlp_hidden": mlp_hidden, "dropout_mask": resid_mask,
               "weight_copies": copies_mlp}
        once = {"embedding dropout mask": mask(R) * N * h if drop else 0,
                "position ids": 8 * s.seq}
        head = {"final_norm": norm, "head_input": C * N * h}
    else:
        fused = s.modules == "hf-phi3"
        norm = (4 + (2 if mixed else 4)) * N * h + 4 * N
        if s.modules == "hf-gemma":
            # Gemma scales by (1 + weight) in fp32 (kept: 4 h) and casts after: xhat stays fp32 in mixed too
            norm = 8 * N * h + 4 * N + 4 * h
        n_qkv, n_up = (1, 1) if fused or not cast else (3, 2)
        Rr = 2 if mixed else 4                # the rotated q, k: fp32 under autocast (fp32 cos)
        # v kept as a view keeps its whole storage: v_proj's output, or Phi-3's fused qkv output
        v_view = C * N * (hl + 2 * kvl if fused else kvl)
        if flash:
            core = C * N * (hl + kvl) + v_view + C * N * hl + 4 * a * s.micro_batch * s.seq
        else:
            # repeat_kv is expand + reshape: a stride-0 view when there is one KV head, which the batched
            # matmul can keep as a view when b = 1 (k then keeps g d per token, v too; under autocast k's
            # bf16 cast materializes all a heads); otherwise both are copies with a heads
            one_kv_view = kvl == D["d"] and s.micro_batch == 1
            k_kept = C * N * (kvl if one_kv_view and not cast else hl)
            v_kept = v_view if one_kv_view else C * N * hl
            core = C * N * hl + k_kept + v_kept + (4 + (2 if C == 2 else 0)) * unit
        # sdpa's output follows q's memory layout: Llama's rotated q is (b, s, a, d) in memory, so
        # ``transpose(1, 2).contiguous()`` is the same tensor; Phi-3's partial-rotary ``cat`` makes q
        # (b, a, s, d)-contiguous and the output projection's input a copy
        proj_in = C * N * hl if (not flash or fused) else 0
        attn = {"norm1": norm, "qkv_input": n_qkv * C * N * h, "core": core,
                "proj_input": proj_in, "dropout_mask": 0, "weight_copies": copies_attn}
        mlp = {"norm2": norm, "mlp_input": n_up * C * N * h, "mlp_hidden": 4 * C * N * f, "dropout_mask": 0,
               "weight_copies": copies_mlp}
        once = {"RoPE cos and sin": 2 * s.seq * D["d"] * Rr}
        head = {"final_norm": norm, "head_input": C * N * h}
    # the loss shifts the labels: pad by one, drop the first: a view of the padded (b, s + 1) int64 labels
    # when b = 1, a copy otherwise; nll_loss keeps them and its fp32 total weight (4 bytes)
    labels = 8 * (N + (1 if s.micro_batch == 1 else 0)) + 4
    if s.recompute == "full" and not flash:
        # eager attention's additive causal mask (b, 1, s, s) in the embeddings' dtype is made once per
        # forward; gradient checkpointing holds it (an argument of every layer) until the last recomputation
        once["causal mask (held by the checkpoints)"] = R * s.micro_batch * s.seq * s.seq
    head.update(head_weight_copy=2 * D["v_h"] * h if cast else 0, log_probs=4 * N * D["v_l"], labels=labels)
    first_core = _frozen(s, attn, mlp, once, head) if s.frozen else None
    out = {"attn": attn, "mlp": mlp, "once": once, "head": head, "norm": norm, "checkpoint": R * N * h,
           "first_norm1": None, "first_attn": 0, "first_core": first_core}
    if s.liger:
        _liger(s, out)
    if s.compiled != "none":
        _compiled(s, out, cpu)
        if s.compiled == "blocks" and "rms_norm" in s.liger:
            _liger_norm_in_blocks(s, out)
    if float8_layers(s):
        _float8(s, out)
    return out


def _float8(s: Setup, t: dict) -> None:
    """``t`` (eager or per-block compiled terms) edited in place into what the layers keep when torchao's float8
    training converts their Linear layers (``s.float8``; see the docstring's float8 part). Per token and layer, the
    compiled layer keeps 2 C h + C f bytes less (the two norms' bf16 outputs and down's input, recomputed from what
    is kept), and under autocast no layer keeps bf16 weight copies (2 bytes a matrix entry) in either."""
    D, C = dims(s), dtypes(s)["C"]
    attn, mlp = t["attn"], t["mlp"]
    # Float8Linear casts the fp32 weight to float8 itself and keeps the parameter (no autocast copy)
    attn["weight_copies"] = mlp["weight_copies"] = 0
    if s.compiled == "blocks":
        # the backward's GEMMs read float8 casts made by a pointwise kernel (a cast after an amax), not their
        # bf16 inputs: the partitioner recomputes those inputs where they are pointwise in what it keeps anyway
        # (a norm's input and row statistic; gate's and up's outputs) and keeps no float8 copy (1 byte > 0)
        attn["qkv_input"] = mlp["mlp_input"] = 0
        mlp["mlp_hidden"] -= C * D["N"] * D["f_l"]


def float8_layers(s: Setup) -> bool:
    """Whether torchao's float8 training converts this transformers model's layers (D24): ``s.float8`` given, and
    the layers' projections Linear (GPT-2's are Conv1D: none is converted)."""
    return s.float8 != "none" and s.modules.startswith("hf-") and s.modules != "hf-gpt2"


def _liger_norm_in_blocks(s: Setup, t: dict) -> None:
    """``t`` (compiled per-block terms) edited in place where liger's RMSNorm sits inside the compiled layer: its
    input and its output kept as they cross the kernel, in the residual stream's dtype R (see the docstring)."""
    N, R = dims(s)["N"], 2 if s.precision == "mixed" else 4
    attn, mlp = t["attn"], t["mlp"]
    mlp["norm2"] = attn["norm1"]                    # the residual sum itself, not the bf16 projection it is made from
    attn["qkv_input"] = mlp["mlp_input"] = R * N * s.hidden     # each norm's output, not its bf16 cast


def liger_chunk_rows(s: Setup) -> int:
    """Rows of one chunk of liger's fused linear cross-entropy: about N h logits, a power of two, at most N
    (``inc = ceil(v / h)``, ``n_c = min(N, next_power_of_2(ceil(N / inc)))``)."""
    D = dims(s)
    N, v = D["N"], D["v_l"]
    inc = -(-v // s.hidden)
    return min(N, 1 << max(0, (-(-N // inc) - 1).bit_length()))


def liger_flce_forward_bytes(s: Setup) -> int:
    """The working memory of liger's fused linear cross-entropy forward beyond what it keeps (its input,
    the per-token loss and target mask, the chunk buffers; see the docstring)."""
    D, T = dims(s), dtypes(s)
    N, v, h = D["N"], D["v_l"], s.hidden
    R = 2 if s.precision == "mixed" else 4
    n_c = liger_chunk_rows(s)
    grad_w = not s.frozen
    out = R * N * h + 4 * N + N
    if T["cast"]:
        # the lab's head under autocast: bf16 copies of the input and the weight, made once; one (n_c, v) bf16
        # logits buffer reused by every chunk; d(weight) summed in an fp32 buffer, cast to bf16 at the end (the kept
        # one) while the fp32 one is still alive
        out += 2 * N * h + 2 * v * h + 2 * n_c * v + (4 * v * h if grad_w else 0)
    elif s.precision == "mixed":
        out += 2 * n_c * v
    else:
        out += 4 * n_c * v + (4 * v * h if grad_w else 0)
    return out


def _liger(s: Setup, t: dict) -> None:
    """``t`` (eager terms) edited in place into what liger-kernel's patched model keeps (``s.liger``; see the
    docstring's liger part)."""
    D, T = dims(s), dtypes(s)
    N, f, h = D["N"], D["f_l"], s.hidden
    C = T["C"]
    R = 2 if s.precision == "mixed" else 4
    attn, mlp, head = t["attn"], t["mlp"], t["head"]
    if "rms_norm" in s.liger:
        norm = R * N * h + 4 * N                      # the input and the fp32 row statistic
        attn["norm1"] = mlp["norm2"] = t["norm"] = head["final_norm"] = norm
    if "glu" in s.liger:
        mlp["mlp_hidden"] = 3 * C * N * f             # gate's and up's outputs, their product (down's input)
    if "rope" in s.liger and s.attention == "flash" and s.modules == "hf-phi3":
        # Phi-3's q and k are views of the fused qkv output: liger's RoPE makes them (b, s, heads, d)-contiguous
        # (a copy, rotated in place) where eager's ``cat`` made them (b, heads, s, d); sdpa's output follows q's
        # layout, so the output projection's input is that output itself (eager: a copy)
        attn["proj_input"] = 0
    # otherwise "rope" changes nothing kept (q and k rotated in place; cos and sin kept as eager keeps them)
    if "fused_linear_cross_entropy" in s.liger:
        # the gradients it computes in its forward, kept for its backward: nothing else of the head and the loss
        # (under autocast the lab's head hands the kernel bf16 copies of its input and weight: both gradients bf16)
        g = C if T["cast"] else R
        t["head"] = {"final_norm": head["final_norm"], "fused_CE_grad_input": g * N * h,
                     "fused_CE_grad_weight": 0 if s.frozen else (C if T["cast"] else T["param"]) * D["v_h"] * h}

def _frozen(s: Setup, attn: dict, mlp: dict, once: dict, head: dict):
    """The eager terms (edited in place) of a frozen base: peft's LoRA on ``s.lora_targets`` (the model's own
    module names) or peft's soft prompt (``s.seq`` already counts its P positions).

    A frozen weight needs no gradient, so what autograd keeps only for one is not kept: a frozen linear
    (or Conv1D's ``addmm``) keeps no input, RMSNorm's ``weight * xhat`` no xhat (its input and row
    statistic stay: the input's gradient needs them), the gated MLP's product is down_proj's input only
    (kept only when down_proj is adapted), GPT-2's ``gelu_new`` chain keeps c_proj's input for c_proj
    only. LoRA's A (r x in) keeps its input (fp32: the very tensor the base linear reads; under
    autocast each A casts it to bf16 itself: one copy per adapted module), B keeps A's output (C N r
    per module); autocast's bf16 copies of the frozen weights are still kept (the input's gradient needs
    them) and A's and B's too. Layer 1 keeps nothing before its first adapted module (``precise``'s
    ``_first_layer``). A soft prompt keeps its int64 indices (peft's prompt embedding).
    Returns what layer 1's eager attention core keeps when it differs from every other layer's, else None."""
    from fasttrain.memory.training_state import lora_linears

    D, T = dims(s), dtypes(s)
    N, hl, f, h, C, cast = D["N"], D["hl"], D["f_l"], s.hidden, T["C"], T["cast"]
    r = s.lora_rank
    mods = {k: lora_linears(s, k) for k in ("qkv", "proj", "up", "down", "head")}
    copies = lambda k: 2 * r * sum(o + i for o, i in mods[k]) if cast else 0   # bf16 A and B (cached leaves)
    gpt2 = s.modules == "hf-gpt2"
    if not gpt2:
        # RMSNorm: x.pow(2) keeps the fp32 input, x * rstd the row statistic; xhat only for the weight
        # (Gemma's (1 + weight) stays: 4 h)
        norm = 4 * N * h + 4 * N + (4 * h if s.modules == "hf-gemma" else 0)
        attn["norm1"] = mlp["norm2"] = head["final_norm"] = norm
    # one input for every adapted module in fp32 (the same tensor); under autocast each A's own bf16 copy
    inputs = lambda k: (len(mods[k]) if cast else min(1, len(mods[k]))) * C * N * mods[k][0][1] if mods[k] else 0
    attn["qkv_input"] = inputs("qkv")
    # A keeps the projection's input: in fp32 under sdpa that is the kernel's output, which the kernel keeps
    # (already counted; layer 1 under LoRA on o_proj first: ``precise._first_layer``); under autocast A's copy
    if not (s.attention == "flash" and not cast and not attn["proj_input"]):
        attn["proj_input"] = inputs("proj")
    mlp["mlp_input"] = inputs("up")
    if not mods["down"] and s.ffn_act != "relu":
        # the down projection's input (c_proj's under GPT-2's gelu_new; ReLU's output is kept by ReLU itself)
        mlp["mlp_hidden"] -= C * N * f
    attn["weight_copies"] += copies("qkv") + copies("proj")
    mlp["weight_copies"] += copies("up") + copies("down")
    head["head_input"] = inputs("head")
    if mods["head"]:
        head["lora"] = C * N * r + copies("head")
    attn["lora"] = C * N * r * (len(mods["qkv"]) + len(mods["proj"]))
    mlp["lora"] = C * N * r * (len(mods["up"]) + len(mods["down"]))
    # the lab's loss passes its targets as ``shift_labels`` (no padded copy): nll_loss keeps the trainer's
    # own tensor (counted with the token ids) and its total weight; a soft prompt's targets are a new
    # (b, s + P) tensor (-100 for the prompt's positions). A frozen position table keeps no indices.
    head["labels"] = 4 + (8 * N if s.prompt_tokens else 0)
    once.pop("position ids", None)
    if s.lora_rank:
        once.pop("embedding dropout mask", None)     # the frozen embeddings' output needs no gradient
    if s.prompt_tokens:
        once["soft prompt indices"] = 8 * s.prompt_tokens
    elif gpt2 or s.attention == "flash" or s.modules == "hf-phi3":
        return None
    # eager attention in layer 1 under LoRA on some of q_proj, k_proj, v_proj: a tensor that needs no
    # gradient (nothing before it is adapted) makes autograd keep less: q k^T keeps q only when k needs a
    # gradient and k only when q does; the softmax keeps P when the scores need one; P V keeps V when P
    # does and P (its bf16 copy under autocast) when V does
    names = set(s.lora_targets)
    q_req, k_req, v_req = "q_proj" in names, "k_proj" in names, "v_proj" in names
    if not (q_req or k_req or v_req) or (q_req and k_req and v_req):
        return None
    qk = q_req or k_req
    unit = D["a_l"] * s.seq * s.seq * s.micro_batch
    one_kv_view = D["kvl"] == D["d"] and s.micro_batch == 1
    k_kept = C * N * (D["kvl"] if one_kv_view and not cast else hl)
    v_kept = C * N * (D["kvl"] if one_kv_view else hl)
    p_kept = (4 if qk else 0) + (2 if cast and v_req else 0) + (4 if not cast and v_req and not qk else 0)
    return (C * N * hl if k_req else 0) + (k_kept if q_req else 0) + (v_kept if qk else 0) + p_kept * unit


def _compiled(s: Setup, t: dict, cpu: bool) -> None:
    """``t`` (eager terms) edited in place into what AOT autograd's min-cut partitioner keeps for a
    ``torch.compile``d model (``s.compiled``: ``model`` or ``blocks``); see the docstring's last part."""
    D, T = dims(s), dtypes(s)
    N, hl, kvl, f, a = D["N"], D["hl"], D["kvl"], D["f_l"], D["a_l"]
    h, C, cast, mixed = s.hidden, T["C"], T["cast"], s.precision == "mixed"
    R = 2 if mixed else 4
    b, sq, v = s.micro_batch, s.seq, D["v_l"]
    unit = a * sq * sq * b
    whole = s.compiled == "model"
    full = s.recompute == "full"
    flash = s.attention == "flash"
    gpt2 = s.modules == "hf-gpt2"
    attn, mlp, once, head = t["attn"], t["mlp"], t["once"], t["head"]
    if not gpt2:
        # RMSNorm: its input and the row statistic; x * rstd and the weight's product are recomputed
        norm = R * N * h + 4 * N + (4 * h if s.modules == "hf-gemma" else 0)
        attn["norm1"] = mlp["norm2"] = t["norm"] = norm
        if whole:
            head["final_norm"] = norm
        if flash and whole:
            # the whole model traced: transformers materializes the causal mask, and with a mask it repeats k
            # and v to every head before sdpa (no enable_gqa): q, k, v and the output with a heads each, and
            # the fp32 log-sum-exp (blocks get no mask and keep eager's k and v with their g heads)
            # (with one KV head the repeat is a stride-0 view: v keeps its g d per token, k too unless autocast's
            # cast of the fp32 rotated k materializes it)
            one_kv = kvl == D["d"]
            k_kept = kvl if one_kv and not cast else hl
            v_kept = kvl if one_kv else hl
            attn["core"] = 2 * C * N * hl + C * N * (k_kept + v_kept) + 4 * a * b * sq
        if flash and s.modules == "hf-phi3":
            attn["proj_input"] = 0                    # the kernel's output is the projection's input (no copy)
        # one bf16 cast of the norm's output feeds q, k and v (gate and up): the fused kernel writes one
        attn["qkv_input"] = mlp["mlp_input"] = C * N * h
        # gated MLP: gate's and up's outputs and their product (down's input); the activation recomputed
        mlp["mlp_hidden"] = 3 * C * N * f
    elif s.ffn_act == "gelu":
        # gelu_new's chain fused: c_fc's output and c_proj's input (the chain recomputed from the first)
        mlp["mlp_hidden"] = 2 * C * N * f
    # GPT-2's attention dropout in a compiled block on CUDA (measured on an H100): the scores S, the bool mask and
    # the dropped P (P V's input), the fp32 P and its bf16 copy recomputed from S and the row statistics; the
    # CPU's compiled blocks keep eager's terms (measured), and a whole model with dropout is eager's (CPU)
    drop_in_block = s.dropout and gpt2 and not cpu and not whole
    if cast and not flash and (not s.dropout or drop_in_block):
        # the scores S and the softmax's bf16 P (P V's input; with dropout the dropped P and the 1-byte mask),
        # each a s^2 b, and the fp32 row maximum and sum: the fp32 P is recomputed from them in backward. A
        # whole compiled model does so in GPT-2's first layer only (every other layer, and every Llama layer,
        # keeps eager's fp32 and bf16 P)
        delta = (2 * C + (1 if s.dropout else 0) - _eager_p_bytes(s)) * unit + 8 * a * b * sq
        if not whole:
            attn["core"] += delta
        elif gpt2:
            t["first_attn"] = delta
    if cast and not whole:
        # the block's second norm input (the residual after attention) is recomputed from the block's input
        # and the bf16 output projection's output, which is kept instead of the fp32 sum
        mlp["norm2"] = mlp["norm2"] - R * N * h + C * N * h
    if whole and "fused_CE_grad_input" not in head:
        # the loss in the graph: the logits in the head's dtype and log-softmax's fp32 row max and log-sum-exp
        # (log-probabilities recomputed in backward); the padded labels (b, s + 1) int64 (the shift is a view)
        # (GPT-2's fused head ends the graph at the last hidden state: the head and the loss are liger's eager
        # kernel, which keeps what it keeps eager)
        head.pop("log_probs")
        head["logits"] = C * N * v + 8 * N
        head["labels"] = 8 * b * (sq + 1) + 4
    if whole:
        if not gpt2:
            once.pop("RoPE cos and sin", None)        # recomputed from the inverse frequencies
            if cast:
                # the final norm's input (the last residual sum) recomputed from the bf16 MLP output
                head["final_norm"] = head["final_norm"] - R * N * h + C * N * h
        else:
            # the position embeddings' output (s h) is kept; a layer's LayerNorm keeps rstd, not the mean
            once["position embeddings"] = R * sq * h
            attn["norm1"] -= 4 * N
            mlp["norm2"] -= 4 * N
            if full or b == 1:
                # under checkpointing (or with one sequence, when the sum is no larger than the position
                # embeddings) layer 1's input, token + position embeddings, is recomputed from them
                t["first_norm1"] = 0
        if not flash and (full or (cast and gpt2)):
            once["causal mask (bool)"] = b * sq * sq
        once.pop("causal mask (held by the checkpoints)", None)
        if flash:
            # transformers materializes the causal mask under tracing and sdpa keeps it (the dtype of q)
            once["causal mask (sdpa's)"] = C * b * sq * sq
        if full and s.recompute_layers in (0, s.layers) and not gpt2 and (flash or cast):
            head["final_norm"] = 4 * N                # its input recomputed with the last layer (when it recomputes)
        if flash and full:
            if cpu:
                # each checkpoint keeps the CPU generator's state (a uint8 tensor of 5056 bytes) as a graph
                # tensor; on a GPU run that state lives in host memory
                once["RNG states (checkpoints)"] = 5056 * (s.recompute_layers or s.layers)
    elif cast and not flash and not full:
        # each compiled block takes the additive causal mask (b, 1, s, s) as an input and keeps it (under
        # checkpointing the checkpoints hold it already: eager's term)
        once["causal mask (a block's input)"] = R * b * sq * sq


def _eager_p_bytes(s: Setup) -> int:
    """Bytes per a s^2 b element eager attention keeps of P (as ``hf_terms`` counts them)."""
    T = dtypes(s)
    C, cast, mixed = T["C"], T["cast"], s.precision == "mixed"
    if s.modules == "hf-gpt2":
        Dsm = 2 if mixed else 4
        if s.dropout:
            pv = C if cast else Dsm
            return Dsm + (1 if s.compiled != "none" else pv) + pv      # P, the mask (bool when compiled), P dropped
        return Dsm + (C if cast else 0)
    return 4 + (2 if C == 2 else 0)
