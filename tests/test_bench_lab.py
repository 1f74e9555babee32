"""``fasttrain bench lab`` on the CPU: the tick and agreement logic on given numbers, the rows'
token budget and selection, and a run of the tiny preset writing the bench's one output format."""

from __future__ import annotations

import csv
import json

import pytest

torch = pytest.importorskip("torch")

from tests_support import run_cli  # noqa: E402
from fasttrain.bench import lab as bench_lab  # noqa: E402
from fasttrain.bench import lab_report  # noqa: E402
from fasttrain.bench.report import CSV_COLUMNS  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab.config import preset  # noqa: E402


# --- ticks on given numbers ---------------------------------------------------------------------

@pytest.mark.parametrize("speed, memory, expected", [
    (1.10, 0.90, ("yes", "yes")),         # the thresholds themselves count as yes
    (1.0999, 0.9001, ("no", "no")),
    (3.0, 1.5, ("yes", "no")),            # faster but hungrier (a larger batch)
    (0.4, 0.3, ("no", "yes")),            # slower but leaner (checkpointing)
    (None, None, (None, None)),           # not measured (no GPU: no peak)
    (1.2, None, ("yes", None)),
])
def test_tick_thresholds(speed, memory, expected):
    assert bench_lab.tick(speed, memory) == expected


def test_agreement_with_the_lecture():
    assert bench_lab.agrees("yes", "yes") is True
    assert bench_lab.agrees("no", "yes") is False
    assert bench_lab.agrees("yes", "no") is False
    assert bench_lab.agrees("no", "no / yes") is True     # "it depends": either agrees
    assert bench_lab.agrees("yes", "no / yes") is True
    assert bench_lab.agrees(None, "yes") is None


def _row(technique, label, speed, memory):
    return {"technique": technique, "label": label, "speed_tick": speed, "memory_tick": memory}


def test_a_technique_is_yes_when_any_of_its_rows_is():
    rows = [_row("batch size", "batch 16", "no", "yes"), _row("batch size", "batch 256", "yes", "no"),
            _row("gradient checkpointing", "full", "no", "yes"), _row("gradient checkpointing", "selective", "no", "no"),
            _row("torch.compile", "compile", "yes", "yes"),
            _row("mixed precision", "bf16", "yes", "no"),
            _row("data preloading", "preload", "no", None)]
    v = {d["technique"]: d for d in bench_lab.technique_verdicts(rows)}
    assert (v["batch size"]["speed"], v["batch size"]["memory"]) == ("yes", "yes")
    assert v["batch size"]["speed_rows"] == ["batch 256"] and v["batch size"]["memory_rows"] == ["batch 16"]
    assert v["batch size"]["speed_agree"] and v["batch size"]["memory_agree"]
    assert v["gradient checkpointing"]["speed_agree"] and v["gradient checkpointing"]["memory_agree"]
    # the lecture says compile buys no memory: a measured yes differs
    assert v["torch.compile"]["speed_agree"] is True and v["torch.compile"]["memory_agree"] is False
    assert v["mixed precision"]["memory_agree"] is True           # "no / yes"
    assert v["data preloading"]["speed_agree"] is False and v["data preloading"]["memory"] is None
    assert v["PEFT"]["rows"] == 0 and v["PEFT"]["speed"] is None and v["PEFT"]["speed_agree"] is None


def test_every_technique_of_the_lecture_has_a_row():
    techniques = {r.technique for r in bench_lab.lab_rows(64)}
    assert set(bench_lab.LECTURE) <= techniques
    labels = [r.label for r in bench_lab.lab_rows(64)]
    assert len(labels) == len(set(labels))
    assert {"batch 16", "batch 256", "accumulate 4 x 16"} <= set(labels)


# --- the plan -----------------------------------------------------------------------------------

