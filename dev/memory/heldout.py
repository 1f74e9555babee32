"""The memory estimator out of sample: every measured peak under ``results/`` predicted again by today's estimator
from the configuration recorded with the measurement, the rows its rules were written against counted apart.

    python3 dev/memory/heldout.py                                    # results/memory/heldout.json and heldout.md
    python3 dev/memory/heldout.py --into results/README.md           # and the results index's section

Held out (``rules_written_against`` false unless a rule of the estimator was written after seeing the row):
- ``results/tune/<machine>/<model>-tune/tune.json``: tune's probes (``ranked``: each configuration at its longest
  probe), each ``base`` + ``overrides``; the model's config is the one ``dev/tune/bench_tune.py``'s ``MODELS`` wrote
  (the record names only its folder);
- ``results/tune/<machine>/tune.json`` ``states``: the grid's points (one read from tune's probe cache is that probe:
  not counted twice) and the pick's 200-step confirmation;
- ``results/dist/<machine>/``: the scale-out tune's probes (``raw/<model>/tune/tune.json``, configs from
  ``dev/dist/bench_scale.py``'s ``MODELS``) and every lab run record (``kind`` lab-run: its own config and model),
  per GPU (the largest rank's peak); ``scale.json``'s cases are these files' figures.
In sample (every row ``rules_written_against``): ``results/memory/validation.json`` (the GPU validation the rules
were fitted to, estimated again by ``fasttrain.memory.validate.rescore``) and the technique tables
``results/lab/*/lab.json`` (their misses made rules: sdpa's math kernel, compiled dropout, the lab GPT compiled
counted as eager). Not predicted (listed in ``excluded``): the HF Trainer's runs (another trainer than the one the
estimator follows), a grid point read from tune's cache, a table row that did not run.

A row is measured (the allocator's peak less what the process held before), out of memory, or neither (skipped).
``predicted_fits``: tune's own rule on the recorded device (predicted x (1 + reserve) + context <= memory).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 2 ** 20
START, END = "<!-- memory-heldout:start -->", "<!-- memory-heldout:end -->"
COMMAND = "python3 dev/memory/heldout.py --into results/README.md"
# rules written in this repository after the rows they apply to were measured, with the rows' test
RULES = {
    "liger in per-block compiled layers": lambda cfg, hf: cfg.use_liger_kernel and cfg.liger_kernels == "all"
    and cfg.torch_compile and cfg.torch_compile_scope == "blocks",
    "CUDA-graph pool": lambda cfg, hf: _cuda_graphs(cfg),
    # written against the 2-GPU Llama-3-8B rows and the 4-GPU profile (results/dist/)
    "FSDP2's layout (D21)": lambda cfg, hf: getattr(cfg, "strategy", "none") in ("fsdp", "hsdp"),
    "no autocast weight cache in compiled layers": lambda cfg, hf: getattr(cfg, "strategy", "none") == "zero1",
    # written against the 1B's tp and fsdp --tp 2 rows on 4 H200 (results/dist/nvidia-h200-x4/)
    "the vocabulary under tensor parallelism (D23)": lambda cfg, hf: getattr(cfg, "strategy", "none") == "tp"
    or getattr(cfg, "tp", 1) > 1,
    # written against the 8B's float8 rows (results/dist/) and the 1B's on an H100 (dev/memory/float8-h100/)
    "float8 layers (D24)": lambda cfg, hf: getattr(cfg, "float8", "none") != "none",
    # written after GPT-2's H200 grid rows of it missed (results/tune/nvidia-h200/), derived on the CPU; the same
    # rule for the other families was written before any GPU row of theirs (those are held out)
    "GPT-2's fused head beside a whole compiled model (D26)": lambda cfg, hf: (hf or {}).get("model_type") == "gpt2"
    and cfg.use_liger_kernel and cfg.liger_kernels == "fused_linear_cross_entropy" and cfg.torch_compile
    and cfg.torch_compile_scope == "model",
    # written after GPT-2's whole-model eager + recomputation rows missed (-5.7%, -5.8%, the H100's 256 x 2 out of
    # memory), from the allocator's snapshots of results/memory/recompute-peaks/
    "GPT-2's last block recomputed beside d(logits) (D27)": lambda cfg, hf: (hf or {}).get("model_type") == "gpt2"
    and cfg.torch_compile and cfg.torch_compile_scope == "model" and cfg.attn_implementation == "eager"
    and cfg.gradient_checkpointing == "full" and not cfg.checkpoint_blocks and cfg.bf16
    and not (cfg.use_liger_kernel and cfg.liger_kernels == "fused_linear_cross_entropy"),
}


# what a measurement ran with that the trainer no longer does, or what its row's prediction came from: (source
# prefix, model, applies, the note)
TRAINER_NOTES = [
    ("results/tune/nvidia-h100-80gb-hbm3/", "gpt2-124m",
     lambda cfg: _cuda_graphs(cfg) and cfg.gradient_accumulation_steps > 1,
     "measured at ba8b5fa, before 3311e36: the trainer then let a micro-batch's gradients live in the CUDA-graph "
     "pool, and the graphs were recorded again micro-batch after micro-batch (dev/tune/README.md)"),
    ("results/dist/nvidia-h200-x4/raw/llama3-8b/float8-gather/", "llama3-8b",
     lambda cfg: cfg.float8 == "tensorwise" and getattr(cfg, "float8_all_gather", False),
     "predicted by a rule written before the run (1-byte gathered copies) and withdrawn after it: today's "
     "estimator refuses the float8 gather (src/fasttrain/memory/MODEL.md)"),
]


class HeldoutError(Exception):
    """Bad input: one line, exit 2."""


def _cuda_graphs(cfg) -> bool:
    from fasttrain.lab.config import cuda_graphs_of

    return cuda_graphs_of(cfg)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HeldoutError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HeldoutError(f"{path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise HeldoutError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise HeldoutError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data


def field(data: dict, key: str, path: Path):
    if key not in data:
        raise HeldoutError(f"{path}: no {key!r}; not a file this table reads (regenerate it with its command)")
    return data[key]


def dev_models(script: str) -> dict:
    """``MODELS`` of a dev benchmark script: the configs it wrote into the model folders its records name."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: spec_["config"] for name, spec_ in module.MODELS.items()}


