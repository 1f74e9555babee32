"""The interactive page in headless Chromium: its JavaScript against the Python formulas on the
same setups, and its controls driven end to end (screenshot kept in test-artifacts/).

Needs Debian's ``chromium`` (/usr/bin/chromium) and the ``playwright`` Python package (no
``playwright install``: the system browser is launched); skips, saying so, when either is absent.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.memory import Setup, estimate, preset
from fasttrain.memory.config import PRESETS
from fasttrain.memory.page import render, write_page
from fasttrain.memory.playbook import format_bytes

CHROMIUM = os.environ.get("FASTTRAIN_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        pytest.skip("chromium not installed: apt-get install -y chromium (Debian) to run the page tests")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright not installed: pip install playwright (the system chromium is used, "
                    "no 'playwright install')")
    html = tmp_path_factory.mktemp("page") / "memory.html"
    write_page(html, preset=("llama3-8b"))
    profile = tempfile.mkdtemp(prefix="fasttrain-chromium-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium"),
            headless=True, args=FLAGS, viewport={"width": 1400, "height": 1000})
        pg = ctx.new_page()
        errors = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.on("requestfailed", lambda r: errors.append(f"request {r.url}"))
        pg.on("request", lambda r: errors.append(f"network request {r.url}") if not r.url.startswith(("file:", "data:", "about:")) else None)
        pg.goto(html.as_uri())
        pg.errors = errors
        yield pg
        ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


def js_setup(s: Setup) -> dict:
    d = asdict(s)
    d["kv_heads"] = s.g
    d["lora_targets"] = list(s.lora_targets)
    return d


def random_setup(rng: random.Random) -> Setup:
    d = rng.choice([16, 32, 64, 128])
    a = rng.choice([1, 2, 4, 8, 12, 16, 32, 64, 128])
    g = rng.choice([x for x in (1, 2, 4, 8, 16, a) if a % x == 0])
    tp = rng.choice([x for x in (1, 2, 4, 8) if a % x == 0 and (g % x == 0 or x % g == 0)])
    return Setup(heads=a, kv_heads=g, hidden=a * d, ffn=tp * rng.randint(1, 3000), layers=rng.randint(1, 130),
                 seq=rng.choice([1, 7, 128, 1000, 2048, 8192, 32768]), vocab=rng.randint(1, 260000),
                 micro_batch=rng.choice([1, 2, 3, 8, 32]), tp=tp, dp=rng.choice([1, 2, 8, 64, 1000]),
                 opt_bytes=rng.choice([0, 4, 8, 12]), precision=rng.choice(["fp32", "mixed", "amp"]),
                 seq_parallel=rng.random() < 0.4, recompute=rng.choice(["none", "selective", "full"]),
                 zero=rng.randint(0, 3), ffn_act=rng.choice(["relu", "gelu", "swiglu"]), norm=rng.choice(["rms", "layer"]),
                 pos=rng.choice(["rope", "learned"]), tied=rng.random() < 0.5, bias=rng.random() < 0.5,
                 dropout=rng.random() < 0.4, attention=rng.choice(["eager", "flash"]),
                 optimizer=rng.choice(["foreach", "fused"]), workspace_mib=rng.choice([0.0, 64.0, 128.0]),
                 grad_buffers=rng.random() < 0.3)


def close(a, b):
    return a == b or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-6)


def compare(js: dict, py, where: str):
    assert close(js["total"], py.total), (where, js["total"], py.total)
    assert close(js["params"], py.params), where
    assert [l["name"] for l in js["lines"]] == [l.name for l in py.lines], where
    for jl, pl in zip(js["lines"], py.lines):
        assert close(jl["bytes"], pl.bytes), (where, pl.name, jl["bytes"], pl.bytes)
        assert jl["in_total"] == pl.in_total, where
        jc = jl.get("children") or []
        assert [c["name"] for c in jc] == [c.name for c in pl.children], where
        for c1, c2 in zip(jc, pl.children):
            assert close(c1["bytes"], c2.bytes), (where, c2.name)
    if py.mode == "precise":
        assert js["peak_moment"] == py.extra["peak_moment"], where
        assert [m["name"] for m in js["moments"]] == [m["name"] for m in py.extra["moments"]], where
        for m1, m2 in zip(js["moments"], py.extra["moments"]):
            assert close(m1["bytes"], m2["bytes"]), (where, m2["name"])
        assert close(js["all_at_once"], py.extra["all_at_once"]), where


def test_page_is_self_contained():
    text = render()
    assert "<script src" not in text and "<link" not in text and "http://" not in text
    assert "https://" not in text.replace("https://github", "")  # no fetched resource of any kind
    for name in PRESETS:
        assert f'"{name}"' in text


def test_js_formulas_equal_python_on_presets_and_random_setups(page):
    rng = random.Random(8)
    setups = [preset(name) for name in PRESETS] + [random_setup(rng) for _ in range(300)]
    cases = [(s, m) for s in setups for m in ("playbook", "precise")]
    results = page.evaluate("""(cases) => cases.map(([s, m]) => {
        try { return FTMemory.estimate(s, m); } catch (e) { return {error: e.message}; } })""",
                            [[js_setup(s), m] for s, m in cases])
    checked = errors = 0
    for (s, m), js in zip(cases, results):
        try:
            py = estimate(s, m)
        except FasttrainError as exc:
            assert js.get("error") == str(exc), (s, m, js)
            errors += 1
            continue
        assert "error" not in js, (s, m, js)
        compare(js, py, f"{m} {s}")
        checked += 1
    assert checked > 400 and errors > 0       # both paths exercised


@pytest.mark.parametrize("bad, message", [
    (dict(heads=5), "heads (5) must divide the hidden size"),
    (dict(tp=3), "tensor parallelism t=3 must divide the heads"),
    (dict(layers=0), "--layers must be a positive integer, got 0"),
    (dict(seq=-8), "--seq must be a positive integer, got -8"),
])
def test_js_rejects_bad_input_like_python(page, bad, message):
    s = preset("llama3-8b").with_(**bad)
    with pytest.raises(FasttrainError, match=message.replace("(", r"\(").replace(")", r"\)")):
        estimate(s, "precise")
    js = page.evaluate("(s) => { try { FTMemory.precise(s); return ''; } catch (e) { return e.message; } }", js_setup(s))
    assert message in js


def test_js_format_bytes_equals_python(page):
    values = [0, 0.5, 1, 1023, 1024, 1536, 1024 ** 2, 1.125 * 1024 ** 3, 2.675 * 1024, 1024 ** 3 - 1, 1024 ** 5,
              3.7e15, 1024 ** 6 * 3, 123456789.0, 5e11 / 3]
    values += [random.Random(1).uniform(1, 1e16) for _ in range(200)]
    js = page.evaluate("(vs) => vs.map(FTMemory.formatBytes)", values)
    assert js == [format_bytes(v) for v in values]


def test_js_cost_equals_python(page):
    from fasttrain.memory import cost as C

    for row in C.published():
        arch = C.PUBLISHED[row.name][0]
        s = preset(arch)
        js = page.evaluate("([p, t, L, h, s, tf, pr, pk, hrs]) => FTMemory.cost(p, t, L, h, s, tf, pr, pk, hrs)",
                           [row.params, row.tokens, s.layers, s.hidden, 8192, row.tflops_sustained, 2.0, C.H100_BF16_TFLOPS,
                            row.published_gpu_hours])
        assert close(js["flops"], row.flops) and close(js["gpu_hours"], row.gpu_hours)
        assert close(js["dollars"], row.dollars) and close(js["implied_mfu"], row.implied_mfu)


def _set_number(page, field, value):
    page.fill(f"#{field}_input", str(value))       # fires 'input'


def _shown_total(page):
    return page.inner_text("#total")


def test_page_controls_end_to_end(page):
    # start: the llama3-8b preset in precise mode, as rendered
    s = preset("llama3-8b")
    from fasttrain.memory import format_gib

    assert _shown_total(page) == format_gib(estimate(s).total)
    # move a slider (as a user drags it: value + input event)
    page.eval_on_selector("#layers", "(el) => { el.value = 40; el.dispatchEvent(new Event('input')); }")
    s = s.with_(layers=40)
    assert page.input_value("#layers_input") == "40"
    assert _shown_total(page) == format_gib(estimate(s).total)
    # type into number boxes, toggle options
    _set_number(page, "micro_batch", 2)
    page.select_option("#recompute", "selective")
    page.select_option("#attention", "eager")
    page.check("#seq_parallel")
    _set_number(page, "tp", 4)
    _set_number(page, "dp", 8)
    page.select_option("#zero", "2")
    s = s.with_(micro_batch=2, recompute="selective", attention="eager", seq_parallel=True, tp=4, dp=8, zero=2)
    assert _shown_total(page) == format_gib(estimate(s).total)
    assert page.inner_text("#peak-at") == f"peak at: {estimate(s).extra['peak_moment']}"
    # the table's lines are the Python lines
    for line in estimate(s).lines:
        if line.in_total:
            cell = page.inner_text(f"tr[data-line='{line.name}'] td.num")
            assert cell == format_gib(line.bytes), line.name
    # what trains: optimizer kind, LoRA on a frozen base, a soft prompt (modelled on one tensor-parallel rank:
    # with t = 4 the page says so, as the CLI does)
    page.fill("#lora_rank", "16")
    assert "modelled on one tensor-parallel rank" in page.inner_text("#error")
    page.fill("#lora_rank", "0")
    _set_number(page, "tp", 1)
    s = s.with_(tp=1)
    assert _shown_total(page) == format_gib(estimate(s).total)
    page.select_option("#optim", "adafactor")
    page.select_option("#optimizer", "foreach")
    page.fill("#lora_rank", "16")
    page.check("#lora_targets input[value=up]")
    s = s.with_(optim="adafactor", optimizer="foreach", lora_rank=16, lora_targets=("qkv", "proj", "up"))
    assert _shown_total(page) == format_gib(estimate(s).total)
    page.fill("#lora_rank", "0")
    page.fill("#prompt_tokens", "20")
    page.select_option("#optim", "adamw_8bit")
    s = s.with_(lora_rank=0, prompt_tokens=20, optim="adamw_8bit")
    assert _shown_total(page) == format_gib(estimate(s).total)
    page.fill("#prompt_tokens", "0")
    page.select_option("#optim", "adamw")
    s = s.with_(prompt_tokens=0, optim="adamw")
    assert _shown_total(page) == format_gib(estimate(s).total)
    # playbook mode: the widget's numbers and byte format
    page.click("#mode label:has-text('playbook')")
    assert _shown_total(page) == format_bytes(estimate(s, "playbook").total)
    page.select_option("#precision", "fp32")
    page.select_option("#ffn_act", "gelu")
    s = s.with_(precision="fp32", ffn_act="gelu")
    assert _shown_total(page) == format_bytes(estimate(s, "playbook").total)
    # a preset reproduces the widget's own preset exactly
    page.select_option("#preset", "playbook-70b")
    assert _shown_total(page) == format_bytes(estimate(preset("playbook-70b"), "playbook").total)
    # bad input: one line, no total
    _set_number(page, "heads", 7)
    assert page.is_visible("#error")
    assert "heads (7) must divide the hidden size (8192)" in page.inner_text("#error")
    assert _shown_total(page) == "–"
    _set_number(page, "heads", 64)
    assert not page.is_visible("#error")
    # back to precise on Llama 3 405B with the published cost figures
    page.select_option("#preset", "llama3-405b")
    page.click("#mode label:has-text('precise')")
    assert _shown_total(page) == format_gib(estimate(preset("llama3-405b")).total)
    from fasttrain.memory import cost as C

    row = next(r for r in C.published() if r.name == "llama3.1-405b")
    assert page.inner_text("#implied") == f"{100 * row.implied_mfu:.1f}%"
    ARTIFACTS.mkdir(exist_ok=True)
    page.select_option("#preset", "llama3-8b")
    page.screenshot(path=str(ARTIFACTS / "memory-page.png"), full_page=True)
    assert (ARTIFACTS / "memory-page.png").stat().st_size > 10_000
    assert page.errors == []


def test_js_format_gib_equals_python(page):
    from fasttrain.memory import format_gib

    values = [0, 1, 512.5, 1023.5, 1024, 8.125 * 1024 ** 3, 1.005 * 1024 ** 2, 3 * 1024 ** 5, 2 ** 60]
    values += [random.Random(2).uniform(1, 1e15) for _ in range(200)]
    assert page.evaluate("(vs) => vs.map(FTMemory.formatGiB)", values) == [format_gib(v) for v in values]


def test_page_refuses_a_transformers_models_setup():
    """The page's JavaScript models the lab's GPT; a setup with a transformers model's fields (head_dim,
    per-kind biases, a learned position table, transformers' modules) is refused, not shown wrong."""
    from fasttrain.memory.hf_config import setup_from_hf_config

    gpt2 = setup_from_hf_config(dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=100,
                                     n_positions=64), seq=64)
    for setup in (gpt2, preset("llama3-8b").with_(head_dim=256), preset("llama3-8b").with_(keep_logits=True)):
        with pytest.raises(FasttrainError, match="models the lab's GPT"):
            render(setup)
    assert "<html" in render(preset("llama3-8b")).lower()


