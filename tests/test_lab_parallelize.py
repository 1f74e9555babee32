"""lab/parallelize.py: the one order of techniques; every strategy (ddp, zero1, fsdp ZeRO-2/3, hsdp,
tp, the 2-D fsdp x tp mesh, optimizer offload) in 2 and 4 gloo processes trains the same function as
one process at the same global batch; the meta-device build gives the one-process weights; fused AdamW
steps FSDP's DTensor shards; float8's module selection and refusals; the shapes that do not divide the world, refused in one line."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import parallelize as P  # noqa: E402
from fasttrain.lab.parallel import distributed as D  # noqa: E402
from fasttrain.lab import fit as F  # noqa: E402
from tests_support import free_port as _free_port, join_process_group, leave_process_group  # noqa: E402
from tests_support import meta_build_beside_one_process, one_rank_world  # noqa: E402
from tests_support import slow_beyond, word_corpus as _text_corpus  # noqa: E402

GLOBAL_BATCH = 16


def _cfg(kv_heads: int = 2, **changes):
    from fasttrain.lab.config import preset

    changes.setdefault("device", "cpu")
    return preset("tiny", style="llama", heads=4, kv_heads=kv_heads, max_steps=3, eval_tokens=512, eval_interval=0,
                  log_interval=1, timing_warmup_steps=1, gradient_accumulation_steps=2,
                  learning_rate=1e-2, warmup_steps=0, **changes)


# --- the order -------------------------------------------------------------------------------------

def test_parallelize_applies_the_steps_in_the_stated_order(monkeypatch):
    """Every step is called, once, in ORDER (recorded by wrapping each step function)."""
    from fasttrain.lab.build import build_model

    calls = []
    steps = {"kernels": "apply_kernels", "adapters": "apply_adapters", "tensor_parallel": "apply_tensor_parallel",
             "activation_checkpointing": "apply_activation_checkpointing", "compile_blocks": "compile_blocks",
             "float8": "apply_float8", "data_parallel": "apply_data_parallel", "compile_model": "compile_model",
             "optimizer": "build_optimizer_for"}
    assert tuple(steps) == P.ORDER
    for step, fn_name in steps.items():
        original = getattr(P, fn_name)

        def recorded(*args, _step=step, _original=original, **kwargs):
            calls.append(_step)
            return _original(*args, **kwargs)
        monkeypatch.setattr(P, fn_name, recorded)
    cfg = _cfg(lora_r=2, gradient_checkpointing="full")
    done = P.parallelize(build_model(cfg, 65, torch.device("cpu")), cfg)
    assert calls == list(P.ORDER)
    # what was applied, in order: the kernels, LoRA, the GPT's own checkpointing, the optimizer
    assert [step for step, _ in done.applied] == ["kernels", "adapters", "activation_checkpointing", "optimizer"]
    assert "LoRA r=2" in done.applied[1][1]
    assert done.autocast and done.module is done.train_model


def test_a_model_built_with_other_kernels_is_refused():
    from fasttrain.lab.build import build_model

    model = build_model(_cfg(), 65, torch.device("cpu"))
    with pytest.raises(FasttrainError, match="built with attention eager"):
        P.parallelize(model, _cfg(attn_implementation="sdpa"))


def test_tensor_parallelism_of_a_model_without_a_plan_is_one_line():
    from fasttrain.lab.models import LabModel

    model = LabModel(module=torch.nn.Linear(4, 4), name="Mine", vocab_size=4)
    world = D.World(rank=0, world_size=2, strategy="tp")
    with pytest.raises(FasttrainError, match="Mine has no tensor-parallel plan"):
        P.apply_tensor_parallel(model, model.module, world, [])


# --- float8 ----------------------------------------------------------------------------------------

def test_float8_converts_the_linear_layers_but_the_head_and_odd_shapes():
    pytest.importorskip("torchao.float8")
    from fasttrain.lab.build import build_model

    # width 32 (multiple of 16), vocabulary 65 (not): the head is skipped by name and shape alike;
    # a SwiGLU MLP of width 40: the fused [gate | up] is 80 x 32 (converted), down 32 x 40 (left)
    cfg = _cfg(width=32, ffn=40)
    module = build_model(cfg, 65, torch.device("cpu")).module
    applied = []
    P.apply_float8(None, cfg.with_(float8="tensorwise"), module, applied)
    kinds = {name: type(m).__name__ for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["blocks.0.attn.qkv"] == kinds["blocks.1.attn.proj"] == "Float8Linear"
    assert kinds["head"] == "Linear"
    assert (kinds["blocks.0.mlp.up"], kinds["blocks.0.mlp.down"]) == ("Float8Linear", "Linear")
    assert applied == [("float8", "tensorwise: 6 Linear layers")]
    # --float8-all-gather: under FSDP the per-tensor recipe gathers the weights in float8 (never rowwise; off unless
    # asked)
    fsdp = type("World", (), {"fsdp": True})()
    for recipe, asked, gathers in (("tensorwise", True, True), ("tensorwise", False, False), ("rowwise", True, False)):
        module = build_model(cfg, 65, torch.device("cpu")).module
        applied = []
        assert P.apply_float8(None, cfg.with_(float8=recipe, float8_all_gather=asked), module, applied, fsdp) is gathers
        assert module.blocks[0].attn.qkv.config.enable_fsdp_float8_all_gather is gathers
        assert applied[0][1].endswith("all-gathered in float8") is gathers
    assert not P.float8_filter(torch.nn.Linear(32, 32), "lm_head")
    assert P.float8_filter(torch.nn.Linear(32, 48), "blocks.0.q_proj")


def test_float8_is_refused_on_the_cpu_and_before_hopper(monkeypatch):
    with pytest.raises(FasttrainError, match="unknown --float8 'e4m3'"):
        P.check_float8(_cfg().with_(float8="e4m3"), torch.device("cpu"))
    with pytest.raises(FasttrainError, match="CUDA GPU .* drop it on the CPU"):
        P.check_float8(_cfg().with_(float8="rowwise"), torch.device("cpu"))
    P.check_float8(_cfg(), torch.device("cpu"))             # none: nothing to check
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(FasttrainError, match="A100 has 8.0: drop --float8"):
        P.check_float8(_cfg().with_(float8="rowwise"), torch.device("cuda"))


def test_float8_run_on_the_cpu_is_one_line(capsys):
    from fasttrain.cli import main

    code = main(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--max-steps", "1", "--float8", "rowwise"])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "--float8" in err and "CPU" in err, err


@pytest.mark.gpu
def test_float8_trains_near_bf16_on_a_gpu():
    """scale-tune runs this on the device: float8 rowwise against bf16, a Llama-shaped model with
    dims of 16s; the losses stay within a few percent over a short run."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with float8 tensor cores")
    pytest.importorskip("torchao.float8")
    from fasttrain.lab.config import preset
    from fasttrain.lab.train import run

    base = preset("tiny", style="llama", layers=2, heads=4, kv_heads=2, width=256, ffn=512, context=128,
                  max_steps=30, bf16=True, device="cuda", eval_tokens=4096, eval_interval=0, log_interval=1,
                  per_device_train_batch_size=16, learning_rate=3e-3, warmup_steps=0, pad_vocab_to_multiple_of=64)
    bf16 = run(base)
    f8 = run(base.with_(float8="rowwise"))
    assert ["float8", "rowwise: 8 Linear layers"] in f8["applied"]
    assert f8["final"]["val_loss"] == pytest.approx(bf16["final"]["val_loss"], rel=0.05)


