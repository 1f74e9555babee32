"""``fasttrain tune``: the fastest configuration of a model that fits this device, predicted then measured.

The space is rows of :class:`~fasttrain.lab.config.LabConfig` overrides over the lab's one trainer
(tune has no loop of its own): by default only what keeps the training math -- the same optimizer,
the same tokens per optimizer step ``T``:

- micro-batch ``b`` x accumulation ``k`` with ``b k seq = T`` (so ``b`` runs over the divisors of ``T / seq``);
- bf16 autocast (tf32 or fp16 where asked, ``precisions=``);
- the attention implementation (eager, sdpa);
- ``torch.compile`` (none, default, reduce-overhead; per block where the lab has the setting);
- activation checkpointing (none, selective, full);
- liger-kernel's fused kernels;
- the AdamW implementation (for-each, fused);
- data preloading.

Techniques that change the math (LoRA, prompt tuning, 8-bit AdamW, Adafactor) join only when asked
(``allow=("lora", "adamw_8bit", ...)``). A setting the user fixed (``fixed=``) is not searched.

Predict, then measure:

1. every configuration's peak is predicted by the memory estimator (``predict(cfg) -> bytes``); one
   whose ``predicted x (1 + reserve) + context`` exceeds the device's memory is pruned before
   anything is allocated (``context``: what is already taken on the device -- the CUDA context,
   other processes -- and ``reserve``: the caching allocator's reserved-over-allocated fraction,
   measured once on this device and raised by every probe that reserves more);
2. the survivors are measured by short runs through the lab's trainer (``measure(cfg, steps) ->
   Probe``, injected so that the search is testable with fakes). When they are few, all of them
   enter successive halving; when they are many, a screen first measures one change at a time
   from the plain configuration (every axis' first choice: the lab's GPT with eager attention, a
   transformers model with sdpa, its library's default; each at its largest predicted-fitting micro-batch), a
   multiplicative model ranks the combinations of every axis' choices
   (``speed(c) = speed(base) prod_axis speed(base with c's choice) / speed(base)``), and the
   halving's first rung takes the best-ranked combination, the screen's fastest, the best-ranked
   combination with each of its changes undone or swapped for another measured choice of its axis
   (changes that help alone can hurt together), then the ranking;
3. successive halving: every candidate of a rung runs ``s`` timed steps (3 at the first rung, after
   untimed ones that cover compilation and CUDA graphs' recording: ``warmup_steps_for``; the screen's
   probes time one step); the faster half goes on with ``eta s`` steps (``eta = 2``); the last one
   standing is the pick. An out-of-memory probe is recorded, its memory freed, and every larger
   micro-batch of the same settings is skipped; a probe that fails (a library that cannot run its
   choices together) has no candidate holding all of its choices tried after it, and the first rung
   goes further down the ranking instead;
4. ``budget_s`` bounds the search: no probe starts after it, a running probe is stopped at it, and the
   answer is the best so far (a probe cut by the budget is no measurement: what its configuration
   measured before stands). A probe is also stopped once it has run ``SLOW_GRACE_S`` plus
   ``SLOW_FACTOR`` times its steps at the best speed so far (it cannot win; a pathological
   configuration must not spend the budget).

Probes run at a constant learning rate (the configuration's peak one, no warm-up) so that the
loss after a probe's steps is comparable across probes: a configuration that trains differently
(the opt-in techniques, or a numerical problem) shows in its loss against the baseline's.

Measured probes are cached in a JSON file keyed by (model, device, versions, configuration,
steps): a second call measures nothing it has measured before.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from fasttrain.errors import FasttrainError
from fasttrain.lab import experiment
from fasttrain.lab.config import LabConfig, validate
from fasttrain.lab.experiment import Experiment

MIB = 2 ** 20
BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps")

# opt-in techniques that change the training math -> the axis they join and their overrides
OPT_IN: dict[str, tuple[str, dict]] = {
    "lora": ("adapter", {"lora_r": 16, "lora_alpha": 32.0}),
    "prompt_tuning": ("adapter", {"prompt_tuning_tokens": 16}),
    "adamw_8bit": ("optimizer", {"optim": "adamw_8bit"}),
    "adafactor": ("optimizer", {"optim": "adafactor"}),
}
PRECISION_OVERRIDES = {
    "bf16": {"bf16": True, "fp16": False, "tf32": False},
    "tf32": {"bf16": False, "fp16": False, "tf32": True},
    "fp16": {"bf16": False, "fp16": True, "tf32": False},
    "fp32": {"bf16": False, "fp16": False, "tf32": False},
}
# the lab's per-block compile setting, where the lab has one (name: field, value)
PER_BLOCK_COMPILE = (("torch_compile_scope", "blocks"),)
# a probe is stopped once it has run SLOW_GRACE_S (a model's build and compilation) plus SLOW_FACTOR times what its
# steps would take at the best speed measured so far: one that slow cannot win, and a pathological configuration
# (minutes a step) must not spend the budget
SLOW_FACTOR = 4.0
SLOW_GRACE_S = 90.0
BUDGET_ENDS = "the budget ends"
CPU_NOTE = "timings on a CPU do not transfer to a GPU: this run checks the search, not what a GPU would pick"


# --- the space -----------------------------------------------------------------------------------

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
        shown = [c for a, c in self.choices if c not in ("none", "off", "eager", "dataloader", "adamw_torch")
                 or a == "precision"]
        return f"{self.micro_batch}x{self.accumulation} " + " ".join(shown)

    @property
    def key(self) -> str:
        return json.dumps(sorted(self.overrides_dict().items()), default=str)

    def overrides_dict(self) -> dict:
        return dict(self.overrides)


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


@dataclass
class DeviceMemory:
    """How much of the device a run may use: ``total_bytes`` less ``context_bytes`` (taken before the
    run: the CUDA context, other processes), with ``reserve`` (the caching allocator's reserved over
    allocated, as a fraction) on top of a predicted peak."""

    name: str
    total_bytes: int
    context_bytes: int = 0
    reserve: float = 0.0
    cpu: bool = False

    def need(self, predicted: int) -> int:
        return int(math.ceil(predicted * (1.0 + self.reserve))) + self.context_bytes

    def fits(self, predicted: int | None) -> bool:
        return predicted is None or self.need(predicted) <= self.total_bytes


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


def liger_support(family: str | None) -> str | None:
    """None when liger-kernel can patch a model of ``family`` (None: the lab's own GPT), else why not."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if family is None:
        return None
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return "this liger-kernel has no transformers patches"
    if family not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"liger-kernel has no kernels for the {family} family"
    return None


def build_axes(base: LabConfig, *, cuda: bool, family: str | None = None, allow=(), precisions=("bf16",),
               fixed=(), liger_reason: str | None | bool = False, hf: bool = False) -> tuple[list[Axis], list[str]]:
    """The search's axes for ``base`` on this device, and one line for every axis (or choice) dropped.

    ``fixed``: LabConfig fields the user set; an axis touching one is not searched.
    ``liger_reason``: why liger cannot run (False: ask :func:`liger_support`)."""
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
    axes.append(Axis("checkpointing", tuple((c, {"gradient_checkpointing": c}) for c in checkpointing)))
    reason = liger_support(family) if liger_reason is False else liger_reason
    if not cuda:
        dropped.append("liger-kernel: dropped on the CPU (its kernels are Triton, GPU only)")
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
    """Combinations that are another one under a different name (measured once, not twice)."""
    # selective checkpointing recomputes the eager attention core; sdpa keeps no s^2 scores: no change
    return choices.get("checkpointing") == "selective" and choices.get("attention") == "sdpa"


def enumerate_space(axes: list[Axis], sequences: int, fixed_batch: int | None = None) -> list[Candidate]:
    """Every combination of the axes' choices at every micro-batch reaching ``sequences`` per step."""
    out = []
    batches = [fixed_batch] if fixed_batch else micro_batches(sequences)
    for combo in itertools.product(*(axis.choices for axis in axes)):
        choices = {axis.name: label for axis, (label, _) in zip(axes, combo)}
        if _redundant(choices):
            continue
        overrides: dict = {}
        for _, o in combo:
            overrides.update(o)
        for b in batches:
            out.append(make_candidate(axes, tuple(choices.items()), overrides, b, sequences))
    return out


def make_candidate(axes, choices, overrides: dict, micro_batch: int, sequences: int) -> Candidate:
    k = sequences // micro_batch
    full = {**overrides, "per_device_train_batch_size": micro_batch, "gradient_accumulation_steps": k}
    return Candidate(tuple(choices), micro_batch, k, tuple(sorted(full.items())))


# --- the device's memory -------------------------------------------------------------------------

def device_memory(device, limit_bytes: int | None = None) -> DeviceMemory:
    """The device's memory, what is already taken on it, and the allocator's reserve, measured once.

    On a GPU: ``torch.cuda.mem_get_info`` gives (free, total); ``context = total - free`` (this
    process's CUDA context and whatever else runs there). The reserve is measured with a pattern
    of allocations like a training step's (activations of growing sizes freed in reverse, a large
    temporary between them): ``max_memory_reserved / max_memory_allocated - 1``. On a CPU: the
    machine's physical memory, no context, no reserve. ``limit_bytes`` caps the total (a smaller
    budget than the device, or a test)."""
    import torch

    if device.type != "cuda":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 2 ** 40
        if limit_bytes:
            total = min(total, int(limit_bytes))
        return DeviceMemory("cpu", int(total), 0, 0.0, cpu=True)
    from fasttrain.lab.measure import free_memory, gpu_name

    free_memory(device)
    free, total = torch.cuda.mem_get_info(device)
    context = int(total - free)
    torch.cuda.reset_peak_memory_stats(device)
    kept = []
    for i in range(24):
        kept.append(torch.empty((1 + i % 7) * 3 * MIB + 4096 * i, dtype=torch.uint8, device=device))
        tmp = torch.empty(37 * MIB + 8192 * i, dtype=torch.uint8, device=device)
        del tmp
    while kept:
        kept.pop()
    torch.cuda.synchronize(device)
    reserve = max(0.0, torch.cuda.max_memory_reserved(device) / max(1, torch.cuda.max_memory_allocated(device)) - 1.0)
    free_memory(device)
    if limit_bytes:
        total = min(total, int(limit_bytes))
    return DeviceMemory(gpu_name(device), int(total), context, min(reserve, 0.25))


# --- the cache -----------------------------------------------------------------------------------

def default_cache_path() -> Path:
    root = os.environ.get("FASTTRAIN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fasttrain")
    return Path(root) / "tune-probes.json"


class ProbeCache:
    """Measured probes on disk, keyed by (model, device, versions, configuration, steps)."""

    def __init__(self, path: str | os.PathLike | None, identity: dict):
        self.path = None if path is None else Path(path)
        self.identity = identity
        self.entries: dict = {}
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                self.entries = data.get("probes", {}) if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self.entries = {}       # a damaged cache is not an error: it is measured again

    def key(self, cfg: LabConfig, steps: int) -> str:
        text = json.dumps({"identity": self.identity, "config": cfg.to_dict(), "steps": steps}, sort_keys=True,
                          default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, cfg: LabConfig, steps: int) -> Probe | None:
        entry = self.entries.get(self.key(cfg, steps))
        if entry is None:
            return None
        known = {f.name for f in fields(Probe)}
        return Probe(**{k: v for k, v in entry.items() if k in known}, )

    def put(self, cfg: LabConfig, steps: int, probe: Probe) -> None:
        if probe.error and not probe.oom:
            return                      # a failure may be transient: measured again next time
        self.entries[self.key(cfg, steps)] = {**probe.to_dict(), "cached": False}
        if self.path is not None:
            from fasttrain.files import atomic_write_text

            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps({"schema": 1, "probes": self.entries}, indent=1, sort_keys=True))


