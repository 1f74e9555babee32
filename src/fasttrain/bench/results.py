"""What a suite run produces: a :class:`CaseResult` per row and model, a :class:`SuiteResult` per suite
(the JSON schema of ``<suite>.json``), and :class:`Progress`, where a runner reports while it works.

Plain data, read by every writer (tables, figures, each suite's report) and written by the runners.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from fasttrain.errors import FasttrainError

SCHEMA = 1
NOT_SELECTED = "not selected (--engines)"


def utc_now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


@dataclass
class CaseResult:
    """One row on one model: its status and, when it ran, one run record per seed."""

    suite: str
    label: str
    engine: str
    rung: str
    model: str
    precision: str
    options: dict
    config: dict
    seed_ms: float | None
    status: str  # ok | skipped | failed
    reason: str | None = None
    seeds: list[int] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    deviation: dict | None = None  # curves: against the NumPy fp64 reference
    timestamp: str = ""
    traceback: str | None = None
    k: int | None = None  # the many suite: models trained at once
    run_id: str | None = None  # the invocation that ran it: rows compared "in the same run" share it

    @property
    def key(self) -> tuple[str, str, int | None]:
        return (self.label, self.model, self.k)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def metric(self, name: str, stat: str = "p50"):
        entry = self.metrics.get(name)
        return None if entry is None else entry.get(stat)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CaseResult":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class SuiteResult:
    suite: str
    title: str
    quick: bool
    command: str
    timestamp: str
    dataset: dict
    environment: dict
    repeats: int
    cases: list[CaseResult] = field(default_factory=list)
    reference: dict = field(default_factory=dict)  # curves, record: model -> the fp64 reference's run record
    commands: list[str] = field(default_factory=list)  # every command whose cases are in here, oldest first
    baselines: list[str] = field(default_factory=list)  # labels of the rows the speed-up columns divide by
    schema: int = SCHEMA

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        return {"schema": data.pop("schema"), **data}

    @classmethod
    def from_dict(cls, data: dict) -> "SuiteResult":
        if data.get("schema") != SCHEMA:
            raise FasttrainError(f"benchmark results schema {data.get('schema')!r} is not {SCHEMA}; rerun the suite")
        data = dict(data)
        data["cases"] = [CaseResult.from_dict(c) for c in data.get("cases", [])]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def ran(self) -> list[CaseResult]:
        return [c for c in self.cases if c.ok]


Log = Callable[[str], None]


class Progress:
    """Where the runner reports while it works. This base stays silent (tests, the Python API);
    the CLI's subclass draws rich progress bars and prints the log lines."""

    def start(self, total: int, description: str) -> None:
        """``total`` runs are planned."""

    def describe(self, description: str) -> None:
        """The run starting now."""

    def advance(self, n: int = 1) -> None:
        """``n`` runs are done (or will not happen)."""

    def log(self, message: str) -> None:
        """A line for the user (rich markup): a finished, skipped or failed row."""

    def stop(self) -> None:
        """The suite is over."""
