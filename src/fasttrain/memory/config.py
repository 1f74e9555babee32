"""What the estimator is asked about: one training setup (model shape + parallelism + precision).

A :class:`Setup` holds every knob of the Ultra-Scale Playbook's memory widget (under the
widget's letters: a, b, h, h_ff, L, s, v, k, tp, dp, zero, mixed, recomputation,
ff_activation, seq_parallel) plus what the ``precise`` mode needs to describe a real model
(key/value heads, norm, position encoding, tied embeddings, biases, dropout, attention kernel,
optimizer implementation, cuBLAS workspace).

Presets:
- ``llama3-8b``, ``llama3-70b``, ``llama3-405b``: the published Llama 3 (and 3.1, same shapes)
  architectures: Table 3 of "The Llama 3 Herd of Models" (arXiv:2407.21783) and the released
  ``config.json`` files (vocabulary 128256 = 128000 tokens + 256 special). Default training
  shape: micro-batch 1 of 8192 tokens, bf16 mixed precision, no parallelism.
- ``playbook-tiny``, ``playbook-8b``, ``playbook-70b``, ``playbook-405b``: the widget's own
  presets, value for value (``Llama 3 Tiny``/``8B``/``70B``/``405B`` in ``src/memory.js``). They are
  NOT the real Llama 3 shapes (4h feed-forward, BERT's 30522 vocabulary, 256 tokens); they exist
  so that ``--mode playbook`` reproduces the widget's numbers exactly.
- ``gpt2-124m`` and ``val-*``: small GPT-style models; ``val-*`` are the GPU validation models
  (see ``fasttrain.memory.validate``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from fasttrain.errors import FasttrainError

PRECISIONS = ("fp32", "mixed", "amp")
RECOMPUTE = ("none", "selective", "full")
FFN_ACTS = ("relu", "gelu", "swiglu")
NORMS = ("rms", "layer")
POSITIONS = ("rope", "learned")
ATTENTIONS = ("eager", "flash")
OPTIMIZERS = ("foreach", "fused")
REDUCE_DTYPES = ("fp32", "bf16")
# whose modules the activations follow: the lab's GPT (fasttrain.lab.model) or transformers' modeling code of
# one family (llama also stands for mistral and qwen2, which share its modules; see hf_config.py)
MODULES = ("lab", "hf-llama", "hf-gemma", "hf-phi3", "hf-gpt2")
# what the optimizer keeps per trainable parameter (``precise``): adamw = fp32 m and v (k bytes,
# --opt-bytes, 8 by default); adamw_8bit = torchao's AdamW8bit (block-wise 8-bit m and v);
# adafactor = torch.optim.Adafactor (factored second moment, no first moment); sgd = nothing;
# sgd_momentum = one momentum buffer
OPTIMS = ("adamw", "adamw_8bit", "adafactor", "sgd", "sgd_momentum")
# the lab's (Hugging Face) optimizer names -> (optim, implementation)
OPTIM_ALIASES = {"adamw_torch": ("adamw", "foreach"), "adamw_torch_fused": ("adamw", "fused"),
                 "adamw_fused": ("adamw", "fused")}
LORA_TARGETS = ("qkv", "proj", "up", "down", "head")
# transformers' module names -> the kinds of linear they are, per family (``Setup.modules``): (kind, which
# rows of the kind's (out, in) matrix the module is). GPT-2's ``c_proj`` names two modules of a layer, the
# attention's output projection and the MLP's down projection: peft adapts both.
HF_LINEARS = {
    "hf-llama": {"q_proj": [("qkv", "q")], "k_proj": [("qkv", "kv")], "v_proj": [("qkv", "kv")],
                 "o_proj": [("proj", "all")], "gate_proj": [("up", "half")], "up_proj": [("up", "half")],
                 "down_proj": [("down", "all")], "lm_head": [("head", "all")]},
    "hf-phi3": {"qkv_proj": [("qkv", "all")], "o_proj": [("proj", "all")], "gate_up_proj": [("up", "all")],
                "down_proj": [("down", "all")], "lm_head": [("head", "all")]},
    "hf-gpt2": {"c_attn": [("qkv", "all")], "c_proj": [("proj", "all"), ("down", "all")], "c_fc": [("up", "all")],
                "lm_head": [("head", "all")]},
}
HF_LINEARS["hf-gemma"] = HF_LINEARS["hf-llama"]
MODES = ("playbook", "precise")
# torch.compile of a transformers model (precise only): none = eager; model = the whole module one graph (the loss
# inside it); blocks = each decoder layer compiled alone (embeddings, head and loss eager). See hf_activations.py.
COMPILED = ("none", "model", "blocks")
# torchao's float8 training of a transformers model's decoder-layer Linear layers (``convert_to_float8_training``, the
# lab's ``--float8``; precise only, D24): none, or the recipe's scaling (per tensor, per row)
FLOAT8 = ("none", "tensorwise", "rowwise")
# liger-kernel's patches of a transformers model (precise only; what each keeps: hf_activations.py): its RMSNorm,
# RoPE, gated MLP (SwiGLU; Gemma's GeGLU) and fused linear cross-entropy (the logits never materialized)
LIGER_KERNELS = ("rms_norm", "rope", "glu", "fused_linear_cross_entropy")
# the vocabulary-sized tensors tensor parallelism can split t ways (precise only, D23): the embedding's rows, the
# output layer's rows and the logits (a vocabulary-parallel cross-entropy). Megatron's layout splits all three
# (the default); a transformers model's plan gathers the logits whole on every rank and keeps a tied embedding
# whole (hf_config.vocab_split_of); the lab's GPT splits none
VOCAB_SPLITS = ("embedding", "head", "logits")


@dataclass(frozen=True)
class Setup:
    """One training configuration, per GPU unless said otherwise.

    precision: ``fp32``; ``mixed`` = the widget's mixed precision (bf16 weights, gradients and
    activations, fp32 master weights in the optimizer: k + 4 bytes of optimizer state); ``amp`` =
    PyTorch autocast to bf16 (fp32 weights, gradients and optimizer state; bf16 matmul inputs),
    ``precise`` mode only.
    """

    heads: int = 32            # a: attention (query) heads
    micro_batch: int = 1       # b: sequences per GPU per step
    hidden: int = 4096         # h
    ffn: int = 14336           # h_ff: feed-forward width (per gate for SwiGLU)
    layers: int = 32           # L
    seq: int = 8192            # s: tokens per sequence
    vocab: int = 128256        # v
    tp: int = 1                # t: tensor parallelism
    dp: int = 1                # d: data parallelism (ZeRO shards over it)
    opt_bytes: int = 8         # k: optimizer bytes per parameter (Adam: 4 + 4)
    precision: str = "mixed"
    seq_parallel: bool = False
    recompute: str = "none"
    zero: int = 0
    recompute_layers: int = 0      # recompute full: the first this many layers recompute, the rest keep theirs (0: all)
    ffn_act: str = "swiglu"
    # precise-only knobs (the widget has none of these)
    kv_heads: int | None = None     # g: key/value heads (grouped-query attention); None = heads
    norm: str = "rms"
    pos: str = "rope"
    tied: bool = False
    bias: bool = False
    dropout: bool = False
    attention: str = "eager"
    optimizer: str = "foreach"
    workspace_mib: float = 65.0     # cuBLAS(Lt) workspaces, measured on an H200 with torch 2.11: 2 x 32 + 1 MiB
    grad_buffers: bool = False      # gradients kept between steps (DDP buckets, Megatron main_grad)
    offload: bool = False           # ZeRO's sharded weights, their gradients and the optimizer state in host memory
    # ZeRO-2/3 as FSDP2 (torch's fully_shard) holds it, not the widget's: fp32 shards (under ``mixed`` the master
    # weights), compute copies gathered per block and the root group (embeddings, final norm, output layer), a
    # block's gradients unsharded until its reduce-scatter (buffer in ``reduce_dtype``) lands them in fp32 shards
    fsdp: bool = False
    reduce_dtype: str = "fp32"      # FSDP's gradient reduction (MixedPrecisionPolicy.reduce_dtype): fp32 or bf16
    # what trains, and with which optimizer (precise only)
    optim: str = "adamw"            # optimizer state kind, one of OPTIMS
    lora_rank: int = 0              # r: LoRA (peft) on lora_targets, base frozen; 0 = off
    lora_targets: tuple = ("qkv", "proj")   # module kinds that get A (r x in) and B (out x r)
    lora_dropout: float = 0.0       # peft's lora_dropout: > 0 keeps a dropped copy of A's input and its mask
    prompt_tokens: int = 0          # P: trainable soft-prompt vectors (P x h) prepended, base frozen; 0 = off
    # a model other than the lab's GPT (precise only; ``fasttrain.memory.hf_config`` fills these from a
    # Hugging Face config.json). The defaults describe the lab's GPT and change no figure of it.
    head_dim: int | None = None     # d: per-head width; None = h / a (Gemma-7B: 256 with 16 heads of a 3072 model)
    qkv_bias: bool | None = None    # biases on the q, k, v projections; None = ``bias`` (Qwen2: q, k, v only)
    proj_bias: bool | None = None   # bias on the attention output projection; None = ``bias``
    mlp_bias: bool | None = None    # biases on the MLP's linears; None = ``bias``
    positions: int | None = None    # rows of the learned position table; None = s (GPT-2: n_positions = 1024)
    modules: str = "lab"            # whose modules keep the activations: the lab's GPT or a transformers family
    keep_logits: bool = False       # the trainer holds the model's output (its logits) through backward
    compiled: str = "none"          # torch.compile scope (one of COMPILED); modelled for transformers models only
    liger: tuple = ()               # liger-kernel's kernels patched in (among LIGER_KERNELS); transformers models only
    float8: str = "none"            # torchao's float8 training of the layers' Linears (one of FLOAT8; precise.D24)
    float8_all_gather: bool = False  # fsdp gathering tensorwise float8 weights in float8: not modelled (refused)
    cuda_graphs: bool = False       # the compiled code captured as CUDA graphs, their private memory pool (precise.D20)
    # under tensor parallelism t, which vocabulary-sized tensors are split t ways (among VOCAB_SPLITS; precise.D23):
    # the default is Megatron's layout; () keeps the embedding, the output layer and the logits whole on every rank
    vocab_split: tuple = VOCAB_SPLITS

    @property
    def g(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def d(self) -> int:
        """The per-head width: ``head_dim``, or h / a."""
        return self.hidden // self.heads if self.head_dim is None else self.head_dim

    @property
    def mixed(self) -> bool:
        return self.precision == "mixed"

    @property
    def frozen(self) -> bool:
        """The base model is frozen (LoRA or prompt tuning): only the adapters train."""
        return self.lora_rank > 0 or self.prompt_tokens > 0

    def with_(self, **changes) -> "Setup":
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise FasttrainError(f"unknown setup field(s) {sorted(unknown)}")
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["kv_heads"] = self.g
        out["lora_targets"] = list(self.lora_targets)
        out["liger"] = list(self.liger)
        out["vocab_split"] = list(self.vocab_split)
        return out


_POSITIVE = ("heads", "micro_batch", "hidden", "ffn", "layers", "seq", "vocab", "tp", "dp")
# Upper bounds, far above any real model (Llama 3.1 405B: h 16384, h_ff 53248, L 126, v 128256) and
# low enough that every byte count stays an exact, printable number.
MAXIMA = {"heads": 2**16, "micro_batch": 2**20, "hidden": 2**20, "ffn": 2**22, "layers": 2**16, "seq": 2**24,
          "vocab": 2**24, "tp": 2**16, "dp": 2**24, "opt_bytes": 64, "workspace_mib": 2**20, "head_dim": 2**16,
          "positions": 2**24}


def _flag(name: str) -> str:
    return "--" + {"micro_batch": "micro-batch", "opt_bytes": "opt-bytes", "kv_heads": "kv-heads",
                   "lora_rank": "lora-r", "lora_targets": "lora-targets", "lora_dropout": "lora-dropout",
                   "prompt_tokens": "prompt-tokens", "head_dim": "head-dim"}.get(name, name)


def check(setup: Setup, mode: str = "precise") -> Setup:
    """Raise a one-line :class:`FasttrainError` (with the fix) for a setup no model can have."""
    if mode not in MODES:
        raise FasttrainError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    for name in _POSITIVE:
        value = getattr(setup, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise FasttrainError(f"{_flag(name)} must be a positive integer, got {value!r}")
        if value > MAXIMA[name]:
            raise FasttrainError(f"{_flag(name)} must be at most {MAXIMA[name]:,}, got {value:,}")
    if isinstance(setup.opt_bytes, bool) or not isinstance(setup.opt_bytes, int) or setup.opt_bytes < 0:
        raise FasttrainError(f"--opt-bytes must be a non-negative integer, got {setup.opt_bytes!r}")
    if setup.opt_bytes > MAXIMA["opt_bytes"]:
        raise FasttrainError(f"--opt-bytes must be at most {MAXIMA['opt_bytes']}, got {setup.opt_bytes:,}")
    g = setup.g
    if isinstance(g, bool) or not isinstance(g, int) or g <= 0:
        raise FasttrainError(f"--kv-heads must be a positive integer, got {g!r}")
    for name in ("head_dim", "positions"):
        value = getattr(setup, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0
                                  or value > MAXIMA[name]):
            raise FasttrainError(f"{_flag(name)} must be a positive integer up to {MAXIMA[name]:,}, got {value!r}")
    if setup.head_dim is None and setup.hidden % setup.heads:
        raise FasttrainError(f"heads ({setup.heads}) must divide the hidden size ({setup.hidden}); "
                             f"pick --heads among the divisors of {setup.hidden}")
    if setup.pos == "learned" and setup.positions is not None and setup.seq > setup.positions:
        raise FasttrainError(f"sequence length {setup.seq:,} exceeds the model's {setup.positions:,} learned positions "
                             f"(n_positions); use --seq {setup.positions:,} or less")
    if setup.modules not in MODULES:
        raise FasttrainError(f"modules must be one of {', '.join(MODULES)}, got {setup.modules!r}")
    if setup.modules != "lab" and mode == "playbook":
        raise FasttrainError("a transformers model (--hf-config) exists only in --mode precise; the widget "
                             "knows its own GPT")
    if setup.modules != "lab" and setup.recompute == "selective":
        raise FasttrainError("a transformers model recomputes whole layers (gradient_checkpointing_enable): "
                             "use --recompute full or none")
    if setup.pos == "learned" and setup.positions is not None and setup.seq + setup.prompt_tokens > setup.positions \
            and setup.modules != "lab":
        raise FasttrainError(f"sequence length {setup.seq:,} + {setup.prompt_tokens} soft-prompt tokens exceeds the "
                             f"model's {setup.positions:,} learned positions (n_positions); use --seq "
                             f"{setup.positions - setup.prompt_tokens:,} or less")
    if setup.modules != "lab" and setup.frozen and (setup.compiled != "none" or setup.recompute != "none"
                                                    or setup.lora_dropout > 0 or setup.precision == "mixed"):
        raise FasttrainError("LoRA and prompt tuning of a transformers model are modelled without torch.compile, "
                             "gradient checkpointing, lora_dropout and bf16 weights (mixed); drop those, or "
                             "drop --lora-r / --prompt-tokens")
    if setup.compiled not in COMPILED:
        raise FasttrainError(f"compiled must be one of {', '.join(COMPILED)} (the torch.compile scope), "
                             f"got {setup.compiled!r}")
    if setup.compiled != "none" and mode == "playbook":
        raise FasttrainError("torch.compile (compiled) exists only in --mode precise; the widget models eager PyTorch")
    if setup.cuda_graphs and setup.compiled == "none":
        raise FasttrainError("cuda_graphs are torch.compile's (reduce-overhead, the cudagraphs backend): give the "
                             "compiled scope too (--compiled model or blocks)")
    _check_liger(setup)
    _check_float8(setup)
    _check_vocab_split(setup)
    if setup.heads % setup.tp:
        raise FasttrainError(f"tensor parallelism t={setup.tp} must divide the heads ({setup.heads}); "
                             f"pick --tp among the divisors of {setup.heads}")
    if setup.heads % g:
        raise FasttrainError(f"key/value heads ({g}) must divide the heads ({setup.heads})")
    if g % setup.tp and setup.tp % g:
        raise FasttrainError(f"tensor parallelism t={setup.tp} and key/value heads {g}: one must divide the other")
    if setup.ffn % setup.tp:
        raise FasttrainError(f"tensor parallelism t={setup.tp} must divide the feed-forward size ({setup.ffn})")
    if setup.d % 2 and setup.pos == "rope" and mode == "precise":
        raise FasttrainError(f"rotary embeddings need an even head size; the head size is {setup.d}")
    for name, allowed in (("precision", PRECISIONS), ("recompute", RECOMPUTE), ("ffn_act", FFN_ACTS),
                          ("norm", NORMS), ("pos", POSITIONS), ("attention", ATTENTIONS), ("optimizer", OPTIMIZERS)):
        if getattr(setup, name) not in allowed:
            raise FasttrainError(f"{_flag(name).replace('_', '-')} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(setup, name)!r}")
    if setup.zero not in (0, 1, 2, 3) or isinstance(setup.zero, bool):
        raise FasttrainError(f"--zero must be 0, 1, 2 or 3, got {setup.zero!r}")
    if setup.fsdp and (mode == "playbook" or setup.zero < 2):
        raise FasttrainError("fsdp (FSDP2's layout of ZeRO) is modelled in --mode precise with --zero 2 or 3 "
                             "(fully_shard resharding after the backward, or after the forward too)")
    if isinstance(setup.recompute_layers, bool) or not isinstance(setup.recompute_layers, int) \
            or not 0 <= setup.recompute_layers <= setup.layers:
        raise FasttrainError(f"--recompute-layers must be between 0 (every layer) and the {setup.layers} layers, "
                             f"got {setup.recompute_layers!r}")
    if setup.recompute_layers and setup.recompute != "full":
        raise FasttrainError(f"--recompute-layers {setup.recompute_layers} counts the layers full recomputation "
                             f"recomputes: it goes with --recompute full")
    if setup.reduce_dtype not in REDUCE_DTYPES:
        raise FasttrainError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {setup.reduce_dtype!r}")
    if setup.reduce_dtype != "fp32" and not setup.fsdp:
        raise FasttrainError(f"reduce_dtype {setup.reduce_dtype} is FSDP's gradient reduction: it goes with fsdp")
    if setup.offload and (mode == "playbook" or setup.zero < 2):
        raise FasttrainError("offload (FSDP's CPUOffloadPolicy) is modelled in --mode precise with --zero 2 or 3 "
                             "(the sharded state is what moves to the host)")
    if isinstance(setup.workspace_mib, bool) or not isinstance(setup.workspace_mib, int | float) \
            or not 0 <= setup.workspace_mib <= MAXIMA["workspace_mib"]:
        raise FasttrainError(f"--workspace-mib must be a number from 0 to {MAXIMA['workspace_mib']:,}, "
                             f"got {setup.workspace_mib!r}")
    if mode == "playbook" and setup.precision == "amp":
        raise FasttrainError("precision 'amp' (PyTorch autocast) exists only in --mode precise; "
                             "the widget knows fp32 and --mixed")
    _check_training(setup, mode)
    return setup


def _check_vocab_split(setup: Setup) -> None:
    """``vocab_split``: distinct names among :data:`VOCAB_SPLITS`; split logits come from a split output layer (each
    rank computes its rows' columns), and tied embeddings are one matrix, split both ways or neither."""
    split = setup.vocab_split
    if isinstance(split, str) or not isinstance(split, (tuple, list)) \
            or not all(k in VOCAB_SPLITS for k in split) or len(set(split)) != len(split):
        raise FasttrainError(f"vocab_split must be distinct names among {', '.join(VOCAB_SPLITS)}, got {split!r}")
    if "logits" in split and "head" not in split:
        raise FasttrainError("vocab_split: split logits come from a split output layer; add head or drop logits")
    if setup.tied and ("embedding" in split) != ("head" in split):
        raise FasttrainError("vocab_split: tied embeddings are one matrix, split as embedding and head both or "
                             "neither")


def _check_float8(setup: Setup) -> None:
    """``float8``: modelled (D24) for a transformers model's layers, eager or compiled one by one, under bf16
    autocast or bf16 weights, every layer's Linear converted (the lab converts those whose features are multiples
    of 16: float8 GEMMs need them), one tensor-parallel rank; refused otherwise, with what to drop."""
    f8 = setup.float8
    if f8 not in FLOAT8:
        raise FasttrainError(f"float8 must be one of {', '.join(FLOAT8)}, got {f8!r}")
    if f8 == "none":
        return
    if setup.modules == "lab":
        raise FasttrainError("float8 is modelled for a transformers model's layers (--hf-config), not the lab's GPT; "
                             "drop float8")
    if setup.precision == "fp32":
        raise FasttrainError("float8 is modelled under bf16 autocast or bf16 weights (precision amp or mixed); "
                             "drop float8 or pick one")
    if setup.compiled == "model":
        raise FasttrainError("float8 is modelled with eager or per-block compiled layers (compiled none or blocks), "
                             "not a whole compiled model")
    if set(setup.liger) & {"rms_norm", "glu"} and setup.compiled != "none":
        raise FasttrainError("float8 beside liger's RMSNorm or SwiGLU inside compiled layers is not modelled; "
                             "keep liger's fused cross-entropy alone")
    if setup.frozen:
        raise FasttrainError("float8 with LoRA or a soft prompt (a frozen base) is not modelled; drop float8")
    if setup.tp > 1:
        raise FasttrainError("float8 is modelled on one tensor-parallel rank (the lab refuses it with tensor "
                             "parallelism)")
    if setup.float8_all_gather and setup.fsdp and f8 == "tensorwise":
        # measured on the 8B's pick (FSDP2 ZeRO-2, 4 H200): 62,623 MiB against 63,831 gathering in bf16, not the
        # 6,656 MiB less that 1-byte gathered copies would hold (MODEL.md, D24)
        raise FasttrainError("float8 weights all-gathered in float8 under FSDP are not modelled (their peak is not "
                             "what 1-byte gathered copies hold); drop --float8-all-gather")
    d = setup.d
    if setup.modules != "hf-gpt2" and any(n % 16 for n in (setup.hidden, setup.ffn, setup.heads * d, setup.g * d)):
        raise FasttrainError(f"float8 converts only Linear layers whose features are multiples of 16; hidden "
                             f"{setup.hidden}, ffn {setup.ffn}, q {setup.heads * d}, k/v {setup.g * d} leave some "
                             f"in bf16 (not modelled): drop float8")


def _check_liger(setup: Setup) -> None:
    """liger-kernel's patches: modelled for the transformers families liger patches, and its fused linear
    cross-entropy alone on any transformers model's head (the lab's fused head); eager, beside per-block compiled
    layers, or (the fused cross-entropy alone) beside a whole compiled model; one rank."""
    kernels = setup.liger
    if isinstance(kernels, str) or not isinstance(kernels, (tuple, list)) \
            or not all(k in LIGER_KERNELS for k in kernels) or len(set(kernels)) != len(kernels):
        raise FasttrainError(f"liger must be distinct names among {', '.join(LIGER_KERNELS)}, got {kernels!r}")
    if not kernels:
        return
    if setup.modules == "lab" or (setup.modules == "hf-gpt2" and tuple(kernels) != ("fused_linear_cross_entropy",)):
        raise FasttrainError("liger-kernel is modelled for the transformers families it patches (Llama, Mistral, "
                             "Qwen2, Gemma, Phi-3) and, for GPT-2, its fused linear cross-entropy alone; not for "
                             + ("the lab's GPT" if setup.modules == "lab" else "GPT-2's other layers") + "; drop liger")
    if setup.compiled == "model" and tuple(kernels) != ("fused_linear_cross_entropy",):
        # per-block compile leaves the head and the loss eager (liger's fused cross-entropy is what it is eager) and
        # puts liger's layer kernels inside the compiled layers (hf_activations: what crosses them is kept); the
        # lab's fused head under a whole compiled model ends the graph at the last hidden state, the kernel eager
        # after it (D26, any family); liger's layer kernels the lab refuses under a whole-model compile
        raise FasttrainError("liger-kernel's layer kernels under a whole-model torch.compile are not modelled; "
                             "estimate them with per-block compiled layers (compiled blocks), eager (compiled none), "
                             "or the fused cross-entropy alone (liger fused_linear_cross_entropy)")
    if setup.tp > 1:
        raise FasttrainError("liger-kernel with tensor parallelism is not modelled by the estimator; use --tp 1")


def _check_training(setup: Setup, mode: str) -> None:
    """The optimizer kind and the parameter-efficient fine-tuning knobs."""
    if setup.optim not in OPTIMS:
        raise FasttrainError(f"--optim must be one of {', '.join(OPTIMS + tuple(OPTIM_ALIASES))}, got {setup.optim!r}")
    for name in ("lora_rank", "prompt_tokens"):
        value = getattr(setup, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FasttrainError(f"{_flag(name)} must be a non-negative integer, got {value!r}")
    if isinstance(setup.lora_dropout, bool) or not isinstance(setup.lora_dropout, (int, float)) \
            or not 0 <= setup.lora_dropout < 1:
        raise FasttrainError(f"--lora-dropout must be in [0, 1), got {setup.lora_dropout!r}")
    targets = setup.lora_targets
    # a transformers model's targets are its own module names (peft's target_modules)
    names = LORA_TARGETS if setup.modules == "lab" else tuple(HF_LINEARS.get(setup.modules, {}))
    if (setup.modules == "lab" or setup.lora_rank) and (
            isinstance(targets, str) or not all(t in names for t in targets) or len(set(targets)) != len(targets)):
        raise FasttrainError(f"--lora-targets must be distinct names among {', '.join(names)}, got {targets!r}")
    if mode == "playbook" and (setup.optim != "adamw" or setup.frozen):
        raise FasttrainError("--optim, --lora-r and --prompt-tokens exist only in --mode precise; "
                             "the widget knows --opt-bytes")
    if setup.optim != "adamw" and setup.opt_bytes != 8:
        raise FasttrainError(f"--opt-bytes is AdamW's k; --optim {setup.optim} counts its own state: drop --opt-bytes")
    if setup.optimizer == "fused" and setup.optim in ("adamw_8bit", "adafactor"):
        raise FasttrainError(f"--optim {setup.optim} has no fused implementation: use --optimizer foreach")
    if setup.lora_rank and setup.prompt_tokens:
        raise FasttrainError("give --lora-r or --prompt-tokens, not both")
    if setup.lora_rank and not targets:
        raise FasttrainError(f"--lora-targets is empty; name at least one of {', '.join(LORA_TARGETS)}")
    if setup.lora_rank and setup.modules != "lab" and tuple(targets) == ("lm_head",):
        raise FasttrainError("LoRA on lm_head alone of a transformers model is not modelled (no layer needs a "
                             "gradient: the peak is in the forward pass); add a layer's module, e.g. q_proj")
    if setup.lora_rank and "lm_head" in targets and setup.tied:
        raise FasttrainError("LoRA on lm_head of a model with tied embeddings is not modelled; drop lm_head")
    if setup.lora_rank and "head" in targets and setup.tied:
        raise FasttrainError("LoRA on the head needs an untied output projection (--untied), or drop 'head'")
    if setup.frozen and setup.tp > 1:
        raise FasttrainError("LoRA and prompt tuning are modelled on one tensor-parallel rank: use --tp 1")


# The published Llama 3 shapes (identical for 3.1). GQA with 8 KV heads, RMSNorm, RoPE,
# SwiGLU, no biases, untied input/output embeddings, no dropout.
_LLAMA = dict(norm="rms", pos="rope", tied=False, bias=False, dropout=False, ffn_act="swiglu",
              vocab=128256, kv_heads=8, micro_batch=1, seq=8192, precision="mixed", attention="flash",
              optimizer="fused")
# The widget assumes a GPT-2/Megatron-style model: learned positions, tied embeddings, biases,
# LayerNorm, dropout everywhere, multi-head attention.
_WIDGET = dict(norm="layer", pos="learned", tied=True, bias=True, dropout=True, kv_heads=None)

PRESETS: dict[str, dict] = {
    "llama3-8b": dict(_LLAMA, heads=32, hidden=4096, ffn=14336, layers=32),
    "llama3-70b": dict(_LLAMA, heads=64, hidden=8192, ffn=28672, layers=80),
    "llama3-405b": dict(_LLAMA, heads=128, hidden=16384, ffn=53248, layers=126),
    # memory.js presets, value for value ("Llama 3 Tiny", "Llama 3 8B", "Llama 3 70B", "Llama 3 405B")
    "playbook-tiny": dict(_WIDGET, heads=16, micro_batch=3, hidden=1024, ffn=4096, layers=1, seq=7, vocab=30522,
                          opt_bytes=8, tp=1, zero=1, dp=1, precision="mixed", recompute="none", ffn_act="gelu",
                          seq_parallel=False),
    "playbook-8b": dict(_WIDGET, heads=32, micro_batch=32, hidden=4096, ffn=16384, layers=32, seq=256, vocab=30522,
                        opt_bytes=8, tp=1, zero=1, dp=1, precision="mixed", recompute="none", ffn_act="swiglu",
                        seq_parallel=False),
    "playbook-70b": dict(_WIDGET, heads=64, micro_batch=32, hidden=8192, ffn=32768, layers=80, seq=256, vocab=30522,
                         opt_bytes=8, tp=8, zero=1, dp=8, precision="mixed", recompute="none", ffn_act="swiglu",
                         seq_parallel=False),
    "playbook-405b": dict(_WIDGET, heads=128, micro_batch=32, hidden=16384, ffn=65536, layers=126, seq=256,
                          vocab=30522, opt_bytes=8, tp=8, zero=1, dp=8, precision="mixed", recompute="none",
                          ffn_act="swiglu", seq_parallel=False),
    # GPT-2 small (124M): 12 x 768, 12 heads, 3072 GELU MLP, 50257 tokens, 1024 positions.
    "gpt2-124m": dict(_WIDGET, heads=12, hidden=768, ffn=3072, layers=12, seq=1024, vocab=50257, micro_batch=8,
                      ffn_act="gelu", precision="fp32"),
    # GPU validation models (fasttrain.memory.validate): a Llama-style one with GQA and a
    # GPT-2-style one (tied, learned positions, LayerNorm, GELU, dropout), and a ReLU one.
    "val-llama": dict(_LLAMA, heads=16, kv_heads=4, hidden=1024, ffn=2816, layers=8, vocab=32000, seq=1024,
                      micro_batch=8, precision="fp32", attention="eager", optimizer="foreach"),
    "val-gpt": dict(_WIDGET, heads=12, hidden=768, ffn=3072, layers=6, seq=1024, vocab=50304, micro_batch=8,
                    ffn_act="gelu", precision="fp32"),
    "val-relu": dict(_LLAMA, heads=8, kv_heads=None, hidden=1024, ffn=4096, layers=4, vocab=16384, seq=512,
                     micro_batch=16, ffn_act="relu", norm="layer", precision="fp32", attention="eager",
                     optimizer="foreach"),
}

PRESET_NOTES = {
    "llama3-8b": "Llama 3 / 3.1 8B: Table 3 of arXiv:2407.21783 and meta-llama config.json",
    "llama3-70b": "Llama 3 / 3.1 70B: Table 3 of arXiv:2407.21783 and meta-llama config.json",
    "llama3-405b": "Llama 3.1 405B: Table 3 of arXiv:2407.21783 and meta-llama config.json",
    "playbook-tiny": "the widget's 'Llama 3 Tiny' preset (memory.js), not a real model",
    "playbook-8b": "the widget's 'Llama 3 8B' preset (memory.js): 4h FFN, BERT vocabulary, s=256",
    "playbook-70b": "the widget's 'Llama 3 70B' preset (memory.js)",
    "playbook-405b": "the widget's 'Llama 3 405B' preset (memory.js)",
    "gpt2-124m": "GPT-2 small (Radford et al. 2019): 12 layers, 768 wide, 12 heads",
    "val-llama": "GPU validation model: Llama-style, GQA 16/4, 8 layers",
    "val-gpt": "GPU validation model: GPT-2-style, 6 layers, tied, dropout",
    "val-relu": "GPU validation model: ReLU MLP, LayerNorm, RoPE, 4 layers",
}


ALIASES = {"llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3.1-405b": "llama3-405b"}


def preset(name: str, **overrides) -> Setup:
    """The named preset as a :class:`Setup`, with ``overrides`` applied."""
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise FasttrainError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
    return Setup(**{**PRESETS[name], **overrides})
