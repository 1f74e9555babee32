"""``fasttrain bench lab``: the lecture's table of single-GPU techniques, measured on the lab's transformer.

One row per technique setting, each a :class:`~fasttrain.lab.config.LabConfig` override of one
baseline: the preset (``shakespeare-char`` by default) in fp32, eager attention, PyTorch's AdamW
(its default implementation: foreach on CUDA), batches from a ``DataLoader`` with 0 workers, no
checkpointing, no compilation, no PEFT (:data:`BASELINE` names every one of those switches).

Every row trains the same token budget: the baseline runs ``warmup + steps`` optimizer steps; a row
that moves ``f`` times fewer tokens per step runs ``f`` times more steps (and its learning-rate
warm-up is ``f`` times longer), so the validation loss is compared at equal tokens seen. The first
``warmup`` steps of every row are timed apart (compilation, autotuning, the allocator's growth);
tokens/s is over the other steps. The PEFT rows fine-tune a checkpoint the suite pretrains first
(the baseline's own model) and are compared with full fine-tuning of the same checkpoint.

A row that compiles (``torch_compile``) runs with empty compiler caches (inductor's and Triton's folders
fresh and empty, the in-memory caches cleared: :func:`empty_compiler_caches`), then builds and warms up once
more in the same process with those folders filled (:func:`warm_start_config`): its cold and warm compile
times (:func:`compile_metrics`) and the steps after which compiling has paid against its pair, for each
(:func:`breakeven_metric`).

Per row: speed ratio (tokens/s over the pair's), memory ratio (peak ``max_memory_allocated`` over
the pair's), the validation-loss change, measured ticks (:func:`tick`: speed "yes" at >= 1.10x,
memory "yes" at <= 0.90x), the lecture's ticks beside them and whether they agree. A technique's
verdict (:func:`technique_verdicts`) is "yes" when any of its rows measured "yes": the lecture's
"yes" means "this technique can buy it" (a smaller batch buys memory, a larger one speed).

A batch-size sweep on a larger preset (``char-100m``, bf16) doubles the batch until the GPU runs out
of memory (``torch.cuda.OutOfMemoryError``, caught in a probe), then bisects for the edge.

Results go through the bench's one output format: ``lab.json`` (a :class:`SuiteResult` whose cases
hold the lab's run records), the long CSV, ``lab.md`` and PNG plots (laid out by
:mod:`fasttrain.bench.lab_report`), written into a locked folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from fasttrain.bench.results import CaseResult, Progress, SuiteResult, utc_now
from fasttrain.errors import FasttrainError
from fasttrain.lab.experiments import experiment
from fasttrain.lab.experiments.experiment import Experiment
from fasttrain.lab.measure import forget_compiled_code
from fasttrain.lab.experiments.record_protocol import breakeven_steps, compile_seconds_of
from fasttrain.timing import summarize

SPEED_YES = 1.10          # tokens/s at least 1.10x the pair's: the technique buys speed
MEMORY_YES = 0.90         # peak allocated at most 0.90x the pair's: the technique buys memory
MIB = 2 ** 20

# the lecture's table: technique -> (training speed, memory); "no / yes": it depends (either agrees)
LECTURE: dict[str, tuple[str, str]] = {
    "batch size": ("yes", "yes"),
    "gradient accumulation": ("no", "yes"),
    "gradient checkpointing": ("no", "yes"),
    "mixed precision": ("yes", "no / yes"),
    "optimizers": ("yes", "yes"),
    "data preloading": ("yes", "no"),
    "torch_empty_cache_steps": ("no", "yes"),
    "torch.compile": ("yes", "no"),
    "PEFT": ("no", "yes"),
    "efficient kernels": ("yes", "yes"),
}

# the baseline's switches, named so that no row inherits a default by accident
BASELINE = dict(fp16=False, bf16=False, tf32=False, attn_implementation="eager", optim="adamw_torch",
                preload=False, dataloader_num_workers=0, dataloader_pin_memory=False,
                dataloader_prefetch_factor=None, gradient_checkpointing="none", gradient_accumulation_steps=1,
                torch_compile=False, torch_empty_cache_steps=0, use_liger_kernel=False, pad_vocab_to_multiple_of=0,
                lora_r=0, prompt_tuning_tokens=0, auto_find_batch_size=False)

SWEEP_PRESET = "char-100m"
SWEEP_START = 4
SWEEP_MAX = 4096
SWEEP_OVERRIDES = dict(bf16=True)     # the preset's eager attention: its s^2 scores bring the edge early
SWEEP_RUNG = "batch-size sweep"


@dataclass(frozen=True)
class LabRow(Experiment):
    """One setting (an :class:`~fasttrain.lab.experiments.experiment.Experiment`: ``overrides`` of the baseline,
    ``compared_with`` the row it is compared with, ``gpu_only`` why it does not run on the CPU);
    ``technique``: the lecture's row it measures; ``finetune``: it starts from the suite's pretrained
    checkpoint."""

    technique: str
    _: KW_ONLY
    compared_with: str | None = "baseline"
    finetune: bool = False


NEEDS_CUDA = "needs a CUDA GPU"


def lab_rows(batch: int) -> list[LabRow]:
    """The table's rows for a preset whose batch is ``batch`` (batch sizes are /4 and x4 of it)."""
    small, large = max(1, batch // 4), batch * 4
    return [
        LabRow("baseline", "baseline"),
        LabRow(f"batch {small}", "batch size", overrides={"per_device_train_batch_size": small}),
        LabRow(f"batch {large}", "batch size", overrides={"per_device_train_batch_size": large}),
        LabRow(f"accumulate 4 x {small}", "gradient accumulation",
               overrides={"per_device_train_batch_size": small, "gradient_accumulation_steps": 4}),
        LabRow("checkpointing full", "gradient checkpointing", overrides={"gradient_checkpointing": "full"}),
        LabRow("checkpointing selective", "gradient checkpointing",
               overrides={"gradient_checkpointing": "selective"}),
        LabRow("fp16", "mixed precision", overrides={"fp16": True},
               gpu_only=f"{NEEDS_CUDA} (fp16 autocast with a GradScaler is a GPU technique)"),
        LabRow("bf16", "mixed precision", overrides={"bf16": True}),
        LabRow("tf32", "mixed precision", overrides={"tf32": True}, gpu_only=f"{NEEDS_CUDA} (TF32 tensor cores)"),
        LabRow("adafactor", "optimizers", overrides={"optim": "adafactor"}),
        LabRow("adamw_8bit", "optimizers", overrides={"optim": "adamw_8bit"},
               gpu_only=f"{NEEDS_CUDA} (8-bit AdamW's kernels are CUDA)"),
        LabRow("sgd", "optimizers", overrides={"optim": "sgd"}),
        LabRow("preload", "data preloading", overrides={"preload": True}),
        LabRow("workers 2 + pin + prefetch", "data preloading",
               overrides={"dataloader_num_workers": 2, "dataloader_pin_memory": True,
                          "dataloader_prefetch_factor": 2},
               gpu_only=f"{NEEDS_CUDA} (pinned memory is for copies to a GPU)"),
        LabRow("empty cache every step", "torch_empty_cache_steps", overrides={"torch_empty_cache_steps": 1},
               gpu_only=f"{NEEDS_CUDA} (the CUDA caching allocator)"),
        LabRow("empty cache every 10", "torch_empty_cache_steps", overrides={"torch_empty_cache_steps": 10},
               gpu_only=f"{NEEDS_CUDA} (the CUDA caching allocator)"),
        LabRow("compile", "torch.compile", overrides={"torch_compile": True},
               gpu_only=f"{NEEDS_CUDA} here (compiling on the CPU takes minutes: not a smoke run)"),
        LabRow("compile reduce-overhead", "torch.compile",
               overrides={"torch_compile": True, "torch_compile_mode": "reduce-overhead"},
               gpu_only=f"{NEEDS_CUDA} (CUDA graphs)"),
        LabRow("full fine-tune", "PEFT", compared_with="full fine-tune", finetune=True),
        LabRow("LoRA r=8 qkv,proj", "PEFT", overrides={"lora_r": 8, "lora_target_modules": ("qkv", "proj")},
               compared_with="full fine-tune", finetune=True),
        LabRow("prompt tuning 16", "PEFT", overrides={"prompt_tuning_tokens": 16}, compared_with="full fine-tune",
               finetune=True),
        LabRow("sdpa attention", "efficient kernels", overrides={"attn_implementation": "sdpa"}),
        LabRow("liger kernels", "efficient kernels", overrides={"use_liger_kernel": True},
               gpu_only=f"{NEEDS_CUDA} (liger-kernel's kernels are Triton)"),
        LabRow("adamw fused", "efficient kernels", overrides={"optim": "adamw_torch_fused"}),
        LabRow("vocab padded to 64", "efficient kernels", overrides={"pad_vocab_to_multiple_of": 64}),
    ]


# --- ticks --------------------------------------------------------------------------------------

def tick(speed_ratio: float | None, memory_ratio: float | None) -> tuple[str | None, str | None]:
    """Measured ticks: speed "yes" when tokens/s >= SPEED_YES x the pair's, memory "yes" when the
    peak is <= MEMORY_YES x the pair's; None when the ratio was not measured (no GPU: no peak)."""
    speed = None if speed_ratio is None else ("yes" if speed_ratio >= SPEED_YES else "no")
    memory = None if memory_ratio is None else ("yes" if memory_ratio <= MEMORY_YES else "no")
    return speed, memory


def agrees(measured: str | None, lecture: str) -> bool | None:
    """Does a measured tick agree with the lecture's? ("no / yes" agrees with either; None: not measured)."""
    if measured is None:
        return None
    return measured in {word.strip() for word in lecture.split("/")}


def technique_verdicts(rows: list[dict]) -> list[dict]:
    """Per technique: "yes" when any of its rows measured "yes" (the technique can buy it), "no"
    when every measured row said "no", None when none was measured; and the lecture's tick beside.
    ``rows``: dicts with ``technique``, ``speed_tick``, ``memory_tick``."""
    out = []
    for technique, (lecture_speed, lecture_memory) in LECTURE.items():
        mine = [r for r in rows if r["technique"] == technique]
        verdict = {"technique": technique, "rows": len(mine),
                   "lecture_speed": lecture_speed, "lecture_memory": lecture_memory}
        for axis in ("speed", "memory"):
            ticks = [r[f"{axis}_tick"] for r in mine if r[f"{axis}_tick"] is not None]
            measured = None if not ticks else ("yes" if "yes" in ticks else "no")
            best = [r["label"] for r in mine if r[f"{axis}_tick"] == "yes"]
            verdict[axis] = measured
            verdict[f"{axis}_rows"] = best
            verdict[f"{axis}_agree"] = agrees(measured, verdict[f"lecture_{axis}"])
        out.append(verdict)
    return out


# --- the plan -----------------------------------------------------------------------------------

def select_rows(rows: list[LabRow], wanted: list[str] | None) -> list[LabRow]:
    """Rows whose label or technique contains one of ``wanted``; the pair rows the chosen ones need come along."""
    if not wanted:
        return list(rows)
    chosen = {r.label for r in rows if any(w.lower() in (r.label + " " + r.technique).lower() for w in wanted)}
    if not chosen and not any("sweep" in w.lower() for w in wanted):
        raise FasttrainError(f"--rows {','.join(wanted)}: no row label or technique contains that "
                             "(see fasttrain bench lab --list)")
    chosen |= {r.compared_with for r in rows if r.label in chosen}
    return [r for r in rows if r.label in chosen]


def sweep_selected(wanted: list[str] | None) -> bool:
    return not wanted or any("sweep" in w.lower() for w in wanted)


def row_config(base, row: LabRow, steps: int, warmup: int):
    """The row's LabConfig: the baseline with the row's overrides, trained on the baseline's token
    budget of ``(warmup + steps)`` steps; the learning-rate warm-up (a tenth of the budget) and the
    cosine decay are stretched in the same proportion, so every row sees the same schedule over tokens."""
    cfg = row.config(base)
    base_tokens = base.batch_tokens
    total_base = warmup + steps
    factor = base_tokens / cfg.batch_tokens
    # a row with f x the baseline's tokens per step runs 1/f the steps; it keeps at least one timed
    # step by shortening its warm-up, and only below 2 steps does it train more than the budget
    total = max(2, round(total_base * factor))
    lr_warmup = max(1, round(max(1, round(0.1 * total_base)) * factor))
    return cfg.with_(max_steps=total, warmup_steps=lr_warmup, timing_warmup_steps=min(warmup, total - 1),
                     log_interval=max(1, total // 100), eval_interval=0)


# --- figures from records -----------------------------------------------------------------------

def case_metrics(records: list[dict]) -> dict:
    """The case's figures across its runs (seeds)."""
    def entry(unit, values):
        return {"unit": unit, **summarize(values)}

    # one run: percentiles over its timed steps (n = steps); several: across the runs' medians (n = runs)
    if len(records) == 1:
        step_ms = {"unit": "ms", **{k: records[0]["step_ms"][k] for k in ("p20", "p50", "p80", "mean", "n")}}
    else:
        step_ms = entry("ms", [r["step_ms"]["p50"] for r in records])
    out = {
        "step_ms": step_ms,
        "tokens_per_s": entry("tokens/s", [r["tokens_per_s"] for r in records]),
        "warmup_ms": entry("ms", [sum(r["warmup_ms"]) for r in records]),
        "val_loss": entry("nats/char", [r["final"]["val_loss"] for r in records]),
        "peak_allocated": entry("MiB", [_mib(r["memory"]["peak_allocated_bytes"]) for r in records]),
        "peak_reserved": entry("MiB", [_mib(r["memory"]["peak_reserved_bytes"]) for r in records]),
        "estimate_precise": entry("MiB", [_mib(r["estimate"].get("precise_bytes")) for r in records]),
        "estimate_error": entry("%", [r["estimate"].get("error_pct") for r in records]),
    }
    return out


def _mib(value):
    return None if value is None else value / MIB


def _one(unit: str, value) -> dict:
    return {"unit": unit, "p20": value, "p50": value, "p80": value, "mean": value, "n": 0 if value is None else 1}


# --- compiling rows: cold and warm start ---------------------------------------------------------

COMPILER_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
NEVER = "never"     # the unit of a breakeven that never comes: the compiled step is not faster than its pair's
COMPILE_METRICS = ("compile_cold_s", "compile_warm_s")
BREAKEVEN_METRICS = ("breakeven_steps_cold", "breakeven_steps_warm")


@contextmanager
def empty_compiler_caches() -> Iterator[Path]:
    """Inside: inductor's and Triton's cache folders are new empty folders (``TORCHINDUCTOR_CACHE_DIR``,
    ``TRITON_CACHE_DIR``: inductor reads both when it compiles, and hands them to its compile workers with
    every job) and the in-memory caches are empty; on exit the variables are as they were (unset when they
    were: inductor sets them itself on its first compilation), the in-memory caches dropped again (they
    point into the folder) and the folder removed."""
    folder = Path(tempfile.mkdtemp(prefix="fasttrain-compile-cache-"))
    saved = {name: os.environ.get(name) for name in COMPILER_CACHE_ENV}
    for name, sub in zip(COMPILER_CACHE_ENV, ("inductor", "triton")):
        (folder / sub).mkdir()
        os.environ[name] = str(folder / sub)
    forget_compiled_code()
    try:
        yield folder
    finally:
        forget_compiled_code()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(folder, ignore_errors=True)


def warm_start_config(cfg, seed: int):
    """The warm start of a compiling row: the same model and compilation, trained only through its warm-up
    steps and one more (the run's smallest length), validated on one batch: only its warm-up time is read."""
    return cfg.with_(seed=seed, save=None, max_steps=cfg.timing_warmup_steps + 1, log_interval=1,
                     eval_tokens=cfg.context * (cfg.eval_batch_size or cfg.per_device_train_batch_size))


def run_compile_seconds(record: dict, ms_per_step: float | None) -> float | None:
    """A run's compile time: its warm-up steps' time less those steps at the steady step time."""
    warmup_ms = record.get("warmup_ms") or []
    if not warmup_ms:
        return None
    return compile_seconds_of(sum(warmup_ms) / 1e3, len(warmup_ms), ms_per_step)


def compile_metrics(case: CaseResult, warm_record: dict | None) -> dict:
    """``compile_cold_s`` (the row's first run, empty caches) and ``compile_warm_s`` (the warm start, caches
    filled), both counted against the row's steady step time (its ms/step p50)."""
    step_ms = case.metric("step_ms")
    cold = run_compile_seconds(case.records[0], step_ms) if case.records else None
    warm = None if warm_record is None else run_compile_seconds(warm_record, step_ms)
    return {"compile_cold_s": _one("s", cold), "compile_warm_s": _one("s", warm)}


def breakeven_metric(compile_s: float | None, pair_ms: float | None, mine_ms: float | None) -> dict:
    """Steps after which compiling has paid: compile_s / (pair's step time - this row's); unit :data:`NEVER`
    (no value) when the compiled step is not faster, no value when a figure is missing."""
    steps = breakeven_steps(compile_s, None if pair_ms is None else pair_ms / 1e3,
                            None if mine_ms is None else mine_ms / 1e3)
    if steps is not None and steps == float("inf"):
        return _one(NEVER, None)
    return _one("steps", steps)


def derive(result: SuiteResult) -> list[dict]:
    """Ratios, loss change and ticks of every row that ran, against its pair (stored in each
    case's metrics, so the CSV holds them); returns the row table as dicts."""
    by_label = {c.label: c for c in result.ran()}
    table = []
    for case in result.ran():
        if case.rung == SWEEP_RUNG:
            continue
        pair_label = case.options.get("_pair", "baseline")
        pair = by_label.get(pair_label)
        speed = memory = loss = None
        if pair is not None and pair is not case:
            speed = _ratio(case.metric("tokens_per_s"), pair.metric("tokens_per_s"))
            memory = _ratio(case.metric("peak_allocated"), pair.metric("peak_allocated"))
            a, b = case.metric("val_loss"), pair.metric("val_loss")
            loss = None if a is None or b is None else a - b
        speed_tick, memory_tick = tick(speed, memory) if pair is not case else (None, None)
        case.metrics["speed_ratio"] = _one("x", speed)
        case.metrics["memory_ratio"] = _one("x", memory)
        case.metrics["val_loss_change"] = _one("nats/char", loss)
        case.metrics["speed_tick"] = _one("yes=1", None if speed_tick is None else float(speed_tick == "yes"))
        case.metrics["memory_tick"] = _one("yes=1", None if memory_tick is None else float(memory_tick == "yes"))
        if "compile_cold_s" in case.metrics:
            mine = case.metric("step_ms")
            theirs = pair.metric("step_ms") if pair is not None and pair is not case else None
            for which in ("cold", "warm"):
                case.metrics[f"breakeven_steps_{which}"] = breakeven_metric(case.metric(f"compile_{which}_s"),
                                                                            theirs, mine)
        lecture = LECTURE.get(case.rung)
        table.append({"label": case.label, "technique": case.rung, "pair": pair_label, "speed_ratio": speed,
                      "memory_ratio": memory, "val_loss_change": loss, "speed_tick": speed_tick,
                      "memory_tick": memory_tick, "lecture": lecture,
                      "speed_agree": agrees(speed_tick, lecture[0]) if lecture else None,
                      "memory_agree": agrees(memory_tick, lecture[1]) if lecture else None, "case": case})
    return table


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


# --- running ------------------------------------------------------------------------------------

@dataclass
class LabPlan:
    preset: str
    steps: int
    warmup: int
    repeats: int
    rows: list[LabRow]
    sweep: bool
    sweep_steps: int
    data_dir: str | None = None
    device: str = "auto"
    model: str = "gpt"              # the LabConfig's --model: gpt (the lab's own) or hf:PATH_OR_NAME

    @property
    def model_label(self) -> str:
        """The table's ``model`` column: the preset for the lab's GPT, else the HF model's folder name."""
        if self.model == "gpt":
            return self.preset
        from pathlib import PurePath

        from fasttrain.lab.hf.config import HF_PREFIX, source_of

        return HF_PREFIX + PurePath(source_of(self.model).rstrip("/")).name


def _case(row_label: str, rung: str, model: str, cfg, status: str, reason: str | None = None,
          options: dict | None = None) -> CaseResult:
    return CaseResult(suite="lab", label=row_label, engine="lab", rung=rung, model=model,
                      precision=cfg.precision if cfg is not None else "fp32", options=options or {},
                      config=cfg.to_dict() if cfg is not None else {}, seed_ms=None, status=status, reason=reason,
                      timestamp=utc_now())


def _jsonable(overrides: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}


def run_lab(plan: LabPlan, *, progress: Progress | None = None, on_case: Callable[[SuiteResult], None] | None = None,
            command: str = "", corpus=None, runner=None) -> SuiteResult:
    """Run the plan's rows (and the sweep), ``plan.repeats`` seeds each; ``on_case(result)`` after
    every row (the CLI saves the results so far: a run cut short keeps its rows)."""
    from fasttrain.environment import environment
    from fasttrain.lab import train as lab_train
    from fasttrain.lab.config import preset
    from fasttrain.lab.data import load_corpus

    runner = runner or lab_train.run
    progress = progress or Progress()
    corpus = corpus or load_corpus(plan.data_dir)
    base = preset(plan.preset, **BASELINE, data_dir=plan.data_dir, device=plan.device, model=plan.model)
    cuda = lab_train.resolve_device(base).type == "cuda"
    result = SuiteResult("lab", title(plan.preset), False, command, utc_now(), dataset_info(corpus, plan),
                         environment(), plan.repeats, commands=[command] if command else [], baselines=["baseline"])
    # every row's configuration is built and validated before any row trains; one that cannot run here
    # (no CUDA GPU, a configuration this model refuses) is a skipped row of the table, with its reason
    rows = experiment.prepare(plan.rows, config=lambda row: row_config(base, row, plan.steps, plan.warmup),
                              cuda=cuda, skip=True)
    runnable = [p.experiment for p in rows if p.unable is None]
    runs = sum(len(p.experiment.seed_list(p.config, plan.repeats)) for p in rows if p.unable is None)
    progress.start(runs + (1 if plan.sweep else 0), "lab")
    workdir = Path(tempfile.mkdtemp(prefix="fasttrain-bench-lab-"))
    checkpoint = workdir / "pretrained"
    needs_checkpoint = any(r.finetune for r in runnable)

    def skipped(row: LabRow, cfg, reason: str) -> CaseResult:
        progress.log(f"[yellow]skip[/] lab {row.label}: {reason}")
        return _case(row.label, row.technique, plan.model_label, cfg, "skipped", reason, _options(row))

    def run_row(row: LabRow, cfg) -> CaseResult:
        if row.finetune:
            if not checkpoint.exists():
                _pretrain(base, plan, checkpoint, corpus, runner, progress)
            # the lab's GPT fine-tunes its checkpoint; a HF model loads the saved folder as its model
            cfg = cfg.with_(init_from=str(checkpoint)) if plan.model == "gpt" else \
                cfg.with_(model=f"hf:{checkpoint}")
        elif row.label == "baseline" and needs_checkpoint:
            cfg = cfg.with_(save=str(checkpoint))     # the baseline's model is the PEFT rows' checkpoint
        seeds = row.seed_list(cfg, plan.repeats)
        if cfg.torch_compile:
            return _run_compiling_row(row.label, row.technique, plan.model_label, cfg, _options(row), seeds,
                                      corpus, runner, progress)
        return _run_row(row.label, row.technique, plan.model_label, cfg, _options(row), seeds, corpus, runner,
                        progress)

    def finished(row: LabRow, case: CaseResult) -> None:
        result.cases.append(case)
        if on_case:     # the results so far: a run cut short keeps its rows
            derive(result)
            on_case(result)

    try:
        experiment.run(rows, run_row, skipped=skipped, on_row=finished)
        if plan.sweep:
            _sweep(plan, result, corpus, runner, progress, cuda, on_case)
    finally:
        progress.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    derive(result)
    return result


def _options(row: LabRow) -> dict:
    """The case's options: the row's overrides and the row it is compared with."""
    return {**_jsonable(row.overrides), "_pair": row.compared_with}


def _pretrain(base, plan: LabPlan, checkpoint: Path, corpus, runner, progress: Progress) -> None:
    cfg = row_config(base, LabRow("pretrain", "PEFT"), plan.steps, plan.warmup).with_(save=str(checkpoint))
    progress.describe("lab: pretraining the checkpoint the PEFT rows fine-tune")
    runner(cfg, corpus=corpus)
    progress.log(f"pretrained {cfg.max_steps} steps -> the PEFT rows' checkpoint")


def _run_row(label, technique, model, cfg, options, seeds, corpus, runner, progress: Progress) -> CaseResult:
    from fasttrain.bench.device import release_memory

    out = _case(label, technique, model, cfg, "ok", options=options)
    for i, seed in enumerate(seeds):

        clock = {}

        def step_progress(step, steps, loss=None, i=i):
            # the row's step, its newest logged loss and tokens/s since its first step (the bar's own
            # columns give the rows done and the time left)
            now = time.perf_counter()
            clock.setdefault("first", (step, now))
            first_step, t0 = clock["first"]
            speed = (step - first_step) * cfg.batch_tokens / (now - t0) if now > t0 else None
            if step == 1 or step % 10 == 0 or step == steps:
                progress.describe(f"lab: {label} (seed {seed}) step {step}/{steps}"
                                  + (f"  loss {loss:.3f}" if loss is not None else "")
                                  + (f"  {speed:,.0f} tok/s" if speed else ""))
        step_progress.takes_loss = True

        try:
            record = runner(cfg.with_(seed=seed, save=cfg.save if i == 0 else None), corpus=corpus,
                            progress=step_progress)
        except FasttrainError as exc:
            release_memory()
            out.status, out.reason = "skipped", str(exc)
            progress.log(f"[yellow]skip[/] lab {label}: {exc}")
            progress.advance(len(seeds) - i)
            return out
        except Exception as exc:  # noqa: BLE001 - one broken row must not lose the rest of the table
            import traceback

            release_memory()
            out.status, out.reason = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0]
            out.traceback = traceback.format_exc()
            progress.log(f"[red]FAILED[/] lab {label}: {out.reason}")
            progress.advance(len(seeds) - i)
            return out
        out.seeds.append(seed)
        out.records.append(record)
        del record
        release_memory()
        progress.advance()
    out.config = cfg.with_(save=None, init_from=None).to_dict() | {"init_from": "pretrained" if cfg.init_from else None}
    out.metrics = case_metrics(out.records)
    peak = out.metric("peak_allocated")
    progress.log(f"[green]ok[/] lab {label}: {_fmt(out.metric('tokens_per_s'))} tokens/s, "
                 f"step p50 {_fmt(out.metric('step_ms'))} ms"
                 + (f", peak {_fmt(peak)} MiB" if peak is not None else "")
                 + f", val loss {out.metric('val_loss'):.4f}")
    return out


def _run_compiling_row(label, technique, model, cfg, options, seeds, corpus, runner,
                       progress: Progress) -> CaseResult:
    """A compiling row: its runs with empty compiler caches (the first run's warm-up is the cold start), then
    its warm start with the caches those runs filled, read from the folders alone (the in-memory caches
    dropped first, as a new process would find them)."""
    from fasttrain.bench.device import release_memory

    warm = None
    with empty_compiler_caches():
        case = _run_row(label, technique, model, cfg, options, seeds, corpus, runner, progress)
        if case.ok:
            forget_compiled_code()
            progress.describe(f"lab: {label}: warm start (compiler caches filled)")
            try:
                warm = runner(warm_start_config(cfg, seeds[0]), corpus=corpus)
            except Exception as exc:  # noqa: BLE001 - the row's own figures stand without its warm start
                progress.log(f"[yellow]no warm start[/] lab {label}: {f'{type(exc).__name__}: {exc}'.splitlines()[0]}")
            finally:
                release_memory()
    if case.ok:
        case.metrics.update(compile_metrics(case, warm))
        progress.log(f"lab {label}: compile {_fmt(case.metric('compile_cold_s'))} s cold, "
                     f"{_fmt(case.metric('compile_warm_s'))} s warm")
    return case


def _fmt(v) -> str:
    from fasttrain.bench.tables import fmt_num

    return fmt_num(v)


def _sweep(plan: LabPlan, result: SuiteResult, corpus, runner, progress: Progress, cuda: bool, on_case) -> None:
    """Throughput against batch size on the sweep preset: double from SWEEP_START while a two-step
    probe fits, run each that fits, then bisect between the last fit and the first
    out-of-memory to within an eighth."""
    from fasttrain.bench.device import release_memory
    from fasttrain.lab import batchsize
    from fasttrain.lab import train as lab_train
    from fasttrain.lab.config import preset

    sweep_base = preset(SWEEP_PRESET, **{**BASELINE, **SWEEP_OVERRIDES}, data_dir=plan.data_dir, device=plan.device)
    warm = min(plan.warmup, 3)
    if not cuda:
        reason = "the batch-size sweep needs a CUDA GPU (nothing runs out of memory here)"
        progress.log(f"[yellow]skip[/] lab sweep: {reason}")
        result.cases.append(_case("sweep", SWEEP_RUNG, SWEEP_PRESET, sweep_base, "skipped", reason))
        progress.advance()
        return
    device = lab_train.resolve_device(sweep_base)
    last_fit, first_oom = 0, None
    batch = SWEEP_START
    while batch <= SWEEP_MAX:
        cfg = sweep_base.with_(per_device_train_batch_size=batch, max_steps=warm + plan.sweep_steps,
                               timing_warmup_steps=warm, warmup_steps=1, eval_interval=0, eval_tokens=8 * sweep_base.context,
                               eval_batch_size=min(batch, 8), log_interval=1)
        progress.describe(f"lab: sweep {SWEEP_PRESET} batch {batch}: probing")
        if not batchsize.probe_batch(cfg, corpus, device):
            first_oom = batch
            break
        label = f"sweep batch {batch}"
        case = _run_row(label, SWEEP_RUNG, SWEEP_PRESET, cfg, {"per_device_train_batch_size": batch}, [cfg.seed],
                        corpus, runner, Progress())
        result.cases.append(case)
        if case.ok:
            last_fit = batch
            progress.log(f"[green]ok[/] lab sweep batch {batch}: {_fmt(case.metric('tokens_per_s'))} tokens/s, "
                         f"peak {_fmt(case.metric('peak_allocated'))} MiB")
        else:
            first_oom = batch
            break
        if on_case:
            on_case(result)
        batch *= 2
        release_memory()
    # the edge: bisect between the last batch that fit and the first that did not
    if first_oom is not None and last_fit:
        lo, hi = last_fit, first_oom
        while hi - lo > max(1, lo // 8):
            mid = (lo + hi) // 2
            progress.describe(f"lab: sweep edge, probing batch {mid}")
            if batchsize.probe_batch(sweep_base.with_(per_device_train_batch_size=mid), corpus, device):
                lo = mid
            else:
                hi = mid
        reason = (f"torch.cuda.OutOfMemoryError at batch {first_oom}; the largest batch that fits is in "
                  f"[{lo}, {hi}) (bisected by two-step probes)")
        edge = _case("sweep out-of-memory edge", SWEEP_RUNG, SWEEP_PRESET,
                     sweep_base.with_(per_device_train_batch_size=first_oom), "oom", reason,
                     {"first_oom": first_oom, "largest_fit": lo, "first_oom_bisected": hi})
        result.cases.append(edge)
        progress.log(f"[yellow]edge[/] lab sweep: {reason}")
    elif first_oom is None:
        progress.log(f"lab sweep: no out-of-memory up to batch {SWEEP_MAX}")
    progress.advance()
    if on_case:
        on_case(result)


def title(preset_name: str) -> str:
    return f"The lecture's table, measured: {preset_name}, every technique against one baseline"


def dataset_info(corpus, plan: LabPlan) -> dict:
    """The data and the setting of the run (two runs merge only when they agree on both)."""
    tokenizer = getattr(corpus, "tokenizer", None)
    unit = "characters" if getattr(corpus, "chars", None) is not None else "tokens"
    return {"name": "tinyshakespeare", "n_train": int(len(corpus.train)), "n_test": int(len(corpus.val)),
            "unit": unit, **({"tokenizer": tokenizer.describe()} if unit == "tokens" and tokenizer is not None else {}), "preset": plan.preset, "steps": plan.steps, "warmup": plan.warmup,
            "sweep_preset": SWEEP_PRESET, "sweep_steps": plan.sweep_steps,
            **({"model": plan.model} if plan.model != "gpt" else {})}


def sweep_edge(result: SuiteResult) -> CaseResult | None:
    return next((c for c in result.cases if c.rung == SWEEP_RUNG and c.status == "oom"), None)


def sweep_cases(result: SuiteResult) -> list[CaseResult]:
    return sorted((c for c in result.ran() if c.rung == SWEEP_RUNG),
                  key=lambda c: c.options.get("per_device_train_batch_size", 0))


__all__ = ["LECTURE", "BASELINE", "SPEED_YES", "MEMORY_YES", "LabRow", "LabPlan", "lab_rows", "tick", "agrees",
           "technique_verdicts", "run_lab", "derive"]