# --- meta-device build -------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_a_meta_build_sharded_by_fsdp_has_the_one_process_weights(monkeypatch, style):
    from fasttrain.lab.config import preset

    shape = dict(style="llama", heads=4, kv_heads=2) if style == "llama" else dict(style="gpt2", heads=2, bias=True)
    with one_rank_world(monkeypatch) as world:
        # the matrices are never materialized whole: on the meta device until sharded
        ref, _, mine, rng = meta_build_beside_one_process(preset("tiny", device="cpu", **shape), 65, world)
    for name, w in ref.named_parameters():
        assert torch.equal(mine[name], w), name
    # the generator ends where a plain build leaves it (dropout draws after it match too)
    assert rng


def test_meta_build_is_for_fsdp_from_scratch_only():
    from fasttrain.lab.build import meta_build_for

    fsdp = D.World(rank=0, world_size=2, strategy="fsdp")
    assert meta_build_for(_cfg(), fsdp)
    assert not meta_build_for(_cfg(), D.World(rank=0, world_size=2, strategy="ddp"))
    assert not meta_build_for(_cfg(), D.World(rank=0, world_size=4, strategy="fsdp", tp_size=2))
    assert not meta_build_for(_cfg(lora_r=2), fsdp)
    assert not meta_build_for(_cfg(), None)