def test_rows_train_the_baselines_token_budget():
    base = preset("shakespeare-char", **bench_lab.BASELINE)
    rows = {r.label: r for r in bench_lab.lab_rows(base.per_device_train_batch_size)}
    cfg = {label: bench_lab.row_config(base, rows[label], steps=40, warmup=5)
           for label in ("baseline", "batch 16", "batch 256", "accumulate 4 x 16", "bf16")}
    budget = 45 * 64 * 256
    for label, c in cfg.items():
        assert c.max_steps * c.batch_tokens == pytest.approx(budget, rel=0.05), label
        assert c.timing_warmup_steps == 5 and c.eval_interval == 0
    assert cfg["batch 16"].max_steps == 4 * cfg["baseline"].max_steps
    assert cfg["batch 16"].warmup_steps == 4 * cfg["baseline"].warmup_steps     # the schedule over tokens
    assert cfg["accumulate 4 x 16"].max_steps == cfg["baseline"].max_steps
    assert cfg["bf16"].bf16 and not cfg["baseline"].bf16 and cfg["baseline"].attn_implementation == "eager"


def test_row_selection_brings_the_pair_along():
    rows = bench_lab.lab_rows(64)
    chosen = [r.label for r in bench_lab.select_rows(rows, ["LoRA"])]
    assert chosen == ["full fine-tune", "LoRA r=8 qkv,proj"]
    assert [r.label for r in bench_lab.select_rows(rows, ["compile"])] == ["baseline", "compile", "compile reduce-overhead"]
    assert bench_lab.select_rows(rows, ["sweep"]) == [] and bench_lab.sweep_selected(["sweep"])
    assert not bench_lab.sweep_selected(["batch"])
    with pytest.raises(FasttrainError, match="no row"):
        bench_lab.select_rows(rows, ["nothing-like-this"])


def test_cpu_skips_the_gpu_rows_with_a_reason():
    rows = {r.label: r for r in bench_lab.lab_rows(64)}
    for label in ("fp16", "liger kernels", "adamw_8bit", "workers 2 + pin + prefetch", "empty cache every step"):
        assert "CUDA" in rows[label].cannot_run(cuda=False)
        assert rows[label].cannot_run(cuda=True) is None
    assert rows["bf16"].cannot_run(cuda=False) is None


# --- compiling rows: cold and warm start, on given numbers --------------------------------------

def _record(step_p50, warmup_ms):
    return {"step_ms": {"p20": step_p50, "p50": step_p50, "p80": step_p50, "mean": step_p50, "n": 5},
            "tokens_per_s": 1000.0 / step_p50, "warmup_ms": warmup_ms, "final": {"val_loss": 2.0},
            "memory": {"peak_allocated_bytes": 64 * bench_lab.MIB, "peak_reserved_bytes": 80 * bench_lab.MIB},
            "estimate": {}, "environment": {}}


def _lab_case(label, technique, record, options=None):
    from fasttrain.bench.results import CaseResult

    config = {"max_steps": 7, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "context": 16,
              "learning_rate": 1e-3, "timing_warmup_steps": len(record["warmup_ms"])}
    case = CaseResult(suite="lab", label=label, engine="lab", rung=technique, model="tiny", precision="fp32",
                      options=options or {"_pair": "baseline"}, config=config, seed_ms=None, status="ok",
                      records=[record], seeds=[0])
    case.metrics = bench_lab.case_metrics([record])
    return case


def _compiled_result(compiled_step_ms, warm_record):
    from fasttrain.bench.results import SuiteResult

    base = _lab_case("baseline", "baseline", _record(20.0, [30.0, 21.0]))
    # two warm-up steps: 12,000 + 40 ms cold; at 10 ms a step the compilation took 12.02 s
    compiled = _lab_case("compile", "torch.compile", _record(compiled_step_ms, [12_000.0, 40.0]),
                         {"torch_compile": True, "_pair": "baseline"})
    compiled.metrics.update(bench_lab.compile_metrics(compiled, warm_record))
    result = SuiteResult("lab", "t", False, "cmd", "now", {"name": "tinyshakespeare", "n_train": 100, "n_test": 10,
                                                            "steps": 5, "warmup": 2, "preset": "tiny"}, {}, 1,
                         cases=[base, compiled])
    return result, compiled


def test_compile_seconds_and_breakeven_of_a_compiling_row():
    # warm start: 2 warm-up steps in 2,000 + 20 ms, at 10 ms a step: 2.0 s
    result, compiled = _compiled_result(10.0, _record(10.0, [2_000.0, 20.0]))
    bench_lab.derive(result)
    assert compiled.metric("compile_cold_s") == pytest.approx(12.02)
    assert compiled.metric("compile_warm_s") == pytest.approx(2.0)
    # 20 ms against 10 ms: 10 ms saved a step
    assert compiled.metric("breakeven_steps_cold") == pytest.approx(12.02 / 0.010)
    assert compiled.metric("breakeven_steps_warm") == pytest.approx(2.0 / 0.010)
    assert compiled.metrics["breakeven_steps_cold"]["unit"] == "steps"
    assert "compile_cold_s" not in result.cases[0].metrics      # a row that does not compile has none


