"""Start a lease's lanes from an earlier lease's state of one model: what a change since did not touch is kept, the
rest is measured again. Kept: the HF Trainer as users run it and every point of its search (the Trainer runs none of
the lab's code), and the grid's points whose configuration the change cannot reach (``--drop-grid KEY=VALUE``: a point
whose overrides hold that value is measured again; tune searches again unless ``--keep-tune``: a lease that ran out
before its confirmation, nothing changed since, goes on from its pick). Every kept figure is marked ``reused_from``
with ``--label``, and the report's ``measured_with`` says so.

    python3 dev/tune/reuse_state.py .state-carry/qwen2.5-0.5b-state.json --work /tmp/tune-work \\
        --lane /tmp/tune-work-b --drop-grid use_liger_kernel=true --label "e198b7a, 4 x H200"

Writes ``<work>/<model>/state.json`` (lane a: the fixed grid and the kept points) and, for each ``--lane``, the same
grid and the Trainer's figures with its ``done-hf`` marker (lane b measures only the search's missing points); with no
``--lane`` (one GPU, dev/device/tune_case.sh's queue) the work folder gets the Trainer's figures too. Refuses to write
over a state already there.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _value(text: str):
    """A --drop-grid value as the state's JSON holds it (true, 64, null), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def reused_states(earlier: dict, drop_grid: list[tuple[str, object]], label: str,
                  keep_tune: bool = False) -> tuple[dict, dict]:
    """(lane a's state, the Trainer lanes' state) from an ``earlier`` state: the fixed grid, the grid's points
    none of ``drop_grid`` matches, (``keep_tune``) tune's search and pick, and (the Trainer lanes') the Trainer's
    figures; each kept figure marked."""
    def mark(figure: dict) -> dict:
        return {**figure, "reused_from": label}

    base = {"model": earlier["model"], "grid_members": earlier["grid_members"]}
    grid = {key: mark(row) for key, row in (earlier.get("grid") or {}).items()
            if not any(row["overrides"].get(k) == v for k, v in drop_grid)}
    lane_a = {**base, "grid": grid}
    if keep_tune:
        # the measured size of the case (prepare's) and where tune ran go with its pick
        lane_a.update({k: earlier[k] for k in ("params", "seq", "global_batch_tokens", "environment", "versions")
                       if k in earlier})
        lane_a["tune"] = mark(earlier["tune"])
    points = [mark(p) for p in earlier.get("hf_search_points") or []]
    trainer = {**lane_a, "hf": mark(earlier["hf"]), "hf_search_points": points}
    if earlier.get("hf_flags"):     # the column those points sum up to (the lane's search sums it again)
        trainer["hf_flags"] = {**mark(earlier["hf_flags"]), "points": points}
    return lane_a, trainer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("state", type=Path, help="an earlier lease's state.json of the model")
    ap.add_argument("--work", type=Path, required=True, help="lane a's work folder")
    ap.add_argument("--lane", type=Path, action="append", default=[], help="a Trainer lane's work folder")
    ap.add_argument("--drop-grid", action="append", default=[], metavar="KEY=VALUE",
                    help="measure again the grid's points whose overrides hold this value")
    ap.add_argument("--keep-tune", action="store_true",
                    help="keep tune's search and pick too (nothing that reaches the lab changed since)")
    ap.add_argument("--label", required=True, help="where the kept figures come from (commit, machine)")
    args = ap.parse_args(argv)
    try:
        earlier = json.loads(args.state.read_text())
    except (OSError, ValueError) as exc:
        ap.error(f"{args.state}: not a readable state ({exc})")
    missing = [k for k in ("model", "grid_members", "hf") + (("tune",) * args.keep_tune) if k not in earlier]
    if missing:
        ap.error(f"{args.state}: no {', '.join(missing)} in it: reuse needs a lease's whole state")
    drop = []
    for item in args.drop_grid:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--drop-grid {item}: give KEY=VALUE")
        drop.append((key, _value(value)))
    name = earlier["model"]
    targets = [args.work, *args.lane]
    taken = [w for w in targets if (w / name / "state.json").exists()]
    if taken:
        ap.error(f"{taken[0] / name / 'state.json'} exists: reuse starts a lease, it does not write over one")
    lane_a, trainer = reused_states(earlier, drop, args.label, keep_tune=args.keep_tune)
    lanes = [(args.work, lane_a)] + [(w, trainer) for w in args.lane] if args.lane else [(args.work, trainer)]
    for work, state in lanes:
        (work / name).mkdir(parents=True, exist_ok=True)
        (work / name / "state.json").write_text(json.dumps(state, indent=2))
        if "hf" in state:
            (work / name / "done-hf").touch()
        if "tune" in state:     # the queue's phases before it are done with it
            for phase in ("fix-grid", "tune"):
                (work / name / f"done-{phase}").touch()
    print(f"{name}: {len(lane_a['grid'])} of {len(earlier['grid_members'])} grid points and the Trainer's "
          f"{len(trainer['hf_search_points'])} search points{' and tune' * args.keep_tune} kept from {args.label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