# --- the optimizer over FSDP's shards ------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_adamw_steps_fsdp_s_dtensor_shards_in_one_fused_kernel(monkeypatch, device):
    """``--optim adamw_torch_fused`` under fully_shard: AdamW(fused=True) over the DTensor shards, stepped by
    torch's fused kernel on the DTensors themselves (no fall-back to for-each or the per-tensor loop), to the
    weights ``--optim adamw_torch`` gives (on the CPU its per-tensor loop; for-each on a GPU)."""
    from fasttrain.lab.build import build_model

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fasttrain.lab.config import preset

    kernels = []
    fused = torch._fused_adamw_

    def spy_fused(params, *args, **kwargs):
        kernels.append({type(p).__name__ for p in params})
        return fused(params, *args, **kwargs)
    monkeypatch.setattr(torch, "_fused_adamw_", spy_fused)
    with one_rank_world(monkeypatch, device=device) as world:
        weights = {}
        for optim in ("adamw_torch_fused", "adamw_torch"):
            cfg = preset("tiny", device=device, style="llama", heads=4, kv_heads=2, optim=optim)
            done = P.parallelize(build_model(cfg, 65, torch.device(world.device)), cfg, world)
            assert all(type(p).__name__ == "DTensor" for p in done.module.parameters())
            assert {g["fused"] for g in done.optimizer.param_groups} == ({True} if optim.endswith("fused") else {None})
            kernels.clear()
            x = torch.randint(0, 65, (2, cfg.context), generator=torch.Generator().manual_seed(0)).to(world.device)
            done.train_model(x, x).backward()
            done.optimizer.step()
            if optim.endswith("fused"):
                assert kernels and all(types == {"DTensor"} for types in kernels), kernels
            else:
                assert not kernels
            weights[optim] = {n: p.full_tensor() for n, p in done.module.named_parameters()}
    for n, w in weights["adamw_torch"].items():
        torch.testing.assert_close(weights["adamw_torch_fused"][n], w, msg=n)


# --- bad input: shapes, combinations -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,world,message", [
    (dict(strategy="fsdp", tp=3), 4, "--tp 3 does not divide the 4 ranks"),
    (dict(strategy="fsdp", tp=2, dp=4), 4, "--dp 4 x --tp 2 = 8 ranks, but the world has 4"),
    (dict(strategy="hsdp", dp_replicate=3), 4, "--dp-replicate 3 does not divide the 4 data-parallel ranks"),
    (dict(strategy="tp", tp=2), 4, "tp alone spans every rank; use --strategy fsdp --tp 2"),
    (dict(strategy="ddp", dp=2), 4, "data parallelism takes every rank"),
])
def test_a_mesh_that_does_not_divide_the_world_is_one_line(kwargs, world, message):
    with pytest.raises(FasttrainError, match=message.replace("(", r"\(").replace(")", r"\)")):
        D.mesh_shape(D.validate_parallel(D.ParallelConfig(**kwargs)), world)


