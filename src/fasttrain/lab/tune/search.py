"""The search, pure: prediction, measurement and the clock are injected (tests run it with fakes)."""

from __future__ import annotations

import inspect
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from fasttrain.errors import FasttrainError
from fasttrain.lab.experiments import experiment
from fasttrain.lab.config import LabConfig, validate
from fasttrain.lab.experiments.experiment import Experiment
from fasttrain.lab.tune.device import DeviceMemory, ProbeCache
from fasttrain.lab.tune.probes import warmup_steps_for
from fasttrain.lab.tune.space import Candidate, ScaleConfig, build_axes, enumerate_space
from fasttrain.lab.tune.space import MIB, OPT_IN, PARTIAL_PREFIX, Probe


# a probe is stopped once it has run SLOW_GRACE_S (a model's build and compilation) plus SLOW_FACTOR times what its
# steps would take at the best speed measured so far: one that slow cannot win, and a pathological configuration
# (minutes a step) must not spend the budget
SLOW_FACTOR = 4.0
SLOW_GRACE_S = 90.0

BUDGET_ENDS = "the budget ends"
CPU_NOTE = "timings on a CPU do not transfer to a GPU: this run checks the search, not what a GPU would pick"




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
    fixed: tuple = ()               # the settings the user gave (tune kept them; its answer says them)
    family: str | None = None       # the transformers family (None: the lab's GPT): the answer's FSDP wrapping unit


def slow_probe_limit(cfg: LabConfig, steps: int, best_tokens_per_s: float) -> tuple[float, str]:
    """The time a probe of ``cfg`` may take when the best speed measured so far is ``best_tokens_per_s``:
    SLOW_GRACE_S + SLOW_FACTOR x its steps (warm-up included) at that speed; and why it would be stopped."""
    n = steps + warmup_steps_for(cfg)
    at_best = n * tokens_per_step(cfg) / best_tokens_per_s
    return (SLOW_GRACE_S + SLOW_FACTOR * at_best,
            f"more than {SLOW_FACTOR:.0f}x slower than the best so far, {best_tokens_per_s:,.0f} tokens/s")


def tokens_per_step(cfg: LabConfig) -> int:
    """Tokens per optimizer step over every data-parallel rank (one process: ``b k seq``)."""
    dp = cfg.dp if isinstance(cfg, ScaleConfig) else 1       # a ScaleConfig's data-parallel ranks
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.context * dp


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


def _offload_where_needed(entries: list[Entry], memory: DeviceMemory, dropped: list) -> list[Entry]:
    """The optimizer state on the host costs a step its copies over PCIe: searched only where no configuration
    keeping it on the GPUs is predicted to fit."""
    def offload(e: Entry) -> bool:
        return dict(e.candidate.settings).get("strategy", "").endswith("offload")
    if any(memory.fits(e.predicted_bytes) for e in entries if not offload(e)):
        kept = [e for e in entries if not offload(e)]
        if len(kept) < len(entries):
            dropped.append("fsdp-offload: other strategies are predicted to fit; the optimizer state stays on the GPUs")
        return kept
    return entries


def _recomputed_blocks(e: Entry, layers: int) -> int:
    o = dict(e.candidate.overrides)
    if o.get("gradient_checkpointing", "none") != "full":
        return 0
    return o.get("checkpoint_blocks") or layers


def _fewest_recomputed(entries: list[Entry], memory: DeviceMemory, layers: int | None, dropped: list) -> list[Entry]:
    """Partial checkpointing (the first k blocks recompute) is searched only where nothing recomputing fewer
    blocks fits: of configurations equal but for it, a partial one is kept when it recomputes the fewest blocks
    of those predicted to fit -- recomputing one block more only costs its forward again."""
    if not layers:
        return entries

    def partial(e: Entry) -> bool:
        return dict(e.candidate.settings).get("checkpointing", "").startswith(PARTIAL_PREFIX)

    def rest(e: Entry):
        c = e.candidate
        return tuple(x for x in c.settings if x[0] != "checkpointing"), c.micro_batch, c.accumulation
    fewest: dict = {}
    for e in entries:
        if memory.fits(e.predicted_bytes):
            key = rest(e)
            fewest[key] = min(fewest.get(key, layers + 1), _recomputed_blocks(e, layers))
    kept = [e for e in entries if not partial(e) or _recomputed_blocks(e, layers) == fewest.get(rest(e))]
    if len(kept) < len(entries):
        dropped.append(f"partial checkpointing: {len(entries) - len(kept)} configuration(s) where fewer recomputed "
                       f"blocks fit, or none of them fits")
    return kept


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
           refuse: Callable[[LabConfig], str | None] | None = None, nproc: int = 1, strategies=None,
           layers: int | None = None) -> TuneResult:
    """Search the space of ``base`` (see the module docstring); ``measure(cfg, steps) -> Probe`` runs
    one probe, ``predict(cfg) -> bytes | None`` the estimator's peak; ``refuse(cfg)``: why the model cannot
    run a configuration (:func:`model_refusal`), None where it can.

    ``steps``: timed steps of the first rung; ``max_candidates``: configurations that enter the
    halving when the space is larger (then a one-change-at-a-time screen chooses them);
    ``batch_choices``: micro-batches per setting kept (the largest that fit, by prediction); ``nproc`` > 1:
    the strategy axis over that many ranks (:mod:`.scale`), every prediction per GPU, ``measure`` a probe of
    that many processes, tokens/s those of the world."""
    log = log or (lambda line: None)
    free = free or (lambda: None)
    check_shape(seq, global_batch_tokens)
    if steps < 1:
        raise FasttrainError(f"probe steps must be >= 1, got {steps}")
    if budget_s is not None and budget_s <= 0:
        raise FasttrainError(f"--budget must be positive, got {budget_s}")
    cuda = not memory.cpu
    if nproc > 1:
        from fasttrain.lab.tune.space import scaled

        base = base if isinstance(base, ScaleConfig) else scaled(base, nproc)
    base = validate(base.with_(context=seq))
    axes, dropped = build_axes(base, cuda=cuda, family=family, allow=allow, precisions=precisions, fixed=fixed,
                               liger_reason=liger_reason, hf=hf, nproc=nproc, layers=layers,
                               strategies=strategies)
    notes = [] if cuda else [CPU_NOTE]
    sequences = global_batch_tokens // seq
    space = enumerate_space(axes, sequences, fixed_batch, nproc=nproc)
    t0 = clock()
    entries = []
    # every configuration of the space built through the one parser and validated before any probe (the
    # experiments' prepare); one the model refuses is dropped with its reason. The probes themselves are not
    # the experiments' rows run once each: successive halving measures a candidate again at more steps.
    rows = [Experiment(cand.label, overrides=cand.overrides_dict()) for cand in space]
    refused: dict[str, int] = {}
    row_config = None
    if nproc > 1:
        from fasttrain.lab.tune.space import scaled_row_config

        row_config = scaled_row_config(base)
    for cand, row in zip(space, experiment.prepare(rows, base, skip=True, config=row_config)):
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
    entries = _fewest_recomputed(entries, memory, layers, dropped)
    if nproc > 1:
        entries = _offload_where_needed(entries, memory, dropped)
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
                      probes_measured=search.measured, probes_cached=search.cached, loss_step=loss_step, mode=mode,
                      fixed=tuple(sorted(fixed)))


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