# --- a configuration as the lab reads it, and its prediction ------------------------------------------------

def config_of(fields: dict, distributed: dict | None = None):
    """The ``LabConfig`` (``ScaleConfig`` over several processes) of recorded fields: unknown ones dropped (a field
    since removed), a null where the field has a value by default read as that default (a field added since)."""
    from dataclasses import MISSING

    from fasttrain.lab.config import LabConfig
    from fasttrain.lab.tune.space import ScaleConfig

    cls = ScaleConfig if distributed or fields.get("nproc_per_node") else LabConfig
    known = cls.__dataclass_fields__
    kept = {k: v for k, v in fields.items() if k in known
            and not (v is None and known[k].default not in (None, MISSING))}
    if "lora_target_modules" in kept:
        kept["lora_target_modules"] = tuple(kept["lora_target_modules"])
    if distributed:
        kept.update(nproc_per_node=distributed["world_size"], strategy=distributed["strategy"],
                    tp=1 if distributed["strategy"] == "tp" else distributed.get("tp", 1),
                    dp_replicate=distributed.get("dp_replicate", 1),
                    reshard_after_forward="zero2" not in distributed.get("label", ""),
                    offload_optimizer=bool(distributed.get("offload_optimizer")))
    return cls(**kept)


def predict_mib(cfg, hf_config: dict | None, vocab: int = 65) -> float | None:
    """Today's estimator on ``cfg`` per GPU, as tune and the lab predict it; None where it cannot describe it."""
    from fasttrain.lab.tune.probes import lab_predictor

    got = lab_predictor(vocab, hf_config)(cfg)
    return got / MIB if got else None


def model_name(spec) -> str:
    """A model's name from what a record says of it: ``hf:/work/llama-1b/model`` is the llama-1b benchmark's."""
    path = Path(str(spec or "").removeprefix("hf:"))
    return path.parent.name if path.name == "model" else path.name