def test_mesh_shapes():
    shape = lambda world, **kw: D.mesh_shape(D.ParallelConfig(**kw), world)  # noqa: E731
    assert shape(4, strategy="fsdp", tp=2) == (("dp", "tp"), (2, 2))
    assert shape(8, strategy="hsdp", dp_replicate=2, tp=2) == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2))
    assert shape(4, strategy="fsdp") == (("dp",), (4,))
    assert shape(4, strategy="tp") == (("tp",), (4,))
    assert shape(4, strategy="ddp") == ((), ())
    # rank = dp_rank * tp + tp_rank: the tp groups are consecutive ranks, sharing their rows
    ranks = [D.World(rank=r, world_size=4, strategy="fsdp", tp_size=2) for r in range(4)]
    assert [w.dp_rank for w in ranks] == [0, 0, 1, 1] and ranks[0].dp == 2
    assert [w.rows(3) for w in ranks[1:3]] == [slice(0, 3), slice(3, 6)]


@pytest.mark.parametrize("kwargs,message", [
    (dict(strategy="ddp", tp=2), "--tp 2 goes with --strategy fsdp or hsdp"),
    (dict(strategy="fsdp", dp_replicate=2), "is HSDP's: use --strategy hsdp"),
    (dict(strategy="hsdp"), "--strategy hsdp needs --dp-replicate R >= 2"),
    (dict(strategy="ddp", offload_optimizer=True), "CPUOffloadPolicy: use --strategy fsdp or hsdp"),
    (dict(strategy="fsdp", tp=0), "--tp must be a positive integer"),
    (dict(strategy="fsdp", dp=-1), "--dp must be a positive integer"),
])
def test_strategy_combinations_refused(kwargs, message):
    with pytest.raises(FasttrainError, match=message):
        D.validate_parallel(D.ParallelConfig(**kwargs))


def test_tp_must_divide_the_heads_and_kv_heads_of_its_group():
    cfg = _cfg(kv_heads=2)
    with pytest.raises(FasttrainError, match=r"--kv-heads \(2\) divisible by 4"):
        D.check_model_fits(cfg, 8, "fsdp", tp=4)
    D.check_model_fits(cfg, 8, "fsdp", tp=2)            # 2-D: only the tp group splits the heads
    D.check_model_fits(cfg, 8, "fsdp")


def _cli(args, capsys):
    from fasttrain.cli import main

    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--strategy", "fsdp", "--tp", "3", "--nproc-per-node", "4"], "--tp 3 does not divide the 4 ranks"),
    (["--strategy", "fsdp", "--tp", "2", "--nproc-per-node", "4", "--heads", "1"], "--heads (1) divisible by 2"),
    (["--strategy", "fsdp", "--tp", "2", "--nproc-per-node", "4", "--global-batch-size", "6",
      "--gradient-accumulation-steps", "2"], "does not split over 2 data-parallel rank(s)"),
    (["--strategy", "hsdp", "--nproc-per-node", "4"], "needs --dp-replicate R >= 2"),
    (["--strategy", "ddp", "--nproc-per-node", "2", "--offload-optimizer"], "use --strategy fsdp or hsdp"),
    (["--strategy", "fsdp", "--tp", "2", "--nproc-per-node", "4", "--lora-r", "2"], "does not combine with"),
])
def test_cli_bad_shapes_are_one_line_before_any_process(tmp_path, capsys, args, message):
    out = tmp_path / "run.json"
    code, err = _cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", *args, "--out", str(out)], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and message in lines[0], err
    assert not out.exists()


# --- the estimator's view -------------------------------------------------------------------------------