# --- the search ----------------------------------------------------------------------------------

@dataclass
class Entry:
    """A candidate and what is known of it."""

    candidate: Candidate
    predicted_bytes: int | None
    probes: list = field(default_factory=list)      # Probe, by rung
    stage: str = ""                                  # screen, halving
    skipped: str | None = None                       # why it was not measured

    @property
    def last(self) -> Probe | None:
        return self.probes[-1] if self.probes else None

    @property
    def ok(self) -> bool:
        return bool(self.probes) and not self.last.oom and not self.last.error and self.last.tokens_per_s is not None

    @property
    def steps_measured(self) -> int:
        return sum(p.steps for p in self.probes)


@dataclass
class TuneResult:
    entries: list                   # every Entry measured or pruned, ranked (best first) where measured
    pick: Entry | None
    baseline: Entry | None
    memory: DeviceMemory
    dropped: list
    notes: list
    pruned: int
    space_size: int
    tune_s: float
    budget_s: float | None
    budget_hit: bool
    seq: int
    global_batch_tokens: int
    base: LabConfig
    probes_measured: int
    probes_cached: int
    loss_step: int | None = None
    mode: str = "halving"


def slow_probe_limit(cfg: LabConfig, steps: int, best_tokens_per_s: float) -> tuple[float, str]:
    """The time a probe of ``cfg`` may take when the best speed measured so far is ``best_tokens_per_s``:
    SLOW_GRACE_S + SLOW_FACTOR x its steps (warm-up included) at that speed; and why it would be stopped."""
    n = steps + warmup_steps_for(cfg)
    at_best = n * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.context / best_tokens_per_s
    return (SLOW_GRACE_S + SLOW_FACTOR * at_best,
            f"more than {SLOW_FACTOR:.0f}x slower than the best so far, {best_tokens_per_s:,.0f} tokens/s")


