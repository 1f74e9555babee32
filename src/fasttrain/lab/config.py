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

from dataclasses import asdict, dataclass, fields, replace

from fasttrain.errors import FasttrainError

LAB_EXTRA = 'pip install -e ".[lab]"'


def missing_extra(library: str, exc: ImportError) -> FasttrainError:
    return FasttrainError(f"{library} is not installed ({exc.name} missing); install the lab extra: {LAB_EXTRA}")


STYLES = ("gpt2", "llama")
OPTIMS = ("adamw_torch", "adamw_torch_fused", "adafactor", "adamw_8bit", "sgd", "muon")
CHECKPOINTING = ("none", "full", "selective")
ATTENTIONS = ("eager", "sdpa")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")


@dataclass
class LabConfig:
    """One lab run. ``None`` for a model size means "derive it" (see :meth:`resolved`)."""

    name: str = "custom"
    model: str = "gpt"                  # gpt: the lab's own GPT (the shape below); hf:PATH_OR_NAME: a transformers causal LM
    # --- model shape -----------------------------------------------------------------------
    style: str = "gpt2"                 # gpt2: LayerNorm, learned positions, GELU, tied; llama: RMSNorm, RoPE, SwiGLU, GQA
    layers: int = 6
    heads: int = 6
    kv_heads: int | None = None         # grouped-query attention (llama); None = heads
    width: int = 384
    ffn: int | None = None              # feed-forward width (per gate for SwiGLU); None: 4 w (gpt2), 8/3 w rounded to 64 (llama)
    context: int = 256                  # tokens per training sequence
    vocab_size: int | None = None       # None: the corpus' characters (65 for Tiny Shakespeare)
    pad_vocab_to_multiple_of: int = 0   # e.g. 64: round the embedding/output rows up (tensor-core friendly shapes)
    dropout: float = 0.0
    bias: bool = False
    # --- optimization ----------------------------------------------------------------------
    per_device_train_batch_size: int = 64
    gradient_accumulation_steps: int = 1
    auto_find_batch_size: bool = False
    max_steps: int = 5000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4                # cosine decay ends here at max_steps
    warmup_steps: int = 100             # linear warm-up from 0
    weight_decay: float = 0.1           # applied to matrices (dim >= 2) only
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0          # 0 = no clipping
    optim: str = "adamw_torch"
    # --- precision and kernels -------------------------------------------------------------
    fp16: bool = False                  # autocast to fp16 + GradScaler
    bf16: bool = False                  # autocast to bf16
    tf32: bool = False                  # TF32 tensor cores for the fp32 matmuls
    gradient_checkpointing: str = "none"
    torch_compile: bool = False
    torch_compile_mode: str = "default"
    torch_compile_scope: str = "model"  # model: the whole model as one graph; blocks: each repeated block alone
    attn_implementation: str = "eager"  # eager: softmax(q k^T) v in PyTorch ops; sdpa: F.scaled_dot_product_attention
    use_liger_kernel: bool = False
    # --- data ------------------------------------------------------------------------------
    preload: bool = False               # the whole corpus on the device, batches cut there
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = False
    dataloader_prefetch_factor: int | None = None   # batches each worker loads ahead (needs workers)
    data_dir: str | None = None
    torch_empty_cache_steps: int = 0    # torch.cuda.empty_cache() every N steps; 0 = never
    # --- evaluation, logging, timing -------------------------------------------------------
    eval_interval: int = 250            # validation every N steps (and after the last); 0 = only at the end
    eval_tokens: int | None = None      # validation token budget; None = the whole validation split
    eval_batch_size: int | None = None  # sequences per validation batch; None = the training batch
    log_interval: int = 10              # loss-curve point every N steps
    timing_warmup_steps: int = 3        # first steps (compilation, autotuning, allocator growth) timed apart
    seed: int = 1337
    device: str = "auto"                # auto: cuda if available, else cpu
    # --- PEFT and checkpoints --------------------------------------------------------------
    lora_r: int = 0                     # 0 = no LoRA
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("qkv", "proj")
    prompt_tuning_tokens: int = 0       # trainable soft-prompt vectors prepended to every sequence; 0 = off
    init_from: str | None = None        # a checkpoint saved with ``save`` (fine-tuning)
    save: str | None = None             # write the trained model here (folder: model.safetensors + config.json)
    # --- training state checkpoints (a long run survives a crash) ---------------------------
    save_steps: int = 0                 # write output_dir/checkpoint-<step> every N steps; 0 = never
    save_total_limit: int | None = None  # keep the newest N checkpoints; None = all
    output_dir: str | None = None       # where --save-steps writes
    resume: str | None = None           # continue from this checkpoint (or the newest in this output_dir)

    # ---------------------------------------------------------------------------------------
    def with_(self, **changes) -> "LabConfig":
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise FasttrainError(f"unknown lab setting(s) {sorted(unknown)}; see: fasttrain lab --help")
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["lora_target_modules"] = list(self.lora_target_modules)
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


def validate(cfg: LabConfig) -> LabConfig:
    """Raise a one-line :class:`FasttrainError` (naming the fix) for a configuration that cannot run."""
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
    if not isinstance(cfg.model, str) or not (cfg.model == "gpt" or cfg.model.startswith("hf:")):
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
    _choice(cfg, "attn_implementation", ATTENTIONS)
    _choice(cfg, "torch_compile_mode", COMPILE_MODES)
    _choice(cfg, "torch_compile_scope", COMPILE_SCOPES)
    _positive(cfg, "save_steps", allow_zero=True)
    if cfg.save_total_limit is not None:
        _positive(cfg, "save_total_limit")
    if cfg.save_steps and not cfg.output_dir:
        raise FasttrainError("--save-steps needs --output-dir (the folder its checkpoint-N folders go to)")
    if cfg.width % cfg.heads:
        raise FasttrainError(f"--heads ({cfg.heads}) must divide --width ({cfg.width})")
    if cfg.heads % cfg.kv:
        raise FasttrainError(f"--kv-heads ({cfg.kv}) must divide --heads ({cfg.heads})")
    if cfg.style == "gpt2" and cfg.kv != cfg.heads:
        raise FasttrainError("grouped-query attention (--kv-heads) needs --style llama")
    if cfg.style == "llama" and (cfg.width // cfg.heads) % 2:
        raise FasttrainError(f"RoPE needs an even head size; width/heads = {cfg.width // cfg.heads}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise FasttrainError(f"--dropout must be in [0, 1), got {cfg.dropout!r}")
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
    if cfg.lora_r and cfg.use_liger_kernel and "head" in cfg.lora_target_modules:
        raise FasttrainError("liger's fused cross-entropy reads the output weight directly: drop 'head' from "
                             "--lora-target-modules or --use-liger-kernel")
    if cfg.lora_r and not cfg.lora_target_modules:
        raise FasttrainError("--lora-target-modules is empty; name at least one of qkv, proj, up, down, head")
    if cfg.device not in ("auto", "cpu", "cuda") and not str(cfg.device).startswith("cuda:"):
        raise FasttrainError(f"unknown --device {cfg.device!r}; use auto, cpu, cuda or cuda:N")
    if cfg.save is not None:
        from fasttrain.files import check_new_folder

        check_new_folder(cfg.save, "--save")     # before training, not after it
    return cfg


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


__all__ = ["LabConfig", "PRESETS", "PRESET_NOTES", "OPTIMS", "preset", "validate"]
