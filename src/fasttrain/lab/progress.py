"""Progress of a long lab run: a rich bar with the loss, the throughput and the time left, and one
line with the expected time of the whole run once its first steps are measured.

A GPU-sized run started on a CPU would otherwise begin hours of work without a word: after the
timing warm-up and a few measured steps, :class:`RunProgress` prints

    expected: about 2 h 14 min for 5,000 steps (1.61 s a step over steps 4-6, cpu; validation extra)

and, where that is long on a CPU, how to get a run of seconds. The bar's time left is the same
estimate, updated as the steps go: (steps left) x (mean seconds a step since the warm-up).

Callers of a training loop pass the bar as ``progress``; the loop reports through
:func:`report`, which hands the loss only to callbacks that take it (a plain ``progress(step,
total)`` keeps working).
"""

from __future__ import annotations

import time

# the first measured steps (after the timing warm-up) the expected time is computed from
MEASURED_STEPS = 3
# an expected time above this many seconds gets the line (shorter runs speak for themselves)
WORTH_SAYING_S = 60.0
# the clock of the bars (a test replaces it)
CLOCK = time.perf_counter


def report(progress, step: int, total: int, loss: float | None = None) -> None:
    """Call ``progress(step, total)``, with ``loss=`` when the callback takes it."""
    if progress is None:
        return
    if getattr(progress, "takes_loss", False):
        progress(step, total, loss=loss)
    else:
        progress(step, total)


def format_duration(seconds: float) -> str:
    """``3 h 05 min``, ``12 min 04 s``, ``41 s``."""
    seconds = max(0.0, float(seconds))
    if seconds >= 3600:
        h, rest = divmod(int(round(seconds)), 3600)
        return f"{h} h {rest // 60:02d} min"
    if seconds >= 60:
        m, s = divmod(int(round(seconds)), 60)
        return f"{m} min {s:02d} s"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def expected_line(total: int, step_s: float, first: int, last: int, device: str) -> str:
    """The line printed once the first steps are measured (see the module docstring)."""
    expected = total * step_s
    line = (f"expected: about {format_duration(expected)} for {total:,} steps ({step_s:.3g} s a step over steps "
            f"{first}-{last}, {device}; validation extra)")
    if device == "cpu" and expected > 10 * WORTH_SAYING_S:
        line += ("; on a CPU, --preset tiny (or fewer --max-steps) trains in seconds, this size wants a GPU; "
                 "Ctrl-C stops it and writes nothing")
    return line


class StepClock:
    """Seconds a step after the warm-up: the expected total and the time left, without rich."""

    def __init__(self, total: int, warmup_steps: int, clock=None):
        self.total, self.warmup = total, max(0, warmup_steps)
        self.clock = clock or CLOCK
        self.start = None           # the time the first measured step began (end of the warm-up)
        self.now = None
        self.measured = 0
        self.said = False

    def begin(self) -> None:
        """The loop starts: with no warm-up, the first step is measured from here."""
        if self.warmup == 0:
            self.start = self.now = self.clock()

    def tick(self, step: int) -> None:
        """Step ``step`` (1-based) has ended."""
        self.now = self.clock()
        if step == self.warmup:
            self.start = self.now
        elif step > self.warmup and self.start is not None:
            self.measured = step - self.warmup

    def step_s(self) -> float | None:
        if self.start is None or not self.measured:
            return None
        return (self.now - self.start) / self.measured

    def seconds_left(self, step: int) -> float | None:
        s = self.step_s()
        return None if s is None else s * (self.total - step)

    def ready_to_say(self) -> bool:
        """Once: after MEASURED_STEPS measured steps (or the last step, if fewer)."""
        if self.said or self.step_s() is None:
            return False
        done = self.measured + self.warmup
        return self.measured >= MEASURED_STEPS or done >= self.total


class RunProgress:
    """A rich progress bar for a training loop: steps, loss, tokens/s, elapsed, time left; prints
    the expected time of the whole run once (to ``console``, above the bar)."""

    takes_loss = True

    def __init__(self, description: str, total: int, *, tokens_per_step: int | None = None, warmup_steps: int = 0,
                 device: str = "", console=None, clock=None, say_expected: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console or Console(stderr=True)
        self.total, self.tokens_per_step, self.device = total, tokens_per_step, device
        self.clock = StepClock(total, warmup_steps, clock)
        self.say_expected = say_expected
        self.last_step = 0
        self.bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("{task.fields[loss]}"), TextColumn("{task.fields[speed]}"),
                            TimeElapsedColumn(), TextColumn("{task.fields[left]}"), console=self.console,
                            transient=True)
        self.task = self.bar.add_task(description, total=total, loss="", speed="", left="")
        self.lines: list[str] = []

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def start(self) -> None:
        self.clock.begin()
        self.bar.start()

    def stop(self) -> None:
        self.bar.stop()

    def __call__(self, step: int, total: int, loss: float | None = None) -> None:
        if step == 0 or step < self.last_step:
            # a new run on the same bar (the speedrun's next seed or rung): its own clock
            self.clock = StepClock(total, self.clock.warmup, self.clock.clock)
            self.clock.begin()
            self.bar.reset(self.task, total=total, loss="", speed="", left="")
        self.last_step = step
        if step == 0:
            return
        clock = self.clock
        clock.total = total
        clock.tick(step)
        fields = {}
        if loss is not None:
            fields["loss"] = f"loss {loss:.4f}"
        step_s = clock.step_s()
        if step_s:
            if self.tokens_per_step:
                fields["speed"] = f"{self.tokens_per_step / step_s:,.0f} tok/s"
            else:
                fields["speed"] = f"{1 / step_s:.2f} steps/s"
            fields["left"] = f"~{format_duration(clock.seconds_left(step))} left"
        self.bar.update(self.task, completed=step, **fields)
        if self.say_expected and clock.ready_to_say():
            clock.said = True
            if step_s * total > WORTH_SAYING_S and step < total:
                line = expected_line(total, step_s, clock.warmup + 1, step, self.device)
                self.lines.append(line)
                self.bar.console.print(line, markup=False, highlight=False, soft_wrap=True)


__all__ = ["RunProgress", "StepClock", "expected_line", "format_duration", "report"]
