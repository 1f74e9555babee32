"""What fits on N GPUs (fasttrain.memory.fit): the lab's strategies as the estimator reads them, every
strategy x checkpointing ranked by its per-GPU peak, ``memory --strategy/--nproc-per-node/--bf16``, and
the page of a transformers model (``memory --hf-config X --html``)."""

from __future__ import annotations

import json

import pytest

from fasttrain.memory import estimate
from fasttrain.memory.config import check
from fasttrain.memory.fit import STRATEGIES, lab_flags, rank, strategy_changes
from fasttrain.memory.hf_config import setup_from_hf_config
from tests_support import fasttrain_cli, one_line_error

# a small Llama: every strategy splits it (4 heads over 2 key/value heads, tp 2)
LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)


def test_strategies_read_as_the_lab_maps_a_run_it_measured():
    from fasttrain.lab.parallel import distributed as D

    for strategy, lab, reshard in (("ddp", "ddp", True), ("zero1", "zero1", True), ("fsdp", "fsdp", True),
                                   ("fsdp-zero2", "fsdp", False), ("tp", "tp", True)):
        for bf16 in (False, True):
            world = D.World(world_size=4, strategy=lab, reshard_after_forward=reshard)
            mine = strategy_changes(strategy, 4, bf16)
            theirs = D.estimator_parallelism(world, bf16)
            assert {k: mine[k] for k in theirs} == theirs, strategy
            # what the lab's run would hold: autocast (amp) under --bf16, FSDP's policy (mixed) under fsdp
            assert mine["precision"] == (("mixed" if lab == "fsdp" else "amp") if bf16 else "fp32")


def test_rank_puts_what_fits_first_smallest_first():
    setup = setup_from_hf_config(LLAMA, micro_batch=8, seq=512, precision="amp")
    peaks = {(r.strategy, r.recompute): r.bytes for r in rank(setup, 2, 1e12, True)}
    assert set(peaks) == {(s, c) for s in STRATEGIES[1:] for c in ("none", "full")}
    # each figure is the estimator's on the strategy's setup
    fsdp = check(setup.with_(**strategy_changes("fsdp", 2, True), recompute="full"))
    assert peaks["fsdp", "full"] == estimate(fsdp, "precise").total
    assert peaks["fsdp", "none"] < peaks["fsdp-zero2", "none"] < peaks["zero1", "none"] < peaks["ddp", "none"]
    assert peaks["ddp", "full"] < peaks["ddp", "none"]
    # a GPU between two peaks: the choices below it first (smallest first), then those above
    limit = sorted(peaks.values())[4] + 1
    rows = rank(setup, 2, limit, True)
    assert [r.fits for r in rows] == [True] * 5 + [False] * 5
    assert [r.bytes for r in rows[:5]] == sorted(r.bytes for r in rows[:5])
    # one GPU: no strategy to choose
    assert {r.strategy for r in rank(setup, 1, limit, True)} == {"none"}
    # a split the model cannot take is said, not ranked as fitting
    odd = rank(setup, 3, 1e12, True)
    tp = [r for r in odd if r.strategy == "tp"]
    assert tp and all(r.bytes is None and not r.fits and r.note for r in tp) and odd[-1].strategy == "tp"
    assert lab_flags("fsdp-zero2", "full") == "--strategy fsdp --no-reshard-after-forward --gradient-checkpointing full"


def test_memory_answers_in_the_labs_words(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    r = fasttrain_cli("memory", "--hf-config", tmp_path, "--strategy", "fsdp", "--nproc-per-node", "8", "--bf16",
                      "--micro-batch", "8", "--seq", "512", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert (data["setup"]["dp"], data["setup"]["zero"], data["setup"]["precision"]) == (8, 3, "mixed")
    fits = data["fits"]
    assert fits["nproc_per_node"] == 8 and "FSDP's mixed-precision policy" in fits["precision"]
    mine = next(x for x in fits["ranking"] if (x["strategy"], x["recompute"]) == ("fsdp", "none"))
    assert mine["bytes"] == data["total"]                     # the breakdown is the ranking's row asked for
    r = fasttrain_cli("memory", "--hf-config", tmp_path, "--nproc-per-node", "2", "--bf16", "--micro-batch", "8",
                      "--seq", "512", "--gpu-gb", "0.16")
    assert r.returncode == 0, r.stderr
    assert "precision: bf16 autocast over fp32 weights" in r.stdout and "what fits on 2 x 0.16 GB" in r.stdout
    assert "smallest: fasttrain lab --strategy tp --gradient-checkpointing full on 2 GPUs" in r.stdout
    one_line_error(fasttrain_cli("memory", "--hf-config", tmp_path, "--nproc-per-node", "8", "--tp", "2"),
                   "set --tp as the lab's run would; drop --tp")
    one_line_error(fasttrain_cli("memory", "--hf-config", tmp_path, "--bf16", "--precision", "fp32"),
                   "--bf16 is the lab's precision flag")
    one_line_error(fasttrain_cli("memory", "--hf-config", tmp_path, "--nproc-per-node", "2", "--strategy", "none"),
                   "--nproc-per-node 2 needs a --strategy")


def test_the_page_of_a_transformers_model_holds_its_breakdown_and_rankings(tmp_path):
    from fasttrain.memory.page import PAGE_GPUS

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    page = tmp_path / "page.html"
    r = fasttrain_cli("memory", "--hf-config", tmp_path, "--bf16", "--micro-batch", "8", "--seq", "512",
                      "--nproc-per-node", "2", "--strategy", "zero1", "--html", page)
    assert r.returncode == 0, r.stderr
    text = page.read_text()
    data = json.loads(text.split("const DATA = ", 1)[1].split(";\n", 1)[0])
    setup = setup_from_hf_config(LLAMA, micro_batch=8, seq=512, precision="amp")
    assert sorted(map(int, data["rankings"])) == list(PAGE_GPUS)
    assert data["rankings"]["2"] == [x.to_dict() for x in rank(setup, 2, 80e9, True)]
    asked = check(setup.with_(**strategy_changes("zero1", 2, True)))
    assert data["total"] == estimate(asked, "precise").total and data["nproc_per_node"] == 2
    assert "as asked: zero1 on 2 GPUs" in data["summary"] and "bf16 autocast" in data["summary"]
