"""The lab's progress (fasttrain.lab.progress): the expected time of a run from its first measured
steps, the time left, and callbacks that do not take the loss."""

from __future__ import annotations

from fasttrain.lab import progress as P


def test_step_clock_measures_after_the_warm_up():
    ticks = iter([10.0, 12.0, 14.0, 16.0, 18.0])        # step 1 (warm-up) ends at 10 s, then 2 s a step
    clock = P.StepClock(total=100, warmup_steps=1, clock=lambda: next(ticks))
    clock.begin()
    clock.tick(1)
    assert clock.step_s() is None                        # nothing measured during the warm-up
    clock.tick(2)
    clock.tick(3)
    assert clock.step_s() == 2.0 and not clock.ready_to_say()
    clock.tick(4)
    assert clock.ready_to_say() and clock.seconds_left(4) == 2.0 * 96


def test_expected_line_on_a_cpu_says_how_to_get_seconds():
    line = P.expected_line(5000, 1.61, 4, 6, "cpu")
    assert line.startswith("expected: about 2 h 14 min for 5,000 steps (1.61 s a step over steps 4-6, cpu")
    assert "--preset tiny" in line
    assert "--preset tiny" not in P.expected_line(5000, 0.05, 4, 6, "cuda")


def test_format_duration():
    assert P.format_duration(41) == "41 s" and P.format_duration(724) == "12 min 04 s"
    assert P.format_duration(3 * 3600 + 5 * 60) == "3 h 05 min" and P.format_duration(2.5) == "2.5 s"


def test_report_passes_the_loss_only_to_callbacks_that_take_it():
    seen = []
    P.report(lambda step, total: seen.append((step, total)), 3, 10, loss=1.5)

    class WithLoss:
        takes_loss = True

        def __call__(self, step, total, loss=None):
            seen.append((step, total, loss))
    P.report(WithLoss(), 4, 10, loss=1.25)
    P.report(None, 5, 10)
    assert seen == [(3, 10), (4, 10, 1.25)]


def test_run_progress_prints_the_expected_time_once(capsys):
    from rich.console import Console

    console = Console(stderr=True, force_terminal=False, width=200)
    ticks = iter(float(t) for t in range(0, 1000, 30))            # 30 s a step
    bar = P.RunProgress("lab x", 50, tokens_per_step=1000, warmup_steps=1, device="cpu", console=console,
                        clock=lambda: next(ticks))
    with bar:
        for step in range(1, 8):
            bar(step, 50, loss=2.0)
    assert len(bar.lines) == 1 and bar.lines[0].startswith("expected: about 25 min 00 s for 50 steps (30 s a step")