def tags_of(cfg) -> list[str]:
    """The techniques of a configuration, as the breakdown groups them (attention always)."""
    tags = ["eager attention" if cfg.attn_implementation == "eager" else "sdpa"]
    if not (cfg.bf16 or cfg.fp16):
        tags.append("fp32")
    if cfg.torch_compile:
        tags.append("compile per block" if cfg.torch_compile_scope == "blocks" else "compile whole model")
        if _cuda_graphs(cfg):
            tags.append("CUDA graphs")
    if cfg.gradient_checkpointing != "none":
        tags.append(f"checkpointing {cfg.gradient_checkpointing}")
    if cfg.use_liger_kernel:
        tags.append("liger fused CE" if cfg.liger_kernels == "fused_linear_cross_entropy" else "liger (all kernels)")
    if cfg.lora_r:
        tags.append("LoRA")
    if cfg.prompt_tuning_tokens:
        tags.append("prompt tuning")
    if getattr(cfg, "float8", "none") not in (None, "none"):
        tags.append(f"float8 {cfg.float8}")
    if getattr(cfg, "strategy", "none") != "none":
        tags.append(cfg.label)
    return tags


def row(source: str, model: str, cfg, hf_config, *, measured, then=None, oom=False, reserved=None, device=None,
        vocab: int = 65, in_sample: str | None = None) -> dict:
    """One measurement against today's prediction (the prediction made at measurement time where today's cannot
    describe it, said in ``prediction``)."""
    now = predict_mib(cfg, hf_config, vocab)
    predicted, origin = (now, "today's estimator") if now is not None else (
        then, "recorded at measurement (today's estimator cannot describe it)" if then else "none")
    rules = [name for name, applies in RULES.items() if applies(cfg, hf_config)]
    if in_sample:
        rules.append(in_sample)
    tags = tags_of(cfg)
    notes = [note for prefix, name, applies, note in TRAINER_NOTES
             if source.startswith(prefix) and model == name and applies(cfg)]
    batch = f"{cfg.per_device_train_batch_size}x{cfg.gradient_accumulation_steps}"
    return dict(source=source, model=model, batch=batch,
                technique=" + ".join(tags), tags=tags, measured_mib=measured,
                measured_reserved_mib=reserved, predicted_mib=predicted, predicted_then_mib=then, prediction=origin,
                error_pct=error_pct(measured, predicted), oom=oom, predicted_fits=fits(predicted, device),
                rules_written_against=bool(rules), rules=rules, note="; ".join(notes) or None)


def error_pct(measured, predicted) -> float | None:
    return 100.0 * (predicted - measured) / measured if measured and predicted else None


def fits(predicted_mib, device: dict | None) -> bool | None:
    """tune's rule (``DeviceMemory.fits``) on the device the row's search recorded."""
    if predicted_mib is None or not device:
        return None
    return predicted_mib * (1 + device["reserve"]) + device["context_mib"] <= device["total_mib"]


# --- the sources ------------------------------------------------------------------------------------------

def tune_rows(folder: Path, models: dict, rel) -> tuple[list[dict], list[dict]]:
    """tune's probes, the grid and the confirmation of one machine's tune benchmark."""
    top = folder / "tune.json"
    states = field(read_json(top), "states", top)
    rows, excluded = [], []
    for name, state in states.items():
        path = folder / f"{name}-tune" / "tune.json"
        search = read_json(path)
        base, device = field(search, "base", path), field(search, "device", path)
        hf = models.get(name)
        for probe in field(search, "ranked", path):
            oom = str(probe.get("status", "")).startswith("out of memory")
            if probe.get("peak_mib") is None and not oom:
                excluded.append(dict(source=rel(path), reason=f"{probe.get('label')}: {probe.get('status')}"))
                continue
            rows.append(row(rel(path), name, config_of({**base, **probe["overrides"]}), hf,
                            measured=probe.get("peak_mib"), then=probe.get("predicted_mib"), oom=oom,
                            reserved=probe.get("reserved_mib"), device=device))
        for key, point in (state.get("grid") or {}).items():
            overrides = point.get("overrides") or dict(json.loads(key))
            if point.get("from_tune_cache"):
                excluded.append(dict(source=f"{rel(top)} grid",
                                     reason="read from tune's probe cache: that probe's row"))
                continue
            oom = point.get("oom") or point.get("error") == "out of memory"
            if point.get("peak_mib") is None and not oom:
                excluded.append(dict(source=f"{rel(top)} grid", reason=str(point.get("error"))))
                continue
            rows.append(row(f"{rel(top)} grid", name, config_of({**base, **overrides}), hf,
                            measured=point.get("peak_mib"), oom=bool(oom), device=device))
        confirm, pick = state.get("confirm"), (state.get("tune") or {}).get("pick")
        if confirm and pick and (confirm.get("peak_mib") or confirm.get("oom")):
            rows.append(row(f"{rel(top)} confirmation", name, config_of({**base, **pick}), hf,
                            measured=confirm.get("peak_mib"), then=confirm.get("predicted_mib"),
                            oom=bool(confirm.get("oom")), device=device))
        for what in ("hf", "hf_flags"):
            if state.get(what):
                excluded.append(dict(source=f"{rel(top)} {name} {what}",
                                     reason="the HF Trainer's run: not the trainer the estimator follows"))
    return rows, excluded