def test_a_compiled_row_that_is_not_faster_never_pays_and_a_missing_warm_start_is_no_figure():
    from fasttrain.bench.report import to_csv, to_json

    result, compiled = _compiled_result(25.0, None)
    bench_lab.derive(result)
    for which in ("cold", "warm"):
        assert compiled.metric(f"breakeven_steps_{which}") is None
    assert compiled.metrics["breakeven_steps_cold"]["unit"] == bench_lab.NEVER
    assert compiled.metric("compile_warm_s") is None and compiled.metrics["breakeven_steps_warm"]["unit"] == "steps"
    to_json(result)             # strict JSON: "never" is a unit, not an infinity
    lines = {(r["label"], r["metric"]): r for r in csv.DictReader(to_csv([result]).splitlines())}
    assert lines[("compile", "breakeven_steps_cold")]["unit"] == "never"
    assert lines[("compile", "breakeven_steps_cold")]["p50"] == ""


def test_lab_md_shows_the_compiling_rows_cold_and_warm_start():
    from fasttrain.bench.report import to_csv

    result, _ = _compiled_result(10.0, _record(10.0, [2_000.0, 20.0]))
    md = lab_report.markdown(result)
    assert "Compiling rows, cold and warm start" in md
    header = next(line for line in md.splitlines() if line.startswith("| row | ms/step p50 | pair"))
    for column in ("compile s cold", "compile s warm", "pays after (cold)", "pays after (warm)"):
        assert column in header
    line = next(line for line in md.splitlines() if line.startswith("| compile |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == ["compile", "10", "baseline", "20", "12", "12", "2", "1,202", "200"]
    metrics = {r["metric"] for r in csv.DictReader(to_csv([result]).splitlines()) if r["label"] == "compile"}
    assert {"compile_cold_s", "compile_warm_s", "breakeven_steps_cold", "breakeven_steps_warm"} <= metrics
    # the never case, and a table without a compiling row has no such table
    slow, _ = _compiled_result(25.0, None)
    assert "| compile | 25 | baseline | 20 | 12 | 12 | - | never | - |" in lab_report.markdown(slow)
    result.cases = result.cases[:1]
    assert "Compiling rows" not in lab_report.markdown(result)


@pytest.mark.slow
def test_a_compiling_row_runs_cold_on_empty_cache_folders_then_warm_on_them_and_restores(corpus, monkeypatch):
    import os

    from fasttrain.lab import train as lab_train

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/the/users/inductor/cache")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    seen, events = [], []
    forget = bench_lab.forget_compiled_code
    monkeypatch.setattr(bench_lab, "forget_compiled_code", lambda: (events.append("forget"), forget()))

    def runner(cfg, **kw):
        events.append("compiled run" if cfg.torch_compile else "run")
        inductor, triton = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")
        files = sorted(os.listdir(inductor)) if cfg.torch_compile and os.path.isdir(inductor) else None
        seen.append({"compile": cfg.torch_compile, "steps": cfg.max_steps, "inductor": inductor, "triton": triton,
                     "files": files})
        if cfg.torch_compile:       # a compilation fills the cache folder
            os.makedirs(inductor, exist_ok=True)
            open(os.path.join(inductor, f"graph-{len(seen)}"), "w").close()
        return lab_train.run(cfg.with_(torch_compile=False), **kw)     # the CPU: the eager run stands in

    rows = [bench_lab.LabRow("baseline", "baseline"),
            bench_lab.LabRow("compile", "torch.compile", overrides={"torch_compile": True})]
    result = bench_lab.run_lab(bench_lab.LabPlan("tiny", 3, 2, 1, rows, False, 2, device="cpu"), corpus=corpus,
                               runner=runner)
    base, cold, warm = seen
    assert base["inductor"] == "/the/users/inductor/cache" and base["triton"] is None
    # the cold run: fresh folders, nothing in them
    assert cold["compile"] and cold["inductor"] != "/the/users/inductor/cache" and cold["files"] == []
    assert cold["triton"] and os.path.dirname(cold["triton"]) == os.path.dirname(cold["inductor"])
    # the warm start: the same folders, holding what the cold run wrote; only the warm-up and one step
    assert (warm["inductor"], warm["triton"]) == (cold["inductor"], cold["triton"]) and warm["files"] == ["graph-2"]
    assert warm["steps"] == 3
    # the in-memory caches dropped before the cold run, before the warm start (only the folders serve it), after
    assert events == ["run", "forget", "compiled run", "forget", "compiled run", "forget"]
    # restored: the user's folder back, the unset variable unset, the temporary folder gone
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/the/users/inductor/cache"
    assert "TRITON_CACHE_DIR" not in os.environ
    assert not os.path.exists(os.path.dirname(cold["inductor"]))
    compiled = next(c for c in result.cases if c.label == "compile")
    for metric in ("compile_cold_s", "compile_warm_s"):
        assert compiled.metrics[metric]["unit"] == "s" and compiled.metric(metric) is not None
    assert {"breakeven_steps_cold", "breakeven_steps_warm"} <= set(compiled.metrics)
    assert "compile_cold_s" not in next(c for c in result.cases if c.label == "baseline").metrics


@pytest.mark.gpu
def test_bench_lab_measures_the_compile_rows_cold_and_warm_start_on_cuda(fake_corpus, tmp_path, capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "res"
    code, _, err = run_cli(["bench", "lab", "--preset", "tiny", "--rows", "compile", "--steps", "5", "--warmup", "2",
                            "--out", str(out)], capsys)
    assert code == 0, err
    with open(out / "lab.csv") as fh:
        by = {(r["label"], r["metric"]): r for r in csv.DictReader(fh)}
    for label in ("compile", "compile reduce-overhead"):
        cold = float(by[(label, "compile_cold_s")]["p50"])
        warm = float(by[(label, "compile_warm_s")]["p50"])
        assert cold >= warm > 0, (label, cold, warm)
        for which in ("cold", "warm"):
            entry = by[(label, f"breakeven_steps_{which}")]
            assert entry["unit"] == "never" or float(entry["p50"]) > 0
    md = (out / "lab.md").read_text()
    assert "Compiling rows, cold and warm start" in md and "| compile |" in md and "pays after (warm)" in md
    cases = {c["label"]: c for c in json.loads((out / "lab.json").read_text())["cases"]}
    assert cases["compile"]["metrics"]["compile_cold_s"]["p50"] > 0


# --- runs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_lab_on_the_cpu_writes_csv_markdown_and_readme(fake_corpus, tmp_path, capsys):
    out = tmp_path / "res"
    code, stdout, err = run_cli(["bench", "lab", "--preset", "tiny", "--steps", "3", "--warmup", "2", "--device", "cpu",
                              "--rows", "baseline,batch,LoRA,fp16,sweep", "--out", str(out)], capsys)
    assert code == 0, err
    for name in ("lab.json", "lab.csv", "lab.md", "results.csv", "README.md"):
        assert (out / name).is_file(), name
    with open(out / "lab.csv") as fh:
        lines = list(csv.DictReader(fh))
    assert tuple(lines[0].keys()) == CSV_COLUMNS
    by = {(r["label"], r["metric"]): r for r in lines}
    assert {r["suite"] for r in lines} == {"lab"} and {r["model"] for r in lines} == {"tiny"}
    for metric in ("tokens_per_s", "step_ms", "val_loss", "estimate_precise", "warmup_ms"):
        assert float(by[("baseline", metric)]["p50"]) > 0, metric
    # a larger batch at the same budget: the ratio is the two tokens/s divided
    speed = float(by[("batch 32", "speed_ratio")]["p50"])
    assert speed == pytest.approx(float(by[("batch 32", "tokens_per_s")]["p50"])
                                  / float(by[("baseline", "tokens_per_s")]["p50"]), rel=1e-4)
    assert by[("batch 32", "speed_tick")]["p50"] == ("1" if speed >= bench_lab.SPEED_YES else "0")
    assert by[("batch 32", "memory_ratio")]["p50"] == ""          # no GPU: no peak, no memory tick
    # LoRA is compared with full fine-tuning of the same checkpoint
    lora = float(by[("LoRA r=8 qkv,proj", "speed_ratio")]["p50"])
    assert lora == pytest.approx(float(by[("LoRA r=8 qkv,proj", "tokens_per_s")]["p50"])
                                 / float(by[("full fine-tune", "tokens_per_s")]["p50"]), rel=1e-4)
    result = json.loads((out / "lab.json").read_text())
    cases = {c["label"]: c for c in result["cases"]}
    assert cases["fp16"]["status"] == "skipped" and "CUDA" in cases["fp16"]["reason"]
    assert cases["sweep"]["status"] == "skipped"
    assert cases["LoRA r=8 qkv,proj"]["records"][0]["params"]["trainable"] < \
        cases["full fine-tune"]["records"][0]["params"]["trainable"]
    # equal token budget: batch 2 ran 4 x the baseline's steps
    assert cases["batch 2"]["config"]["max_steps"] == 4 * cases["baseline"]["config"]["max_steps"]
    md = (out / "lab.md").read_text()
    assert "The lecture's table, measured" in md and "| batch size | yes |" in md
    assert ">= 1.10" in md and "<= 0.90" in md and "one run (n=1)" in md
    assert "fp16: needs a CUDA GPU" in md
    assert "lab_loss_curves.png" in md or not (out / "lab_loss_curves.png").exists()
    assert "The lecture's table, measured" in stdout
    # the README section generator picks the lab up
    code, readme, err = run_cli(["bench", "readme", str(out)], capsys)
    assert code == 0, err
    assert "The lecture's table, measured" in readme

    # a second run of other rows merges; another setting is refused with one line
    code, _, err = run_cli(["bench", "lab", "--preset", "tiny", "--steps", "3", "--warmup", "2", "--device", "cpu",
                         "--rows", "adafactor", "--out", str(out)], capsys)
    assert code == 0, err
    labels = [c["label"] for c in json.loads((out / "lab.json").read_text())["cases"]]
    assert "adafactor" in labels and "LoRA r=8 qkv,proj" in labels
    code, _, err = run_cli(["bench", "lab", "--preset", "tiny", "--steps", "4", "--device", "cpu", "--rows", "baseline",
                         "--out", str(out)], capsys)
    assert code != 0 and "another setting" in err and "Traceback" not in err


def test_a_run_cut_short_keeps_its_finished_rows(corpus):
    from fasttrain.lab import train as lab_train

    calls = []

    def runner(cfg, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(cfg)
        return lab_train.run(cfg, **kw)

    saved = []
    rows = bench_lab.select_rows(bench_lab.lab_rows(8), ["batch"])
    plan = bench_lab.LabPlan("tiny", 2, 1, 1, rows, False, 2, device="cpu")
    with pytest.raises(KeyboardInterrupt):
        bench_lab.run_lab(plan, on_case=lambda r: saved.append([c.label for c in r.ran()]), corpus=corpus,
                          runner=runner)
    assert saved[-1] == ["baseline", "batch 2"]


def test_the_bar_names_each_rows_step_loss_and_throughput(corpus):
    from fasttrain.bench.results import Progress

    class Recorder(Progress):
        def __init__(self):
            self.lines = []

        def describe(self, description):
            self.lines.append(description)

    bar = Recorder()
    rows = bench_lab.select_rows(bench_lab.lab_rows(8), ["baseline"])
    bench_lab.run_lab(bench_lab.LabPlan("tiny", 20, 1, 1, rows, False, 2, device="cpu"), corpus=corpus, progress=bar)
    last = [line for line in bar.lines if "step 20/" in line][-1]
    assert "lab: baseline" in last and "loss " in last and "tok/s" in last, bar.lines


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown --preset"),
    (["--preset", "tiny", "--rows", "zzz"], "no row"),
    (["--preset", "tiny", "--steps", "0"], "--steps"),
    (["--preset", "tiny", "--model", "bert"], "unknown --model 'bert'"),
    (["--preset", "tiny", "--model", "hf:/no/such/folder", "--rows", "baseline"], "no such folder"),
])
def test_bench_lab_bad_input_is_one_line(fake_corpus, tmp_path, capsys, args, message):
    code, _, err = run_cli(["bench", "lab", "--device", "cpu", "--out", str(tmp_path / "r"), *args], capsys)
    assert code != 0 and message in err and "Traceback" not in err
    assert not (tmp_path / "r" / "lab.json").exists()


def test_bench_lab_list_shows_rows_and_skips(capsys):
    code, out, err = run_cli(["bench", "lab", "--preset", "tiny", "--device", "cpu", "--list"], capsys)
    assert code == 0, err
    assert "baseline" in out and "skip" in out and "liger" in out and "sweep" in out


def test_sweep_doubles_until_out_of_memory_then_bisects_the_edge(corpus, monkeypatch, tmp_path):
    # no GPU runs out of memory here: a probe that "fits" below 13 sequences stands in for the GPU
    from fasttrain.bench import figures, report
    from fasttrain.bench.results import Progress, SuiteResult
    from fasttrain.lab import batchsize
    from fasttrain.lab import train as lab_train

    probed = []

    def probe(cfg, corpus, device):
        batch = cfg.per_device_train_batch_size
        probed.append(batch)
        return batch < 13

    monkeypatch.setattr(bench_lab, "SWEEP_PRESET", "tiny")
    monkeypatch.setattr(bench_lab, "SWEEP_OVERRIDES", {})
    monkeypatch.setattr(batchsize, "probe_batch", probe)
    plan = bench_lab.LabPlan("tiny", 2, 1, 1, [], True, 2, device="cpu")
    result = SuiteResult("lab", "t", False, "", "", bench_lab.dataset_info(corpus, plan), {}, 1)
    bench_lab._sweep(plan, result, corpus, lab_train.run, Progress(), True, None)
    assert [c.options["per_device_train_batch_size"] for c in bench_lab.sweep_cases(result)] == [4, 8]
    edge = bench_lab.sweep_edge(result)
    assert edge.options == {"first_oom": 16, "largest_fit": 12, "first_oom_bisected": 13}
    assert probed == [4, 8, 16, 12, 14, 13]
    md = lab_report.markdown(result)
    assert "Batch-size sweep up to the out-of-memory edge" in md and "largest batch that fits is in [12, 13)" in md
    assert report.to_csv([result]).count("sweep batch") >= 2
    if figures.matplotlib_or_none() is not None:
        assert (tmp_path / "lab_batch_sweep.png") in lab_report.write_plots(result, tmp_path)


def test_bench_lab_takes_a_hf_model(corpus, tmp_path):
    """``--model hf:DIR``: every row trains the HF model (the PEFT rows fine-tune the folder the
    baseline saved), rows that shape the lab's own GPT are skipped with their one line, and the
    model column names the model."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(tmp_path / "tiny-llama")
    rows = bench_lab.select_rows(bench_lab.lab_rows(8), ["baseline", "PEFT", "selective", "vocab"])
    plan = bench_lab.LabPlan("tiny", 2, 1, 1, rows, False, 2, device="cpu", model=f"hf:{tmp_path / 'tiny-llama'}")
    result = bench_lab.run_lab(plan, corpus=corpus)
    cases = {c.label: c for c in result.cases}
    assert {c.model for c in result.cases} == {"hf:tiny-llama"}
    assert cases["baseline"].status == "ok" and cases["baseline"].records[0]["model"]["model_type"] == "llama"
    for label in ("full fine-tune", "LoRA r=8 qkv,proj", "prompt tuning 16"):
        assert cases[label].status == "ok", (label, cases[label].reason)
        assert cases[label].records[0]["config"]["model"].endswith("pretrained")
    lora = cases["LoRA r=8 qkv,proj"].records[0]["params"]
    assert 0 < lora["trainable"] < lora["total"]
    assert cases["checkpointing selective"].status == "skipped" and "full" in cases["checkpointing selective"].reason
    assert cases["vocab padded to 64"].status == "skipped" and "vocab_size" in cases["vocab padded to 64"].reason


def test_the_data_line_names_what_the_split_sizes_count():
    """A corpus cut by a tokenizer counts tokens, named with the tokenizer; a character corpus, characters."""
    from fasttrain.bench.lab_report import _units

    bpe = {"unit": "tokens", "tokenizer": {"kind": "hf", "vocab_size": 8192, "path": "/models/bpe"}}
    assert _units(bpe) == "tokens (hf tokenizer /models/bpe, 8,192 ids)"
    assert _units({"unit": "characters"}) == "characters" and _units({"unit": "tokens"}) == "tokens"