def test_estimator_parallelism_of_hsdp_the_2d_mesh_and_offload():
    def fields(**kw):
        return D.estimator_parallelism(D.World(rank=0, **kw), bf16=True)
    assert fields(world_size=4, strategy="fsdp", tp_size=2) == {"dp": 2, "zero": 3, "tp": 2, "precision": "mixed",
                                                               "fsdp": True, "reduce_dtype": "fp32"}
    assert D.estimator_parallelism(D.World(rank=0, world_size=2, strategy="fsdp"), True, "bf16")["reduce_dtype"] == "bf16"
    # hsdp: the state is sharded over the shard group only
    assert fields(world_size=8, strategy="hsdp", dp_replicate=2)["dp"] == 4
    assert fields(world_size=4, strategy="fsdp", offload_optimizer=True)["offload"] is True


# --- the dtype FSDP reduces the gradients in ----------------------------------------------------------

def _reduce_dtype_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from fasttrain.lab.build import build_model
    from fasttrain.lab.train import run

    group = join_process_group(rank, world, port)
    seen = []

    def spying(collective):
        def spy(*args, **kwargs):
            seen.append(str(kwargs.get("input", args[1] if len(args) > 1 else None).dtype))
            return collective(*args, **kwargs)
        return spy
    # FSDP's reduce-scatter (torch.distributed's name for it differs between versions)
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, spying(getattr(dist, name)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 65, (2 * world, 32), generator=gen)
    out_data = {}
    parallel = D.ParallelConfig(strategy="fsdp", global_batch_size=2 * world)
    w = D.init_world(parallel, device="cpu")
    for dtype in ("fp32", "bf16"):
        cfg = _cfg(reduce_dtype=dtype)
        done = P.parallelize(build_model(cfg, 65, torch.device("cpu")), cfg, w)
        seen.clear()
        rows = x[w.rows(2)]
        done.train_model(rows, rows).backward()
        grads = {n: p.grad for n, p in done.module.named_parameters()}
        out_data[dtype] = {"reduced_in": sorted(set(seen)), "grad_dtypes": sorted({str(g.dtype) for g in grads.values()}),
                           "applied": [what for step, what in done.applied if step == "data_parallel"],
                           "grads": {n: g.full_tensor().tolist() for n, g in grads.items()}}
    # a run through the lab's trainer: its record says how it reduced
    record = run(_cfg(reduce_dtype="bf16").with_(max_steps=2), corpus=_text_corpus(), parallel=parallel)
    if rank == 0:
        out_data["record"] = {"config": record["config"]["reduce_dtype"], "applied": record["applied"]}
        with open(out, "w") as f:
            json.dump(out_data, f)
    leave_process_group(group)


def test_reduce_dtype_bf16_rounds_the_gradient_sums_to_bf16(monkeypatch):
    """One process under FSDP (its reduce-scatter is a copy through the reduce buffer): with bf16 every
    gradient passes through bf16 on its way to its fp32 shard (each element the fp32 one rounded to bf16's 8
    significant bits, some of them changed); with fp32, untouched."""
    from fasttrain.lab.build import build_model

    with one_rank_world(monkeypatch) as world:
        x = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(0))
        grads = {}
        for dtype in ("fp32", "bf16"):
            cfg = _cfg(reduce_dtype=dtype)
            done = P.parallelize(build_model(cfg, 65, torch.device("cpu")), cfg, world)
            assert [what for step, what in done.applied if step == "data_parallel"][-1].endswith(f"reduced in {dtype}")
            done.train_model(x, x).backward()
            grads[dtype] = {n: p.grad.to_local() for n, p in done.module.named_parameters()}
    for n, g in grads["fp32"].items():
        assert grads["bf16"][n].dtype == torch.float32, n
        assert torch.equal(grads["bf16"][n], g.bfloat16().float()), n
    assert any(not torch.equal(grads["bf16"][n], g) for n, g in grads["fp32"].items())


