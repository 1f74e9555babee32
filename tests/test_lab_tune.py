"""``fasttrain tune`` on the CPU: the search with fake probes of known speeds and memory (pruning by the
estimator, successive halving, the cache, out-of-memory above a fake allocator limit, the budget with a
fake clock), every bad input, the answer's forms (lab command line, TrainingArguments), and a real run
through the lab's trainer on a tiny model."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from tests_support import fasttrain_in_process, one_line_error, run_cli, toy_text  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab.cli import config_from  # noqa: E402
from fasttrain.lab.config import LabConfig, preset, validate  # noqa: E402
from fasttrain.lab import tune as T  # noqa: E402
from fasttrain.lab.tune import report as R  # noqa: E402

MIB = 2 ** 20
SEQ = 32


def base(**kw):
    return preset("tiny", device="cpu", **kw)


def fake_predict(cfg):
    """Bytes a configuration would take: 100 MiB + per sequence 40 MiB (eager) or 20 (sdpa), /4 with full
    checkpointing."""
    per = 40 if cfg.attn_implementation == "eager" else 20
    if cfg.gradient_checkpointing == "full":
        per /= 4
    return int((100 + per * cfg.per_device_train_batch_size) * MIB)


def fake_speed(cfg):
    """Known speeds: sdpa 1.5x, fused AdamW 1.2x, preload 1.1x, checkpointing 0.7x (full), larger micro-batches
    faster up to 8."""
    s = 1000.0 * min(cfg.per_device_train_batch_size, 8) ** 0.5
    s *= 1.5 if cfg.attn_implementation == "sdpa" else 1.0
    s *= 1.2 if cfg.optim == "adamw_torch_fused" else 1.0
    s *= 1.1 if cfg.preload else 1.0
    s *= {"none": 1.0, "selective": 0.9, "full": 0.7}[cfg.gradient_checkpointing]
    return s


class FakeMeasure:
    """``measure(cfg, steps)``: the known speed, the predicted peak as the measured one; counts its calls.
    ``limit``: a fake allocator limit above which it raises the CUDA out-of-memory error; ``clock``: a
    fake clock it advances by ``cost`` seconds a probe."""

    def __init__(self, limit=None, clock=None, cost=10.0):
        self.calls = []
        self.limit, self.clock, self.cost = limit, clock, cost

    def __call__(self, cfg, steps):
        self.calls.append((cfg, steps))
        if self.clock is not None:
            self.clock.now += self.cost
        peak = fake_predict(cfg)
        if self.limit is not None and peak > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {peak} bytes")
        return T.Probe(steps=steps, tokens_per_s=fake_speed(cfg), peak_bytes=peak, reserved_bytes=peak,
                       losses=[3.0 - 0.01 * i for i in range(steps + 2)])


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def gpu_memory(total_mib=1000):
    # a pretend GPU: the axes of a GPU (compile, liger...) take part; the speeds are the fakes'
    return T.DeviceMemory("fake GPU", total_mib * MIB, context_bytes=50 * MIB, reserve=0.0, cpu=False)


def run_search(measure, memory=None, **kw):
    kw.setdefault("liger_reason", None)
    kw.setdefault("cache_path", None)
    return T.tune(base(), seq=SEQ, global_batch_tokens=SEQ * 16, measure=measure, predict=fake_predict,
                  memory=memory or gpu_memory(), **kw)


# --- the space -----------------------------------------------------------------------------------

def test_space_keeps_the_math_by_default_and_opt_in_adds_techniques():
    axes, dropped = T.build_axes(base(), cuda=True, liger_reason=None)
    names = [a.name for a in axes]
    assert names == ["precision", "attention", "compile", "checkpointing", "liger", "optimizer", "data"]
    assert not any(a.changes_math for a in axes)
    space = T.enumerate_space(axes, 16)
    # every candidate reaches the global batch exactly: b k = 16 sequences of SEQ
    assert {c.micro_batch * c.accumulation for c in space} == {16}
    assert {c.micro_batch for c in space} == {1, 2, 4, 8, 16}
    assert not any(dict(c.overrides).get("lora_r") for c in space)
    axes, _ = T.build_axes(base(), cuda=True, allow="lora,adamw_8bit", liger_reason=None)
    assert "adapter" in [a.name for a in axes]
    assert [c for c, _ in axes[[a.name for a in axes].index("optimizer")].choices][-1] == "adamw_8bit"
    # selective checkpointing with sdpa is the plain sdpa configuration: not searched twice
    labels = {dict(c.choices)["checkpointing"] for c in space if dict(c.choices)["attention"] == "sdpa"}
    assert labels == {"none", "full"}


def test_fixed_settings_are_not_searched():
    axes, dropped = T.build_axes(base(), cuda=True, fixed={"attn_implementation", "optim"}, liger_reason=None)
    by_name = {a.name: a for a in axes}
    assert len(by_name["attention"].choices) == 1 and len(by_name["optimizer"].choices) == 1
    assert any("fixed by you (--attn-implementation)" in d for d in dropped)


def test_cpu_drops_compile_and_liger_with_one_line_each():
    axes, dropped = T.build_axes(base(), cuda=False, liger_reason=None)
    names = [a.name for a in axes]
    assert "compile" not in names and "liger" not in names
    assert sum("torch.compile" in d for d in dropped) == 1 and sum("liger-kernel" in d for d in dropped) == 1


def test_a_family_liger_cannot_patch_drops_the_axis():
    pytest.importorskip("liger_kernel")
    assert T.liger_support("llama") is None
    reason = T.liger_support("gpt2")
    assert reason and "gpt2" in reason
    axes, dropped = T.build_axes(base(), cuda=True, family="gpt2")
    assert "liger" not in [a.name for a in axes]
    assert [d for d in dropped if "liger" in d] == [f"liger-kernel: {reason}; dropped"]


def test_a_transformers_family_liger_cannot_patch_searches_its_fused_cross_entropy():
    """GPT-2 from transformers: liger's fused linear cross-entropy alone on its head (the lab's forward) is searched,
    said in one line; liger's other kernels are not; what the lab would refuse of it is not in the space."""
    pytest.importorskip("liger_kernel")
    assert T.liger_support("gpt2", "fused_linear_cross_entropy") is None
    axes, dropped = T.build_axes(base(), cuda=True, family="gpt2", hf=True)
    (liger,) = [a for a in axes if a.name == "liger"]
    assert liger.choices == (("off", {"use_liger_kernel": False, "liger_kernels": "all"}),
                             ("fused-ce", {"use_liger_kernel": True, "liger_kernels": "fused_linear_cross_entropy"}))
    assert [d for d in dropped if "liger" in d] == [
        f"liger-kernel: {T.liger_support('gpt2')}; its fused linear cross-entropy alone (on the model's head) searched"]
    gpt2 = dict(model_type="gpt2", vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    refuse = T.model_refusal(gpt2, torch.device("cuda"))
    space = T.enumerate_space(axes, 16)
    fused = [c for c in space if dict(c.choices)["liger"] == "fused-ce"]
    assert {dict(c.choices)["compile"] for c in fused} == {"none", "default", "reduce-overhead", "block"}
    assert all(refuse(base(context=64, model="hf:x").with_(**c.overrides_dict())) is None for c in fused)
    assert refuse(base(context=64, model="hf:x", use_liger_kernel=True)).startswith("liger-kernel")


def test_the_space_offers_cuda_graphs_for_the_step_on_a_gpu():
    """reduce-overhead (CUDA graphs of the compiled forward and backward: the lab's batches have fixed shapes) is a
    choice of the compile axis on a GPU, at every micro-batch, accumulation included: the trainer keeps the
    gradients allocated between a step's micro-batches so that each graph replay adds into them
    (``Trainer.keep_grads``); the cudagraphs backend takes the default mode only, so a user's fixed backend leaves
    it out before any probe."""
    axes, _ = T.build_axes(base(), cuda=True, liger_reason=None)
    (compile_axis,) = [a for a in axes if a.name == "compile"]
    assert ("reduce-overhead", {"torch_compile": True, "torch_compile_mode": "reduce-overhead"}) in compile_axis.choices
    graphs = [c for c in T.enumerate_space(axes, 16) if dict(c.choices)["compile"] == "reduce-overhead"]
    assert {c.accumulation for c in graphs} == {1, 2, 4, 8, 16}
    res = T.search(base(torch_compile_backend="cudagraphs"), seq=SEQ, global_batch_tokens=SEQ * 16,
                   measure=FakeMeasure(), predict=fake_predict, memory=gpu_memory(), liger_reason=None,
                   fixed={"torch_compile_backend"}, steps=1, max_candidates=4)
    assert not any(dict(e.candidate.choices)["compile"] == "reduce-overhead" for e in res.entries)
    assert any("reduce-overhead" in d and "cudagraphs backend takes the default mode" in d for d in res.dropped)


# --- predict, then measure -----------------------------------------------------------------------

def test_the_estimator_prunes_before_anything_is_measured():
    measure = FakeMeasure()
    memory = gpu_memory(400)          # 50 MiB taken: eager fits up to 6 sequences, sdpa up to 12
    res = run_search(measure, memory)
    assert res.pruned > 0
    assert measure.calls, "the survivors are measured"
    for cfg, _ in measure.calls:
        assert memory.need(fake_predict(cfg)) <= memory.total_bytes, cfg
    # the largest that fit were measured: eager at 4 (8 does not fit), sdpa at 8 (16 does not)
    eager = {c.per_device_train_batch_size for c, _ in measure.calls if c.attn_implementation == "eager"
             and c.gradient_checkpointing == "none"}
    assert max(eager) == 4


def test_successive_halving_keeps_the_best_and_gives_bad_ones_fewer_steps():
    measure = FakeMeasure()
    # a small space: everything fixed but attention, checkpointing and the micro-batch
    fixed = {"optim", "preload", "dataloader_num_workers", "use_liger_kernel", "torch_compile", "bf16"}
    res = run_search(measure, gpu_memory(4000), fixed=fixed, max_candidates=16, steps=2)
    assert res.mode == "halving"
    best = max((validate(res.base.with_(**e.candidate.overrides_dict())) for e in res.entries),
               key=fake_speed)
    assert res.pick.candidate.overrides_dict()["attn_implementation"] == best.attn_implementation == "sdpa"
    assert res.pick.candidate.micro_batch >= 8
    worst = min((e for e in res.entries if e.ok), key=lambda e: e.last.tokens_per_s)
    assert worst.steps_measured < res.pick.steps_measured
    assert len(res.pick.probes) >= 3          # rungs of 2, 4, 8 steps
    assert [p.steps for p in res.pick.probes] == [2 * 2 ** i for i in range(len(res.pick.probes))]


def test_large_space_is_screened_then_halved_and_the_pick_is_the_known_best():
    measure = FakeMeasure()
    res = run_search(measure, gpu_memory(4000), steps=2)
    assert res.mode == "screen + halving"
    assert len(measure.calls) < res.space_size / 4           # far fewer probes than configurations
    cfg = res.base.with_(**res.pick.candidate.overrides_dict())
    assert (cfg.attn_implementation, cfg.optim, cfg.preload, cfg.gradient_checkpointing) == \
        ("sdpa", "adamw_torch_fused", True, "none")
    assert res.pick.candidate.micro_batch >= 8
    assert res.baseline is not None and res.baseline.ok
    assert dict(res.baseline.candidate.settings)["attention"] == "eager"


def test_out_of_memory_is_recorded_freed_and_the_search_goes_on():
    frees = []
    # the estimator says 16 eager sequences fit (740 MiB < 950) but the (fake) allocator stops at 500 MiB
    measure = FakeMeasure(limit=500 * MIB)
    fixed = {"optim", "preload", "dataloader_num_workers", "use_liger_kernel", "torch_compile", "bf16",
             "gradient_checkpointing"}
    res = run_search(measure, gpu_memory(1000), fixed=fixed, max_candidates=16, free=lambda: frees.append(1))
    ooms = [e for e in res.entries if e.probes and e.last.oom]
    assert ooms and frees and len(frees) == len(ooms)
    assert res.pick is not None and res.pick.ok and fake_predict(
        res.base.with_(**res.pick.candidate.overrides_dict())) <= 500 * MIB
    rows = R.ranked_rows(res)
    assert any(r["status"] == "out of memory" for r in rows)


def test_out_of_memory_skips_larger_micro_batches_of_the_same_settings():
    measure = FakeMeasure(limit=300 * MIB)
    fixed = {"optim", "preload", "dataloader_num_workers", "use_liger_kernel", "torch_compile", "bf16",
             "gradient_checkpointing", "attn_implementation"}
    res = run_search(measure, gpu_memory(2000), fixed=fixed, max_candidates=16, batch_choices=5)
    # eager: 100 + 40 b MiB; 300 MiB stops b = 8 and 16; only one of them is tried
    tried = sorted(c.per_device_train_batch_size for c, _ in measure.calls)
    assert tried.count(8) + tried.count(16) == 1
    assert any(e.skipped for e in res.entries)


def test_the_budget_answers_with_the_best_so_far():
    clock = Clock()
    measure = FakeMeasure(clock=clock, cost=10.0)
    res = run_search(measure, gpu_memory(4000), budget="35s", clock=clock, steps=2)
    assert res.budget_hit
    assert len(measure.calls) == 4            # probes start at 0, 10, 20, 30 s; none at 40
    assert res.pick is not None
    measured = [e for e in res.entries if e.ok]
    assert res.pick.last.tokens_per_s == max(e.last.tokens_per_s for e in measured)


class StoppableMeasure(FakeMeasure):
    """A measure that can be stopped: ``slow`` configurations take ``slow_cost`` seconds of the fake clock, or
    the time they are allowed when that is less (then they come back stopped)."""

    def __init__(self, clock, cost=10.0, slow=lambda cfg: False, slow_cost=1000.0):
        super().__init__(clock=clock, cost=cost)
        self.slow, self.slow_cost, self.allowed = slow, slow_cost, []

    def __call__(self, cfg, steps, time_allowed_s=None):
        self.allowed.append(time_allowed_s)
        if not self.slow(cfg):
            return super().__call__(cfg, steps)
        self.calls.append((cfg, steps))
        if time_allowed_s is not None and time_allowed_s < self.slow_cost:
            self.clock.now += time_allowed_s
            return T.Probe(steps=steps, stopped=True, error=f"stopped after {time_allowed_s:.0f} s")
        self.clock.now += self.slow_cost
        return T.Probe(steps=steps, tokens_per_s=1.0, peak_bytes=fake_predict(cfg))


def test_a_probe_far_slower_than_the_best_is_stopped_and_not_cached(tmp_path):
    """A configuration whose steps take minutes (reduce-overhead recording a graph a micro-batch, seen on the H100)
    is stopped at SLOW_GRACE_S + SLOW_FACTOR x its steps at the best speed so far; the search goes on, and the
    stopped probe is not cached (a second call measures it again)."""
    clock = Clock()
    slow = lambda cfg: cfg.optim == "adamw_torch_fused"     # noqa: E731 - the pathological axis choice
    measure = StoppableMeasure(clock, slow=slow)
    cache = tmp_path / "cache.json"
    res = run_search(measure, gpu_memory(4000), clock=clock, steps=3, cache_path=cache)
    stopped = [e for e in res.entries if e.probes and e.last.stopped]
    assert stopped and all("slower than the best so far" in e.last.error for e in stopped)
    assert all(not e.ok for e in stopped) and res.pick is not None and res.pick.ok
    assert clock.now < 1000.0                   # none ran its 1000 s
    first = [a for a in measure.allowed if a is not None][0]
    assert T.SLOW_GRACE_S < first < 1000.0
    cached = json.loads(cache.read_text())["probes"].values()
    assert cached and not any(p["stopped"] or p["error"] for p in cached)
    again = StoppableMeasure(Clock(), slow=slow)
    run_search(again, gpu_memory(4000), clock=again.clock, steps=3, cache_path=cache)
    assert again.calls and all(slow(c) for c, _ in again.calls)


def test_choices_that_failed_together_are_not_tried_again_and_the_halving_fills_from_below():
    """liger's fused cross-entropy under torch.compile failed on the H100 (a Llama): once a candidate with both
    fails, no candidate holding both is tried; the halving's first rung takes the next-ranked ones instead."""
    class LigerUnderCompileFails(FakeMeasure):
        def __call__(self, cfg, steps):
            if cfg.use_liger_kernel and cfg.torch_compile:
                self.calls.append((cfg, steps))
                raise RuntimeError("TorchRuntimeError: RuntimeError when making fake tensor call\ntrace")
            probe = super().__call__(cfg, steps)
            # liger and compile each help alone, so the screen's model ranks them together first
            probe.tokens_per_s *= (1.3 if cfg.use_liger_kernel else 1.0) * (1.4 if cfg.torch_compile else 1.0)
            return probe

    measure = LigerUnderCompileFails()
    res = run_search(measure, gpu_memory(4000), steps=3, max_candidates=4)
    both = [c for c, _ in measure.calls if c.use_liger_kernel and c.torch_compile]
    def choices(cfg):                           # the model's axis choices (a compile mode or scope is one choice)
        return {"attention": cfg.attn_implementation, "checkpointing": cfg.gradient_checkpointing,
                "liger": cfg.use_liger_kernel,
                "compile": (cfg.torch_compile_mode, cfg.torch_compile_scope) if cfg.torch_compile else None}
    plain = choices(measure.calls[0][0])        # the screen's baseline
    failed = [{(a, c) for a, c in choices(cfg).items() if c != plain[a]} for cfg in both]
    # once a set of the model's changes failed, no candidate holding all of them is tried again (one holding
    # fewer may be: the best-ranked combination without one of its changes, say)
    assert both and all(not failed[j] <= failed[i] for i in range(len(failed)) for j in range(i))
    skipped = [e for e in res.entries if e.skipped and "failed together" in e.skipped]
    assert skipped and all("liger" in e.skipped for e in skipped)
    halving_ok = [e for e in res.entries if e.ok and any(p.steps == 3 for p in e.probes)]
    assert len(halving_ok) >= 4                 # the first rung still measured max_candidates that ran
    assert res.pick.ok and not (res.pick.candidate.overrides_dict()["use_liger_kernel"]
                                and res.pick.candidate.overrides_dict()["torch_compile"])


def test_a_change_that_hurts_beside_another_loses_to_the_combination_without_it():
    """On the H100 (Llama 1B) liger and per-block compile each helped alone and together ran slower than the
    compiled layers alone: the screen's product of speed-ups ranks the pair first, so the halving's first rung
    also holds that combination without each of its changes (and the screen's fastest), and the pick is not
    the pair."""
    class LigerHurtsInsideCompiledBlocks(FakeMeasure):
        def __call__(self, cfg, steps):
            probe = super().__call__(cfg, steps)
            blocks = cfg.torch_compile and cfg.torch_compile_scope == "blocks"
            liger = cfg.use_liger_kernel
            probe.tokens_per_s *= (1.5 if blocks else 1.0) * (1.3 if liger else 1.0) * (0.6 if blocks and liger else 1.0)
            return probe

    res = run_search(LigerHurtsInsideCompiledBlocks(), gpu_memory(4000), steps=3, max_candidates=6)
    pick = res.pick.candidate.overrides_dict()
    assert pick["torch_compile"] and pick.get("torch_compile_scope") == "blocks" and not pick["use_liger_kernel"]
    pair = [e for e in res.entries if e.ok and e.candidate.overrides_dict().get("torch_compile_scope") == "blocks"
            and e.candidate.overrides_dict()["use_liger_kernel"]]
    assert pair and all(e.last.tokens_per_s < res.pick.last.tokens_per_s for e in pair)


def test_a_probe_is_stopped_at_the_budget_not_after_it():
    clock = Clock()
    measure = StoppableMeasure(clock, slow=lambda cfg: True, slow_cost=500.0)
    lines = []
    res = run_search(measure, gpu_memory(4000), clock=clock, steps=3, budget="120s", log=lines.append)
    assert res.budget_hit and measure.allowed[0] == pytest.approx(120.0) and res.tune_s <= 121.0
    assert any(line.endswith("the budget ends") for line in lines)
    # cut by the budget is not a measurement: nothing is recorded against the configuration
    assert not any(e.probes for e in res.entries) and res.pick is None
    assert any("no probe finished within the budget" in n for n in res.notes)


def test_a_probe_cut_by_the_budget_leaves_what_its_configuration_measured_before():
    """The halving's next rung cut by the budget: the entry keeps its first-rung figure and can be the pick."""
    clock = Clock()

    class SlowSecondRung(StoppableMeasure):
        def __call__(self, cfg, steps, time_allowed_s=None):
            if steps > 3:
                self.clock.now += time_allowed_s
                return T.Probe(steps=steps, stopped=True, error=f"stopped after {time_allowed_s:.0f} s: the budget ends")
            return super().__call__(cfg, steps, time_allowed_s)

    measure = SlowSecondRung(clock)
    res = run_search(measure, gpu_memory(4000), clock=clock, steps=3, budget="200s", max_candidates=4)
    assert res.budget_hit and res.pick is not None and res.pick.ok and res.pick.last.steps == 3
    assert not any(p.stopped for e in res.entries for p in e.probes)


def test_the_screen_times_one_step_and_the_halving_the_full_rung():
    measure = FakeMeasure()
    run_search(measure, gpu_memory(4000), steps=3, max_candidates=4)
    steps = [n for _, n in measure.calls]
    assert steps[0] == 1 and 3 in steps          # the screen's probes, then the halving's first rung


def test_a_transformers_model_is_screened_from_sdpa_the_lab_gpt_from_eager():
    hf_axes, _ = T.build_axes(base(), cuda=True, liger_reason=None, hf=True)
    lab_axes, _ = T.build_axes(base(), cuda=True, liger_reason=None)
    plain = lambda axes: dict((a.name, a.choices[0][0]) for a in axes)      # noqa: E731
    assert plain(hf_axes)["attention"] == "sdpa" and plain(lab_axes)["attention"] == "eager"


def test_a_lab_probe_stops_between_micro_batches_once_past_its_time(monkeypatch):
    """A step of many micro-batches (a pathological one took minutes on the H100) is not waited out: the probe
    ends after the micro-batch during which its time ran out."""
    from fasttrain.lab import trainer as lab_trainer
    from fasttrain.lab.data import corpus_from_text

    calls = []
    real = lab_trainer.accumulate_gradients

    def counting(*args, after_micro_batch=None, **kw):
        def seen(j):
            calls.append(j)
            after_micro_batch(j)
        return real(*args, after_micro_batch=seen if after_micro_batch else None, **kw)

    monkeypatch.setattr(lab_trainer, "accumulate_gradients", counting)
    measure = T.lab_measure(corpus=corpus_from_text(toy_text(20000)))
    cfg = base().with_(context=16, per_device_train_batch_size=1, gradient_accumulation_steps=4)
    probe = measure(cfg, 3, time_allowed_s=0.0)
    assert probe.stopped and probe.tokens_per_s is None and calls == [0]
    assert probe.error.startswith("stopped after ") and "0 of 4 steps done" in probe.error
    calls.clear()
    assert measure(cfg, 1, time_allowed_s=None).tokens_per_s and calls == []     # no clock without a limit


def test_the_cache_measures_nothing_the_second_time(tmp_path):
    cache = tmp_path / "cache.json"
    first = FakeMeasure()
    kw = dict(seq=SEQ, global_batch_tokens=SEQ * 16, predict=fake_predict, memory=gpu_memory(4000), steps=2,
              liger_reason=None, cache_path=cache)
    a = T.tune(base(), measure=first, **kw)
    assert first.calls and cache.exists()
    second = FakeMeasure()
    b = T.tune(base(), measure=second, **kw)
    assert second.calls == []
    assert b.probes_cached == a.probes_measured and b.probes_measured == 0
    assert b.pick.candidate == a.pick.candidate
    # another device is another key: measured again
    third = FakeMeasure()
    T.tune(base(), measure=third, **{**kw, "memory": T.DeviceMemory("other GPU", 4000 * MIB)})
    assert third.calls


def test_cpu_runs_say_their_timings_do_not_transfer():
    res = run_search(FakeMeasure(), T.DeviceMemory("cpu", 4000 * MIB, cpu=True), steps=1)
    assert T.CPU_NOTE in res.notes
    assert not any("torch_compile" in dict(c.overrides) and dict(c.overrides)["torch_compile"]
                   for c in (e.candidate for e in res.entries))


# --- bad input -----------------------------------------------------------------------------------

def test_nothing_fits_names_the_smallest_peak_the_device_and_what_would_fit():
    def predict(cfg):
        base_mib = 20 if cfg.lora_r else 900
        return int((base_mib + cfg.per_device_train_batch_size * cfg.context / 32) * MIB)
    with pytest.raises(FasttrainError) as err:
        T.tune(base(), seq=SEQ, global_batch_tokens=SEQ * 4, measure=FakeMeasure(), predict=predict,
               memory=gpu_memory(500), cache_path=None, liger_reason=None)
    msg = str(err.value)
    assert "\n" not in msg
    assert "smallest predicted peak is 901 MiB" in msg and "500 MiB" in msg and "--allow lora" in msg


def test_nothing_fits_suggests_a_shorter_sequence():
    def predict(cfg):
        return int((cfg.per_device_train_batch_size * cfg.context * 30) * MIB)
    with pytest.raises(FasttrainError, match=r"--seq 8 \(predicted 240 MiB"):
        T.tune(base(), seq=SEQ, global_batch_tokens=SEQ * 4, measure=FakeMeasure(), predict=predict,
               memory=gpu_memory(400), cache_path=None, liger_reason=None)


@pytest.mark.parametrize("kw, pattern", [
    (dict(global_batch_tokens=SEQ * 4 + 1), r"not a whole number of sequences .* use 128 or 160"),
    (dict(seq=0), r"--seq must be a positive integer"),
    (dict(budget="five minutes"), r"--budget 'five minutes': give a duration"),
    (dict(budget="0s"), r"--budget must be positive"),
    (dict(allow="lora,bogus"), r"--allow bogus: unknown technique"),
])
def test_bad_input_is_one_line(kw, pattern):
    args = dict(seq=SEQ, global_batch_tokens=SEQ * 4, measure=FakeMeasure(), predict=fake_predict,
                memory=gpu_memory(), cache_path=None)
    with pytest.raises(FasttrainError, match=pattern):
        T.tune(base(), **{**args, **kw})


def test_an_out_folder_holding_files_is_refused_before_any_work(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    measure = FakeMeasure()
    with pytest.raises(FasttrainError, match="holds files already"):
        T.tune(base(), seq=SEQ, global_batch_tokens=SEQ * 4, measure=measure, predict=fake_predict,
               memory=gpu_memory(), cache_path=None, out=tmp_path)
    assert measure.calls == [] and (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("args, pattern", [
    (["--seq", "32", "--global-batch-tokens", "100"], r"not a whole number of sequences"),
    (["--seq", "32", "--global-batch-tokens", "128", "--budget", "soon"], r"--budget 'soon'"),
    (["--seq", "32", "--global-batch-tokens", "128", "--allow", "magic"], r"--allow magic"),
    (["--seq", "32", "--global-batch-tokens", "128", "--memory-limit", "lots"], r"--memory-limit 'lots'"),
])
def test_cli_bad_input_is_one_line(args, pattern, tmp_path):
    res = fasttrain_in_process("tune", "--preset", "tiny", "--device", "cpu", *args, "--no-cache",
                               env={"FASTTRAIN_DATA_DIR": str(tmp_path)})
    one_line_error(res, pattern)


# --- the answer ----------------------------------------------------------------------------------

def test_the_answer_as_a_lab_command_and_training_arguments(tmp_path):
    res = run_search(FakeMeasure(), gpu_memory(4000), steps=2, out=tmp_path / "run")
    cfg = R.pick_config(res)
    command = R.lab_command(cfg)
    assert command.startswith("fasttrain lab --preset tiny ")
    # the answer's shape is written out, even where it is the preset's own
    assert f"--per-device-train-batch-size {cfg.per_device_train_batch_size} " in command
    assert f"--gradient-accumulation-steps {cfg.gradient_accumulation_steps}" in command
    # the command line parses back to the same configuration through the lab's own CLI parser
    from fasttrain.lab.cli import command as lab_command
    ctx = lab_command.make_context("lab", command.split()[2:])
    options = {k: v for k, v in ctx.params.items() if k in {f for f in cfg.to_dict()}}
    assert config_from(ctx.params["preset_name"], options) == cfg
    args, model_kwargs, _ = R.training_arguments(cfg)
    assert args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] * SEQ == SEQ * 16
    assert args["optim"] == "adamw_torch_fused" and model_kwargs == {"attn_implementation": "sdpa"}
    data = json.loads((tmp_path / "run" / "tune.json").read_text())
    assert data["pick"]["lab_command"] == command
    assert data["ranked"][0]["rank"] == 1 and data["pruned_by_prediction"] == res.pruned
    csv_text = (tmp_path / "run" / "tune.csv").read_text().splitlines()
    assert csv_text[0].startswith("config,label,stage,rung,steps,metric,value")
    assert (tmp_path / "run" / "tune.png").stat().st_size > 1000


def test_training_arguments_are_accepted_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = base(per_device_train_batch_size=4, gradient_accumulation_steps=4, bf16=True, optim="adamw_torch_fused",
               gradient_checkpointing="full")
    args, _, _ = R.training_arguments(cfg, cpu=True)
    ta = transformers.TrainingArguments(output_dir=str(tmp_path), **args)
    assert (ta.per_device_train_batch_size, ta.gradient_accumulation_steps, ta.bf16, ta.gradient_checkpointing) == \
        (4, 4, True, True)
    # liger's fused cross-entropy alone: the Trainer's liger_kernel_config switches the layer kernels off; the lab
    # command names it
    flce = cfg.with_(model="hf:some/folder", use_liger_kernel=True, liger_kernels="fused_linear_cross_entropy")
    args, _, _ = R.training_arguments(flce, cpu=True)
    ta = transformers.TrainingArguments(output_dir=str(tmp_path), **args)
    assert ta.use_liger_kernel and ta.liger_kernel_config["fused_linear_cross_entropy"] is True
    assert not any(v for k, v in ta.liger_kernel_config.items() if k != "fused_linear_cross_entropy")
    assert "--use-liger-kernel --liger-kernels fused_linear_cross_entropy" in R.lab_command(flce)


def test_the_trainers_answer_leaves_out_liger_for_a_family_it_does_not_patch():
    """The HF Trainer's use_liger_kernel is liger's family patch: for GPT-2 it would apply nothing (the logits made,
    silently). The pick's fused cross-entropy on GPT-2's head is the lab's, so the answer leaves it out and says why;
    a Llama's stays."""
    pytest.importorskip("liger_kernel")
    from types import SimpleNamespace

    overrides = {"use_liger_kernel": True, "liger_kernels": "fused_linear_cross_entropy"}
    cfg = base(model="hf:some/folder", **overrides)

    def answer(family):
        pick = SimpleNamespace(candidate=SimpleNamespace(overrides_dict=lambda: overrides))
        return R.answer_arguments(SimpleNamespace(pick=pick, fixed=(), family=family), cfg)

    args, _, notes = answer("gpt2")
    assert "use_liger_kernel" not in args and "liger_kernel_config" not in args
    assert [n for n in notes if "liger" in n] == [
        "liger's fused linear cross-entropy on the gpt2 model's head is the lab's own forward (liger has no gpt2 "
        "patch, so the Trainer's use_liger_kernel would apply nothing): left out here"]
    args, _, notes = answer("llama")
    assert args["use_liger_kernel"] and args["liger_kernel_config"]["fused_linear_cross_entropy"]
    assert not any("liger" in n for n in notes)
    # beside a whole compiled model the Trainer would compile liger's own forward, which does not trace
    overrides.update(torch_compile=True, torch_compile_scope="model")
    cfg = base(model="hf:some/folder", **overrides)
    args, _, notes = answer("llama")
    assert args["torch_compile"] and "use_liger_kernel" not in args
    assert any("does not trace: left out here" in n for n in notes)


def test_frontier_keeps_only_points_nothing_beats():
    pts = [(100, 5.0), (200, 4.0), (200, 7.0), (300, 6.0), (400, 9.0)]
    assert R.frontier(pts) == [(100, 5.0), (200, 7.0), (400, 9.0)]


# --- through the lab's trainer -------------------------------------------------------------------

@pytest.mark.slow
def test_end_to_end_on_a_tiny_model_through_the_real_trainer(tmp_path):
    from fasttrain.lab.data import corpus_from_text

    corpus = corpus_from_text(toy_text(20000))
    fixed = {"optim", "preload", "dataloader_num_workers", "gradient_checkpointing", "bf16"}
    res = T.tune(base(), seq=16, global_batch_tokens=16 * 8, corpus=corpus, fixed=fixed, steps=1,
                 max_candidates=4, cache_path=tmp_path / "cache.json", out=tmp_path / "run")
    assert res.pick is not None and res.pick.ok and res.pick.last.tokens_per_s > 0
    assert T.CPU_NOTE in res.notes
    assert res.pick.predicted_bytes > 0                  # the estimator's prediction of the lab's GPT
    # the untimed warm-up steps (three micro-batches' worth), then the timed one
    warm = T.warmup_steps_for(base(gradient_accumulation_steps=res.baseline.candidate.accumulation))
    assert len(res.baseline.probes[0].losses) == warm + 1
    data = json.loads((tmp_path / "run" / "tune.json").read_text())
    assert "use_cpu" not in data["pick"]["training_arguments"]         # the answer reads as a GPU's
    again = T.tune(base(), seq=16, global_batch_tokens=16 * 8, corpus=corpus, fixed=fixed, steps=1,
                   max_candidates=4, cache_path=tmp_path / "cache.json")
    assert again.probes_measured == 0 and again.pick.candidate == res.pick.candidate


def test_cli_end_to_end_on_the_cpu(tmp_path, capsys, shakespeare_dir):
    code, out, err = run_cli(["tune", "--preset", "tiny", "--device", "cpu", "--seq", "16",
                              "--global-batch-tokens", "64", "--probe-steps", "1", "--optim", "adamw_torch",
                              "--no-preload", "--gradient-checkpointing", "none", "--bf16",
                              "--max-candidates", "2", "--cache", str(tmp_path / "c.json"),
                              "--out", str(tmp_path / "run"), "--quiet"], capsys)
    assert code == 0, err
    assert "pick: fasttrain lab --preset tiny" in out and "TrainingArguments:" in out
    assert "do not transfer to a GPU" in out
    assert (tmp_path / "run" / "tune.json").exists()


# --- the GPU benchmark's harness, tiny and on the CPU ---------------------------------------------

def _dev_tune_module(name: str):
    """A script of dev/tune/ loaded as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "dev" / "tune" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_module():
    return _dev_tune_module("bench_tune")


def test_bench_harness_writes_a_large_vocabulary_case_in_uint32_ids_the_lab_reads(tmp_path):
    """The Qwen2.5-0.5B-shaped case (vocabulary 151,936): its ids do not fit uint16; the lab's configuration of it
    and the Trainer's windows read the same uint32 files."""
    pytest.importorskip("transformers")
    import numpy as np

    from fasttrain.lab.data import corpus_for

    bench = _bench_module()
    assert [bench.bin_dtype(n) for n in ("gpt2-124m", "llama-1b", "qwen2.5-0.5b")] == ["uint16", "uint16", "uint32"]
    folder = bench.prepare(tmp_path, "qwen2.5-0.5b", n_tokens=4096)
    ids = np.fromfile(folder / "train.bin", dtype=np.uint32)
    assert len(ids) == 4096 and ids.max() < 151936 and ids.max() > 65535
    assert bench.load_state(tmp_path, "qwen2.5-0.5b")["params"] == pytest.approx(494e6, rel=0.01)
    cfg = bench.lab_base(tmp_path, "qwen2.5-0.5b", cuda=False)
    corpus = corpus_for(cfg)
    assert cfg.bin_dtype == "uint32" and int(corpus.train.max()) == int(ids.max())


def test_bench_harness_measures_the_hf_trainer_and_reports_fixed_keys(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    bench = _bench_module()
    work, results = tmp_path / "work", tmp_path / "results"
    for phase in ("prepare", "hf", "hf-flags"):
        assert bench.main([phase, str(work), "--model", "tiny-gpt2", "--steps", "1", "--skip", "1"]) == 0
    state = bench.load_state(work, "tiny-gpt2")
    assert state["hf"]["tokens_per_s"] > 0 and state["hf"]["found_batch"] == 8
    assert state["hf"]["tokens_per_step"] == bench.MODELS["tiny-gpt2"]["tokens"]     # the same global batch
    assert state["hf_flags"]["flags"]["optim"] == "adamw_torch_fused"
    assert len(state["hf"]["step_s"]) == 1 and len(state["hf"]["first_steps_s"]) == 1
    assert bench.main(["report", str(work), "--model", "tiny-gpt2", "--results", str(results)]) == 0
    (folder,) = list(results.iterdir())
    data = json.loads((folder / "tune.json").read_text())
    assert [tuple(c) for c in data["cases"]] == [bench.CASE_KEYS]
    assert data["cases"][0]["hf_trainer_tokens_per_s"] == state["hf"]["tokens_per_s"]
    text = (folder / "README.md").read_text()
    assert "| tiny-gpt2 |" in text and "HF Trainer (users)" in text
    # --into writes the same section between a README's markers, the rest of the file kept
    readme = tmp_path / "README.md"
    readme.write_text(f"# top\n{bench.README_START}\nold\n{bench.README_END}\ntail\n")
    assert bench.main(["report", str(work), "--model", "tiny-gpt2", "--results", str(results),
                       "--into", str(readme)]) == 0
    written = readme.read_text()
    assert written.startswith("# top\n") and written.endswith(f"{bench.README_END}\ntail\n")
    assert "| tiny-gpt2 |" in written and "old" not in written
    # a file without the markers is refused in one line before any report is written
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(SystemExit):
        bench.main(["report", str(work), "--model", "tiny-gpt2", "--results", str(tmp_path / "r2"),
                    "--into", str(bare)])
    assert not (tmp_path / "r2").exists() and bare.read_text() == "no markers\n"
    # readme: the section again from a results folder alone (what is committed), no work folder needed
    (folder / "README.md").unlink()
    readme.write_text(f"# top\n{bench.README_START}\n{bench.README_END}\n")
    assert bench.main(["readme", str(folder), "--into", str(readme)]) == 0
    own, section = (folder / "README.md").read_text(), readme.read_text()
    assert "| tiny-gpt2 |" in own and "| tiny-gpt2 |" in section
    # the folder's own README: the machine its title, each model under it; in the index's section the machine is
    # a ### (under the index's "## fasttrain tune ..."), each model a ####, and the folder is linked from there
    assert own.startswith("# fasttrain tune against the Hugging Face Trainer: ") and "\n## tiny-gpt2\n" in own
    assert f"{bench.README_START}\n### " in section and "\n#### tiny-gpt2\n" in section
    assert f"]({os.path.relpath(folder, readme.parent)}/)" in section
    with pytest.raises(SystemExit):
        bench.main(["readme", str(tmp_path / "nothing-here"), "--into", str(readme)])
    # one section for several machines' folders, each under its device's heading
    other = tmp_path / "other"
    other.mkdir()
    data = json.loads((folder / "tune.json").read_text())
    (other / "tune.json").write_text(json.dumps({**data, "device": "NVIDIA H200", "measured_with": "bash pair.sh"}))
    assert bench.main(["readme", str(folder), "--also", str(other), "--into", str(readme)]) == 0
    text = readme.read_text()
    assert [line for line in text.splitlines() if line.startswith("### ")][1] == "### NVIDIA H200"
    assert "Measured with `bash pair.sh`" in text
    # a wrong --also is refused before the folder's README is written
    (folder / "README.md").unlink()
    with pytest.raises(SystemExit):
        bench.main(["readme", str(folder), "--also", str(tmp_path / "nothing-here"), "--into", str(readme)])
    assert not (folder / "README.md").exists()
    # a report written away from the GPU (from a state copied back) names the machine the phases ran on
    assert state["environment"]["cpu"]                  # each phase records where it ran
    state["environment"] = {**state["environment"], "gpu": {"name": "NVIDIA H100 80GB HBM3"}}
    bench.save_state(work, "tiny-gpt2", state)
    assert bench.main(["report", str(work), "--model", "tiny-gpt2", "--results", str(tmp_path / "away")]) == 0
    (away,) = list((tmp_path / "away").iterdir())
    assert away.name == "nvidia-h100-80gb-hbm3"
    assert json.loads((away / "tune.json").read_text())["device"] == "NVIDIA H100 80GB HBM3"


def test_bench_report_names_a_grid_not_finished_and_the_picks_profile(tmp_path):
    """A grid that ran part of its points has no best (the goal says how many ran); a profile of the pick in the
    results folder's logs is summed up under the model's goals."""
    bench = _bench_module()
    state = {"model": "llama-1b", "tune": {"pick_tokens_per_s": 66_000.0, "tune_s": 478.0},
             "hf": {"tokens_per_s": 50_000.0}, "grid_members": [{"a": 1}, {"a": 2}, {"a": 3}],
             "grid": {"x": {"tokens_per_s": 59_000.0}}}
    case = bench.case_of(state)
    assert case["best_tokens_per_s"] is None
    assert dict(bench.goals(case, state))["pick within 5% of the grid's best"] == \
        "not measured: the grid ran 1 of its 3 points"
    state["grid"].update(y={"tokens_per_s": None, "oom": True}, z={"tokens_per_s": 70_000.0})
    case = bench.case_of(state)
    assert case["best_tokens_per_s"] == 70_000.0
    assert dict(bench.goals(case, state))["pick within 5% of the grid's best"] == \
        "MISSED: 0.943x (2 of the 3 points ran; 1 did not: 1 out of memory, 0 refused or failed)"
    # a miss is never printed as the goal's own figure
    assert bench.ratio_result(1.09993, 1.1) == "MISSED: 1.0999x" and bench.ratio_result(1.22, 1.1) == "met: 1.220x"
    folder = tmp_path / "results"
    (folder / "logs").mkdir(parents=True)
    (folder / "tune.json").write_text(json.dumps({"cases": [case], "details": [
        {"model": "llama-1b", "goals": bench.goals(case, state)}]}))
    (folder / "logs" / "llama-1b-profile.json").write_text(json.dumps({
        "wall_ms_per_step": 1995.7, "gpu_busy_ms_per_step": 1897.0,
        "by_family_ms_per_step": {"gemm": 1000.0, "attention": 310.72}, "tokens_per_step": 131_072,
        "flops_per_token": {"total": 6.63e9, "dense": 6.0e9}, "model_tflops": 435.8, "mfu": 0.4404,
        "peak_tflops": 989.4, "mfu_of_2x_hf": 0.6817}))
    (folder / "llama-1b-tune").mkdir()
    (folder / "llama-1b-tune" / "tune.json").write_text(json.dumps({
        "pick": {"label": "8x8 block liger", "tokens_per_s": 66_360.0},
        "ranked": [{"label": "8x8 block liger", "tokens_per_s": 66_360.0, "status": "ok", "stage": "halving",
                    "steps_measured": 24},
                   {"label": "8x8 block", "tokens_per_s": 73_006.0, "status": "ok", "stage": "screen",
                    "steps_measured": 1}]}))
    text = bench.readme(folder)
    assert ("The fastest configuration tune measured was not its pick: `8x8 block` ran 73,006 tokens/s in its "
            "screen (1 step(s)), 1.100x the pick.") in text
    assert "1,996 ms a step, the GPU busy 1,897 ms (gemm 1,000, attention 311 ms)" in text
    assert "44% of the 989.4 TFLOP/s dense bf16 peak; 2x the HF Trainer as its users run it would need 68%" in text
    # 6e9 FLOP x 131,072 tokens in 1 s of GEMMs; 131,072 tokens in 1.31072 s of GEMMs and attention
    assert ("Its GEMMs run at 786 TFLOP/s (79% of that peak); a step of only its GEMMs and attention, as they run, "
            "would be 100,000 tokens/s, 2.00x the HF Trainer as its users run it.") in text
    # the results folder's own README links its logs from there; a section written into another file, from that one
    assert "[logs/llama-1b-profile.json](logs/llama-1b-profile.json)" in text
    assert "(results/logs/llama-1b-profile.json)" in bench.readme(folder, into=tmp_path / "README.md")


def _search_case(bench, monkeypatch, runs, work):
    """A case of 64 sequences a step (micro-batches 8 to 64) whose fake Trainer fits 16 sequences eager and 32
    compiled or with liger, runs faster with more sequences, compile and liger, and cannot run liger under its
    torch_compile (seen on the H100 with a Llama); each run takes its expected time on a fake clock."""
    import torch
    import fasttrain.lab.tune as tune_module

    monkeypatch.setattr(tune_module, "liger_support", lambda family: None)
    monkeypatch.setitem(bench.MODELS, "search-case", dict(seq=32, tokens=32 * 64, config=dict(model_type="llama")))
    (work / "search-case").mkdir()
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def fake_run(work, name, *, batch, extra, steps, skip, cuda, find):
        clock[0] += bench.point_seconds(extra)
        assert find is False and extra["optim"] == "adamw_torch_fused"
        assert extra["logging_nan_inf_filter"] is False and extra["dataloader_num_workers"] == 2
        runs.append((bench._flags_label({k: v for k, v in extra.items() if k != "tf32"})
                     + ("" if extra.get("tf32") else " (no tf32)"), batch))
        if extra.get("torch_compile") and extra.get("use_liger_kernel"):
            raise RuntimeError("RuntimeError when making fake tensor call\nlong trace")
        if extra.get("torch_compile_mode") and extra.get("tf32"):     # torch 2.11's inductor under max-autotune
            raise RuntimeError("PyTorch is checking the matmul precision without a specific backend name")
        if batch > (32 if extra.get("torch_compile") or extra.get("use_liger_kernel") else 16):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        speed = batch * (1.5 if extra.get("torch_compile") else 1.0) * (1.2 if extra.get("use_liger_kernel") else 1.0)
        # as _hf_run reports: the micro-batch and the accumulation that keeps the 64 sequences
        return {"tokens_per_s": speed, "peak_mib": 10.0 * batch, "batch": batch, "gradient_accumulation_steps": 64 // batch}

    monkeypatch.setattr(bench, "_hf_run", fake_run)


def test_bench_trainer_search_climbs_each_variants_micro_batches_until_one_does_not_fit(monkeypatch, tmp_path):
    """The Trainer's column is the search a careful user runs: micro-batches 8, 16, 32, ... (the accumulation
    keeping the global batch) for each of its flags apart and together, until a micro-batch does not fit; a
    combination a library cannot run is said and skipped; the best point is the column, every point is kept."""
    bench = _bench_module()
    runs = []
    _search_case(bench, monkeypatch, runs, tmp_path)
    best = bench.hf_search_case(tmp_path, "search-case", steps=2, skip=1, cuda=True)
    # a point that does not run with tf32 is tried once without it, and its ladder goes on without it (max-autotune
    # here); one that does not run without it either ends its variant (liger + compile)
    autotune = "torch_compile+mode=max-autotune-no-cudagraphs"
    assert runs == [("no flags", 8), ("no flags", 16), ("no flags", 32),
                    ("torch_compile", 8), ("torch_compile", 16), ("torch_compile", 32), ("torch_compile", 64),
                    (autotune, 8), (autotune + " (no tf32)", 8), (autotune + " (no tf32)", 16),
                    (autotune + " (no tf32)", 32), (autotune + " (no tf32)", 64),
                    ("use_liger_kernel", 8), ("use_liger_kernel", 16), ("use_liger_kernel", 32),
                    ("use_liger_kernel", 64), ("use_liger_kernel+torch_compile", 8),
                    ("use_liger_kernel+torch_compile (no tf32)", 8)]
    assert best["tokens_per_s"] == 48.0 and best["batch"] == 32 and best["gradient_accumulation_steps"] == 2
    assert best["flags"]["torch_compile"] and best["complete"]
    statuses = [p["status"] for p in best["points"]]
    assert len(best["points"]) == 18 and statuses.count("oom") == 4 and statuses.count("failed: RuntimeError") == 3
    assert any("use_liger_kernel+torch_compile: RuntimeError: RuntimeError when making fake tensor call" in n
               and "[dynamo's fake tensors fail in liger's patched forward" in n for n in best["notes"])
    # the points are in the state as they were measured: a second call measures nothing again
    assert len(bench.load_state(tmp_path, "search-case")["hf_search_points"]) == 18
    runs.clear()
    assert bench.hf_search_case(tmp_path, "search-case", steps=2, skip=1, cuda=True)["tokens_per_s"] == 48.0
    assert runs == []


def test_bench_trainer_runs_leave_torchs_precision_switches_as_they_found_them(monkeypatch, tmp_path):
    """A Trainer run's tf32 sets torch's newer precision API for the process; the next point's max-autotune reads
    the legacy getter, which refuses the mix. Each run, failed or not, puts the switches back."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch
    import transformers

    bench = _bench_module()
    bench.prepare(tmp_path, "tiny-gpt2", n_tokens=4096)

    from transformers.utils import import_utils

    def train_as_tf32_does(self, *args, **kwargs):
        torch.backends.cuda.matmul.fp32_precision = "tf32"      # what TrainingArguments(tf32=True) leaves
        import_utils.enable_tf32(True)                          # and the cached call that set it
        raise RuntimeError("the run failed after setting tf32")
    monkeypatch.setattr(transformers.Trainer, "train", train_as_tf32_does)
    kept = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "none"                              # as a process starts
    try:
        before = torch.get_float32_matmul_precision()
        point = bench._trainer_point(tmp_path, "tiny-gpt2", batch=8, flags={}, steps=2, skip=1, cuda=False)
        assert point["status"] == "failed: RuntimeError"
        assert torch.backends.cuda.matmul.fp32_precision == "none"
        assert torch.get_float32_matmul_precision() == before   # no "mix of the legacy and new APIs"
        # the next point asking for tf32 gets it: transformers' cached switch was forgotten with the state
        import_utils.enable_tf32(True)
        assert torch.backends.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = kept
        torch.backends.fp32_precision = "none"
        import_utils.enable_tf32.cache_clear()


def test_bench_trainer_search_stops_where_the_calls_time_ends_and_goes_on_in_the_next(monkeypatch, tmp_path):
    bench = _bench_module()
    runs = []
    _search_case(bench, monkeypatch, runs, tmp_path)
    # 80 s: the three eager points (25 s each, point_seconds) fit; a compiled one (110 s) would not
    first = bench.hf_search_case(tmp_path, "search-case", steps=2, skip=1, cuda=True, time_left=80.0)
    assert runs == [("no flags", 8), ("no flags", 16), ("no flags", 32)] and not first["complete"]
    assert not first["share_complete"]          # the phase then exits 3: the lease script runs it again
    assert "rerun the phase for the rest" in first["notes"][-1]
    runs.clear()
    second = bench.hf_search_case(tmp_path, "search-case", steps=2, skip=1, cuda=True)
    assert runs[0] == ("torch_compile", 8) and second["complete"] and len(second["points"]) == 18
    assert second["share_complete"]
    # a share with no time for any point: an empty column, not an error
    empty = tmp_path / "empty"
    (empty / "search-case").mkdir(parents=True)
    runs.clear()
    none_yet = bench.hf_search_case(empty, "search-case", steps=2, skip=1, cuda=True, time_left=1.0)
    assert runs == [] and none_yet["tokens_per_s"] is None and not none_yet["share_complete"]


def test_bench_trainer_search_shared_by_lanes_merges_into_the_one_search(monkeypatch, tmp_path):
    """Three lanes (three GPUs of a host) share the Trainer's flag variants (k/3 each), each in its own work
    folder; merge folds their points into lane A's state, whose column is then the one search's: the same points,
    the same best, complete only once every variant's ladder ended."""
    bench = _bench_module()
    runs = []
    _search_case(bench, monkeypatch, runs, tmp_path)
    whole = bench.hf_search_case(tmp_path, "search-case", steps=2, skip=1, cuda=True)
    lanes = [tmp_path / f"lane-{k}" for k in (1, 2, 3)]
    shared = []
    for k, lane in enumerate(lanes, start=1):
        (lane / "search-case").mkdir(parents=True)
        runs.clear()
        shared.append(bench.hf_search_case(lane, "search-case", steps=2, skip=1, cuda=True, share=(k, 3)))
        shared[-1]["runs"] = list(runs)
    # variants 0 and 3 (none, liger), 1 and 4 (compile, liger + compile), 2 (max-autotune)
    labels = [{label.removesuffix(" (no tf32)") for label, _ in lane["runs"]} for lane in shared]
    assert labels == [{"no flags", "use_liger_kernel"}, {"torch_compile", "use_liger_kernel+torch_compile"},
                      {"torch_compile+mode=max-autotune-no-cudagraphs"}]
    assert not any(s["complete"] for s in shared)         # a lane's share alone is not the search
    a = tmp_path / "a"
    (a / "search-case").mkdir(parents=True)
    for lane in lanes[:2]:
        state = bench.merge_lanes(a, "search-case", lane)
    assert not state["hf_flags"]["complete"]
    state = bench.merge_lanes(a, "search-case", lanes[2])
    assert state["hf_flags"]["complete"] and len(state["hf_flags"]["points"]) == len(whole["points"]) == 18
    assert state["hf_flags"]["tokens_per_s"] == whole["tokens_per_s"] and state["hf_flags"]["batch"] == whole["batch"]
    assert bench.merge_lanes(a, "search-case", lanes[2])["hf_flags"]["points"] == state["hf_flags"]["points"]
    with pytest.raises(SystemExit):
        bench.main(["hf-flags", str(a), "--model", "tiny-gpt2", "--share", "4/3"])


def test_bench_the_goals_come_from_the_long_run_measured_alone_on_one_card(monkeypatch, tmp_path):
    """``alone`` measures the Trainer's best point and the Trainer as users run it again on this GPU (run when
    nothing else runs on the host); with the pick's confirmation on the same card, the Trainer goals' ratios are
    the long run's; on another card, or before, they are the search's figures and say so."""
    bench = _bench_module()
    runs = []
    monkeypatch.setitem(bench.MODELS, "alone-case", dict(seq=32, tokens=32 * 64, config=dict(model_type="gpt2")))
    (tmp_path / "alone-case").mkdir()

    def fake_run(work, name, *, batch, extra, steps, skip, cuda, find):
        runs.append((dict(extra), batch, steps, find))
        return {"tokens_per_s": 40.0 if extra else 20.0, "found_batch": batch, "batch": batch}

    monkeypatch.setattr(bench, "_hf_run", fake_run)
    flags = dict(bench.TRAINER_FLAGS, torch_compile=True)
    state = {"model": "alone-case", "tune": {"pick_tokens_per_s": 50.0, "gpu": "0"},
             "hf": {"tokens_per_s": 21.0, "found_batch": 8, "gpu": "1"},
             "hf_flags": {"tokens_per_s": 42.0, "batch": 32, "flags": flags, "complete": True, "gpu": "2"},
             "confirm": {"tokens_per_s": 48.0, "steps": 200, "gpu": "0"}}
    bench.save_state(tmp_path, "alone-case", state)
    case = bench.case_of(state)
    assert case["long_run"] is None
    assert dict(bench.goals(case, state))["at least 2x the HF Trainer as users run it"] == \
        "met: 2.381x (search figures, not measured alone)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert bench.main(["alone", str(tmp_path), "--model", "alone-case", "--alone-steps", "30",
                       "--alone-users-steps", "10", "--skip", "2"]) == 0
    assert runs == [(flags, 32, 32, False), ({}, 8, 12, True)]
    state = bench.load_state(tmp_path, "alone-case")
    assert state["alone"]["gpu"] == "0" and state["versions"]["torch"]
    case = bench.case_of(state)
    assert case["long_run"]["pick_tokens_per_s"] == 48.0 and case["long_run"]["hf_trainer_flags_tokens_per_s"] == 40.0
    goals = dict(bench.goals(case, state))
    assert goals["at least 2x the HF Trainer as users run it"] == \
        "met: 2.400x (the pick's 200 steps against the Trainer alone, both on GPU 0)"
    assert goals["at least 1.1x the HF Trainer with its best flags"].startswith("met: 1.200x (the pick's 200 steps")
    assert "with its best flags (torch_compile, micro-batch 32) 40" in bench.long_run_line(case["long_run"])
    # a users' run alone that was discarded (measured from a patched model): that goal falls back to the search's
    # figures, said in both places
    users_alone = state["alone"].pop("hf")
    case = bench.case_of(state)
    assert "as its users run it not measured alone" in bench.long_run_line(case["long_run"])
    assert dict(bench.goals(case, state))["at least 2x the HF Trainer as users run it"] == \
        "met: 2.381x (search figures, not measured alone)"
    state["alone"]["hf"] = users_alone
    # a confirmation on another card than the Trainer's alone runs is no long run of one card
    state["confirm"]["gpu"] = "1"
    assert bench.case_of(state)["long_run"] is None
    with pytest.raises(SystemExit, match="run hf and hf-flags"):
        bench.alone_case(tmp_path / "nothing", "alone-case", cuda=False, steps=1, users_steps=1, skip=0)


def test_bench_a_trainer_run_leaves_no_liger_patch_for_the_next_and_refuses_a_patched_family(monkeypatch, tmp_path):
    """The Trainer's ``use_liger_kernel`` patches the family's modeling module for the whole process: a Llama built
    after it is liger's (its RMSNorm, SwiGLU, RoPE and fused loss), which made a users' run measured after the best
    flags' point in one process read 1.27x. Each run puts the module back (here a liger run that fails on the CPU,
    after the Trainer patched it); a family patched from outside is refused in one line, before any work."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    liger = pytest.importorskip("liger_kernel.transformers")
    from fasttrain.lab.hf import liger_patched_names, modeling_modules_restored

    bench = _bench_module()
    monkeypatch.setitem(bench.MODELS, "tiny-llama", dict(seq=32, tokens=32 * 8, config=dict(
        model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)))
    bench.prepare(tmp_path, "tiny-llama")
    assert liger_patched_names("llama") == []
    with pytest.raises(Exception):      # noqa: B017 - liger's Triton kernels cannot run on the CPU, whatever they raise
        bench._hf_run(tmp_path, "tiny-llama", batch=8, extra={"use_liger_kernel": True}, steps=2, skip=1,
                      cuda=False, find=False)
    assert liger_patched_names("llama") == []
    plain = bench._hf_run(tmp_path, "tiny-llama", batch=8, extra={}, steps=2, skip=1, cuda=False, find=False)
    assert plain["tokens_per_s"] > 0
    with modeling_modules_restored("llama"):
        liger.apply_liger_kernel_to_llama()
        assert "LlamaForCausalLM.forward" in liger_patched_names("llama")
        with pytest.raises(SystemExit, match="liger's patches left by an earlier run"):
            bench._hf_run(tmp_path, "tiny-llama", batch=8, extra={}, steps=2, skip=1, cuda=False, find=False)
    assert liger_patched_names("llama") == []
    # in a fresh process, where the first run is also the first to import transformers' Llama module
    import subprocess
    import sys
    from pathlib import Path

    ROOT = Path(__file__).resolve().parents[1]

    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'dev' / 'tune')!r}); import bench_tune as bench; "
              "from fasttrain.lab.hf import liger_patched_names; "
              "assert 'transformers.models.llama.modeling_llama' not in sys.modules\n"
              "bench.MODELS['tiny-llama'] = " + repr(bench.MODELS["tiny-llama"]) + "\n"
              "from pathlib import Path\n"
              "try:\n bench._hf_run(Path(" + repr(str(tmp_path)) + "), 'tiny-llama', batch=8, "
              "extra={'use_liger_kernel': True}, steps=2, skip=1, cuda=False, find=False)\n"
              "except Exception as exc: print(type(exc).__name__)\n"
              "print('imported:', 'transformers.models.llama.modeling_llama' in sys.modules)\n"
              "print(liger_patched_names('llama'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-2:] == ["imported: True", "[]"], \
        done.stdout[-500:] + done.stderr[-2000:]


def test_bench_trainer_search_on_the_cpu_is_the_micro_batches_without_gpu_flags(monkeypatch, tmp_path):
    bench = _bench_module()
    assert bench.trainer_micro_batches(512) == [8, 16, 32, 64, 128, 256, 512]
    assert bench.trainer_micro_batches(8) == [8] and bench.trainer_micro_batches(4) == [4]
    variants, notes = bench.trainer_variants("gpt2", cuda=False)
    assert variants == [{}] and "no torch_compile, tf32 or liger" in notes[0]


def test_the_prediction_of_a_transformers_model_counts_liger_and_cuda_graphs():
    """liger-kernel's patches keep less (the fused cross-entropy never makes the logits): predicted as the estimator
    models them, eager and inside per-block compiled layers alike (no longer as the compiled model without liger,
    which counted the logits the fused cross-entropy never makes); reduce-overhead's CUDA graphs with their pool."""
    pytest.importorskip("transformers")
    from fasttrain.memory import estimate
    from fasttrain.memory.hf_config import setup_from_hf_config

    hf = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    predict = T.lab_predictor(hf["vocab_size"], hf)
    base = LabConfig(name="custom").with_(context=128, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                          bf16=True, attn_implementation="sdpa", device="cuda")

    def estimated(**changes):
        return int(estimate(setup_from_hf_config(hf, micro_batch=4, seq=128, precision="bf16", recompute="none",
                                                 attention="sdpa", optim="adamw_torch", grad_buffers=True,
                                                 **changes), "precise").total)

    assert predict(base.with_(use_liger_kernel=True)) == estimated(liger=True) < predict(base)
    blocks = base.with_(torch_compile=True, torch_compile_scope="blocks")
    assert predict(blocks) == estimated(compiled="blocks")
    assert predict(blocks.with_(use_liger_kernel=True)) == estimated(compiled="blocks", liger=True) < predict(blocks)
    whole = base.with_(torch_compile=True)
    graphs = whole.with_(torch_compile_mode="reduce-overhead")
    assert predict(graphs) == estimated(compiled="model", cuda_graphs=True) > predict(whole)



def test_the_prediction_of_gpt2s_fused_cross_entropy_drops_the_logits():
    """GPT-2's fused cross-entropy (the lab's forward with liger's kernel) is the estimator's liger fused
    cross-entropy: the predicted peak drops by more than the fp32 logits, eager and beside per-block compiled
    layers; beside a whole compiled model (the graph ends at the last hidden state, D26) by more than the logits
    in bf16 that model's loss keeps in its graph."""
    pytest.importorskip("transformers")
    gpt2 = dict(model_type="gpt2", vocab_size=8192, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    predict = T.lab_predictor(gpt2["vocab_size"], gpt2)
    plain = LabConfig(name="custom").with_(context=128, per_device_train_batch_size=8, bf16=True,
                                           attn_implementation="sdpa", device="cuda")
    fused = dict(use_liger_kernel=True, liger_kernels="fused_linear_cross_entropy")
    logits_fp32 = 4 * 8 * 128 * 8192
    for compiled in ({}, dict(torch_compile=True, torch_compile_scope="blocks")):
        assert predict(plain.with_(**compiled, **fused)) < predict(plain.with_(**compiled)) - logits_fp32, compiled
    whole = plain.with_(torch_compile=True)
    assert predict(whole.with_(**fused)) < predict(whole) - logits_fp32 // 2


def test_the_search_on_the_modelled_llama_finds_the_models_best_within_its_budget(capsys):
    """dev/tune/simulate_search.py: the search on the first look's Llama 1B speed model (compile + liger failing
    together, reduce-overhead 25x slower) finds the model's best configuration within 8 minutes."""
    pytest.importorskip("transformers")
    sim = _dev_tune_module("simulate_search")
    assert sim.main(["--budget", "8m", "--slow-reduce-overhead"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    pick, best = last.split("; the model's best that fits: ")
    assert pick.split(",")[0] == "pick: " + best.split(",")[0] and "in 480 s" in pick


# --- on a GPU (the device machine: python3 -m pytest -q -m gpu tests/test_lab_tune.py) ------------

@pytest.mark.gpu
def test_device_memory_is_measured_once_on_a_gpu():
    dev = torch.device("cuda")
    mem = T.device_memory(dev)
    free, total = torch.cuda.mem_get_info(dev)
    assert mem.total_bytes == total and 0 < mem.context_bytes <= total
    assert 0.0 <= mem.reserve <= 0.25
    assert T.device_memory(dev, limit_bytes=2 ** 30).total_bytes == 2 ** 30


@pytest.mark.gpu
def test_tune_on_a_gpu_prunes_measures_and_predicts_the_pick(tmp_path):
    from fasttrain.lab.data import corpus_from_text

    corpus = corpus_from_text(toy_text(400_000))
    cfg = preset("shakespeare-char", device="cuda")
    # a 6 GiB device: the estimator prunes the larger micro-batches of eager attention before any run
    res = T.tune(cfg, seq=256, global_batch_tokens=256 * 256, corpus=corpus, budget="4m", steps=3,
                 memory_limit_bytes=6 * 2 ** 30, cache_path=None, out=tmp_path / "run")
    assert res.pruned > 0 and res.pick is not None and res.pick.ok
    probe = res.pick.last
    assert probe.peak_bytes and probe.peak_bytes <= 6 * 2 ** 30
    if not res.pick.candidate.overrides_dict().get("torch_compile") and \
            not res.pick.candidate.overrides_dict().get("use_liger_kernel"):
        assert abs(res.pick.predicted_bytes - probe.peak_bytes) <= 0.10 * probe.peak_bytes
    rows = R.ranked_rows(res)
    assert all(abs(r["loss_vs_baseline"]) < 0.05 for r in rows if r["loss_vs_baseline"] is not None)


@pytest.mark.slow
def test_bench_harness_every_phase_on_the_cpu(tmp_path):
    """prepare, both HF Trainer runs, tune, a grid of 3, confirm and the report, on a tiny GPT-2 (needs the lab's
    --model hf: and --train-bin)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from dataclasses import fields as dc_fields
    from fasttrain.lab.config import LabConfig
    names = {f.name for f in dc_fields(LabConfig)}
    if not {"model", "train_bin"} <= names:
        pytest.skip("this lab has no --model / --train-bin yet (the model and data branches of issue 28)")
    bench = _bench_module()
    work, results = tmp_path / "work", tmp_path / "results"
    assert bench.main(["all", str(work), "--model", "tiny-gpt2", "--steps", "1", "--skip", "1", "--budget", "40s",
                       "--probe-steps", "1", "--max-candidates", "2", "--grid-size", "3", "--grid-steps", "1",
                       "--confirm-steps", "2", "--results", str(results)]) == 0
    state = bench.load_state(work, "tiny-gpt2")
    assert state["tune"]["pick"] and state["tune"]["pick_tokens_per_s"] > 0
    # at least --grid-size points: more where covering every axis choice needs more (a GPU's compile modes)
    assert len(state["grid"]) == len(state["grid_members"]) >= 3
    assert state["confirm"]["oom"] is False and state["confirm"]["steps"] == 2
    (folder,) = list(results.iterdir())
    case = json.loads((folder / "tune.json").read_text())["cases"][0]
    assert tuple(case) == bench.CASE_KEYS
    assert case["best_tokens_per_s"] == max(g["tokens_per_s"] for g in state["grid"].values())
    assert "--model hf:" in state["tune"]["lab_command"] and state["tune"]["lab_command"].count("--model") == 1
    # tune's own answer travels with the comparison
    assert json.loads((folder / "tiny-gpt2-tune" / "tune.json").read_text())["pick"]["label"] == state["tune"]["pick_label"]


def test_a_probe_a_library_cannot_run_is_recorded_and_the_search_goes_on():
    class Broken(FakeMeasure):
        def __call__(self, cfg, steps):
            if cfg.attn_implementation == "sdpa":
                raise RuntimeError("backend compiler failed\nlong trace")
            return super().__call__(cfg, steps)
    fixed = {"optim", "preload", "dataloader_num_workers", "use_liger_kernel", "torch_compile", "bf16",
             "gradient_checkpointing"}
    res = run_search(Broken(), gpu_memory(4000), fixed=fixed, max_candidates=16)
    failed = [r for r in R.ranked_rows(res) if r["status"].startswith("failed")]
    assert failed and failed[0]["status"] == "failed: RuntimeError: backend compiler failed"
    assert res.base.with_(**res.pick.candidate.overrides_dict()).attn_implementation == "eager"


def test_every_probe_releases_what_it_leaves_in_the_process(monkeypatch):
    """A probe's liger patches, compiled code and CUDA-graph pool must not reach the next probe: each probe
    ends with the lab's release, an out-of-memory one too."""
    from fasttrain.lab import measure as M
    from fasttrain.lab.data import corpus_from_text

    released = []
    monkeypatch.setattr(M, "release_run_state", lambda cfg: released.append(cfg.per_device_train_batch_size))
    measure = T.lab_measure(corpus=corpus_from_text(toy_text(20000)))
    probe = measure(base().with_(context=16, per_device_train_batch_size=2), 1)
    assert probe.tokens_per_s and released == [2]


def test_a_probe_warms_up_on_micro_batches_not_on_whole_steps():
    """Compilation and CUDA graphs' recording take the first three forward/backward calls: a step of many
    micro-batches covers them in one untimed step (the probe's time goes to measuring), a step of one
    micro-batch needs three."""
    for accumulation, warm in ((1, 3), (2, 2), (3, 1), (32, 1)):
        assert T.warmup_steps_for(base(gradient_accumulation_steps=accumulation)) == warm


def test_a_probe_runs_its_warmup_untimed_then_its_timed_steps(monkeypatch):
    from fasttrain.lab.data import corpus_from_text

    seen = []
    real = T.probe_config
    monkeypatch.setattr(T.probes, "probe_config", lambda cfg, steps, warmup: seen.append((steps, warmup)) or
                        real(cfg, steps, warmup))
    measure = T.lab_measure(corpus=corpus_from_text(toy_text(20000)))
    probe = measure(base().with_(context=16, per_device_train_batch_size=2, gradient_accumulation_steps=2), 2)
    assert seen == [(2, 2)] and probe.steps == 2 and probe.tokens_per_s
    T.lab_measure(corpus=corpus_from_text(toy_text(20000)), warmup=1)(base().with_(context=16), 1)
    assert seen[-1] == (1, 1)


@pytest.mark.slow
def test_bench_grid_reads_tunes_probes_and_stops_when_told(tmp_path):
    """The benchmark's grid measures each point once, saves after every point, reads a point tune measured
    from tune's probe cache (run tune first: its search time stays its own), and --stop-after leaves the
    rest for the next call."""
    pytest.importorskip("transformers")
    bench = _bench_module()
    work = tmp_path / "work"
    assert bench.main(["prepare,tune", str(work), "--model", "tiny-gpt2", "--budget", "60s", "--max-candidates", "2"]) == 0
    assert bench.main(["grid", str(work), "--model", "tiny-gpt2", "--grid-size", "6", "--stop-after", "0"]) == 0
    state = bench.load_state(work, "tiny-gpt2")
    assert len(state["grid_members"]) == 6 and not state.get("grid")      # stopped before the first point
    # a member tune measured: the grid takes tune's probe of it rather than measuring again
    pick = state["tune"]["pick"]
    state["grid_members"][0] = pick
    bench.save_state(work, "tiny-gpt2", state)
    assert bench.main(["grid", str(work), "--model", "tiny-gpt2", "--grid-size", "6"]) == 0
    grid = bench.load_state(work, "tiny-gpt2")["grid"]
    # (the pick, timing-dependent, may be another member too: one point each)
    points = {json.dumps(sorted(m.items()), default=str) for m in state["grid_members"]}
    assert set(grid) == points and all(g["tokens_per_s"] or g["error"] for g in grid.values())
    # tune measured its pick at the first rung's steps, the grid's: read from the cache, not measured again
    first = grid[json.dumps(sorted(pick.items()), default=str)]
    assert first["from_tune_cache"] and first["tokens_per_s"] > 0 and first["steps"] >= 3    # tune's, the longer
    assert not all(g["from_tune_cache"] for g in grid.values())
    assert {g["steps"] for g in grid.values() if not g["from_tune_cache"]} == {1}     # the grid's own: one step
    with pytest.raises(SystemExit):
        bench.main(["prepare,nonsense", str(work), "--model", "tiny-gpt2"])


@pytest.mark.slow
def test_bench_two_lanes_share_one_grid_and_merge(tmp_path, monkeypatch):
    """A lease of two GPUs: lane A fixes the grid before its search, lane B measures the same members, each point
    is taken by one lane only (the claims folder), a point starts only where its expected time fits the call, and
    merge folds lane B's figures into lane A's, every figure naming its GPU."""
    pytest.importorskip("transformers")
    bench = _bench_module()
    a, b, claims = tmp_path / "a", tmp_path / "b", tmp_path / "claims"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert bench.main(["prepare,fix-grid", str(a), "--model", "tiny-gpt2", "--grid-size", "6"]) == 0
    members = bench.load_state(a, "tiny-gpt2")["grid_members"]
    assert len(members) == 6 and not bench.load_state(a, "tiny-gpt2").get("grid")
    # lane B before lane A fixed anything: one line
    with pytest.raises(SystemExit, match="holds no fixed grid yet"):
        bench.grid_case(b, "tiny-gpt2", cuda=False, size=6, steps=1, part=(1, 1), members_from=tmp_path / "none")
    # too little time for any point: none starts, none is claimed
    assert bench.main(["prepare", str(b), "--model", "tiny-gpt2"]) == 0
    assert bench.main(["grid", str(b), "--model", "tiny-gpt2", "--members-from", str(a), "--claims", str(claims),
                       "--time-left", "5"]) == 0
    assert not bench.load_state(b, "tiny-gpt2").get("grid") and not list(claims.glob("*"))
    # lane A holds points 1 and 3 (claimed, in flight); lane B measures the others
    claims.mkdir(exist_ok=True)
    for i in (1, 3):
        (claims / str(i)).touch()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert bench.main(["grid", str(b), "--model", "tiny-gpt2", "--members-from", str(a), "--claims", str(claims)]) == 0
    grid_b = bench.load_state(b, "tiny-gpt2")["grid"]
    assert set(grid_b) == {bench.point_key(members[i]) for i in (0, 2, 4, 5)}
    assert {g["gpu"] for g in grid_b.values()} == {"1"}
    assert sorted(p.name for p in claims.glob("*.done")) == [f"{i}.done" for i in (0, 2, 4, 5)]
    # lane A measures what it holds once its claims are its own again (the lease script clears unfinished ones)
    for i in (1, 3):
        (claims / str(i)).unlink()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert bench.main(["grid", str(a), "--model", "tiny-gpt2", "--claims", str(claims)]) == 0
    assert set(bench.load_state(a, "tiny-gpt2")["grid"]) == {bench.point_key(members[i]) for i in (1, 3)}
    # lane B's HF figures and points fold into lane A's state, twice the same
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert bench.main(["hf", str(b), "--model", "tiny-gpt2", "--steps", "1", "--skip", "1"]) == 0
    for _ in range(2):
        assert bench.main(["merge", str(a), "--model", "tiny-gpt2", "--from", str(b)]) == 0
    state = bench.load_state(a, "tiny-gpt2")
    assert set(state["grid"]) == {bench.point_key(m) for m in members} and state["hf"]["gpu"] == "1"
    assert bench.grid_left(state) == 0
    line = bench.lanes_line(state)
    assert "2 GPUs of one host" in line and "GPU 0: 2 grid point(s)" in line
    assert "GPU 1: the HF Trainer as users run it, 4 grid point(s)" in line
    # the cross-check: the grid's best measured on each card
    state["crosscheck"] = [{"what": "pick", "gpu": "0", "tokens_per_s": 100.0, "steps": 3},
                           {"what": "pick", "gpu": "1", "tokens_per_s": 99.0, "steps": 3}]
    assert ("The same configuration on both cards (pick, 3 timed steps): 100 tokens/s on GPU 0, 99 on GPU 1 "
            "(0.990x).") in bench.lanes_line(state)
    # the goals' ratios from one card: the pick's cross-check where the HF Trainer ran (GPU 1), tune on GPU 0
    one_card = {**state, "tune": {"gpu": "0", "pick_tokens_per_s": 100.0}, "hf": {**state["hf"], "tokens_per_s": 45.0}}
    assert ("On GPU 1, where the HF Trainer as users run it ran (45 tokens/s), the pick's cross-check is 2.200x it."
            in bench.lanes_line(one_card))
    assert "where the HF Trainer" not in bench.lanes_line({**one_card, "tune": {"gpu": "1"}})
    # figures kept from an earlier lease (reuse_state.py) are named apart, never as this lease's cards'
    kept = {**state, "hf": {**state["hf"], "reused_from": "abc, 4 x H200"},
            "grid": {k: ({**g, "reused_from": "abc, 4 x H200"} if g["gpu"] == "1" else g)
                     for k, g in state["grid"].items()}, "crosscheck": []}
    assert bench.lanes_line(kept) == ("Kept from an earlier lease (abc, 4 x H200), which the change since cannot "
                                      "reach: the HF Trainer as users run it, 4 grid point(s); the rest measured in "
                                      "this one.")
    assert bench.gpu_text(None) == "the lease's one GPU" and bench.gpu_text("2") == "GPU 2"
    bench.save_state(a, "tiny-gpt2", {**state, "crosscheck": []})
    assert bench.main(["crosscheck", str(b), "--model", "tiny-gpt2", "--from", str(a),
                       "--crosscheck-steps", "1"]) == 0
    rows = bench.load_state(b, "tiny-gpt2")["crosscheck"]
    assert [r["what"] for r in rows] == ["grid's best"] and rows[0]["gpu"] == "1" and rows[0]["tokens_per_s"]
    # another grid is never merged
    other = bench.load_state(b, "tiny-gpt2")
    other["grid_members"] = other["grid_members"][:2]
    bench.save_state(b, "tiny-gpt2", other)
    with pytest.raises(SystemExit, match="another grid"):
        bench.main(["merge", str(a), "--model", "tiny-gpt2", "--from", str(b)])
    with pytest.raises(SystemExit):
        bench.main(["merge", str(a), "--model", "tiny-gpt2"])


@pytest.mark.slow
def test_the_lanes_script_takes_a_case_through_on_three_fake_gpus(tmp_path):
    """dev/device/tune_lanes.sh on the CPU, three lanes (an nvidia-smi that lists four GPUs; every lane's process
    on the CPU): one call takes the tiny case through -- the grid fixed, tune, the Trainer as users run it and its
    search shared, every grid point, the cross-check on each card, then the confirmation and the Trainer's alone
    runs on GPU 0 -- and leaves lane a's merged state, the lanes' logs and tune's folder in $OUT; a side command
    ran once on the fourth GPU, its files back in one tarball."""
    import subprocess
    import tarfile
    from pathlib import Path

    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[1]
    bin_dir, out, work = tmp_path / "bin", tmp_path / "out", tmp_path / "tmp"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text('#!/bin/bash\ncase "$*" in *-L*) for i in 0 1 2 3; do echo "GPU $i: fake"; done;; *) exit 1;; esac\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), TUNE_TMP=str(work), CALL_S="420",
               GPU_TESTS="none", FASTTRAIN_GIT_SHA="test", LANES="3",
               SIDE='echo "side on GPU $CUDA_VISIBLE_DEVICES" > "$OUT/ran.txt"')
    done = subprocess.run(["bash", "dev/device/tune_lanes.sh", "tiny-gpt2", "--budget", "1m"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    state = json.loads((out / "tiny-gpt2-state.json").read_text())
    bench = _bench_module()
    assert bench.grid_left(state) == 0 and state["tune"]["pick"] and state["hf"]["tokens_per_s"]
    assert state["hf_flags"]["complete"]
    assert state["confirm"]["gpu"] == state["alone"]["gpu"] == "0" and state["confirm"]["steps"] == 200
    assert {r["gpu"] for r in state["crosscheck"]} == {"0", "1", "2"}
    assert {g["gpu"] for g in state["grid"].values()} <= {"0", "1", "2"}
    assert bench.case_of(state)["long_run"]["gpu"] == "0"
    with tarfile.open(out / "tiny-gpt2-lanes.tar.gz") as tar:
        names = tar.getnames()
    assert {f"tune-logs/tiny-gpt2-lane-{x}.log" for x in "abc"} <= set(names)
    assert (out / "tiny-gpt2-tune-folder.tar.gz").is_file()
    with tarfile.open(out / "side.tgz") as tar:
        assert tar.extractfile("side/ran.txt").read().decode().strip() == "side on GPU 3"
        assert "side/side.log" in tar.getnames()

    # a second lease started from this one's state (REUSE): the Trainer's figures and the grid's points the change
    # cannot reach are kept, marked; only the dropped points, tune and the long run are measured again
    key, value = next((k, m[k]) for m in state["grid_members"] for k in sorted(m)
                      if 0 < sum(n.get(k) == m[k] for n in state["grid_members"]) < len(state["grid_members"]))
    out2 = tmp_path / "out2"
    env2 = dict(env, OUT=str(out2), TUNE_TMP=str(tmp_path / "tmp2"), CROSSCHECK="0", SIDE="",
                REUSE=f"{out / 'tiny-gpt2-state.json'} --drop-grid {key}={json.dumps(value)} --label earlier")
    done = subprocess.run(["bash", "dev/device/tune_lanes.sh", "tiny-gpt2", "--budget", "1m"], cwd=root, env=env2,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    again = json.loads((out2 / "tiny-gpt2-state.json").read_text())
    assert bench.grid_left(again) == 0 and again["confirm"]["steps"] == 200 and not again.get("crosscheck")
    for row in again["grid"].values():
        assert (row.get("reused_from") == "earlier") == (row["overrides"].get(key) != value)
    assert again["hf"]["reused_from"] == "earlier" and again["hf_flags"]["complete"]
    assert all(p["reused_from"] == "earlier" for p in again["hf_search_points"])
    assert "reused_from" not in again["tune"]


@pytest.mark.slow
def test_the_one_gpu_queue_takes_a_case_through_in_two_sessions(tmp_path):
    """dev/device/tune_case.sh on the CPU, one GPU's queue over two sessions: the first (SKIP="tune confirm alone")
    fixes the grid and measures the Trainer as users run it, its whole search and the grid's points; the second
    starts from that state (REUSE, some grid points dropped), on a fresh machine, and runs tune, the dropped points,
    the confirmation, the Trainer's figures again alone and the profile -- what the first measured kept, marked,
    never measured twice; a third, from the second's state before its confirmation (--keep-tune), only the long
    run."""
    import subprocess
    from pathlib import Path

    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[1]
    bench = _bench_module()

    def session(n: int, **extra) -> dict:
        out = tmp_path / f"out{n}"
        env = dict(os.environ, OUT=str(out), TUNE_TMP=str(tmp_path / f"tmp{n}"), CALL_S="400", GPU_TESTS="none",
                   FASTTRAIN_GIT_SHA="test", **extra)
        done = subprocess.run(["bash", "dev/device/tune_case.sh", "tiny-gpt2", "--budget", "1m"], cwd=root, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        # the device returns 8 files a call: the rest are packed into more.tgz
        assert len([p for p in out.iterdir() if p.is_file()]) <= 8
        return json.loads((out / "tiny-gpt2-state.json").read_text())

    first = session(1, SKIP="tune confirm alone")
    assert first["hf_flags"]["complete"] and first["hf"]["tokens_per_s"] and first["grid_members"]
    assert not any(k in first for k in ("tune", "confirm", "alone")) and bench.grid_left(first) == 0
    (tmp_path / "first.json").write_text(json.dumps(first))
    key, value = next((k, m[k]) for m in first["grid_members"] for k in sorted(m)
                      if 0 < sum(n.get(k) == m[k] for n in first["grid_members"]) < len(first["grid_members"]))
    second = session(2, REUSE=f"{tmp_path / 'first.json'} --drop-grid {key}={json.dumps(value)} --label first")
    for row in second["grid"].values():
        assert (row.get("reused_from") == "first") == (row["overrides"].get(key) != value)
    assert second["hf"]["reused_from"] == "first" and second["tune"]["pick"] and second["confirm"]["steps"] == 200
    assert all(p["reused_from"] == "first" for p in second["hf_search_points"])
    assert len(second["hf_search_points"]) == len(first["hf_search_points"])
    assert second["grid_members"] == first["grid_members"] and bench.grid_left(second) == 0
    assert bench.case_of(second)["long_run"]["pick_tokens_per_s"] == second["confirm"]["tokens_per_s"]
    assert (tmp_path / "out2" / "tiny-gpt2-profile.json").is_file()

    # a lease that ran out before its confirmation (nothing changed since) goes on from its pick: --keep-tune keeps
    # tune's search too, and the third session measures only the confirmation and the Trainer's figures alone
    ran_out = {k: v for k, v in second.items() if k not in ("confirm", "alone")}
    (tmp_path / "second.json").write_text(json.dumps(ran_out))
    third = session(3, REUSE=f"{tmp_path / 'second.json'} --keep-tune --label second")
    assert third["tune"]["reused_from"] == "second" and third["tune"]["pick"] == second["tune"]["pick"]
    assert third["confirm"]["steps"] == 200 and "reused_from" not in third["confirm"] and third["alone"]
    assert all(row.get("reused_from") for row in third["grid"].values()) and bench.grid_left(third) == 0


def test_a_lease_reuses_an_earlier_ones_trainer_and_the_grid_points_a_change_cannot_reach(tmp_path, capsys):
    """dev/tune/reuse_state.py: lane a gets the fixed grid and the points no --drop-grid value matches, a Trainer
    lane those too, the Trainer's figures and its done-hf marker; --keep-tune keeps tune's pick too; every kept
    figure is marked; a state already there, a state without the Trainer (or tune, to keep) and a malformed
    --drop-grid are refused with one line."""
    reuse = _dev_tune_module("reuse_state")
    members = [{"b": 8, "liger": True}, {"b": 16, "liger": False}, {"b": 32, "liger": False}]
    earlier = {"model": "m", "grid_members": members, "hf": {"tokens_per_s": 1.0},
               "hf_search_points": [{"batch": 8, "flags": {}, "status": "ok", "tokens_per_s": 2.0}],
               "grid": {json.dumps(sorted(m.items())): {"tokens_per_s": 3.0, "overrides": m} for m in members},
               "tune": {"pick": members[0]}}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    a, b = tmp_path / "a", tmp_path / "b"
    assert reuse.main([str(path), "--work", str(a), "--lane", str(b), "--drop-grid", "liger=true",
                       "--label", "x"]) == 0
    lane_a, lane_b = (json.loads((w / "m" / "state.json").read_text()) for w in (a, b))
    assert [r["overrides"]["b"] for r in lane_a["grid"].values()] == [16, 32] and lane_b["grid"] == lane_a["grid"]
    assert all(r["reused_from"] == "x" for r in lane_a["grid"].values())
    assert "tune" not in lane_a and "hf" not in lane_a and lane_a["grid_members"] == members
    assert lane_b["hf"]["reused_from"] == "x" and lane_b["hf_search_points"][0]["reused_from"] == "x"
    assert (b / "m" / "done-hf").exists() and not (a / "m" / "done-hf").exists()
    for argv, says in (([str(path), "--work", str(a), "--label", "x"], "exists"),
                       ([str(path), "--work", str(tmp_path / "c"), "--drop-grid", "liger", "--label", "x"],
                        "give KEY=VALUE")):
        with pytest.raises(SystemExit):
            reuse.main(argv)
        assert says in capsys.readouterr().err
    # a lease that ran out before its confirmation goes on from its pick on one GPU: tune kept and marked, the
    # queue's phases before it done; a state without tune's search cannot be kept that way
    one = tmp_path / "one"
    assert reuse.main([str(path), "--work", str(one), "--keep-tune", "--label", "x"]) == 0
    kept = json.loads((one / "m" / "state.json").read_text())
    assert kept["tune"] == {"pick": members[0], "reused_from": "x"} and kept["hf"]["reused_from"] == "x"
    assert len(kept["grid"]) == 3 and all((one / "m" / f"done-{p}").exists() for p in ("fix-grid", "tune", "hf"))
    assert not (b / "m" / "done-tune").exists() and "tune" not in lane_a
    untuned = tmp_path / "untuned.json"
    untuned.write_text(json.dumps({k: v for k, v in earlier.items() if k != "tune"}))
    with pytest.raises(SystemExit):
        reuse.main([str(untuned), "--work", str(tmp_path / "e"), "--keep-tune", "--label", "x"])
    assert "no tune in it" in capsys.readouterr().err
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"model": "m"}))
    with pytest.raises(SystemExit):
        reuse.main([str(bare), "--work", str(tmp_path / "d"), "--label", "x"])
    assert "no grid_members, hf in it" in capsys.readouterr().err
    assert not any((tmp_path / w).exists() for w in "cde")


def test_configurations_the_model_refuses_are_dropped_before_any_probe():
    """A combination the model's own check refuses (liger's layer kernels under a whole-model compile) is
    never probed: one line per reason, with how many configurations it takes."""
    def refuse(cfg):
        return "no liger under a whole-model compile" if cfg.torch_compile and cfg.use_liger_kernel else None

    measure = FakeMeasure()
    res = T.search(base(), seq=SEQ, global_batch_tokens=SEQ * 16, measure=measure, predict=fake_predict,
                   memory=gpu_memory(), liger_reason=None, refuse=refuse, max_candidates=64)
    (line,) = [d for d in res.dropped if "the model refuses" in d]
    assert line.endswith("configuration(s) the model refuses: no liger under a whole-model compile")
    assert int(line.split()[0]) > 0
    assert measure.calls and not any(refuse(cfg) for cfg, _ in measure.calls)


def test_a_transformers_model_refuses_liger_under_a_whole_model_compile():
    pytest.importorskip("transformers")
    pytest.importorskip("liger_kernel")
    llama = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    refuse = T.model_refusal(llama, torch.device("cuda"))
    cfg = LabConfig(name="custom").with_(context=64, use_liger_kernel=True, torch_compile=True)
    assert "--torch-compile-scope blocks" in refuse(cfg)
    assert refuse(cfg.with_(torch_compile_scope="blocks")) is None
    assert refuse(cfg.with_(liger_kernels="fused_linear_cross_entropy")) is None     # the lab's head, after the graph
    assert refuse(cfg.with_(context=256)).startswith("--context 256 exceeds")
    assert T.model_refusal(None, torch.device("cuda"))(cfg) is None         # the lab's GPT: validate judged it


def hf_tune_config(tmp_path, config) -> LabConfig:
    """A GPU run of the transformers model ``config`` (saved in ``tmp_path / "model"``) on random token files of its
    vocabulary, for tune."""
    import numpy as np

    folder = tmp_path / "model"
    config.save_pretrained(folder)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, config.vocab_size, size=200_000, dtype=np.int64).astype(np.uint16).tofile(
            tmp_path / f"{split}.bin")
    return LabConfig(name="custom").with_(model=f"hf:{folder}", train_bin=str(tmp_path / "train.bin"),
                                          val_bin=str(tmp_path / "val.bin"), bin_dtype="uint16", device="cuda",
                                          eval_interval=0, eval_tokens=128, warmup_steps=0)


@pytest.mark.gpu
def test_tune_on_a_gpu_never_probes_what_a_transformers_model_refuses(tmp_path):
    """A HF Llama with liger's kernels searched: the combinations its check refuses (liger's fused cross-entropy
    under a whole-model compile) are dropped in one line before any probe, and no probe fails for that reason."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("liger_kernel")
    cfg = hf_tune_config(tmp_path, transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True))
    res = T.tune(cfg, seq=128, global_batch_tokens=128 * 16, budget="2m", steps=1, cache_path=None,
                 out=tmp_path / "run", fixed=("attn_implementation", "gradient_checkpointing", "optim", "preload"))
    assert any("the model refuses: --use-liger-kernel with --torch-compile" in d for d in res.dropped)
    rows = R.ranked_rows(res)
    assert rows and not any("does not trace" in str(r["status"]) for r in rows)
    assert res.pick is not None and res.pick.ok


@pytest.mark.gpu
def test_tune_on_a_gpu_probes_gpt2s_fused_cross_entropy(tmp_path):
    """A HF GPT-2 (liger has no patch for it): tune's liger axis is the fused cross-entropy alone on its head, and
    its probes run, eager, per block and whole compiled, without an error."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("liger_kernel")
    cfg = hf_tune_config(tmp_path, transformers.GPT2Config(vocab_size=8192, n_embd=128, n_layer=2, n_head=4,
                                                           n_positions=256))
    res = T.tune(cfg, seq=128, global_batch_tokens=128 * 16, budget="3m", steps=1, cache_path=None,
                 fixed=("attn_implementation", "gradient_checkpointing", "optim", "preload"), max_candidates=16)
    assert any("its fused linear cross-entropy alone (on the model's head) searched" in d for d in res.dropped)
    fused = [e for e in res.entries if e.probes and dict(e.candidate.choices).get("liger") == "fused-ce"]
    assert fused and not any(e.last.error and not (e.last.oom or e.last.stopped) for e in fused), \
        [(e.candidate.label, e.last.error) for e in fused]
    assert {dict(e.candidate.choices)["compile"] for e in fused if e.ok} >= {"none"}


# --- fixed flags and the cache never silently changed (issue 40) ----------------------------------

def test_a_fixed_accumulation_is_kept_or_refused_never_changed():
    """``--gradient-accumulation-steps 2`` was replaced by whatever the micro-batch left (16 / b)."""
    res = T.tune(
        base(gradient_accumulation_steps=2), seq=SEQ, global_batch_tokens=SEQ * 16, measure=FakeMeasure(),
        predict=fake_predict, memory=gpu_memory(), cache_path=None, liger_reason=None,
        fixed={"gradient_accumulation_steps"}, steps=1)
    assert {(e.candidate.micro_batch, e.candidate.accumulation) for e in res.entries} == {(8, 2)}
    with pytest.raises(FasttrainError, match=r"--gradient-accumulation-steps 3 does not divide the 16 sequences"):
        T.tune(base(gradient_accumulation_steps=3), seq=SEQ, global_batch_tokens=SEQ * 16, measure=FakeMeasure(),
               predict=fake_predict, memory=gpu_memory(), cache_path=None, fixed={"gradient_accumulation_steps"})


def test_a_fixed_micro_batch_that_misses_the_global_batch_is_refused():
    """A fixed micro-batch of 3 took 16 // 3 = 5 steps of accumulation: 15 sequences, said to be 16."""
    measure = FakeMeasure()
    with pytest.raises(FasttrainError) as exc:
        T.tune(base(per_device_train_batch_size=3), seq=SEQ, global_batch_tokens=SEQ * 16, measure=measure,
               predict=fake_predict, memory=gpu_memory(), cache_path=None, fixed={"per_device_train_batch_size"})
    assert "--per-device-train-batch-size 3 does not divide the 16 sequences" in str(exc.value)
    assert "\n" not in str(exc.value) and measure.calls == []


@pytest.mark.parametrize("content", ["my notes", json.dumps({"kind": "lab-run", "config": {}})])
def test_the_cache_never_overwrites_a_file_that_is_not_a_cache(tmp_path, content):
    """``--cache run.json`` replaced the record (or any file) with the probes."""
    target = tmp_path / "file.json"
    target.write_text(content)
    with pytest.raises(FasttrainError, match="is not the probe cache of a lab run"):
        T.tune(base(), seq=SEQ, global_batch_tokens=SEQ * 4, measure=FakeMeasure(), predict=fake_predict,
               memory=gpu_memory(), cache_path=target, liger_reason=None)
    assert target.read_text() == content


def test_the_cache_creates_no_folders_of_a_mistyped_path(tmp_path):
    with pytest.raises(FasttrainError, match="does not exist; create it first"):
        T.tune(base(), seq=SEQ, global_batch_tokens=SEQ * 4, measure=FakeMeasure(), predict=fake_predict,
               memory=gpu_memory(), cache_path=tmp_path / "typo" / "cache.json", liger_reason=None)
    assert not (tmp_path / "typo").exists()


def test_partial_checkpointing_is_searched_where_no_fewer_recomputed_blocks_fit():
    """Of the checkpointing choices 'the first k blocks recompute' only the fewest predicted to fit is measured
    (one more recomputed block costs its forward again), and it is picked over recomputing every block; the
    answer says the Trainer cannot express it."""
    layers = 8

    def recomputed(cfg):
        return (cfg.checkpoint_blocks or layers) if cfg.gradient_checkpointing == "full" else 0

    def predict(cfg):       # 20 MiB a sequence kept whole, a quarter of it for a recomputed block
        per = 20.0 * (layers - recomputed(cfg)) / layers + 5.0 * recomputed(cfg) / layers
        return int((100 + per * cfg.per_device_train_batch_size) * MIB)

    calls = []

    def measure(cfg, steps):
        calls.append(cfg)
        return T.Probe(steps=steps, tokens_per_s=1000.0 * (1 - 0.3 * recomputed(cfg) / layers),
                       peak_bytes=predict(cfg), reserved_bytes=predict(cfg), losses=[3.0] * (steps + 2))
    fixed = {"optim", "preload", "dataloader_num_workers", "use_liger_kernel", "torch_compile", "bf16",
             "attn_implementation", "per_device_train_batch_size"}
    # 16 sequences: none needs 420 MiB, every block recomputed 180, the first k 420 - 30 k; 350 MiB are free
    res = T.tune(base(layers=layers, per_device_train_batch_size=16, attn_implementation="sdpa"), seq=SEQ,
                 global_batch_tokens=SEQ * 16, measure=measure, predict=predict, memory=gpu_memory(400),
                 fixed=fixed, liger_reason=None, cache_path=None, steps=2)
    measured = {(c.gradient_checkpointing, c.checkpoint_blocks) for c in calls}
    assert measured == {("full", 0), ("full", 3)}
    pick = res.base.with_(**res.pick.candidate.overrides_dict())
    assert (pick.gradient_checkpointing, pick.checkpoint_blocks) == ("full", 3)
    assert any("partial checkpointing" in line for line in res.dropped)
    from fasttrain.lab.tune.report import training_arguments

    _, _, notes = training_arguments(pick)
    assert any("the first 3 blocks only has no TrainingArguments flag" in n for n in notes)