def lab_record_row(record: dict, path: Path, rel, in_sample: str | None = None, label: str = "") -> dict:
    """A lab run record: its config and model as recorded, per GPU the largest rank's peak."""
    dist = record.get("distributed")
    memory = field(record, "memory", path)
    measured = (dist or {}).get("max_peak_allocated_bytes") or memory.get("peak_allocated_bytes")
    then = (record.get("estimate") or {}).get("precise_bytes")
    setup = (record.get("estimate") or {}).get("setup") or {}
    cfg = config_of(field(record, "config", path), dist)
    model = record.get("model")
    hf = model if isinstance(model, dict) and model.get("model_type") else None
    return row(rel(path) + (f" {label}" if label else ""), model_name(cfg.model or cfg.name), cfg, hf,
               measured=measured / MIB if measured else None, then=then / MIB if then else None,
               reserved=memory.get("peak_reserved_bytes", 0) / MIB or None, vocab=setup.get("vocab", 65),
               in_sample=in_sample)


def dist_rows(folder: Path, models: dict, rel) -> tuple[list[dict], list[dict]]:
    rows, excluded = [], []
    for path in sorted(folder.rglob("*.json")):
        if path.name in ("scale.json", "sweep.json"):
            continue                  # the cases and a sweep's list of runs: the figures of the files below
        data = read_json(path)
        if data.get("kind") == "lab-run":
            rows.append(lab_record_row(data, path, rel))
        elif data.get("kind") == "tune":
            base, device = field(data, "base", path), field(data, "device", path)
            name = model_name(base.get("model"))
            for probe in field(data, "ranked", path):
                if probe.get("peak_mib") is None:
                    excluded.append(dict(source=rel(path), reason=f"{probe.get('label')}: {probe.get('status')}"))
                    continue
                rows.append(row(rel(path), name, config_of({**base, **probe["overrides"]}), models.get(name),
                                measured=probe["peak_mib"], then=probe.get("predicted_mib"),
                                reserved=probe.get("reserved_mib"), device=device))
        elif "peak_mib_per_rank" in data or path.name.startswith("hf-"):
            excluded.append(dict(source=rel(path),
                                 reason="the HF Trainer's run: not the trainer the estimator follows"))
    return rows, excluded


def validation_rows(path: Path, rel) -> list[dict]:
    """The GPU validation (the lab's GPT, one step per case), estimated again by today's model."""
    from fasttrain.memory import validate

    read_json(path)                   # one line if it is missing or broken, before the rescore reads it
    cases, _ = validate.rescore(str(path))
    out = []
    for c in cases:
        tags = ["eager attention" if c["attention"] == "eager" else "sdpa"] + (
            [] if c["precision"] != "fp32" else ["fp32"]) + (
            [f"checkpointing {c['recompute']}"] if c["recompute"] != "none" else [])
        out.append(dict(source=f"{rel(path)} {c['case']}", model=c["preset"], batch=f"{c['micro_batch']}x1",
                        technique=" + ".join(tags), tags=tags,
                        measured_mib=c["measured_mib"], measured_reserved_mib=None, predicted_mib=c["estimate_mib"],
                        predicted_then_mib=None, prediction="today's estimator",
                        error_pct=error_pct(c["measured_mib"], c["estimate_mib"]), oom=False, predicted_fits=None,
                        rules_written_against=True, rules=["the GPU validation the rules were fitted to"],
                        note=None))
    return out