def run_probe(measure: Callable, cfg: LabConfig, steps: int, allowed: tuple[float, str] | None,
              free: Callable) -> Probe:
    """``measure(cfg, steps)`` within ``allowed`` (seconds, and why: given to a measure that can stop; a stopped
    probe's error says why), any failure the probe's result: an out-of-memory error, a refusal, or a library
    that cannot run the configuration (a compiler error, a kernel without a case for this shape) ends this
    probe, not the search. ``free()`` gives a failed probe's cached blocks back."""
    from fasttrain.lab.measure import oom_types

    try:
        probe = measure(cfg, steps, time_allowed_s=allowed[0]) if allowed else measure(cfg, steps)
    except oom_types() as exc:
        probe = Probe(steps=steps, oom=True, error=f"out of memory: {str(exc).splitlines()[0][:160]}")
    except FasttrainError as exc:
        probe = Probe(steps=steps, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - see the docstring
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        probe = Probe(steps=steps, error=f"{type(exc).__name__}: {first}")
    if probe.oom or probe.error:
        free()                  # the probe's frames are gone: give its cached blocks back
    if probe.stopped and allowed:
        probe.error = f"{probe.error}: {allowed[1]}"
    return probe


class Search:
    """Successive halving (with a screen first when the space is large) over ``entries``."""

    def __init__(self, base: LabConfig, measure: Callable, *, cache: ProbeCache | None, clock: Callable,
                 budget_s: float | None, memory: DeviceMemory, log: Callable, free: Callable):
        self.base, self.measure, self.cache, self.clock = base, measure, cache, clock
        self.budget_s, self.memory, self.log, self.free = budget_s, memory, log, free
        self.start = clock()
        self.budget_hit = False
        self.measured = 0
        self.cached = 0
        self.oom_edges: dict = {}       # settings -> the smallest micro-batch that ran out of memory
        self.best_tokens_per_s = 0.0
        self.plain: dict = {}           # axis -> its plain choice (set by the search)
        self.failed: list = []          # (choices that failed together, the error): their supersets are skipped
        # a measure that can stop a probe early is given the time the probe may take
        self.stoppable = "time_allowed_s" in inspect.signature(measure).parameters

    def time_allowed(self, entry: Entry, steps: int) -> tuple[float, str] | None:
        """How long ``entry``'s probe may run, and why: the budget's remainder, or SLOW_GRACE_S + SLOW_FACTOR x
        its steps at the best speed so far (whichever is sooner)."""
        limits = []
        if self.budget_s is not None:
            limits.append((max(1.0, self.budget_s - (self.clock() - self.start)), BUDGET_ENDS))
        if self.best_tokens_per_s:
            limits.append(slow_probe_limit(self.config(entry), steps, self.best_tokens_per_s))
        return min(limits) if limits else None

    def out_of_time(self) -> bool:
        if self.budget_s is not None and self.clock() - self.start >= self.budget_s:
            if not self.budget_hit:
                self.log(f"budget of {self.budget_s:.0f} s reached: answering with the best so far")
            self.budget_hit = True
        return self.budget_hit

    def changes(self, entry: Entry) -> frozenset:
        """``entry``'s choices other than the plain ones (data loading aside: it does not touch the model)."""
        return frozenset((a, c) for a, c in entry.candidate.settings if a != "data" and self.plain.get(a) != c)

    def config(self, entry: Entry) -> LabConfig:
        return self.base.with_(**entry.candidate.overrides_dict())

    def run(self, entry: Entry, steps: int, stage: str) -> Probe | None:
        """One probe of ``entry`` with ``steps`` timed steps (None: the budget is spent)."""
        edge = self.oom_edges.get(entry.candidate.settings)
        if edge is not None and entry.candidate.micro_batch >= edge:
            entry.skipped = f"micro-batch {edge} of the same settings ran out of memory"
            return None
        changes = self.changes(entry)
        for together, error in self.failed:
            if together <= changes:
                entry.skipped = f"{' + '.join(sorted(c for _, c in together))} failed together: {error}"
                return None
        if self.out_of_time():
            return None
        cfg = self.config(entry)
        probe = self.cache.get(cfg, steps) if self.cache else None
        if probe is not None:
            probe.cached = True
            self.cached += 1
        else:
            t0 = self.clock()
            allowed = self.time_allowed(entry, steps) if self.stoppable else None
            probe = run_probe(self.measure, cfg, steps, allowed, self.free)
            probe.wall_s = self.clock() - t0
            self.measured += 1
            if self.cache:
                self.cache.put(cfg, steps, probe)       # (not a failed or stopped one: see ProbeCache.put)
            if probe.error and not (probe.oom or probe.stopped):
                # a library that cannot run these choices together (liger's fused cross-entropy under
                # torch.compile, say) fails on every candidate that has them all: those are not tried. The
                # optimizer's choice is left out where the model's choices remain: it does not change the model
                in_model = frozenset((a, c) for a, c in changes if a != "optimizer")
                self.failed.append((in_model or changes, probe.error))
        if probe.predicted_bytes is None:
            probe.predicted_bytes = entry.predicted_bytes
        if probe.oom:
            settings = entry.candidate.settings
            self.oom_edges[settings] = min(self.oom_edges.get(settings, 1 << 62), entry.candidate.micro_batch)
        elif probe.peak_bytes and probe.reserved_bytes:
            # the allocator reserved more than the calibration said: later predictions use it
            self.memory.reserve = max(self.memory.reserve, min(0.25, probe.reserved_bytes / probe.peak_bytes - 1.0))
        if not (probe.oom or probe.error) and probe.tokens_per_s:
            self.best_tokens_per_s = max(self.best_tokens_per_s, probe.tokens_per_s)
        if probe.stopped and probe.error.endswith(BUDGET_ENDS):
            # cut by the budget, not a measurement: what the entry had measured before still stands
            self.log(f"{stage:8s} {entry.candidate.label:60s} {steps:>4} steps  {probe.error}")
            self.budget_hit = True
            return None
        entry.probes.append(probe)
        entry.stage = entry.stage or stage
        speed = "OOM" if probe.oom else ("failed: " + probe.error) if probe.error else f"{probe.tokens_per_s:,.0f} tok/s"
        self.log(f"{stage:8s} {entry.candidate.label:60s} {steps:>4} steps  {speed}"
                 + ("  (cached)" if probe.cached else ""))
        return probe

    def halving(self, entries: list[Entry], steps: int, eta: int = 2, want: int | None = None) -> list[Entry]:
        """Successive halving: measure all at ``steps``; keep the best ``1/eta``; ``eta x`` steps; repeat.
        ``want``: the first rung goes down ``entries`` (best-ranked first) until that many have run."""
        alive = list(entries)
        rung = 0
        while alive:
            measured = []
            for entry in alive:
                if rung == 0 and want is not None and len(measured) >= want:
                    break
                # the first rung reuses a screen probe of the same length
                if not (rung == 0 and entry.probes and entry.last.steps == steps):
                    if self.run(entry, steps, "halving") is None:
                        continue
                if entry.ok:
                    measured.append(entry)
            if self.budget_hit or len(measured) <= 1:
                return measured
            measured.sort(key=lambda e: -e.last.tokens_per_s)
            alive = measured[:max(1, len(measured) // eta)]
            steps *= eta
            rung += 1
        return alive


def _largest_fitting(entries: list[Entry], memory: DeviceMemory) -> dict:
    """settings -> the entries that fit, by micro-batch (largest first)."""
    by_settings: dict = {}
    for e in entries:
        if memory.fits(e.predicted_bytes):
            by_settings.setdefault(e.candidate.settings, []).append(e)
    for v in by_settings.values():
        v.sort(key=lambda e: -e.candidate.micro_batch)
    return by_settings


def search(base: LabConfig, *, seq: int, global_batch_tokens: int, measure: Callable, predict: Callable,
           memory: DeviceMemory, family: str | None = None, allow=(), precisions=("bf16",), fixed=(),
           budget_s: float | None = None, clock: Callable = time.perf_counter, cache: ProbeCache | None = None,
           steps: int = 4, max_candidates: int = 8, batch_choices: int = 2, log: Callable | None = None,
           free: Callable | None = None, liger_reason: str | None | bool = False,
           fixed_batch: int | None = None, hf: bool = False,
           refuse: Callable[[LabConfig], str | None] | None = None) -> TuneResult:
    """Search the space of ``base`` (see the module docstring); ``measure(cfg, steps) -> Probe`` runs
    one probe, ``predict(cfg) -> bytes | None`` the estimator's peak; ``refuse(cfg)``: why the model cannot
    run a configuration (:func:`model_refusal`), None where it can.

    ``steps``: timed steps of the first rung; ``max_candidates``: configurations that enter the
    halving when the space is larger (then a one-change-at-a-time screen chooses them);
    ``batch_choices``: micro-batches per setting kept (the largest that fit, by prediction)."""
    log = log or (lambda line: None)
    free = free or (lambda: None)
    check_shape(seq, global_batch_tokens)
    if steps < 1:
        raise FasttrainError(f"probe steps must be >= 1, got {steps}")
    if budget_s is not None and budget_s <= 0:
        raise FasttrainError(f"--budget must be positive, got {budget_s}")
    cuda = not memory.cpu
    base = validate(base.with_(context=seq))
    axes, dropped = build_axes(base, cuda=cuda, family=family, allow=allow, precisions=precisions, fixed=fixed,
                               liger_reason=liger_reason, hf=hf)
    notes = [] if cuda else [CPU_NOTE]
    sequences = global_batch_tokens // seq
    space = enumerate_space(axes, sequences, fixed_batch)
    t0 = clock()
    entries = []
    # every configuration of the space built through the one parser and validated before any probe (the
    # experiments' prepare); one the model refuses is dropped with its reason. The probes themselves are not
    # the experiments' rows run once each: successive halving measures a candidate again at more steps.
    rows = [Experiment(cand.label, overrides=cand.overrides_dict()) for cand in space]
    refused: dict[str, int] = {}
    for cand, row in zip(space, experiment.prepare(rows, base, skip=True)):
        if row.unable is not None:
            dropped.append(f"{cand.label}: {row.unable}")
            continue
        why = refuse(row.config) if refuse else None
        if why is not None:     # a combination the model refuses (before any weights): one line per reason
            refused[why] = refused.get(why, 0) + 1
            continue
        entries.append(Entry(cand, predict(row.config)))
    dropped += [f"{n} configuration(s) the model refuses: {why}" for why, n in refused.items()]
    if not entries:
        raise FasttrainError("no configuration of the space is valid for this model: " + "; ".join(dropped[-3:]))
    fitting = _largest_fitting(entries, memory)
    pruned = sum(1 for e in entries if not memory.fits(e.predicted_bytes))
    if not fitting:
        raise FasttrainError(nothing_fits_message(base, entries, memory, seq, global_batch_tokens, predict, allow))
    # per setting, the largest micro-batches that fit (a smaller one only waits longer on the same work)
    chosen = [e for v in fitting.values() for e in v[:batch_choices]]
    log(f"{len(space)} configurations, {pruned} pruned by the estimator's prediction "
        f"(device {memory.total_bytes / MIB:,.0f} MiB, {memory.context_bytes / MIB:,.0f} MiB taken, "
        f"reserve {100 * memory.reserve:.0f}%); {len(chosen)} at the largest micro-batches that fit")
    search = Search(base, measure, cache=cache, clock=clock, budget_s=budget_s, memory=memory, log=log, free=free)
    plain = tuple((a.name, a.choices[0][0]) for a in axes)
    search.plain = dict(plain)
    baseline = fitting.get(plain, [None])[0]
    if len(chosen) <= max_candidates:
        mode = "halving"
        # the plain settings first (the baseline); within a setting the smaller micro-batch first, so that
        # an out-of-memory error there spares the larger ones their probe
        contenders = sorted(chosen, key=lambda e: (e.candidate.settings != plain, e.candidate.micro_batch))
    else:
        mode = "screen + halving"
        # the screen ranks one change at a time: one timed step each (after the warm-up) tells a 10% change
        # from noise at a realistic global batch, and the halving measures the contenders at full length
        contenders = _screen(search, axes, fitting, baseline, max(1, steps // 3), max_candidates, batch_choices)
        baseline = baseline if baseline is not None else next((e for e in contenders), None)
    finalists = search.halving(contenders, steps, want=max_candidates)
    if baseline is not None and not baseline.probes and not search.out_of_time():
        search.run(baseline, steps, "baseline")
    measured = [e for e in entries if e.probes]
    if baseline is not None and not baseline.ok:
        # the plain settings at their largest micro-batch ran out of memory: the largest that ran stands in
        plain_ok = [e for e in measured if e.ok and e.candidate.settings == baseline.candidate.settings]
        baseline = max(plain_ok, key=lambda e: e.candidate.micro_batch) if plain_ok else baseline
    ranked = rank(measured)
    pick = _pick(finalists, ranked)
    loss_step = None
    if baseline is not None and baseline.ok and baseline.probes[0].losses:
        loss_step = len(baseline.probes[0].losses)
    if not any(e.ok for e in measured):
        notes.append("no probe finished" + (" within the budget" if search.budget_hit else "")
                     + ": nothing measured to answer with")
    others = [e for e in entries if not e.probes]
    return TuneResult(entries=ranked + others, pick=pick, baseline=baseline, memory=memory, dropped=dropped,
                      notes=notes, pruned=pruned, space_size=len(space), tune_s=clock() - t0, budget_s=budget_s,
                      budget_hit=search.budget_hit, seq=seq, global_batch_tokens=global_batch_tokens, base=base,
                      probes_measured=search.measured, probes_cached=search.cached, loss_step=loss_step, mode=mode)


def _screen(search: Search, axes, fitting: dict, baseline: Entry | None, steps: int, max_candidates: int,
            batch_choices: int) -> list[Entry]:
    """One change at a time from the plain configuration, each at its largest fitting micro-batch; then
    the combinations of every axis' better choices ranked by the product of their speed-ups."""
    settings_list = list(fitting)
    plain = tuple((a.name, a.choices[0][0]) for a in axes)
    if baseline is None:
        # the plain settings do not fit at any micro-batch: the closest that fits stands in for them
        def distance(s):
            return sum(1 for (a, c), (_, p) in zip(s, plain) if c != p)
        plain = min(settings_list, key=distance)
        baseline = fitting[plain][0]
    screen: list[Entry] = [baseline]
    screen += fitting[plain][1:batch_choices]
    for axis in axes:
        for label, _ in axis.choices[1:]:
            s = tuple((a, label if a == axis.name else c) for a, c in plain)
            if s in fitting:
                screen.append(fitting[s][0])
    for entry in screen:
        search.run(entry, steps, "screen")
    base_speed = baseline.last.tokens_per_s if baseline.ok else None
    if not base_speed:
        ok = [e for e in screen if e.ok]
        return ok[:max_candidates]
    ratio: dict = {}
    for entry in screen:
        if not entry.ok or entry.candidate.micro_batch != fitting[entry.candidate.settings][0].candidate.micro_batch:
            continue
        for (a, c), (_, p) in zip(entry.candidate.settings, plain):
            if c != p:
                ratio[(a, c)] = entry.last.tokens_per_s / base_speed
    # per axis: the plain choice and every choice the screen measured; the combinations are ranked by the
    # product of their speed-ups, so the halving takes the best-ranked and goes further down where some
    # fail together (compile's next mode with liger where one mode cannot run with it, say)
    keep = {a: [p] + [c for (ax, c) in ratio if ax == a] for a, p in plain}

    def score(settings) -> float:
        return math.prod(ratio.get((a, c), 1.0) for a, c in settings)

    combos = [s for s in itertools.product(*([(a, c) for c in keep[a]] for a, _ in plain))
              if tuple(s) in fitting]
    combos.sort(key=lambda s: -score(s))
    ranked = [e for s in combos for e in fitting[tuple(s)][:batch_choices]]
    # The product assumes that changes help independently; they need not (on the H100, liger's kernels inside
    # per-block compiled layers made them 10% slower than the compiled layers alone). So the halving's first
    # rung opens with the best-ranked combination, the screen's fastest measured configuration, and the
    # best-ranked combination with each one of its changes undone or swapped for another measured choice of its
    # axis (best-ranked first), each at its largest fitting micro-batch: a change that hurts beside the others
    # loses to the combination without it or with the axis' next choice. The ranking fills the rung to
    # max_candidates (further down where one is skipped or fails).
    first: list[Entry] = []
    if combos:
        top = tuple(combos[0])
        first.append(fitting[top][0])
        first.append(max((e for e in screen if e.ok), key=lambda e: e.last.tokens_per_s))
        around = [tuple((a, other if a == axis else c) for a, c in top)
                  for (axis, choice), (_, plain_choice) in zip(top, plain) if choice != plain_choice
                  for other in keep[axis] if other != choice]
        first += [fitting[w][0] for w in sorted(around, key=lambda w: -score(w)) if w in fitting]
    out: list[Entry] = []
    for e in first + ranked:
        if e not in out:
            out.append(e)
    return out


def rank(entries: list[Entry]) -> list[Entry]:
    """Measured entries, best first: the deepest rung reached (the longest probe: a rung is longer than
    the one before, a screen probe shorter than the first rung), then its tokens/s."""
    def key(e: Entry):
        if not e.ok:
            return (1, 0, 0.0)
        return (0, -e.last.steps, -e.last.tokens_per_s)
    return sorted(entries, key=key)


def _pick(finalists: list[Entry], ranked: list[Entry]) -> Entry | None:
    ok = [e for e in finalists if e.ok]
    if ok:
        return max(ok, key=lambda e: (e.last.steps, e.last.tokens_per_s))
    ok = [e for e in ranked if e.ok]
    return ok[0] if ok else None


# --- bad input -----------------------------------------------------------------------------------

def _size(nbytes: float) -> str:
    mib = nbytes / MIB
    return f"{mib:,.0f} MiB" if mib >= 10 else f"{mib:.2f} MiB"


def check_shape(seq: int, global_batch_tokens: int) -> None:
    for flag, value in (("--seq", seq), ("--global-batch-tokens", global_batch_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FasttrainError(f"{flag} must be a positive integer, got {value!r}")
    if global_batch_tokens % seq:
        lo = max(seq, global_batch_tokens // seq * seq)
        raise FasttrainError(f"--global-batch-tokens {global_batch_tokens} is not a whole number of sequences of "
                             f"--seq {seq}; use {lo} or {lo + seq}")


def nothing_fits_message(base: LabConfig, entries: list[Entry], memory: DeviceMemory, seq: int, tokens: int,
                         predict: Callable, allow) -> str:
    """Nothing fits: the smallest predicted peak, the device's memory, and what would fit."""
    known = [e for e in entries if e.predicted_bytes is not None]
    smallest = min(known, key=lambda e: e.predicted_bytes)
    need = memory.need(smallest.predicted_bytes)
    cfg = base.with_(**smallest.candidate.overrides_dict())
    fixes = []
    for name, (axis, overrides) in OPT_IN.items():
        if name in allow or (name == "adamw_8bit" and memory.cpu):
            continue
        try:
            trial = validate(cfg.with_(**overrides))
            p = predict(trial)
        except FasttrainError:
            continue
        if p is not None and memory.fits(p):
            fixes.append(f"--allow {name} (predicted {_size(p)})")
    s = seq
    while s > 1:
        s //= 2
        try:
            p = predict(validate(cfg.with_(context=s)))
        except FasttrainError:
            break
        if p is not None and memory.fits(p):
            fixes.append(f"--seq {s} (predicted {_size(p)}; --global-batch-tokens stays {tokens}: "
                         "more sequences per step)")
            break
    hint = "; would fit: " + " or ".join(fixes) if fixes else "; nothing in reach fits: a smaller model or a larger device"
    return (f"no configuration fits: the smallest predicted peak is {_size(smallest.predicted_bytes)} "
            f"({smallest.candidate.label.strip()}, {_size(need)} with the context and the allocator's "
            f"reserve) on {memory.name} with {_size(memory.total_bytes)}" + hint)


# --- the lab: prediction and probes through its trainer -------------------------------------------

def model_of(cfg: LabConfig) -> tuple[str, dict | None]:
    """(the model's name, its Hugging Face config as a dict or None for the lab's own GPT)."""
    spec = getattr(cfg, "model", None) or "gpt"
    if not str(spec).startswith("hf:"):
        return "gpt", None
    path = Path(str(spec)[3:]).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        return str(spec), None          # a hub name: the lab resolves it; the estimator cannot read it here
    try:
        return str(spec), json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise FasttrainError(f"--model {spec}: cannot read {config_file} ({exc})") from None


def model_refusal(hf_config: dict | None, device) -> Callable[[LabConfig], str | None]:
    """``refuse(cfg)``: the one line with which the lab's check of a transformers model (run before any weights
    are built) refuses ``cfg`` on ``device`` -- liger's fused cross-entropy under a whole-model compile, say --
    or None where the model runs it. The lab's own GPT refuses nothing here (``validate`` judged it)."""
    if hf_config is None:
        return lambda cfg: None
    from fasttrain.lab import hf

    config = hf.config_from_dict(hf_config)

    def refuse(cfg: LabConfig) -> str | None:
        try:
            hf.check_hf_setup(cfg, config, None, device)
        except FasttrainError as exc:
            return str(exc)
        return None
    return refuse


def lab_predictor(vocab: int, hf_config: dict | None = None, cpu: bool = False) -> Callable:
    """``predict(cfg) -> bytes``: the memory estimator's ``precise`` peak of ``cfg`` -- the lab's GPT
    (:func:`~fasttrain.lab.train.lab_setup`) or a transformers model from its config
    (``fasttrain.memory.hf_config.setup_from_hf_config``); None where the estimator cannot describe it
    (then nothing is pruned and the probe finds out). ``cpu``: no cuBLAS workspaces (the estimator's
    65 MiB are a GPU's). torch.compile of a transformers model is modelled, liger-kernel's patches of it eager,
    and its fused cross-entropy alone beside per-block compiled layers; liger's layer kernels inside compiled
    code are predicted as the compiled model without liger (the estimator does not model them; liger only frees
    memory there: on the H100 the Llama 1B case's per-block compiled layers with all of liger peaked 5% below
    that prediction, so the pruning is on the safe side)."""
    from fasttrain.memory import estimate

    def peak(cfg: LabConfig, liger) -> int | None:
        if hf_config is not None:
            try:
                from fasttrain.memory.hf_config import setup_from_hf_config
            except ImportError:
                return None
            from fasttrain.lab.config import compiled_scope

            precision = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"
            setup = setup_from_hf_config(hf_config, micro_batch=cfg.per_device_train_batch_size, seq=cfg.context,
                                         precision=precision, recompute=cfg.gradient_checkpointing,
                                         attention=cfg.attn_implementation, optim=cfg.optim,
                                         grad_buffers=cfg.gradient_accumulation_steps > 1,
                                         compiled=compiled_scope(cfg), liger=liger)
        else:
            from fasttrain.lab.train import lab_setup

            setup = lab_setup(cfg, vocab, cfg.per_device_train_batch_size)
        if cpu:
            setup = setup.with_(workspace_mib=0.0)
        return int(estimate(setup, "precise").total)

    def predict(cfg: LabConfig) -> int | None:
        from fasttrain.lab.config import liger_of

        liger = liger_of(cfg) if hf_config is not None else False
        try:
            return peak(cfg, liger)
        except FasttrainError:
            if not liger:
                return None
        # liger where the estimator does not model it (its layer kernels under compile): the model without it
        try:
            return peak(cfg, False)
        except FasttrainError:
            return None
    return predict


def probe_config(cfg: LabConfig, steps: int, warmup: int) -> LabConfig:
    """A probe's run: ``warmup`` untimed steps then ``steps`` timed ones, a constant learning rate (so that
    losses compare across probes of any length), no validation but the smallest, nothing saved."""
    return cfg.with_(max_steps=warmup + steps, timing_warmup_steps=warmup, warmup_steps=0,
                     min_lr=cfg.learning_rate, eval_interval=0, eval_tokens=max(cfg.context, 64), log_interval=1,
                     save=None, auto_find_batch_size=False)


def load_corpus_for(cfg: LabConfig):
    """The corpus ``cfg`` names (Tiny Shakespeare, or the user's text or token files where the lab reads them)."""
    from fasttrain.lab import data

    if hasattr(data, "corpus_for"):
        return data.corpus_for(cfg)
    return data.load_corpus(cfg.data_dir)


# forward/backward calls run before a probe's timing starts: the first compiles, the second and third are
# CUDA graphs' warm-up and recording (reduce-overhead); after them every call is a steady-state one
WARM_MICRO_STEPS = 3


def warmup_steps_for(cfg: LabConfig) -> int:
    """Untimed optimizer steps before a probe's timed ones: enough for :data:`WARM_MICRO_STEPS` micro-batches.
    At a realistic global batch a step is many micro-batches (0.5M tokens of 1024 are 512 sequences: 16 of
    32), so one step warms up and the probe's time goes to measuring, not to repeating the warm-up."""
    return max(1, math.ceil(WARM_MICRO_STEPS / max(1, cfg.gradient_accumulation_steps)))


def lab_measure(corpus=None, warmup: int | None = None) -> Callable:
    """``measure(cfg, steps) -> Probe``: one probe through the lab's trainer (``make_trainer`` builds the
    model ``cfg`` names; ``Trainer.train`` is the loop; ``Metrics`` times each step between device
    synchronizations, the first ``warmup`` apart, and reads the peaks less what was held before). An
    out-of-memory error is caught, the frames holding the probe's tensors are left, and the cache is
    emptied before the probe is answered as out of memory (no batch search: the tuner chooses)."""
    loaded: dict = {}

    def measure(cfg: LabConfig, steps: int, time_allowed_s: float | None = None) -> Probe:
        import torch

        from fasttrain.lab.build import make_trainer, resolve_device
        from fasttrain.lab.measure import free_memory, held_before, oom_types, release_run_state, tf32_matmuls
        from fasttrain.lab.trainer import Metrics

        pc = validate(probe_config(cfg, steps, warmup_steps_for(cfg) if warmup is None else warmup))
        device = resolve_device(pc)
        data = corpus if corpus is not None else loaded.get("corpus")
        if data is None:
            data = loaded["corpus"] = load_corpus_for(pc)
        cuda = device.type == "cuda"
        free_memory(device)
        held = held_before(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        oom = stopped = False
        metrics = Metrics(pc, device, held=held, curve=True)
        t_start = time.perf_counter()

        def past_its_time(_: int) -> None:
            # checked after every micro-batch: a probe ends at most one micro-batch after its time
            if time.perf_counter() - t_start > time_allowed_s:
                raise ProbeStopped()

        with tf32_matmuls(pc.tf32):
            try:
                trainer = make_trainer(pc, data, device)
                if time_allowed_s is not None:
                    trainer.after_micro_batch = past_its_time
                trainer.train(metrics=metrics, evaluate=False)
            except oom_types():
                oom = True          # answered below, once the exception (and its frames' tensors) is gone
            except ProbeStopped:
                stopped = True
            finally:
                # the next probe must not run this one's liger patches nor find its CUDA-graph pool held, and
                # compiled probes must not pile up in dynamo's cache (past its limit it runs eager, unsaid)
                release_run_state(pc)
        if oom:
            trainer = None
            free_memory(device)
            return Probe(steps=steps, oom=True, error="out of memory",
                         compile_s=metrics.warmup_ms[0] / 1e3 if metrics.warmup_ms else 0.0)
        if stopped:
            trainer = None
            free_memory(device)
            done = len(metrics.warmup_ms) + len(metrics.step_ms)
            return Probe(steps=steps, stopped=True,
                         error=f"stopped after {time.perf_counter() - t_start:.0f} s, {done} of {pc.max_steps} "
                               f"steps done, past the {time_allowed_s:.0f} s allowed",
                         compile_s=metrics.warmup_ms[0] / 1e3 if metrics.warmup_ms else 0.0)
        del trainer
        free_memory(device)
        timed = metrics.step_ms
        tokens = pc.per_device_train_batch_size * pc.gradient_accumulation_steps * pc.context
        return Probe(steps=steps, tokens_per_s=tokens / (sum(timed) / len(timed) / 1e3) if timed else None,
                     peak_bytes=metrics.train_peak if cuda else None,
                     reserved_bytes=metrics.reserved_peak if cuda else None,
                     compile_s=metrics.warmup_ms[0] / 1e3 if metrics.warmup_ms else 0.0,
                     warmup_s=sum(metrics.warmup_ms[1:]) / 1e3,
                     losses=[p["loss"] for p in metrics.loss_curve])
    return measure


class ProbeStopped(Exception):
    """Raised between a probe's micro-batches once it has run longer than it was allowed."""


def identity(device, memory: DeviceMemory, model_id: str) -> dict:
    """What a cached probe depends on besides its configuration: the model, the device, the versions."""
    import torch

    from fasttrain.environment import library_versions

    versions = {"torch": torch.__version__}
    for name in ("transformers", "liger-kernel", "torchao", "peft"):
        try:
            from importlib import metadata

            versions[name] = metadata.version(name)
        except Exception:  # noqa: BLE001 - absent libraries are simply not part of the key
            pass
    try:
        versions.update({k: v for k, v in library_versions().items() if k in ("numpy",)})
    except Exception:  # noqa: BLE001
        pass
    return {"model": model_id, "device": memory.name, "versions": versions}


def probe_cache(cache_path, device, memory: DeviceMemory, model_id: str, hf_config: dict | None) -> ProbeCache:
    """The probe cache of ``model_id`` on this device (``cache_path``: a file, True for the default one, None or
    False for none). Anything that measures the same configurations (a benchmark's grid) can share it."""
    if cache_path is True:
        cache_path = default_cache_path()
    # a transformers model is its config.json too (the folder's name alone may hold another model tomorrow)
    digest = hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()[:16] if hf_config else ""
    return ProbeCache(cache_path or None, identity(device, memory, model_id + (f"#{digest}" if digest else "")))


def tune(base: LabConfig, *, seq: int, global_batch_tokens: int, budget=None, allow=(), precisions=("bf16",),
         fixed=(), out: str | os.PathLike | None = None, cache_path: str | os.PathLike | None | bool = True,
         memory_limit_bytes: int | None = None, steps: int | None = None, max_candidates: int = 8,
         log: Callable | None = None, corpus=None, model=None, model_id: str = "gpt",
         measure: Callable | None = None, predict: Callable | None = None, memory: DeviceMemory | None = None,
         clock: Callable = time.perf_counter, liger_reason: str | None | bool = False, free: Callable | None = None,
         batch_choices: int = 2) -> TuneResult:
    """``fasttrain tune`` from Python: search, report, and (with ``out``) write the results folder.

    Bad input is refused before anything runs (the out folder, the shape, the budget, the list of
    techniques); a device the lab cannot use says so."""
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.measure import free_memory

    budget_s = parse_budget(budget)
    allow = parse_allow(allow)
    check_shape(seq, global_batch_tokens)
    if out is not None:
        from fasttrain.files import check_new_folder

        folder = check_new_folder(out, "--out")
        if folder.exists() and any(folder.iterdir()):
            raise FasttrainError(f"--out {out}: that folder holds files already; give a new or empty folder")
    base = validate(base.with_(context=seq))
    device = resolve_device(base)
    memory = memory or device_memory(device, memory_limit_bytes)
    if corpus is None and measure is None:
        corpus = load_corpus_for(base)
    vocab = corpus.vocab_size if corpus is not None else (base.vocab_size or 65)
    spec, hf_config = model_of(base)
    if model_id == "gpt":
        model_id = spec
    family = getattr(model, "family", None) or (hf_config or {}).get("model_type")
    predict = predict or lab_predictor(vocab, hf_config, cpu=memory.cpu)
    measure = measure or lab_measure(corpus)
    cache = probe_cache(cache_path, device, memory, model_id, hf_config)
    result = search(base, seq=seq, global_batch_tokens=global_batch_tokens, measure=measure, predict=predict,
                  memory=memory, family=family, hf=spec.startswith("hf:"), allow=allow, precisions=precisions,
                  fixed=fixed, budget_s=budget_s, cache=cache, steps=steps or 3,
                  max_candidates=max_candidates, log=log, free=free or (lambda: free_memory(device)), clock=clock,
                  batch_choices=batch_choices,
                  liger_reason=liger_reason, refuse=model_refusal(hf_config, device),
                  fixed_batch=base.per_device_train_batch_size if "per_device_train_batch_size" in fixed else None)
    if out is not None:
        from fasttrain.lab.tune_report import write_results

        write_results(result, out, model_id=model_id)
    return result


__all__ = ["Axis", "Candidate", "DeviceMemory", "Probe", "ProbeCache", "TuneResult", "build_axes", "device_memory",
           "enumerate_space", "lab_measure", "lab_predictor", "micro_batches", "model_refusal", "parse_allow", "parse_budget", "probe_cache",
           "run_probe", "search", "slow_probe_limit", "tune"]