@pytest.mark.slow
def test_fsdp_reduces_the_gradients_in_the_dtype_asked_for(tmp_path):
    """``--reduce-dtype`` on 2 gloo processes: the reduce-scatter runs in fp32 or bf16 as asked, the
    gradients land in fp32 shards either way; bf16's sum is the fp32 one to within bf16's rounding of each
    rank's gradient and of their sum (here under 2 x 2^-8 of the gradient's norm, and not equal to it); the run
    record says which it was."""
    out = tmp_path / "reduce.json"
    mp.start_processes(_reduce_dtype_worker, args=(2, _free_port(), str(out)), nprocs=2, start_method="spawn")
    data = json.loads(out.read_text())
    assert data["fp32"]["reduced_in"] == ["torch.float32"] and data["bf16"]["reduced_in"] == ["torch.bfloat16"]
    assert data["fp32"]["grad_dtypes"] == data["bf16"]["grad_dtypes"] == ["torch.float32"]
    assert data["bf16"]["applied"][-1].endswith("gradients reduced in bf16")
    f32 = torch.cat([torch.tensor(g).flatten() for g in data["fp32"]["grads"].values()])
    b16 = torch.cat([torch.tensor(g).flatten() for g in data["bf16"]["grads"].values()])
    error = float((b16 - f32).norm() / f32.norm())
    assert 0 < error < 2 * 2 ** -8, error
    record = data["record"]
    assert record["config"] == "bf16"
    assert any(step == "data_parallel" and what.endswith("reduced in bf16") for step, what in record["applied"])


# --- every strategy in 2 and 4 gloo processes, against one process at the same global batch ------------

# (name, ParallelConfig fields, the model's kv heads); 4 heads, so tp 4 needs kv heads 4
CASES = {
    2: [("ddp", dict(strategy="ddp"), 2), ("zero1", dict(strategy="zero1"), 2),
        ("fsdp-zero3", dict(strategy="fsdp"), 2), ("fsdp-zero2", dict(strategy="fsdp", reshard_after_forward=False), 2),
        ("hsdp", dict(strategy="hsdp", dp_replicate=2), 2), ("tp", dict(strategy="tp"), 2),
        ("fsdp-offload", dict(strategy="fsdp", offload_optimizer=True), 2)],
    4: [("ddp", dict(strategy="ddp"), 2), ("zero1", dict(strategy="zero1"), 2),
        ("fsdp-zero2", dict(strategy="fsdp", reshard_after_forward=False), 2),
        ("hsdp", dict(strategy="hsdp", dp_replicate=2), 2), ("tp", dict(strategy="tp"), 4),
        ("fsdp-tp2", dict(strategy="fsdp", tp=2), 2), ("hsdp-tp2", dict(strategy="hsdp", dp_replicate=2, tp=2), 2),
        ("fsdp-offload", dict(strategy="fsdp", offload_optimizer=True), 2)],
    # eight ranks: one rank a sequence of the global 16 under ddp; the 2-D mesh dp 4 x tp 2; the 3-D one,
    # replicate 2 x shard 2 x tp 2 (tp over 8 would need heads and key/value heads in eights)
    8: [("ddp", dict(strategy="ddp"), 2), ("fsdp-zero2", dict(strategy="fsdp", reshard_after_forward=False), 2),
        ("fsdp-tp2", dict(strategy="fsdp", tp=2), 2), ("hsdp-tp2", dict(strategy="hsdp", dp_replicate=2, tp=2), 2)],
}


def _worker(rank: int, world: int, port: int, out: str, device: str = "cpu") -> None:
    group = join_process_group(rank, world, port, device)
    from fasttrain.lab.train import run

    corpus = _text_corpus()
    records = {}
    for name, fields, kv in CASES[world]:
        parallel = D.ParallelConfig(global_batch_size=GLOBAL_BATCH, **fields)
        records[name] = run(_cfg(kv, device=device), corpus=corpus, parallel=parallel)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(records, f, default=str)
    leave_process_group(group)


