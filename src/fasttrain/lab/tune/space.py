"""The space tune searches: axes of choices over a base configuration, its candidates."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig


# opt-in techniques that change the training math -> the axis they join and their overrides
OPT_IN: dict[str, tuple[str, dict]] = {
    "lora": ("adapter", {"lora_r": 16, "lora_alpha": 32.0}),
    "prompt_tuning": ("adapter", {"prompt_tuning_tokens": 16}),
    "adamw_8bit": ("optimizer", {"optim": "adamw_8bit"}),
    "adafactor": ("optimizer", {"optim": "adafactor"}),
    "float8": ("float8", {"float8": "tensorwise"}),      # (its axis: none, tensorwise, rowwise; GPU only)
}
PRECISION_OVERRIDES = {
    "bf16": {"bf16": True, "fp16": False, "tf32": False},
    "tf32": {"bf16": False, "fp16": False, "tf32": True},
    "fp16": {"bf16": False, "fp16": True, "tf32": False},
    "fp32": {"bf16": False, "fp16": False, "tf32": False},
}
# the lab's per-block compile setting, where the lab has one (name: field, value)
PER_BLOCK_COMPILE = (("torch_compile_scope", "blocks"),)


# --- the space -----------------------------------------------------------------------------------

PARTIAL_PREFIX = "first-"     # a partial checkpointing choice's label: "first-8" = the first 8 blocks recompute


@dataclass(frozen=True)
class Axis:
    """One dimension of the search: ``choices`` are (label, LabConfig overrides); the first is the plain one."""

    name: str
    choices: tuple[tuple[str, dict], ...]
    changes_math: bool = False

    @property
    def fields(self) -> set[str]:
        return {k for _, o in self.choices for k in o}


@dataclass(frozen=True)
class Candidate:
    """One configuration: a choice per axis and a micro-batch (its accumulation reaches ``T``)."""

    choices: tuple[tuple[str, str], ...]       # (axis, choice label), in axis order
    micro_batch: int
    accumulation: int
    overrides: tuple[tuple[str, object], ...]  # every LabConfig override, sorted

    @property
    def settings(self) -> tuple[tuple[str, str], ...]:
        return self.choices

    @property
    def label(self) -> str:
        shown = [c for a, c in self.choices if c not in ("none", "off", "eager", "dataloader", "adamw_torch",
                                                         "reduce-fp32") or a == "precision"]
        return f"{self.micro_batch}x{self.accumulation} " + " ".join(shown)

    @property
    def key(self) -> str:
        return json.dumps(sorted(self.overrides_dict().items()), default=str)

    def overrides_dict(self) -> dict:
        return dict(self.overrides)


def parse_budget(text) -> float | None:
    """``5m``, ``300s``, ``300``, ``1h``, ``1.5m`` -> seconds; None or "" -> no budget."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
        if not m:
            raise FasttrainError(f"--budget {text!r}: give a duration such as 5m, 300s or 1h")
        seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if seconds <= 0:
        raise FasttrainError(f"--budget must be positive, got {text!r}")
    return seconds


def parse_allow(allow) -> tuple[str, ...]:
    if allow is None:
        return ()
    names = [a.strip() for a in (allow.split(",") if isinstance(allow, str) else allow) if a and a.strip()]
    unknown = [a for a in names if a not in OPT_IN]
    if unknown:
        raise FasttrainError(f"--allow {','.join(unknown)}: unknown technique; use any of {', '.join(OPT_IN)}")
    return tuple(dict.fromkeys(names))


def micro_batches(sequences: int) -> list[int]:
    """The micro-batches whose accumulation reaches ``sequences`` per optimizer step exactly: its divisors."""
    return [b for b in range(1, sequences + 1) if sequences % b == 0]


def _per_block_compile() -> tuple[str, object] | None:
    names = {f.name for f in fields(LabConfig)}
    for name, value in PER_BLOCK_COMPILE:
        if name in names:
            return name, value
    return None


