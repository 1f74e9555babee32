"""A line of a benchmark suite, as the engines declare it (``Engine.rows(suite)``).

It lives beside the engine base, not in ``bench``: the engines describe their own rows, and the
benchmark (a floor above) reads them. ``OFF`` in a row's options means "this flag switched off",
whatever the engine calls that (``False`` for a boolean flag, ``off``/``none`` for a flag with
choices), so a rung can name every flag explicitly and measure exactly one optimization more than
the row above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class _Off:
    def __repr__(self) -> str:
        return "OFF"


OFF = _Off()


@dataclass(frozen=True)
class Row:
    """One line of a suite: an engine with its flags and config overrides (engines declare their rows).

    ``rung``: the short name of the optimization step (``"3"``, ``"+amp"``); ``overrides``:
    :class:`~fasttrain.contract.TrainConfig` fields this row changes (e.g. precision);
    ``max_hidden``: the largest hidden width this row runs at (a slow CPU baseline); ``models``: the
    only models this row runs on (None: every model of the suite); ``quick``: ``False`` leaves the row
    out of ``--quick`` (the reason is ``quick_note``); ``seed_ms``: the seed study's figure for this
    row (measured elsewhere); ``baseline``: the row the others are compared with (the speed-up
    columns); ``target_ms`` / ``floor``: the goal this row's figure is held to and the estimated floor
    (the record suite); ``max_k``: the most models this row trains at once in the ``many`` suite (None: every
    K of the suite; a slow loop engine stops early).
    """

    label: str
    engine: str
    rung: str = ""
    options: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)
    max_hidden: int | None = None
    models: tuple[str, ...] | None = None
    quick: bool = True
    quick_note: str = ""
    seed_ms: float | None = None
    baseline: bool = False
    target_ms: float | None = None
    floor: str = ""
    max_k: int | None = None

    @property
    def precision(self) -> str:
        return self.overrides.get("precision", "fp32")
