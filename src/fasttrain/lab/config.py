"""The lab's configuration: one dataclass with every knob, and presets (gpt-fast style).

Field names follow Hugging Face ``TrainingArguments`` where a technique has a name there
(``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``optim``, ``bf16``, ...), so
that a measurement here reads as advice for a ``TrainingArguments`` run. The CLI flag of a field
is its name with dashes (``--per-device-train-batch-size``).

Presets:
- ``tiny``: a CPU-sized model that trains in seconds (tests, smoke runs).
- ``shakespeare-char``: the baby GPT of nanoGPT on Tiny Shakespeare (6 layers, 6 heads, width 384,
  context 256, batch 64, dropout 0.2, AdamW lr 1e-3, beta2 0.99, 100 warm-up steps then cosine to
  1e-4; GPT-2 style: LayerNorm, learned positions, GELU, tied embeddings, no biases).
- ``char-100m``: a Llama-style model of about 101M parameters (16 layers, width 768, 12 heads over
  4 key/value heads, SwiGLU 2048, context 1024) on the same characters: activations, not weights,
  dominate its memory (eager attention keeps a heads x 1024^2 score matrix per layer).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.lab.models import HF_PREFIX, is_hf  # noqa: F401  (the one answer, re-exported)

LAB_EXTRA = 'pip install -e ".[lab]"'


def missing_extra(library: str, exc: ImportError) -> FasttrainError:
    return FasttrainError(f"{library} is not installed ({exc.name} missing); install the lab extra: {LAB_EXTRA}")


STYLES = ("gpt2", "llama")
OPTIMS = ("adamw_torch", "adamw_torch_fused", "adafactor", "adamw_8bit", "sgd", "muon")
CHECKPOINTING = ("none", "full", "selective")
ATTENTIONS = ("eager", "sdpa")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
COMPILE_BACKENDS = ("inductor", "cudagraphs")
ACTIVATIONS = ("style", "gelu", "relu", "relu2", "swiglu")
BIN_DTYPES = ("uint16", "uint32")
# which of liger-kernel's patches --use-liger-kernel applies to a transformers model: the family's all (RMSNorm,
# RoPE, SwiGLU or GeGLU, the fused linear cross-entropy), or the fused linear cross-entropy alone (it never makes
# the logits, and leaves the layers to torch.compile, which fuses what the other kernels would replace)
LIGER_KERNEL_SETS = ("all", "fused_linear_cross_entropy")
# the dtypes FSDP/HSDP reduce the gradients in (MixedPrecisionPolicy.reduce_dtype)
REDUCE_DTYPES = ("fp32", "bf16")


# the groups of ``fasttrain lab --help``, in the order it lists them
GROUPS = ("model", "architecture", "data", "batch", "optimizer", "precision", "memory", "speed", "evaluation",
          "fine-tuning", "output", "parallel", "search", "run")


# every setting a transformers model's defaults may set (a config file written for such a run holds them all)
DERIVED = ("name", "context", "per_device_train_batch_size", "learning_rate", "min_lr", "warmup_steps",
           "adam_beta2", "weight_decay", "max_steps")

# the lab GPT's shape: a transformers model has its own (its config.json)
GPT_SHAPE = ("style", "layers", "heads", "kv_heads", "width", "ffn", "vocab_size", "pad_vocab_to_multiple_of",
             "dropout", "bias", "activation", "qk_norm", "zero_init_proj", "unet_skips", "logit_softcap")


def setting(default, group: str, help: str, *, choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = (),
            hf=None):
    """One LabConfig field, declared once: its default, its ``--help`` group and text, the strings it takes
    (``choices``), its other names (``aliases``: old flags and the other commands' names, accepted with a
    one-line note) and its Hugging Face ``TrainingArguments`` mapping (``hf``: True for the same name and
    value, or ``value -> {argument: value}``; None: no equivalent). The CLI's options, ``--help``, the
    ``--set``/record/config-file parser and the ``TrainingArguments`` answer are generated from these."""
    assert group in GROUPS, group
    return field(default=default, metadata={"group": group, "help": help, "choices": choices, "aliases": aliases,
                                            "hf": hf})


@dataclass
class LabConfig:
    """One lab run. ``None`` for a model size means "derive it" (see :meth:`resolved`)."""

    name: str = setting("custom", "run", "The run's name in tables and records (a preset's name, or the model's).")
    model: str = setting("gpt", "model", "gpt (the lab's own GPT, shaped by the flags below) or hf:PATH_OR_NAME (a "
                         "transformers causal LM: a folder with config.json, weights loaded if present, else "
                         "initialized from the config; its own defaults apply, no preset).")
    # --- model shape (the lab's GPT) -----------------------------------------------------------
    style: str = setting("gpt2", "model", "gpt2 (LayerNorm, learned positions, GELU, tied) or llama (RMSNorm, RoPE, "
                         "SwiGLU, GQA).", choices=STYLES)
    layers: int = setting(6, "model", "Transformer blocks.")
    heads: int = setting(6, "model", "Attention heads.")
    kv_heads: int | None = setting(None, "model", "Key/value heads (llama: grouped-query attention; none: --heads).")
    width: int = setting(384, "model", "Hidden size.")
    ffn: int | None = setting(None, "model", "Feed-forward width (none: 4 w; llama 8/3 w rounded to 64).")
    context: int = setting(256, "model", "Tokens per training sequence (a transformers model: its positions, capped "
                           "by the corpus).", aliases=("seq", "seq_len"))
    vocab_size: int | None = setting(None, "model", "Vocabulary (none: the corpus' tokens, 65 for Tiny Shakespeare).")
    pad_vocab_to_multiple_of: int = setting(0, "model", "Pad the vocabulary to a multiple of N (e.g. 64: "
                                            "tensor-core friendly shapes); 0: off.")
    dropout: float = setting(0.0, "model", "Dropout probability.")
    bias: bool = setting(False, "model", "Biases in linear layers and LayerNorm.")
    # the speedrun community's changes (lab/model_options.py), off by default
    activation: str = setting("style", "architecture", "The MLP's activation: style (gpt2: gelu, llama: swiglu), "
                              "gelu, relu, relu2 (relu^2), swiglu.", choices=ACTIVATIONS)
    qk_norm: bool = setting(False, "architecture", "RMS-normalize queries and keys per head before attention.")
    zero_init_proj: bool = setting(False, "architecture", "Start attention's and the MLP's output projections at "
                                   "zero.")
    unet_skips: bool = setting(False, "architecture", "U-net skips: block i's output feeds block L-1-i through a "
                               "learned scalar.")
    logit_softcap: float = setting(0.0, "architecture", "Soft-cap the logits at C: C tanh(z / C) (0: off).")
    # --- batch -------------------------------------------------------------------------------
    per_device_train_batch_size: int = setting(64, "batch", "Sequences per micro-batch on each device.",
                                               aliases=("micro_batch", "batch_size"), hf=True)
    gradient_accumulation_steps: int = setting(1, "batch", "Micro-batches per optimizer step.",
                                               aliases=("accumulation",), hf=True)
    auto_find_batch_size: bool = setting(False, "batch", "Find the largest micro-batch that fits, by trying (GPU).")
    # --- optimizer and schedule ----------------------------------------------------------------
    max_steps: int = setting(5000, "optimizer", "Optimizer steps.", hf=True)
    learning_rate: float = setting(1e-3, "optimizer", "Peak learning rate.", aliases=("lr",), hf=True)
    min_lr: float = setting(1e-4, "optimizer", "Learning rate at the end (cosine decay).",
                            hf=lambda v: {"lr_scheduler_type": "cosine_with_min_lr",
                                          "lr_scheduler_kwargs": {"min_lr": v}})
    warmup_steps: int = setting(100, "optimizer", "Linear warm-up steps from 0.", hf=True)
    weight_decay: float = setting(0.1, "optimizer", "Decoupled weight decay (matrices only).", hf=True)
    adam_beta1: float = setting(0.9, "optimizer", "AdamW beta1.", hf=True)
    adam_beta2: float = setting(0.99, "optimizer", "AdamW beta2.", hf=True)
    adam_epsilon: float = setting(1e-8, "optimizer", "AdamW epsilon.", hf=True)
    max_grad_norm: float = setting(1.0, "optimizer", "Gradient clipping norm (0: off).", hf=True)
    optim: str = setting("adamw_torch", "optimizer", "Optimizer.", choices=OPTIMS, hf=True)
    # --- precision and kernels -------------------------------------------------------------
    fp16: bool = setting(False, "precision", "Autocast to fp16 with a GradScaler.", hf=True)
    bf16: bool = setting(False, "precision", "Autocast to bf16.", hf=True)
    tf32: bool = setting(False, "precision", "TF32 tensor cores for the fp32 matmuls.",
                         hf=lambda v: {"tf32": True} if v else {})
    gradient_checkpointing: str = setting("none", "memory", "Recompute activations: full (every block) or selective "
                                          "(the attention core); alone: full.", choices=CHECKPOINTING,
                                          hf=lambda v: {"gradient_checkpointing": v == "full"})
    checkpoint_blocks: int = setting(0, "memory", "With --gradient-checkpointing full: how many blocks recompute, "
                                     "counted from the first (0: every block); the others keep their activations, "
                                     "for a model that fits with some of them kept.")
    torch_compile: bool = setting(False, "speed", "torch.compile the model.", hf=True)
    torch_compile_mode: str = setting("default", "speed", "torch.compile mode.", choices=COMPILE_MODES)
    torch_compile_scope: str = setting("model", "speed", "What torch.compile compiles: model (one graph) or blocks "
                                       "(each repeated block alone).", choices=COMPILE_SCOPES)
    torch_compile_backend: str = setting("inductor", "speed", "inductor, or cudagraphs (CUDA graphs of forward and "
                                         "backward, no code generation).", choices=COMPILE_BACKENDS)
    cuda_graph_step: bool = setting(False, "speed", "Capture the whole eager step (with the optimizer) as one CUDA "
                                    "graph, no compiler (GPU).")
    attn_implementation: str = setting("eager", "speed", "eager (softmax(q k^T) v in PyTorch ops) or sdpa "
                                       "(scaled_dot_product_attention, flash).", choices=ATTENTIONS,
                                       aliases=("attention",))
    use_liger_kernel: bool = setting(False, "speed", "liger-kernel's RMSNorm/LayerNorm, SwiGLU, RoPE, fused linear "
                                     "cross-entropy (GPU).", hf=True)
    liger_kernels: str = setting("all", "speed", "Which of them --use-liger-kernel applies to a transformers model: "
                                 "all, or fused_linear_cross_entropy alone (the logits never made).",
                                 choices=LIGER_KERNEL_SETS,
                                 hf=lambda v: {} if v == "all" else {"liger_kernel_config": liger_switches(v)})
    float8: str = setting("none", "precision", "torchao's float8 training of the Linear layers: none, tensorwise or "
                          "rowwise (a Hopper GPU; the output head stays bf16).")
    float8_all_gather: bool = setting(False, "parallel", "With --float8 tensorwise under FSDP: all-gather the float8 "
                                      "layers' weights in float8 (half a bf16 gather's bytes, each weight's scale from "
                                      "its whole amax, every scale computed at once after the optimizer step). Off by "
                                      "default: on the 8B's pick (4 H200, FSDP2 ZeRO-2) it ran 0.99x the bf16 gather "
                                      "and its peak is not modelled.")
    reduce_dtype: str = setting("fp32", "parallel", "The dtype data parallelism reduces the gradients in: FSDP/HSDP's "
                                "reduce-scatter, HSDP's all-reduce and their unsharded sum across micro-batches "
                                "between syncs; DDP's and ZeRO-1's all-reduce (a bf16 compression hook). fp32: the "
                                "ranks' gradients summed in fp32. bf16 (the HF Trainer's FSDP under bf16): half the "
                                "bytes on the wire and in those buffers, but each of a ring's N-1 partial sums, and "
                                "each micro-batch's under FSDP, rounds to bf16 (relative error up to 2^-8 each).",
                                choices=REDUCE_DTYPES, aliases=("fsdp_reduce_dtype",))
    # --- data ------------------------------------------------------------------------------
    preload: bool = setting(False, "data", "Keep the corpus on the device and cut batches there.")
    dataloader_num_workers: int = setting(0, "data", "DataLoader worker processes.", hf=True)
    dataloader_pin_memory: bool = setting(False, "data", "Pin host batches.", hf=True)
    dataloader_prefetch_factor: int | None = setting(None, "data", "Batches each worker loads ahead (needs "
                                                     "workers).")
    data_dir: str | None = setting(None, "data", "Data root (default: $FASTTRAIN_DATA_DIR or ~/.cache/fasttrain); "
                                   "holds tinyshakespeare/input.txt.")
    # the corpus (fasttrain.lab.data): Tiny Shakespeare unless a file is given
    train_file: str | None = setting(None, "data", "Your UTF-8 text to train on (instead of Tiny Shakespeare; its "
                                     "SHA-256 recorded).")
    val_file: str | None = setting(None, "data", "UTF-8 text to validate on (default: the last --val-fraction of "
                                   "--train-file).")
    val_fraction: float | None = setting(None, "data", "Share of the tokens kept for validation (none: 0.1 without "
                                         "--val-file/--val-bin).")
    train_bin: str | None = setting(None, "data", "Token ids to train on: a raw .bin (nanoGPT's), of --bin-dtype.")
    val_bin: str | None = setting(None, "data", "Token ids to validate on (default: the last --val-fraction of "
                                  "--train-bin).")
    bin_dtype: str = setting("uint16", "data", "The ids' type in the .bin files: uint16 (nanoGPT's) or uint32.",
                             choices=BIN_DTYPES)
    tokenizer: str | None = setting(None, "data", "char, hf:PATH (tokenizer.json or folder) or tiktoken:NAME "
                                    "(none: the model's own, else char).")
    torch_empty_cache_steps: int = setting(0, "memory", "torch.cuda.empty_cache() every N steps; 0: never.")
    # --- evaluation, logging, timing -------------------------------------------------------
    eval_interval: int = setting(250, "evaluation", "Validation every N steps (and after the last); 0: only at the "
                                 "end.")
    eval_tokens: int | None = setting(None, "evaluation", "Validation token budget (none: the whole split).")
    eval_batch_size: int | None = setting(None, "evaluation", "Sequences per validation batch (none: the training "
                                          "micro-batch).")
    log_interval: int = setting(10, "evaluation", "Loss-curve point every N steps.")
    report_to: str = setting("jsonl,csv", "output", "Where logged steps go, comma-separated: none, jsonl, csv, "
                             "tensorboard, wandb or all (lab/loggers.py).")
    logging_dir: str | None = setting(None, "output", "Folder --report-to writes into (none: beside --out RUN.json).")
    timing_warmup_steps: int = setting(3, "evaluation", "First steps (compilation, autotuning, allocator growth) "
                                       "timed apart.")
    seed: int = setting(1337, "run", "Seed.", hf=True)
    device: str = setting("auto", "run", "auto (cuda if available, else cpu), cpu, cuda or cuda:N.")
    # --- PEFT and checkpoints --------------------------------------------------------------
    lora_r: int = setting(0, "fine-tuning", "LoRA rank (0: off).")
    lora_alpha: float = setting(16.0, "fine-tuning", "LoRA alpha (the adapter's scale is alpha / r).")
    lora_dropout: float = setting(0.0, "fine-tuning", "LoRA dropout.")
    lora_target_modules: tuple[str, ...] = setting(("qkv", "proj"), "fine-tuning", "Comma-separated: qkv, proj, up, "
                                                   "down, head (a transformers model: its own names).")
    prompt_tuning_tokens: int = setting(0, "fine-tuning", "Trainable soft-prompt vectors prepended to every "
                                        "sequence (base frozen); 0: off.")
    init_from: str | None = setting(None, "fine-tuning", "Start from a checkpoint written with --save.")
    save: str | None = setting(None, "output", "Write the trained model to this folder (model.safetensors + "
                               "config.json).")
    # --- training state checkpoints (a long run survives a crash) ---------------------------
    save_steps: int = setting(0, "output", "Write a training-state checkpoint (weights, optimizer, schedule, data "
                              "position, random states) every N steps into --output-dir; 0: never.")
    save_total_limit: int | None = setting(None, "output", "Keep only the newest N checkpoints (none: all).")
    output_dir: str | None = setting(None, "output", "Where --save-steps writes checkpoint-N/.")
    overwrite_output_dir: bool = setting(False, "output", "Write into an --output-dir or --save that holds another "
                                         "run's checkpoints (the HF Trainer's flag; a folder of other files is still "
                                         "refused).")
    resume: str | None = setting(None, "output", "Continue from a checkpoint (a checkpoint-N folder, or the newest "
                                 "in an --output-dir); alone, with the run's saved settings.")

    # ---------------------------------------------------------------------------------------
    def with_(self, **changes) -> "LabConfig":
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise FasttrainError(f"unknown lab setting(s) {sorted(unknown)}; see: fasttrain lab --help")
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Every setting (JSON-able); for a transformers model the lab GPT's shape left out where it is
        at its default (it shapes nothing there: records and ``fasttrain.json`` say nothing of it)."""
        out = asdict(self)
        out["lora_target_modules"] = list(self.lora_target_modules)
        if self.model != "gpt":
            for f in fields(self):
                if f.name in GPT_SHAPE and getattr(self, f.name) == f.default:
                    del out[f.name]
        return out

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn_width(self) -> int:
        if self.ffn is not None:
            return self.ffn
        if self.style == "llama":
            return 64 * -(-(8 * self.width // 3) // 64)
        return 4 * self.width

    def padded_vocab(self, vocab: int) -> int:
        m = self.pad_vocab_to_multiple_of
        return vocab if not m else m * -(-vocab // m)

    @property
    def batch_tokens(self) -> int:
        """Tokens per optimizer step (one device)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.context

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "tf32" if self.tf32 else "fp32"


def _positive(cfg: LabConfig, name: str, allow_zero: bool = False) -> None:
    value = getattr(cfg, name)
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise FasttrainError(f"--{name.replace('_', '-')} must be {kind} integer, got {value!r}")


def _choice(cfg: LabConfig, name: str, choices) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise FasttrainError(f"unknown --{name.replace('_', '-')} {value!r}; use one of {', '.join(choices)}")


# --- the data flags (the corpus: fasttrain.lab.data, fasttrain.lab.tokenizer) ----------------------



def _itemsize(dtype: str) -> int:
    return {"uint16": 2, "uint32": 4}[dtype]


def check_text_file(path: str | os.PathLike, flag: str) -> Path:
    """A file to read (text or token ids): it exists, is a file, is not empty (a one-line error otherwise)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FasttrainError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise FasttrainError(f"{flag} {path}: that is a folder, not a file; give a file inside it")
    if p.stat().st_size == 0:
        raise FasttrainError(f"{flag} {path}: the file is empty (0 bytes); give one with data to train on")
    return p


def check_spec(spec: str) -> str:
    """Refuse a malformed ``--tokenizer`` value (no file is read)."""
    if spec == "char" or (spec.startswith(("hf:", "tiktoken:")) and spec.split(":", 1)[1].strip()):
        return spec
    raise FasttrainError(f"unknown --tokenizer {spec!r}; use char, hf:PATH (a tokenizer.json or a tokenizer "
                         "folder) or tiktoken:NAME")


def hf_tokenizer_file(path: str | os.PathLike) -> Path | None:
    """The ``tokenizer.json`` that ``hf:PATH`` names (the file, or one inside the folder); None for a
    folder that holds none (transformers may still read it). Refuses a path that is not a tokenizer."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return p / "tokenizer.json"
        known = ("tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
        if any((p / name).is_file() for name in known):
            return None
        raise FasttrainError(f"--tokenizer hf:{path}: the folder holds no tokenizer (no tokenizer.json, "
                             "tokenizer_config.json, vocab.json or tokenizer.model); give a tokenizer folder or "
                             "train one: fasttrain lab tokenizer train --vocab-size N --train-file F --out DIR")
    raise FasttrainError(f"--tokenizer hf:{path}: no such file or folder; give a tokenizer.json or a tokenizer "
                         "folder (fasttrain lab tokenizer train --out DIR makes one)")


def check_bin_file(path, dtype: str, flag: str) -> Path:
    """A token file whose size fits ``dtype`` (checked from its size alone: no bytes are read)."""
    p = check_text_file(path, flag)
    item = _itemsize(dtype)
    size = p.stat().st_size
    if size % item:
        other = [d for d in BIN_DTYPES if d != dtype and size % _itemsize(d) == 0]
        fix = f"--bin-dtype {other[0]}" if other else "the raw token file itself (nanoGPT's .bin)"
        raise FasttrainError(f"{flag} {path}: {size} bytes is not a whole number of {dtype} ids ({item} bytes each): "
                             f"wrong dtype or not a token file; give {fix}")
    return p


def check_data_flags(cfg) -> None:
    """The data flags of a :class:`~fasttrain.lab.config.LabConfig` that cannot go together or name
    no usable file: one-line errors before any work (the token files' sizes are checked here, their
    ids when read; a tokenizer path is checked to hold a tokenizer, which is loaded later)."""
    vf = cfg.val_fraction
    if vf is not None and not (isinstance(vf, (int, float)) and 0.0 < vf < 1.0):
        raise FasttrainError(f"--val-fraction must be in (0, 1), got {vf!r}")
    if cfg.train_file and cfg.train_bin:
        raise FasttrainError("give --train-file (text) or --train-bin (token ids), not both")
    if cfg.val_file and vf is not None:
        raise FasttrainError("give --val-file or --val-fraction, not both")
    if cfg.val_bin and vf is not None:
        raise FasttrainError("give --val-bin or --val-fraction, not both")
    if cfg.val_file and not cfg.train_file:
        raise FasttrainError("--val-file needs --train-file (the text to train on)")
    if cfg.val_bin and not cfg.train_bin:
        raise FasttrainError("--val-bin needs --train-bin (the token ids to train on)")
    if cfg.bin_dtype not in BIN_DTYPES:
        raise FasttrainError(f"unknown --bin-dtype {cfg.bin_dtype!r}; use one of {', '.join(BIN_DTYPES)}")
    if cfg.tokenizer is not None:
        check_spec(cfg.tokenizer)
        if cfg.tokenizer == "char" and cfg.train_bin:
            raise FasttrainError("--tokenizer char builds its vocabulary from text, and --train-bin holds token ids: "
                                 "give the tokenizer that made them (hf:PATH or tiktoken:NAME), or none")
        if cfg.tokenizer.startswith("hf:"):
            hf_tokenizer_file(cfg.tokenizer[3:])
    for flag, path in (("--train-file", cfg.train_file), ("--val-file", cfg.val_file)):
        if path is not None:
            check_text_file(path, flag)
    for flag, path in (("--train-bin", cfg.train_bin), ("--val-bin", cfg.val_bin)):
        if path is not None:
            check_bin_file(path, cfg.bin_dtype, flag)


def _values(cfg: LabConfig) -> tuple:
    return tuple(getattr(cfg, f.name) for f in fields(cfg))


def is_validated(cfg: LabConfig) -> bool:
    """Has :func:`validate` passed ``cfg`` as it is now? (a changed copy, or a field set since, has not)."""
    return cfg.__dict__.get("_validated") == _values(cfg)


def ensure_valid(cfg: LabConfig) -> LabConfig:
    """``cfg``, validated unless :func:`validate` has already passed it unchanged: a config is
    validated once, where it is built for a run (the CLI, the presets, the Python API), and every
    later step (preflight, ``lab.train.run``) asks here instead of checking again."""
    return cfg if is_validated(cfg) else validate(cfg)


def validate(cfg: LabConfig) -> LabConfig:
    """Raise a one-line :class:`FasttrainError` (naming the fix) for a configuration that cannot run;
    ``cfg`` itself, marked as validated (:func:`ensure_valid`), when it can."""
    for name in ("layers", "heads", "width", "context", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "max_steps", "log_interval"):
        _positive(cfg, name)
    for name in ("warmup_steps", "eval_interval", "torch_empty_cache_steps", "dataloader_num_workers", "lora_r",
                 "prompt_tuning_tokens", "pad_vocab_to_multiple_of", "timing_warmup_steps"):
        _positive(cfg, name, allow_zero=True)
    for name in ("kv_heads", "ffn", "vocab_size", "eval_tokens", "eval_batch_size", "dataloader_prefetch_factor"):
        if getattr(cfg, name) is not None:
            _positive(cfg, name)
    _choice(cfg, "style", STYLES)
    if not (cfg.model == "gpt" or is_hf(cfg.model)):
        raise FasttrainError(f"unknown --model {cfg.model!r}; use gpt (the lab's own) or hf:PATH_OR_NAME "
                             f"(a folder holding a transformers config.json, or a hub name)")
    if cfg.model != "gpt":
        if cfg.init_from:
            raise FasttrainError("--init-from loads the lab GPT's checkpoints; a HF model starts from its own "
                                 "folder: pass the saved folder as --model hf:FOLDER")
        if cfg.pad_vocab_to_multiple_of:
            raise FasttrainError("--pad-vocab-to-multiple-of shapes the lab GPT; a HF model's vocabulary is its "
                                 "config's vocab_size")
    _choice(cfg, "optim", OPTIMS)
    _choice(cfg, "gradient_checkpointing", CHECKPOINTING)
    if isinstance(cfg.checkpoint_blocks, bool) or not isinstance(cfg.checkpoint_blocks, int) \
            or cfg.checkpoint_blocks < 0:
        raise FasttrainError(f"--checkpoint-blocks must be a whole number >= 0 (0: every block), "
                             f"got {cfg.checkpoint_blocks!r}")
    if cfg.checkpoint_blocks and cfg.gradient_checkpointing != "full":
        raise FasttrainError(f"--checkpoint-blocks {cfg.checkpoint_blocks} counts the blocks full recomputation "
                             f"recomputes: add --gradient-checkpointing full")
    if cfg.checkpoint_blocks and cfg.model == "gpt" and cfg.checkpoint_blocks > cfg.layers:
        raise FasttrainError(f"--checkpoint-blocks {cfg.checkpoint_blocks}: the model has {cfg.layers} blocks; "
                             f"give at most {cfg.layers} (0: every block)")
    _choice(cfg, "attn_implementation", ATTENTIONS)
    _choice(cfg, "torch_compile_mode", COMPILE_MODES)
    _choice(cfg, "torch_compile_scope", COMPILE_SCOPES)
    _positive(cfg, "save_steps", allow_zero=True)
    if cfg.save_total_limit is not None:
        _positive(cfg, "save_total_limit")
    if cfg.save_steps and not cfg.output_dir:
        raise FasttrainError("--save-steps needs --output-dir (the folder its checkpoint-N folders go to)")
    _choice(cfg, "torch_compile_backend", COMPILE_BACKENDS)
    _choice(cfg, "activation", ACTIVATIONS)
    if not cfg.logit_softcap >= 0:
        raise FasttrainError(f"--logit-softcap must be >= 0 (0: off), got {cfg.logit_softcap}")
    if cfg.torch_compile_backend != "inductor" and cfg.torch_compile_mode != "default":
        raise FasttrainError(f"--torch-compile-mode {cfg.torch_compile_mode} is inductor's; the "
                             f"{cfg.torch_compile_backend} backend takes the default mode")
    if cfg.cuda_graph_step:
        if cfg.torch_compile:
            raise FasttrainError("--cuda-graph-step captures the eager step; drop --torch-compile (or the other)")
        if cfg.optim not in ("adamw_torch_fused", "muon"):
            raise FasttrainError(f"--cuda-graph-step needs an optimizer that runs without host synchronization: "
                                 f"--optim adamw_torch_fused or muon (got {cfg.optim})")
        if not cfg.preload:
            raise FasttrainError("--cuda-graph-step copies each batch into the captured step's input on the GPU: "
                                 "add --preload (the corpus on the GPU)")
        if cfg.fp16 or cfg.gradient_accumulation_steps != 1:
            raise FasttrainError("--cuda-graph-step takes one micro-batch per step and no fp16 GradScaler; use --bf16 "
                                 "and --gradient-accumulation-steps 1")
    if cfg.width % cfg.heads:
        raise FasttrainError(f"--heads ({cfg.heads}) must divide --width ({cfg.width})")
    if cfg.heads % cfg.kv:
        raise FasttrainError(f"--kv-heads ({cfg.kv}) must divide --heads ({cfg.heads})")
    if cfg.style == "gpt2" and cfg.kv != cfg.heads:
        raise FasttrainError("grouped-query attention (--kv-heads) needs --style llama")
    if cfg.style == "llama" and (cfg.width // cfg.heads) % 2:
        raise FasttrainError(f"RoPE needs an even head size; width/heads = {cfg.width // cfg.heads}")
    _finite_floats(cfg)
    _fraction(cfg, "dropout")
    _fraction(cfg, "adam_beta1", why="AdamW's moving averages need 0 <= beta < 1")
    _fraction(cfg, "adam_beta2", why="AdamW's moving averages need 0 <= beta < 1")
    if not cfg.adam_epsilon > 0:
        raise FasttrainError(f"--adam-epsilon must be > 0 (it keeps the update's denominator away from 0; "
                             f"e.g. 1e-8), got {cfg.adam_epsilon!r}")
    if not cfg.lora_alpha > 0:
        raise FasttrainError(f"--lora-alpha must be > 0 (the adapter's scale is alpha / r; e.g. 16), "
                             f"got {cfg.lora_alpha!r}")
    _fraction(cfg, "lora_dropout")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 2 ** 63:
        raise FasttrainError(f"--seed must be an integer from 0 to 2^63 - 1, got {cfg.seed!r}")
    if cfg.pad_vocab_to_multiple_of > MAX_VOCAB_PADDING:
        raise FasttrainError(f"--pad-vocab-to-multiple-of {cfg.pad_vocab_to_multiple_of} would add up to that many "
                             f"unused rows to the embedding; use a small power of two (64 or 128), at most "
                             f"{MAX_VOCAB_PADDING}")
    _check_device_text(cfg.device)
    if cfg.preload:
        starts = cfg.max_steps * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        if starts > MAX_PRELOAD_STARTS:
            most = MAX_PRELOAD_STARTS // (cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps)
            raise FasttrainError(f"--preload draws every step's window starts before the first step: --max-steps "
                                 f"{cfg.max_steps:,} x {starts // cfg.max_steps:,} windows = {starts:,} starts "
                                 f"({8 * starts / 2**30:,.1f} GiB, long minutes of setup); give --max-steps <= "
                                 f"{most:,} or drop --preload")
    if cfg.fp16 and cfg.bf16:
        raise FasttrainError("give --fp16 or --bf16, not both")
    if cfg.fp16 and cfg.optim == "muon":
        raise FasttrainError("--optim muon steps two optimizers, which the fp16 GradScaler cannot unscale; use --bf16")
    if not cfg.learning_rate > 0 or not 0 <= cfg.min_lr <= cfg.learning_rate:
        raise FasttrainError(f"need --learning-rate > 0 and 0 <= --min-lr <= --learning-rate "
                             f"(got {cfg.learning_rate}, {cfg.min_lr})")
    if cfg.max_grad_norm < 0 or cfg.weight_decay < 0:
        raise FasttrainError("--max-grad-norm and --weight-decay must be >= 0")
    if cfg.dataloader_prefetch_factor is not None and cfg.dataloader_num_workers == 0:
        raise FasttrainError("--dataloader-prefetch-factor needs --dataloader-num-workers >= 1")
    if cfg.preload and (cfg.dataloader_num_workers or cfg.dataloader_pin_memory):
        raise FasttrainError("--preload keeps the corpus on the device: drop the --dataloader-* flags")
    if cfg.lora_r and cfg.prompt_tuning_tokens:
        raise FasttrainError("give --lora-r or --prompt-tuning-tokens, not both")
    _choice(cfg, "liger_kernels", LIGER_KERNEL_SETS)
    _choice(cfg, "reduce_dtype", REDUCE_DTYPES)
    if cfg.liger_kernels != "all" and not (cfg.use_liger_kernel and is_hf(cfg.model)):
        raise FasttrainError(f"--liger-kernels {cfg.liger_kernels} chooses among liger-kernel's patches of a "
                             "transformers model: give it with --use-liger-kernel and --model hf:..., or drop it")
    head = [m for m in cfg.lora_target_modules if m in ("head", "lm_head")]     # the lab GPT's name, transformers'
    if cfg.lora_r and cfg.use_liger_kernel and head:
        raise FasttrainError(f"liger's fused cross-entropy reads the output weight directly: drop '{head[0]}' from "
                             "--lora-target-modules or --use-liger-kernel")
    if cfg.lora_r and not cfg.lora_target_modules:
        raise FasttrainError("--lora-target-modules is empty; name at least one of qkv, proj, up, down, head")
    check_data_flags(cfg)                       # the corpus flags and files, before any work
    if cfg.save is not None:
        from fasttrain.lab.outputs import check_save_folder

        check_save_folder(cfg.save, "--save")     # before training, not after it: nobody's files are replaced
    cfg.__dict__["_validated"] = _values(cfg)
    return cfg


# --pad-vocab-to-multiple-of beyond this pads the embedding with more unused rows than any
# tensor-core shape asks for (64 or 128 is what they want)
MAX_VOCAB_PADDING = 4096
# --preload keeps an int64 start per window of every step on the device (8 bytes each), built on
# the host before the first step: 2^25 starts are 256 MiB and some seconds of setup
MAX_PRELOAD_STARTS = 2 ** 25


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _finite_floats(cfg: LabConfig) -> None:
    """Every float setting (whatever fields the config grows) is a finite number: a NaN passes
    every comparison unnoticed and an infinity turns the loss into NaN steps later."""
    import math

    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise FasttrainError(f"{_flag(f.name)} must be a finite number, got {value!r}")


def _fraction(cfg: LabConfig, name: str, why: str = "a probability") -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise FasttrainError(f"{_flag(name)} must be in [0, 1) ({why}), got {value!r}")


def _check_device_text(device) -> None:
    """The form of --device (whether this machine has that device is checked by
    :func:`fasttrain.lab.preflight.check_device`, which needs torch)."""
    text = str(device)
    if text in ("auto", "cpu", "cuda"):
        return
    if text.startswith("cuda:"):
        index = text[len("cuda:"):]
        if index.isdigit() and index.isascii():
            return
        raise FasttrainError(f"--device {text}: the GPU index must be a whole number (cuda:0, cuda:1, ...)")
    raise FasttrainError(f"unknown --device {text!r}; use auto, cpu, cuda or cuda:N")


_BABY_GPT = dict(
    style="gpt2", layers=6, heads=6, width=384, context=256, dropout=0.2, bias=False,
    per_device_train_batch_size=64, max_steps=5000, learning_rate=1e-3, min_lr=1e-4, warmup_steps=100,
    weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, eval_interval=250,
)

PRESETS: dict[str, dict] = {
    "tiny": dict(style="gpt2", layers=2, heads=2, width=32, context=32, dropout=0.0, per_device_train_batch_size=8,
                 max_steps=20, learning_rate=1e-2, min_lr=1e-3, warmup_steps=2, eval_interval=10, eval_tokens=4096,
                 log_interval=1, timing_warmup_steps=2),
    "shakespeare-char": dict(_BABY_GPT),
    "char-100m": dict(style="llama", layers=16, heads=12, kv_heads=4, width=768, ffn=2048, context=1024, dropout=0.0,
                      per_device_train_batch_size=16, max_steps=1000, learning_rate=3e-4, min_lr=3e-5,
                      warmup_steps=100, weight_decay=0.1, adam_beta2=0.95, eval_interval=250, eval_tokens=65536),
}

PRESET_NOTES = {
    "tiny": "CPU-sized GPT-2-style model (2 x 32, context 32): trains in seconds",
    "shakespeare-char": "nanoGPT's baby GPT: 6 x 384, 6 heads, context 256, batch 64, dropout 0.2 (10.7M params)",
    "char-100m": "Llama style, 16 x 768, GQA 12/4, SwiGLU 2048, context 1024, batch 16 (~101M params; activations dominate)",
}


def preset(name: str, **overrides) -> LabConfig:
    """The named preset as a validated :class:`LabConfig`, with ``overrides`` applied."""
    if name not in PRESETS:
        raise FasttrainError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
    base = LabConfig(name=name, **PRESETS[name])
    cfg = base.with_(**{k: v for k, v in overrides.items()})
    if "lora_target_modules" in overrides and isinstance(cfg.lora_target_modules, (list, str)):
        mods = cfg.lora_target_modules
        cfg = cfg.with_(lora_target_modules=tuple(mods.split(",") if isinstance(mods, str) else mods))
    return validate(cfg)


def setting_meta(name: str) -> dict:
    """The declaration of field ``name`` (:func:`setting`): group, help, choices, aliases, hf."""
    return dict(LabConfig.__dataclass_fields__[name].metadata)


def training_arguments_of(cfg: LabConfig) -> dict:
    """The Hugging Face ``TrainingArguments`` keyword arguments of ``cfg``, from each field's ``hf``
    declaration (fields without an equivalent are left out)."""
    args: dict = {}
    for f in fields(cfg):
        hf = f.metadata.get("hf")
        if hf is True:
            args[f.name] = getattr(cfg, f.name)
        elif callable(hf):
            args.update(hf(getattr(cfg, f.name)))
    return args


def liger_switches(kernels: str) -> dict:
    """liger-kernel's keyword switches for ``kernels`` (one of LIGER_KERNEL_SETS), as its family functions and
    the HF Trainer's ``liger_kernel_config`` take them (each family takes the ones it has): none for all."""
    if kernels == "all":
        return {}
    return {"rope": False, "rms_norm": False, "layer_norm": False, "swiglu": False, "geglu": False,
            "cross_entropy": False, "fused_linear_cross_entropy": True}


def liger_of(cfg: "LabConfig"):
    """The estimator's ``liger`` for a transformers model: False, True (the family's kernels) or the kernels' names."""
    if not cfg.use_liger_kernel:
        return False
    return True if cfg.liger_kernels == "all" else (cfg.liger_kernels,)


def compiled_scope(cfg: "LabConfig") -> str:
    """The estimator's ``Setup.compiled`` for a lab run: ``none`` (eager), ``model`` (``torch.compile`` of the
    whole module, the loss inside the graph) or ``blocks`` (each decoder layer compiled alone).
    Modes and backends keep the same tensors: AOT autograd's min-cut partitioner chooses what the forward
    saves in every case; CUDA graphs change where they live (:func:`cuda_graphs_of`)."""
    if not cfg.torch_compile:
        return "none"
    return "blocks" if cfg.torch_compile_scope == "blocks" else "model"


def cuda_graphs_of(cfg: "LabConfig") -> bool:
    """The estimator's ``Setup.cuda_graphs``: the compiled code captured as CUDA graphs, whose private pool peaks
    apart from the rest of the step: inductor's reduce-overhead and max-autotune modes (both turn its CUDA
    graphs on) and the cudagraphs backend."""
    return cfg.torch_compile and (cfg.torch_compile_mode in ("reduce-overhead", "max-autotune")
                                  or cfg.torch_compile_backend == "cudagraphs")


def lora_targets_for(cfg: "LabConfig", model_default: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The modules LoRA adapts: ``--lora-target-modules``; left at the lab's default (qkv, proj: the lab GPT's
    names) for a model with its own default (``model_default``, e.g. q_proj, v_proj), that default."""
    targets = tuple(cfg.lora_target_modules)
    if model_default and targets == LabConfig.__dataclass_fields__["lora_target_modules"].default:
        return tuple(model_default)
    return targets


__all__ = ["LabConfig", "GROUPS", "PRESETS", "PRESET_NOTES", "OPTIMS", "REDUCE_DTYPES", "compiled_scope",
           "cuda_graphs_of", "ensure_valid", "lora_targets_for",
           "preset", "setting", "setting_meta", "training_arguments_of", "validate"]