def liger_support(family: str | None, kernels: str = "all") -> str | None:
    """None when liger-kernel can run ``kernels`` on a model of ``family`` (None: the lab's own GPT), else why not:
    all of them on the families its table patches; its fused linear cross-entropy alone
    (``fused_linear_cross_entropy``) on any transformers model's head (the lab's forward, ``lab/hf/liger.py``)."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if family is None:
        return None
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return "this liger-kernel has no transformers patches"
    if family not in MODEL_TYPE_TO_APPLY_LIGER_FN and kernels != "fused_linear_cross_entropy":
        return f"liger-kernel has no kernels for the {family} family"
    return None


def build_axes(base: LabConfig, *, cuda: bool, family: str | None = None, allow=(), precisions=("bf16",),
               fixed=(), liger_reason: str | None | bool = False, hf: bool = False,
               nproc: int = 1, layers: int | None = None, strategies=None) -> tuple[list[Axis], list[str]]:
    """The search's axes for ``base`` on this device, and one line for every axis (or choice) dropped.
    ``nproc`` > 1: the strategy axis over that many ranks joins (:mod:`.scale`).

    ``fixed``: LabConfig fields the user set; an axis touching one is not searched.
    ``liger_reason``: why liger cannot run (False: ask :func:`liger_support`).
    ``layers``: the model's blocks (partial checkpointing's choices: the first k of them recompute).
    ``strategies``: the names of the strategy axis' choices searched, as :func:`parse_strategies` gives them (None
    or empty: every one)."""
    dropped: list[str] = []
    fixed = set(fixed)
    allow = parse_allow(allow)
    axes: list[Axis] = []

    precision_choices = []
    for p in precisions:
        if p not in PRECISION_OVERRIDES:
            raise FasttrainError(f"unknown precision {p!r}; use any of {', '.join(PRECISION_OVERRIDES)}")
        if not cuda and p in ("tf32", "fp16"):
            dropped.append(f"precision {p}: needs a CUDA GPU (tensor cores / GradScaler); dropped on the CPU")
            continue
        precision_choices.append((p, PRECISION_OVERRIDES[p]))
    if not precision_choices:
        precision_choices = [("fp32", PRECISION_OVERRIDES["fp32"])]
    axes.append(Axis("precision", tuple(precision_choices)))
    attention = (("eager", {"attn_implementation": "eager"}), ("sdpa", {"attn_implementation": "sdpa"}))
    # the plain choice is what the model runs by default: a transformers model sdpa, the lab's GPT eager. The
    # screen measures every change from the plain configuration, so it should be one a user would run
    axes.append(Axis("attention", attention[::-1] if hf else attention))
    if cuda:
        compile_choices = [("none", {"torch_compile": False}),
                           ("default", {"torch_compile": True, "torch_compile_mode": "default"}),
                           ("reduce-overhead", {"torch_compile": True, "torch_compile_mode": "reduce-overhead"})]
        block = _per_block_compile()
        if block is not None:
            compile_choices.append(("block", {"torch_compile": True, "torch_compile_mode": "default",
                                              block[0]: block[1]}))
        else:
            dropped.append("torch.compile per block: the lab has no per-block compile setting; whole-model only")
        axes.append(Axis("compile", tuple(compile_choices)))
    else:
        dropped.append("torch.compile: dropped on the CPU (compiling takes minutes per probe and says nothing "
                       "about a GPU)")
    checkpointing = ("none", "selective", "full")
    if hf:
        checkpointing = ("none", "full")
        dropped.append("selective checkpointing: a transformers model checkpoints whole layers "
                       "(gradient_checkpointing_enable); none and full searched")
    choices = [(c, {"gradient_checkpointing": c, "checkpoint_blocks": 0}) for c in checkpointing]
    if layers and layers >= 2 and "checkpoint_blocks" not in fixed:
        # partial checkpointing: the first k blocks recompute, in eighths of the model; the search keeps, of
        # these, the fewest recomputed blocks predicted to fit (PARTIAL_PREFIX: search._fewest_recomputed)
        ks = sorted({max(1, round(layers * i / 8)) for i in range(1, 8)} - {layers})
        choices += [(f"{PARTIAL_PREFIX}{k}", {"gradient_checkpointing": "full", "checkpoint_blocks": k}) for k in ks]
    axes.append(Axis("checkpointing", tuple(choices)))
    reason = liger_support(family) if liger_reason is False else liger_reason
    # a family liger has no patch for (GPT-2): its fused cross-entropy alone, on the model's head
    head_only = hf and bool(reason) and liger_reason is False \
        and liger_support(family, "fused_linear_cross_entropy") is None
    if not cuda:
        dropped.append("liger-kernel: dropped on the CPU (its kernels are Triton, GPU only)")
    elif head_only:
        dropped.append(f"liger-kernel: {reason}; its fused linear cross-entropy alone (on the model's head) "
                       f"searched")
        axes.append(Axis("liger", (("off", {"use_liger_kernel": False, "liger_kernels": "all"}),
                                   ("fused-ce", {"use_liger_kernel": True,
                                                 "liger_kernels": "fused_linear_cross_entropy"}))))
    elif reason:
        dropped.append(f"liger-kernel: {reason}; dropped")
    else:
        liger = [("off", {"use_liger_kernel": False, "liger_kernels": "all"}),
                 ("liger", {"use_liger_kernel": True, "liger_kernels": "all"})]
        if hf:
            # the fused cross-entropy alone: on the H100 liger's layer kernels inside per-block compiled layers ran
            # slower than the compiled layers alone, while the eager head's logits are what compile leaves
            liger.append(("fused-ce", {"use_liger_kernel": True, "liger_kernels": "fused_linear_cross_entropy"}))
        axes.append(Axis("liger", tuple(liger)))
    optimizer_choices = []
    if base.optim in ("adamw_torch", "adamw_torch_fused"):
        optimizer_choices = [("adamw_torch", {"optim": "adamw_torch"}), ("adamw_torch_fused", {"optim": "adamw_torch_fused"})]
    else:
        optimizer_choices = [(base.optim, {"optim": base.optim})]
    for name in allow:
        axis, overrides = OPT_IN[name]
        if axis != "optimizer":
            continue
        if name == "adamw_8bit" and not cuda:
            dropped.append("adamw_8bit: needs a CUDA GPU (its kernels are CUDA); dropped on the CPU")
            continue
        optimizer_choices.append((name, overrides))
    axes.append(Axis("optimizer", tuple(optimizer_choices),
                     changes_math=any(c in OPT_IN for c, _ in optimizer_choices)))
    axes.append(Axis("data", (("dataloader", {"preload": False, "dataloader_num_workers": 0,
                                              "dataloader_pin_memory": False, "dataloader_prefetch_factor": None}),
                              ("preload", {"preload": True, "dataloader_num_workers": 0,
                                           "dataloader_pin_memory": False, "dataloader_prefetch_factor": None}))))
    adapters = [(name, OPT_IN[name][1]) for name in allow if OPT_IN[name][0] == "adapter"]
    if adapters:
        axes.append(Axis("adapter", (("none", {"lora_r": 0, "prompt_tuning_tokens": 0}),
                                     *((n, {"lora_r": 0, "prompt_tuning_tokens": 0, **o}) for n, o in adapters)),
                         changes_math=True))
    if "float8" in allow:
        axis, why = float8_axis(cuda)
        axes += [axis] if axis else []
        dropped += [why] if why else []
    if nproc > 1:
        axis, why = strategy_axis(nproc)
        if strategies:
            left = tuple(c for c in axis.choices if c[0] in strategies)
            dropped.append(f"strategy: {', '.join(c[0] for c in axis.choices if c[0] not in strategies)} left out "
                           f"(--strategies)")
            axis = Axis(axis.name, left)
        axes.append(axis)
        dropped += why
        axes.append(reduce_axis())
        dropped.append("reduce-bf16: tried with every data-parallel strategy (FSDP and HSDP's MixedPrecisionPolicy, "
                       "DDP's bf16 all-reduce hook); tp has no gradient reduction")
    kept = []
    for axis in axes:
        taken = sorted(axis.fields & fixed)
        if taken:
            dropped.append(f"{axis.name}: fixed by you (--{taken[0].replace('_', '-')}); not searched")
            fixed_choice = tuple((lbl, {k: v for k, v in o.items() if k not in fixed}) for lbl, o in axis.choices[:1])
            kept.append(Axis(axis.name, (("fixed", fixed_choice[0][1]),)))
        else:
            kept.append(axis)
    return kept, dropped


def _redundant(choices: dict) -> bool:
    """Combinations that are another one under a different name (measured once, not twice), or that set
    what the rest does not have."""
    # selective checkpointing recomputes the eager attention core; sdpa keeps no s^2 scores: no change
    if choices.get("checkpointing") == "selective" and choices.get("attention") == "sdpa":
        return True
    # the reduce dtype is data parallelism's: tp has no gradient reduction to set
    return choices.get("reduce") == "reduce-bf16" and choices.get("strategy") == "tp"


def enumerate_space(axes: list[Axis], sequences: int, fixed_batch: int | None = None,
                    nproc: int = 1) -> list[Candidate]:
    """Every combination of the axes' choices at every micro-batch reaching ``sequences`` per step. Over
    ``nproc`` ranks a micro-batch is per data-parallel rank: ``b k dp = sequences`` (``dp`` the strategy's)."""
    out = []
    for combo in itertools.product(*(axis.choices for axis in axes)):
        choices = {axis.name: label for axis, (label, _) in zip(axes, combo)}
        if _redundant(choices):
            continue
        overrides: dict = {}
        for _, o in combo:
            overrides.update(o)
        per_rank = sequences
        if nproc > 1:
            dp = dp_of(overrides, nproc)
            if sequences % dp:
                continue            # the global batch does not split over this strategy's ranks
            per_rank = sequences // dp
        batches = [fixed_batch] if fixed_batch else micro_batches(per_rank)
        for b in batches:
            if per_rank % b == 0:
                out.append(make_candidate(axes, tuple(choices.items()), overrides, b, per_rank))
    return out


def fixed_micro_batch(base: LabConfig, fixed, seq: int, global_batch_tokens: int) -> int | None:
    """The micro-batch the user's own ``--per-device-train-batch-size`` / ``--gradient-accumulation-steps``
    leave (None: searched), refused in one line when it cannot reach ``--global-batch-tokens`` exactly:
    a fixed accumulation is never changed, and a fixed micro-batch never rounds the step down."""
    sequences = global_batch_tokens // seq
    b = base.per_device_train_batch_size if "per_device_train_batch_size" in fixed else None
    k = base.gradient_accumulation_steps if "gradient_accumulation_steps" in fixed else None
    target = f"--global-batch-tokens {global_batch_tokens} ({sequences} sequences of {seq})"
    if b is not None and k is not None and b * k != sequences:
        raise FasttrainError(f"--per-device-train-batch-size {b} x --gradient-accumulation-steps {k} = {b * k} "
                             f"sequences per step, not the {sequences} of {target}; fix one of them (or give "
                             f"--global-batch-tokens {b * k * seq})")
    if b is not None and sequences % b:
        raise FasttrainError(f"--per-device-train-batch-size {b} does not divide the {sequences} sequences of "
                             f"{target}; give a micro-batch that divides it, or --global-batch-tokens "
                             f"{max(1, sequences // b) * b * seq}")
    if k is not None and sequences % k:
        raise FasttrainError(f"--gradient-accumulation-steps {k} does not divide the {sequences} sequences of "
                             f"{target}; give an accumulation that divides it, or --global-batch-tokens "
                             f"{max(1, sequences // k) * k * seq}")
    if b is not None:
        return b
    return sequences // k if k is not None else None


def make_candidate(axes, choices, overrides: dict, micro_batch: int, sequences: int) -> Candidate:
    k = sequences // micro_batch
    full = {**overrides, "per_device_train_batch_size": micro_batch, "gradient_accumulation_steps": k}
    return Candidate(tuple(choices), micro_batch, k, tuple(sorted(full.items())))


MIB = 2 ** 20


@dataclass
class Probe:
    """What one short run measured. ``tokens_per_s`` over the timed steps (warm-up excluded);
    ``compile_s``: the first step (compilation, autotuning); ``warmup_s``: the other warm-up steps;
    ``losses``: the training loss after every step, warm-up included."""

    steps: int
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    predicted_bytes: int | None = None
    compile_s: float = 0.0
    warmup_s: float = 0.0
    losses: list = field(default_factory=list)
    oom: bool = False
    error: str | None = None
    wall_s: float = 0.0
    cached: bool = False
    stopped: bool = False           # ended early (the budget, or far slower than the best): an error, not cached

    def to_dict(self) -> dict:
        return asdict(self)


# --- several processes: the strategy's configuration and axes (lab/tune/scale.py searches them) ---------

FLOAT8_RECIPES = ("tensorwise", "rowwise")

@dataclass
class ScaleConfig(LabConfig):
    """A lab configuration and how it spreads over ``nproc_per_node`` processes (``ParallelConfig``'s fields)."""

    nproc_per_node: int = 1
    strategy: str = "none"
    tp: int = 1
    dp_replicate: int = 1
    reshard_after_forward: bool = True
    offload_optimizer: bool = False

    @property
    def tp_size(self) -> int:
        return self.nproc_per_node if self.strategy == "tp" else self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each draws its own ``per_device_train_batch_size`` rows."""
        return max(1, self.nproc_per_node // self.tp_size)

    @property
    def label(self) -> str:
        from fasttrain.lab.parallel.distributed import strategy_label

        return strategy_label(self.strategy, self.reshard_after_forward, self.tp_size if self.strategy != "tp" else 1,
                              self.dp_replicate, self.offload_optimizer)

    def lab_config(self) -> LabConfig:
        return LabConfig(**{f.name: getattr(self, f.name) for f in fields(LabConfig)})

    def parallel(self):
        from fasttrain.lab.parallel.distributed import ParallelConfig

        return ParallelConfig(strategy=self.strategy, reshard_after_forward=self.reshard_after_forward,
                              tp=1 if self.strategy == "tp" else self.tp, dp_replicate=self.dp_replicate,
                              offload_optimizer=self.offload_optimizer)

    def world(self):
        """The :class:`World` rank 0 would join (no process group): what the estimator needs of it."""
        from fasttrain.lab.parallel.distributed import World

        return World(world_size=self.nproc_per_node, strategy=self.strategy,
                     reshard_after_forward=self.reshard_after_forward,
                     tp_size=self.tp_size if self.tp_size > 1 else 0, dp_replicate=self.dp_replicate,
                     offload_optimizer=self.offload_optimizer)

    def parallel_flags(self) -> list[str]:
        return self.parallel().flags()

def scaled(base: LabConfig, nproc: int) -> ScaleConfig:
    return ScaleConfig(**{f.name: getattr(base, f.name) for f in fields(LabConfig)}, nproc_per_node=nproc)

def scaled_row_config(base: ScaleConfig) -> Callable:
    """``config(row)`` for the experiments' ``prepare``: the row's lab settings through the one parser, its
    strategy's fields (not the lab's) as they are."""
    import dataclasses

    lab_fields = {f.name for f in fields(LabConfig)}

    def config(row) -> ScaleConfig:
        lab = {k: v for k, v in row.overrides.items() if k in lab_fields}
        rest = {k: v for k, v in row.overrides.items() if k not in lab_fields}
        return base.with_(**dataclasses.replace(row, overrides=lab).settings(), **rest)
    return config

def dp_of(overrides: dict, nproc: int) -> int:
    """The data-parallel size a candidate's overrides give over ``nproc`` ranks."""
    strategy = overrides.get("strategy", "none")
    tp = nproc if strategy == "tp" else overrides.get("tp", 1)
    return max(1, nproc // tp)

def strategy_axis(nproc: int) -> tuple[Axis, list[str]]:
    """The strategy axis over ``nproc`` ranks (every shape; the model's refusal drops the ones it cannot take)."""
    plain = {"strategy": "fsdp", "tp": 1, "dp_replicate": 1, "reshard_after_forward": True, "offload_optimizer": False}
    choices = [("fsdp", plain), ("fsdp-zero2", {**plain, "reshard_after_forward": False}),
               ("ddp", {**plain, "strategy": "ddp"}), ("zero1", {**plain, "strategy": "zero1"})]
    dropped = []
    if nproc >= 4 and nproc % 2 == 0:
        choices.append(("hsdp-r2", {**plain, "strategy": "hsdp", "dp_replicate": 2}))
    else:
        dropped.append(f"hsdp: replicate x shard needs an even number of ranks >= 4; {nproc} given")
    for t in range(2, nproc):
        if nproc % t == 0:
            choices.append((f"fsdp-tp{t}", {**plain, "tp": t}))
    choices.append(("tp", {**plain, "strategy": "tp", "tp": nproc}))
    choices.append(("fsdp-offload", {**plain, "offload_optimizer": True}))
    return Axis("strategy", tuple(choices)), dropped

def parse_strategies(text, nproc: int) -> tuple[str, ...]:
    """``--strategies fsdp,fsdp-zero2``: the strategy axis' choices over ``nproc`` ranks, or one line naming
    them."""
    if text is None:
        return ()
    names = tuple(s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip())
    if nproc < 2:
        raise FasttrainError("--strategies chooses among the strategies over several processes: add "
                             "--nproc-per-node N (N >= 2)")
    known = [c[0] for c in strategy_axis(nproc)[0].choices]
    unknown = [s for s in names if s not in known]
    if unknown or not names:
        raise FasttrainError(f"--strategies: {', '.join(unknown) or 'none given'} is not a strategy over {nproc} "
                             f"processes; choose among {', '.join(known)}")
    return names


def reduce_axis() -> Axis:
    """The dtype data parallelism reduces the gradients in (``--reduce-dtype``): fp32, the lab's default,
    then bf16 (half the reduce-scatter's bytes, each partial sum rounded to bf16; the HF Trainer's own)."""
    return Axis("reduce", (("reduce-fp32", {"reduce_dtype": "fp32"}), ("reduce-bf16", {"reduce_dtype": "bf16"})))

def float8_axis(cuda: bool) -> tuple[Axis | None, str | None]:
    if not cuda:
        return None, "float8: torchao's float8 GEMMs need an H100-class GPU; dropped on the CPU"
    return Axis("float8", (("none", {"float8": "none"}), *((r, {"float8": r}) for r in FLOAT8_RECIPES)),
                changes_math=True), None
