"""The result of an estimate: named lines of bytes, their children, and the total."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal


@dataclass
class Line:
    name: str
    bytes: float
    note: str = ""
    children: list["Line"] = field(default_factory=list)
    in_total: bool = True       # False: shown for information, not part of the total

    def to_dict(self) -> dict:
        out = {"name": self.name, "bytes": self.bytes, "note": self.note, "in_total": self.in_total}
        if self.children:
            out["children"] = [c.to_dict() for c in self.children]
        return out


@dataclass
class Breakdown:
    mode: str
    setup: object
    lines: list[Line]
    total: float
    params: float               # parameter count of the whole model (all ranks)
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def line(self, name: str) -> Line:
        for line in self.lines:
            if line.name == name:
                return line
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "setup": self.setup.to_dict(), "params": self.params, "total": self.total,
                "lines": [line.to_dict() for line in self.lines], "notes": list(self.notes), **self.extra}


def to_fixed(x: float, digits: int) -> str:
    """JavaScript's ``Number.prototype.toFixed``: the exact binary value rounded half away from
    zero (Python's format rounds exact ties to even), so that the page and the CLI agree."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def format_gib(value: float) -> str:
    """Binary units with their true names (KiB, MiB, GiB, TiB), 2 decimals rounded like the page."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    i = 0
    x = float(value)
    while abs(x) >= 1024 and i < len(units) - 1:
        x /= 1024
        i += 1
    return f"{to_fixed(x, 0)} B" if i == 0 else f"{to_fixed(x, 2)} {units[i]}"