def lab_table_rows(path: Path, rel) -> tuple[list[dict], list[dict]]:
    """A technique table (``fasttrain bench lab``): each row's first run."""
    rows, excluded = [], []
    for case in field(read_json(path), "cases", path):
        if not case.get("records"):
            excluded.append(dict(source=f"{rel(path)} {case.get('label')}",
                                 reason=f"{case.get('status')}: no run record ({(case.get('reason') or '')[:80]})"))
            continue
        rows.append(lab_record_row(case["records"][0], path, rel, in_sample="a technique table the rules were "
                                   "checked and changed on", label=case.get("label", "")))
    return rows, excluded


def collect(results: Path) -> tuple[list[dict], list[dict]]:
    """Every row and every measurement left out, from the committed files under ``results``."""
    def rel(p: Path) -> str:
        try:
            return str(p.relative_to(results.parent))
        except ValueError:
            return str(p)

    if not results.is_dir():
        raise HeldoutError(f"{results}: no such folder (the results folder, e.g. results)")
    rows, excluded = [], []
    tune_models, scale_models = dev_models("dev/tune/bench_tune.py"), dev_models("dev/dist/bench_scale.py")
    for folder in sorted(p for p in (results / "tune").glob("*") if p.is_dir()):
        r, e = tune_rows(folder, tune_models, rel)
        rows += r
        excluded += e
    for folder in sorted(p for p in (results / "dist").glob("*") if p.is_dir()):
        r, e = dist_rows(folder, scale_models, rel)
        rows += r
        excluded += e
    rows += validation_rows(results / "memory" / "validation.json", rel)
    for path in sorted((results / "lab").glob("*/lab.json")):
        r, e = lab_table_rows(path, rel)
        rows += r
        excluded += e
    return rows, excluded


# --- the summary ------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile: the smallest value with at least q of them at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(rows: list[dict]) -> dict:
    """count (rows measured and predicted), the median and 95th percentile of |error|, the worst error, rows within
    5%, out-of-memory rows and those of them predicted to fit (a configuration tune would have run)."""
    errors = [r["error_pct"] for r in rows if r["error_pct"] is not None]
    absolute = [abs(e) for e in errors]
    ooms = [r for r in rows if r["oom"]]
    return dict(count=len(errors), median_abs_error_pct=statistics.median(absolute) if absolute else None,
                p95_abs_error_pct=percentile(absolute, 0.95),
                worst_error_pct=max(errors, key=abs) if errors else None,
                within_5pct=sum(a <= 5 for a in absolute), oom=len(ooms),
                predicted_fit_but_oom=sum(r["predicted_fits"] is True for r in ooms))


def by_technique(rows: list[dict]) -> dict:
    tags = sorted({t for r in rows for t in r["tags"]})
    return {t: summarize([r for r in rows if t in r["tags"]]) for t in tags}


def table(rows: list[dict], excluded: list[dict]) -> dict:
    held = [r for r in rows if not r["rules_written_against"]]
    seen = [r for r in rows if r["rules_written_against"]]
    return {"kind": "memory-heldout", "schema": 1, "command": COMMAND, "runs": rows,
            "summary": summarize(held), "by_technique": by_technique(held),
            "in_sample": {**summarize(seen), "by_rule": {name: summarize([r for r in seen if name in r["rules"]])
                                                           for name in sorted({n for r in seen for n in r["rules"]})}},
            "excluded": excluded}


# --- the Markdown -----------------------------------------------------------------------------------------

def _f(value, spec=",.0f", empty="-") -> str:
    return empty if value is None else format(value, spec)


def summary_line(s: dict) -> str:
    return (f"{s['count']} rows: median |error| {_f(s['median_abs_error_pct'], '.2f')}%, 95th percentile "
            f"{_f(s['p95_abs_error_pct'], '.2f')}%, worst {_f(s['worst_error_pct'], '+.1f')}%, "
            f"{s['within_5pct']} within 5%; {s['oom']} out of memory, {s['predicted_fit_but_oom']} of them "
            f"predicted to fit")