def test_the_page_of_a_transformers_model_in_the_browser(page, tmp_path):
    """``memory --hf-config X --html``: the model's breakdown as the estimator gave it, and what fits
    re-ranked as the GPU memory and count change (numbers from Python, chosen among in the page)."""
    from fasttrain.memory.breakdown import format_gib
    from fasttrain.memory.fit import rank
    from fasttrain.memory.hf_config import setup_from_hf_config
    from fasttrain.memory.page import write_hf_page

    llama = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)
    setup = setup_from_hf_config(llama, micro_batch=8, seq=512, precision="amp")
    b = estimate(setup, "precise")
    html = tmp_path / "hf.html"
    write_hf_page(html, setup, b, model="tiny-llama", nproc_per_node=2, gpu_gb=80.0, bf16=True, strategy="none")
    pg = page.context.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(html.as_uri())
    assert pg.text_content("#model") == "tiny-llama"
    assert pg.text_content("#total") == format_gib(b.total)
    table = lambda: pg.eval_on_selector_all("#ranking tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    rows = table()
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [(x.strategy, x.recompute, format_gib(x.bytes), "yes")
                                                        for x in rank(setup, 2, 80e9, True)]
    # a GPU between the peaks: the smallest fitting first, then the rest marked no
    peaks = sorted(x.bytes for x in rank(setup, 2, 80e9, True))
    gb = (peaks[2] + peaks[3]) / 2 / 1e9
    pg.fill("#gpu_gb", str(gb))
    marks = [r[3] for r in table()]
    assert marks == ["yes"] * 3 + ["no"] * (len(peaks) - 3)
    assert pg.text_content("#best").startswith(f"smallest that fits on 2 x {gb} GB: fasttrain lab --strategy")
    pg.select_option("#gpus", "1")
    assert {r[0] for r in table()} == {"none"}
    pg.fill("#gpu_gb", "0.001")
    assert pg.text_content("#best").startswith("nothing fits on 1 x 0.001 GB")
    assert errors == []
    pg.close()