@pytest.mark.parametrize("world", slow_beyond([2, 4, 8], keep=1))
def test_every_strategy_trains_the_same_function_as_one_process(tmp_path, world):
    _same_function(tmp_path, world, "cpu", rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_strategy_on_gpus_trains_the_same_function_as_one(tmp_path, world):
    # NCCL; cuBLAS may pick other kernels for another batch (another order of the sums): looser
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    _same_function(tmp_path, world, "cuda", rel=1e-4)


def _same_function(tmp_path, world: int, device: str, rel: float) -> None:
    from fasttrain.lab.train import run

    out = tmp_path / "records.json"
    mp.start_processes(_worker, args=(world, _free_port(), str(out), device), nprocs=world, start_method="spawn")
    records = json.loads(out.read_text())
    corpus = _text_corpus()
    one = {kv: run(_cfg(kv, device=device).with_(per_device_train_batch_size=GLOBAL_BATCH // 2), corpus=corpus)
           for kv in sorted({kv for _, _, kv in CASES[world]})}
    for name, fields, kv in CASES[world]:
        got, ref = records[name], one[kv]
        d = got["distributed"]
        tp = world if fields["strategy"] == "tp" else fields.get("tp", 1)
        assert (d["world_size"], d["tp"], d["dp"], d["global_batch_size"]) == (world, tp, world // tp, GLOBAL_BATCH)
        assert [p["loss"] for p in got["loss_curve"]] == pytest.approx([p["loss"] for p in ref["loss_curve"]],
                                                                      rel=rel), name
        assert got["final"]["val_loss"] == pytest.approx(ref["final"]["val_loss"], rel=rel), name
        steps = [step for step, _ in got["applied"]]
        assert steps == sorted(steps, key=P.ORDER.index), name          # applied in the stated order
        assert ("tensor_parallel" in steps) == (tp > 1), name
        setup = got["estimate"]["setup"]
        assert setup["tp"] == tp and setup["offload"] == fields.get("offload_optimizer", False), name
        if fields["strategy"] == "hsdp":
            assert setup["dp"] == world // tp // fields["dp_replicate"], name
    # training moved: the curves are not flat
    assert one[2]["loss_curve"][0]["loss"] - one[2]["loss_curve"][-1]["loss"] > 0.05


# --- a model that fits no strategy, NCCL missing -------------------------------------------------------

def test_a_model_that_fits_no_strategy_names_the_smallest_and_what_fits():
    from fasttrain.lab.config import preset

    gib = 2 ** 30
    # a 1.3B-ish lab GPT at micro-batch 4 of 2048 tokens, fp32 AdamW: ~21 GB of state alone
    cfg = preset("tiny", style="llama", layers=24, heads=16, kv_heads=8, width=2048, context=2048,
                 per_device_train_batch_size=4, vocab_size=32000, device="cuda")
    ddp = D.World(rank=0, world_size=4, strategy="ddp")
    peak = F.per_gpu_peak(cfg, 32000, ddp)
    assert F.check_fits_some_strategy(cfg, 32000, ddp, limit=peak) == peak        # fits: nothing said
    fsdp = F.per_gpu_peak(cfg, 32000, D.World(rank=0, world_size=4, strategy="fsdp"))
    assert fsdp < peak
    with pytest.raises(FasttrainError) as exc:
        F.check_fits_some_strategy(cfg, 32000, ddp, limit=fsdp + 1)
    line = str(exc.value)
    assert line.startswith(f"the memory estimator predicts {peak / gib:,.1f} GiB per GPU for ddp on 4 GPUs")
    assert "the smallest prediction on 4 GPUs is" in line and ": use --strategy " in line and "\n" not in line
    # below the smallest on 4 GPUs: the line says how many GPUs would (tensor parallelism over 8 splits
    # the activations too), or that none up to 32 would
    smallest = min(p for _, c, w in F._alternatives(cfg, 4) if (p := F.per_gpu_peak(c, 32000, w)) is not None)
    with pytest.raises(FasttrainError, match=r"(nothing fits on 4; \d+ GPUs would|nothing fits on up to 32 GPUs)"):
        F.check_fits_some_strategy(cfg, 32000, ddp, limit=smallest - 1)


def test_nccl_missing_is_one_line(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(FasttrainError, match="NCCL backend is not available in this PyTorch build"):
        D._backend_for("cuda:0", None)


def test_the_gpts_partial_checkpointing_trains_the_same_function():
    """--checkpoint-blocks on the lab's GPT: the first k blocks recompute (said in the applied line), the
    loss and the gradients are those of no checkpointing."""
    from fasttrain.lab.build import build_model

    grads, applied = {}, {}
    for changes in (dict(), dict(gradient_checkpointing="full", checkpoint_blocks=1)):
        torch.manual_seed(0)
        cfg = _cfg(dropout=0.0, **changes)
        lab_model = build_model(cfg, 65, torch.device("cpu"))
        done = P.parallelize(lab_model, cfg)
        x = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
        lab_model.loss(done.module, x, x).backward()
        grads[bool(changes)] = [p.grad.clone() for p in done.module.parameters() if p.grad is not None]
        applied[bool(changes)] = dict(done.applied).get("activation_checkpointing")
    assert applied == {False: None, True: "full (the GPT's own), the first 1 blocks"}
    assert grads[True] and len(grads[True]) == len(grads[False])
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b)


def _ddp_reduce_worker(rank: int, world: int, port: int, out: str) -> None:
    from fasttrain.lab.build import build_model

    group = join_process_group(rank, world, port)
    x = torch.randint(0, 65, (2 * world, 32), generator=torch.Generator().manual_seed(0))
    w = D.init_world(D.ParallelConfig(strategy="ddp", global_batch_size=2 * world), device="cpu")
    out_data = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        cfg = _cfg(reduce_dtype=dtype)
        done = P.parallelize(build_model(cfg, 65, torch.device("cpu")), cfg, w)
        rows = x[w.rows(2)]
        done.train_model(rows, rows).backward()
        out_data[dtype] = {"applied": [what for step, what in done.applied if step == "data_parallel"],
                           "grads": [p.grad.flatten().tolist() for p in done.module.parameters()]}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(out_data, f)
    leave_process_group(group)


@pytest.mark.slow
def test_ddp_reduces_the_gradients_in_bf16_when_asked():
    """``--reduce-dtype bf16`` under DDP (its bf16 compression hook) on 2 gloo processes: the averaged gradients
    are the fp32 ones to within bf16's rounding of each rank's gradient and of their sum, not equal to them; the
    applied line says so."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/ddp.json"
        mp.start_processes(_ddp_reduce_worker, args=(2, _free_port(), out), nprocs=2, start_method="spawn")
        data = json.loads(open(out).read())
    assert data["fp32"]["applied"] == ["DDP over 2, gradients reduced in fp32"]
    assert data["bf16"]["applied"] == ["DDP over 2, gradients reduced in bf16"]
    f32 = torch.cat([torch.tensor(g) for g in data["fp32"]["grads"]])
    b16 = torch.cat([torch.tensor(g) for g in data["bf16"]["grads"]])
    error = float((b16 - f32).norm() / f32.norm())
    assert 0 < error < 2 * 2 ** -8, error


def test_reduce_dtype_is_refused_beside_tp_and_one_process():
    for strategy in ("tp", "none"):
        with pytest.raises(FasttrainError, match="--reduce-dtype bf16 is data parallelism's gradient reduction"):
            D.check_config(_cfg(reduce_dtype="bf16"), D.ParallelConfig(strategy=strategy))