def markdown(data: dict) -> str:
    lines = ["# The memory estimator out of sample", "",
             f"Generated by `{data['command']}` from the committed result files (see the script's docstring for "
             "what is read and what is in sample). Error = (predicted - measured) / measured; measured = the "
             "allocator's peak (under CUDA graphs it does not count what the pool holds: the reserved peak is "
             "beside it where recorded).", "",
             f"- **Held out** (rules not written against these rows): {summary_line(data['summary'])}.",
             f"- **In sample** (the rules' own rows): {summary_line(data['in_sample'])}.", "",
             "## Held out, by technique", "",
             "| technique | rows | median abs error | worst error | out of memory | of them predicted to fit |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for tag, s in data["by_technique"].items():
        lines.append(f"| {tag} | {s['count']} | {_f(s['median_abs_error_pct'], '.2f')}% | "
                     f"{_f(s['worst_error_pct'], '+.2f')}% | {s['oom']} | {s['predicted_fit_but_oom']} |")
    lines += ["", "## In sample, by rule", "", "| rule | rows | median abs error | worst error |",
              "| --- | ---: | ---: | ---: |"]
    for name, s in data["in_sample"]["by_rule"].items():
        lines.append(f"| {name} | {s['count']} | {_f(s['median_abs_error_pct'], '.2f')}% | "
                     f"{_f(s['worst_error_pct'], '+.2f')}% |")
    lines += ["", "## Every row", "",
              "| source | model | batch | technique | measured MiB | reserved MiB | predicted MiB | then MiB | error | "
              "OOM | fits | in sample | note |",
              "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for r in data["runs"]:
        fit = {True: "yes", False: "no", None: ""}[r["predicted_fits"]]
        lines.append(f"| {r['source']} | {r['model']} | {r['batch']} | {r['technique']} | {_f(r['measured_mib'])} | "
                     f"{_f(r['measured_reserved_mib'])} | {_f(r['predicted_mib'])} | {_f(r['predicted_then_mib'])} | "
                     f"{_f(r['error_pct'], '+.2f')}{'' if r['error_pct'] is None else '%'} | "
                     f"{'yes' if r['oom'] else ''} | {fit} | {'; '.join(r['rules'])} | {r['note'] or ''} |")
    lines += ["", "## Not predicted", ""] + [f"- {e['source']}: {e['reason']}" for e in data["excluded"]]
    return "\n".join(lines) + "\n"


def readme_section(data: dict) -> str:
    """The results index's lines: both summaries and where the table is."""
    return "\n".join([
        f"Generated by `{data['command']}` from the committed result files: every measured peak predicted again by "
        "today's estimator ([`memory/heldout.md`](memory/heldout.md), data in "
        "[`memory/heldout.json`](memory/heldout.json)).", "",
        f"- In sample (the GPU validation and the technique tables the rules were written on, and the rows a rule was "
        f"written after): {summary_line(data['in_sample'])}.",
        f"- Held out (tune's probes, grids and confirmations, the distributed runs, that no rule was written "
        f"against): {summary_line(data['summary'])}.", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results", help="the results folder (default: results)")
    ap.add_argument("--out", type=Path, help="where heldout.json and heldout.md go (default: RESULTS/memory)")
    ap.add_argument("--into", type=Path, help="a README with the memory-heldout markers (results/README.md)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from fasttrain.errors import FasttrainError
    from fasttrain.files import atomic_write_text, write_into

    try:
        out = args.out or args.results / "memory"
        if not out.is_dir():
            raise HeldoutError(f"{out}: no such folder")
        if args.into is not None and START not in (args.into.read_text() if args.into.is_file() else ""):
            raise HeldoutError(f"{args.into}: no {START} line to write between")
        data = table(*collect(args.results))
        atomic_write_text(out / "heldout.json", json.dumps(data, indent=1) + "\n")
        atomic_write_text(out / "heldout.md", markdown(data))
        if args.into is not None:
            write_into(args.into, readme_section(data), start=START, end=END)
    except (HeldoutError, FasttrainError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"held out: {summary_line(data['summary'])}\nin sample: {summary_line(data['in_sample'])}")
    print(f"wrote {out / 'heldout.json'} and {out / 'heldout.md'}" + (f"; {args.into}" if args.into else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
