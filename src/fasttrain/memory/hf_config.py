"""A Hugging Face ``config.json`` as a memory :class:`~fasttrain.memory.config.Setup`.

Reads the architecture of a causal language model of the families the lab trains (``model_type``
llama, mistral, qwen2, gemma, phi3, gpt2) without importing transformers, and maps it onto the
estimator's knobs so that the parameter count equals ``sum(p.numel() for p in model.parameters())``
of ``AutoModelForCausalLM.from_config`` (tied weights once), checked in
``tests/test_memory_hf_config.py``. What each family's modules keep for backward is in
``hf_activations.py``. Parameter-efficient fine-tuning (peft's LoRA on the model's own module names,
peft's soft prompt) is counted on these shapes too: ``setup_from_hf_config(lora_rank=, lora_targets=)``.

Per family (fields absent from the file take transformers' defaults for that family):

- llama, mistral: q, k, v, o (h x a d, g d, g d; a d x h), gate/up/down (SwiGLU), RMSNorm weights, RoPE,
  untied head; llama's ``attention_bias`` puts biases on q, k, v and o, ``mlp_bias`` on the MLP.
- qwen2: llama's modules with biases on q, k and v only (always); Qwen2.5-0.5B ties its embeddings.
- gemma: llama's modules, ``head_dim`` 256 by default (Gemma-7B: 16 heads of 256 in a 3072 model),
  GeGLU MLP (GELU-tanh gate: the same tensors as SwiGLU), tied embeddings by default.
- phi3: one fused ``qkv_proj`` (h x (a + 2 g) d) and one ``gate_up_proj`` (h x 2 f): the same
  parameters as separate ones, fewer autocast copies.
- gpt2: Conv1D ``c_attn`` (h x 3h), ``c_proj``, ``c_fc`` (h x n_inner, 4 h when ``n_inner`` is null),
  all with biases; LayerNorm with biases; learned positions ``wpe`` (n_positions x h); tied head;
  dropout (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``: all zero or all non-zero).
"""

from __future__ import annotations

import json
import os

from fasttrain.errors import FasttrainError
from fasttrain.memory.config import LIGER_KERNELS, OPTIM_ALIASES, Setup, check

SUPPORTED = ("llama", "mistral", "qwen2", "gemma", "phi3", "gpt2")
MODULES_OF = {"llama": "hf-llama", "mistral": "hf-llama", "qwen2": "hf-llama", "gemma": "hf-gemma",
              "phi3": "hf-phi3", "gpt2": "hf-gpt2"}
# transformers' defaults for the optional fields (its configuration classes)
_TIED_DEFAULT = {"llama": False, "mistral": False, "qwen2": False, "gemma": True, "phi3": False, "gpt2": True}
_REQUIRED = {"gpt2": ("n_embd", "n_layer", "n_head", "vocab_size")}
_REQUIRED_DEFAULT = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# transformers' attention implementations -> the estimator's kernel kinds
ATTENTION_ALIASES = {"eager": "eager", "sdpa": "flash", "flash_attention_2": "flash", "flash": "flash",
                     "flash_attention_3": "flash"}
# the kernels liger-kernel patches into each family by default (its apply_liger_kernel_to_<family>: RMSNorm,
# RoPE, SwiGLU (Gemma: GeGLU), fused linear cross-entropy); GPT-2 has no liger patches (the lab fuses its head
# itself with liger's kernel: liger=("fused_linear_cross_entropy",))
LIGER_OF = {"llama": LIGER_KERNELS, "mistral": LIGER_KERNELS, "qwen2": LIGER_KERNELS, "gemma": LIGER_KERNELS,
            "phi3": LIGER_KERNELS}
# LoRA's default targets per model_type (the lab's too): the attention projections LoRA's authors adapted
# (query and value), under each family's own module names; GPT-2 fuses q, k, v into one Conv1D (c_attn),
# Phi-3 into one Linear (qkv_proj)
DEFAULT_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"), "mixtral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"), "qwen3": ("q_proj", "v_proj"), "gemma": ("q_proj", "v_proj"),
    "gemma2": ("q_proj", "v_proj"), "gemma3_text": ("q_proj", "v_proj"), "olmo2": ("q_proj", "v_proj"),
    "gpt2": ("c_attn",), "phi3": ("qkv_proj",), "gpt_neox": ("query_key_value",),
}
# transformers' default ``pad_token_id`` per family (its configuration classes): the embedding's padding row
_PAD_DEFAULT = {"llama": None, "mistral": None, "qwen2": None, "gemma": 0, "phi3": 32000, "gpt2": None}
PRECISION_ALIASES = {"fp32": "fp32", "no": "fp32", "bf16": "amp", "fp16": "amp", "amp": "amp", "mixed": "mixed"}


