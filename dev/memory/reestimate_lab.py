"""A `fasttrain bench lab` table of a HF model, its measured peaks against today's estimator.

The table's `lab.csv` holds the estimate made when each row ran; the estimator has learned since (torch.compile,
liger-kernel, LoRA and the soft prompt of transformers models). This reads each row's recorded run (its
LabConfig and measured peak, the bytes held before the run subtracted) and the model's `config.json`, and
prints a Markdown table: measured, estimated then, estimated now, and the error now. The measurements are
the table's; only the prediction is recomputed.

    python3 dev/memory/reestimate_lab.py results/lab/nvidia-h100-hf-llama-0.5b --hf-config /tmp/lab-hf/llama-0.5b
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MIB = 2 ** 20


def main(argv=None) -> int:
    from fasttrain.lab.config import LabConfig
    from fasttrain.lab.hf import memory_setup_for
    from fasttrain.memory.precise import estimate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a bench lab folder (lab.json)")
    ap.add_argument("--hf-config", type=Path, required=True, help="the model's folder or config.json")
    args = ap.parse_args(argv)
    path = args.hf_config / "config.json" if args.hf_config.is_dir() else args.hf_config
    setup_of = memory_setup_for(json.loads(path.read_text()))
    result = json.loads((args.results / "lab.json").read_text())
    print("| row | measured MiB | estimate then | error then | estimate now | error now | peak moment now |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for case in result["cases"]:
        if not case.get("records"):
            print(f"| {case['label']} | - | - | - | - | - | not run: {(case.get('reason') or '')[:70]} |")
            continue
        rec = case["records"][0]
        measured = rec["memory"]["peak_allocated_bytes"] / MIB
        then = (rec.get("estimate") or {}).get("precise_bytes")
        fields = {k: v for k, v in rec["config"].items() if k in LabConfig.__dataclass_fields__}
        fields["lora_target_modules"] = tuple(fields.get("lora_target_modules") or ())
        cfg = LabConfig(**fields)
        setup = setup_of(cfg, cfg.per_device_train_batch_size)
        now = estimate(setup) if setup is not None else None
        cell = lambda b: f"{b / MIB:,.1f}" if b else "-"
        err = lambda b: f"{100 * (b / MIB - measured) / measured:+.2f}%" if b else "-"
        moment = now.extra.get("peak_moment", "") if now is not None else "no memory model"
        print(f"| {case['label']} | {measured:,.1f} | {cell(then)} | {err(then)} | "
              f"{cell(now.total if now else None)} | {err(now.total if now else None)} | {moment} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