def read_config_json(path: str | os.PathLike, flag: str = "--hf-config") -> dict:
    """The JSON object of a ``config.json`` (or of the one inside the folder ``path``), its size
    fields checked (:func:`check_config_fields`). The one reader of a model's ``config.json``: the
    lab's ``--model hf:FOLDER`` reads it here too (``flag`` opens every error line)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FasttrainError(f"{flag}: the folder {os.path.dirname(path)} has no config.json; "
                                 "give a model folder or the config.json itself")
    elif not os.path.exists(path):
        raise FasttrainError(f"{flag}: {path} does not exist; give a config.json or the folder holding it")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError) as exc:
        raise FasttrainError(f"{flag}: cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise FasttrainError(f"{flag}: {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise FasttrainError(f"{flag}: {path} holds a JSON {type(data).__name__}, not an object; "
                             "a config.json is an object with model_type, hidden_size, ...")
    check_config_fields(data, path)
    return data


# the size fields of the causal LMs' configs: a positive integer whenever present; the optional ones may
# also be null (transformers derives them: key/value heads = heads, head_dim = hidden / heads, n_inner = 4 h)
_SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions")
_OPTIONAL_SIZE_FIELDS = ("num_key_value_heads", "head_dim", "n_inner")


def check_config_fields(cfg: dict, where="config.json") -> None:
    """One line for a size field that cannot build the model, whatever its family: null, a string,
    a float or a number below 1 where a positive integer belongs; attention heads that do not divide
    the width (without an explicit ``head_dim``) or key/value heads that do not divide the heads."""
    def bad(key, value):
        return isinstance(value, bool) or not isinstance(value, int) or value < 1

    for key in _SIZE_FIELDS:
        if key in cfg and bad(key, cfg[key]):
            raise FasttrainError(f"{where}: {key} must be a positive integer, got {json.dumps(cfg[key])}; fix the "
                                 f"config.json")
    for key in _OPTIONAL_SIZE_FIELDS:
        if cfg.get(key) is not None and bad(key, cfg[key]):
            raise FasttrainError(f"{where}: {key} must be a positive integer or null, got {json.dumps(cfg[key])}; "
                                 f"fix the config.json")
    width, heads = cfg.get("hidden_size", cfg.get("n_embd")), cfg.get("num_attention_heads", cfg.get("n_head"))
    kv = cfg.get("num_key_value_heads")
    if width and heads and cfg.get("head_dim") is None and cfg.get("model_type") != "gemma" and width % heads:
        raise FasttrainError(f"{where}: the attention heads ({heads}) must divide the hidden size ({width}); fix the "
                             f"config.json")
    if heads and kv and heads % kv:
        raise FasttrainError(f"{where}: num_key_value_heads ({kv}) must divide num_attention_heads ({heads}); fix "
                             f"the config.json")


def _as_dict(config) -> dict:
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):           # transformers.PretrainedConfig
        return config.to_dict()
    raise FasttrainError(f"a model config must be a dict or a transformers PretrainedConfig, "
                         f"got {type(config).__name__}")


def _int(cfg: dict, key: str, model_type: str, default=None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise FasttrainError(f"config.json ({model_type}) lacks {key!r}; add it (a positive integer)")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FasttrainError(f"config.json ({model_type}): {key} must be a positive integer, got {value!r}")
    return value


def architecture(config) -> dict:
    """The :class:`Setup` fields of the model ``config`` describes (a dict or a PretrainedConfig)."""
    cfg = _as_dict(config)
    check_config_fields(cfg)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise FasttrainError("config.json has no model_type; it must name one of " + ", ".join(SUPPORTED))
    if model_type not in SUPPORTED:
        raise FasttrainError(f"model_type {model_type!r} is not supported by the memory estimator; "
                             f"supported: {', '.join(SUPPORTED)}")
    for key in _REQUIRED.get(model_type, _REQUIRED_DEFAULT):
        if key not in cfg:
            raise FasttrainError(f"config.json ({model_type}) lacks {key!r}, which the estimator needs")
    tied = cfg.get("tie_word_embeddings", _TIED_DEFAULT[model_type])
    if not isinstance(tied, bool):
        raise FasttrainError(f"config.json ({model_type}): tie_word_embeddings must be true or false, got {tied!r}")
    if model_type == "gpt2":
        h = _int(cfg, "n_embd", model_type)
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "relu"):
            raise FasttrainError(f"config.json (gpt2): activation_function {act!r} is not modelled; "
                                 "gelu_new (GPT-2's) and relu are")
        drops = [float(cfg.get(k, 0.1) or 0.0) for k in ("embd_pdrop", "attn_pdrop", "resid_pdrop")]
        if any(drops) and not all(drops):
            raise FasttrainError("config.json (gpt2): embd_pdrop, attn_pdrop and resid_pdrop must be all zero or "
                                 f"all non-zero for the estimator, got {drops}")
        inner = cfg.get("n_inner")
        return dict(heads=_int(cfg, "n_head", model_type), kv_heads=None, hidden=h,
                    ffn=4 * h if inner is None else _int(cfg, "n_inner", model_type),
                    layers=_int(cfg, "n_layer", model_type), vocab=_int(cfg, "vocab_size", model_type),
                    positions=_int(cfg, "n_positions", model_type, 1024), pos="learned", norm="layer", bias=True,
                    ffn_act="gelu" if act == "gelu_new" else "relu", tied=tied, dropout=all(drops),
                    head_dim=None, qkv_bias=None, proj_bias=None, mlp_bias=None, modules="hf-gpt2")
    heads = _int(cfg, "num_attention_heads", model_type)
    h = _int(cfg, "hidden_size", model_type)
    kv = _int(cfg, "num_key_value_heads", model_type, heads)
    default_d = 256 if model_type == "gemma" else h // heads
    d = _int(cfg, "head_dim", model_type, default_d)
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop"):
        if float(cfg.get(key) or 0.0) > 0:
            raise FasttrainError(f"config.json ({model_type}): {key} > 0 is not modelled by the estimator; "
                                 "set it to 0 (the published configs have no dropout)")
    attn_bias = bool(cfg.get("attention_bias", False)) if model_type in ("llama", "gemma") else False
    mlp_bias = bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False
    return dict(heads=heads, kv_heads=kv, hidden=h, ffn=_int(cfg, "intermediate_size", model_type),
                layers=_int(cfg, "num_hidden_layers", model_type), vocab=_int(cfg, "vocab_size", model_type),
                head_dim=None if d * heads == h else d, pos="rope", norm="rms", ffn_act="swiglu", tied=tied,
                bias=False, dropout=False, positions=None,
                qkv_bias=True if model_type == "qwen2" else attn_bias, proj_bias=attn_bias, mlp_bias=mlp_bias,
                modules=MODULES_OF[model_type])


def vocab_split_of(config) -> tuple:
    """What of the vocabulary the lab's tensor parallelism of this transformers model splits (``Setup.vocab_split``,
    D23), as ``lab/hf/tp_plan.py`` applies the family's plan: the output layer by ``lm_head: colwise_gather_output``
    (its rows split, its logits all-gathered whole on every rank, so the loss is the one-process loss on every rank:
    logits never split), the embedding vocabulary-parallel (``embedding_rowwise``) unless it has a padding row
    (``pad_token_id``: the row index names the whole table), and with tied embeddings neither (one matrix cannot be
    split two ways: both stay whole, a plain Linear and Embedding on every rank)."""
    cfg = _as_dict(config)
    model_type = cfg.get("model_type")
    if cfg.get("tie_word_embeddings", _TIED_DEFAULT.get(model_type, False)):
        return ()
    pad = cfg.get("pad_token_id", _PAD_DEFAULT.get(model_type))
    return ("head",) if pad is not None else ("embedding", "head")


def max_positions(config) -> int | None:
    """The longest sequence the model takes (``max_position_embeddings`` / ``n_positions``), if given."""
    cfg = _as_dict(config)
    value = cfg.get("n_positions" if cfg.get("model_type") == "gpt2" else "max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def setup_from_hf_config(config, *, micro_batch: int = 1, seq: int | None = None, precision: str = "fp32",
                         recompute: str = "none", attention: str = "sdpa", optim: str = "adamw",
                         optimizer: str | None = None, lora_rank: int = 0, lora_targets=(), keep_logits: bool = False,
                         liger=False, **changes) -> Setup:
    """The :class:`Setup` of training the model ``config`` describes, one GPU, for the estimator.

    ``config``: a ``config.json``'s dict or a ``transformers.PretrainedConfig``. ``seq`` defaults to
    the model's longest (``max_position_embeddings`` / ``n_positions``). ``precision``: ``fp32``,
    ``bf16`` / ``fp16`` / ``amp`` (autocast over fp32 weights: the Trainer's ``--bf16``) or ``mixed``
    (bf16 weights). ``recompute``: ``none`` or ``full`` (``gradient_checkpointing_enable``: one
    checkpoint per decoder layer). ``attention``: transformers' ``attn_implementation`` (``eager``,
    ``sdpa``, ``flash_attention_2``). ``optim``: the lab's / Trainer's names (``adamw_torch``,
    ``adamw_torch_fused``, ``adamw_8bit``, ``adafactor``, ``sgd``) or the estimator's.
    ``keep_logits``: the trainer keeps the model's output (its logits) through backward.
    ``liger``: True = liger-kernel's patches of the family (``_apply_liger_kernel_to_instance``: all of
    :data:`LIGER_OF`), or a tuple of kernel names (``Setup.liger``); GPT-2 has no patches, its fused linear
    cross-entropy alone is the lab's head (``("fused_linear_cross_entropy",)``).
    ``changes``: any other Setup field (``workspace_mib``, ``grad_buffers``, ``dp``, ``zero``, ``float8``: torchao's
    float8 training of the layers, the lab's ``--float8``, ...).
    ``lora_rank``: peft's LoRA of that rank on ``lora_targets``, the model's own module names (q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, qkv_proj, gate_up_proj, c_attn, c_proj, c_fc,
    lm_head, as the family has them; default the family's query and value projections), the base frozen.
    ``prompt_tokens`` (a ``changes`` field): peft's soft prompt of that many vectors, the base frozen."""
    arch = architecture(config)
    if lora_targets and not lora_rank:
        raise FasttrainError("lora_targets without lora_rank: give the LoRA rank too")
    if lora_rank:
        model_type = _as_dict(config)["model_type"]
        lora_targets = tuple(lora_targets) or DEFAULT_LORA_TARGETS.get(model_type, ())
        if not lora_targets:
            raise FasttrainError(f"no default LoRA targets for model_type {model_type!r}; name its linear layers "
                                 f"(lora_targets, e.g. q_proj,v_proj)")
        changes.update(lora_rank=lora_rank, lora_targets=lora_targets)
    if precision not in PRECISION_ALIASES:
        raise FasttrainError(f"precision must be one of {', '.join(PRECISION_ALIASES)}, got {precision!r}")
    if attention not in ATTENTION_ALIASES:
        raise FasttrainError(f"attention must be one of eager, sdpa, flash_attention_2, got {attention!r}")
    if recompute not in ("none", "full"):
        raise FasttrainError(f"recompute must be none or full for a transformers model "
                             f"(gradient_checkpointing_enable checkpoints whole layers), got {recompute!r}")
    impl = optimizer or "foreach"
    optim = optim.strip().lower()
    if optim in OPTIM_ALIASES:
        optim, alias_impl = OPTIM_ALIASES[optim]
        if optimizer not in (None, alias_impl):
            raise FasttrainError(f"optim {optim!r} and optimizer {optimizer!r} contradict each other")
        impl = alias_impl
    if seq is None:
        seq = max_positions(config) or 1024
    if liger is True:
        model_type = _as_dict(config)["model_type"]
        if model_type not in LIGER_OF:
            raise FasttrainError(f"liger-kernel has no patches for model_type {model_type!r} in the estimator "
                                 f"(it models {', '.join(LIGER_OF)}); drop liger")
        changes["liger"] = LIGER_OF[model_type]
    elif liger:
        changes["liger"] = tuple(liger)
    # (under tensor parallelism: the family's plan, not Megatron's layout; a field given in ``changes`` wins)
    changes.setdefault("vocab_split", vocab_split_of(config))
    setup = Setup(**arch, micro_batch=micro_batch, seq=seq, precision=PRECISION_ALIASES[precision],
                  recompute=recompute, attention=ATTENTION_ALIASES[attention], optim=optim, optimizer=impl,
                  keep_logits=keep_logits, **changes)
    return check(setup, "precise")
