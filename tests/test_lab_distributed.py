"""The lab on several processes: DDP, ZeRO-1, FSDP2 (ZeRO-2 and ZeRO-3) and tensor parallelism,
each in 2 gloo processes on the CPU, train the same function as one process at the same global
batch; a dead rank stops the others with one error line; bad input is refused before anything
starts."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import distributed as D  # noqa: E402

WORLD = 2
STEPS = 3
ACCUM = 2
PER_DEVICE = 2          # rows per rank and micro-batch: global batch 2 x 2 x 2 = 8 sequences


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_config(style: str):
    from fasttrain.lab.model import GPTConfig

    if style == "llama":
        return GPTConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn=64, vocab=65, seq=16, norm="rms",
                         pos="rope", ffn_act="swiglu")
    return GPTConfig(layers=2, heads=4, hidden=32, ffn=64, vocab=65, seq=16, norm="layer", pos="learned",
                     ffn_act="gelu", tied=True, bias=True)


def _global_batch(step: int, micro: int, rows: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, 65, (rows, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _train(model, optimizer, world, steps=STEPS, accum=ACCUM, per_device=PER_DEVICE):
    """A few optimizer steps: each rank takes its rows of every global micro-batch."""
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            x, y = _global_batch(step, micro, per_device * world.dp)
            rows = world.rows(per_device)
            with D.sync_gradients(model, world, micro == accum - 1):
                loss = model(x[rows], y[rows]) / accum
                loss.backward()
            total += float(loss.detach())
        D.clip_grad_norm(model, 1.0, world)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(D.all_mean(total, world))
    return losses


def _optimizer(model, world):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    if world.strategy == "tp":
        groups = D.split_param_groups(groups)
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99))
    return D.wrap_optimizer(opt, world)


def _full_params(model, world) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in D.unwrap(model).named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_orig_mod.", "")] = t.detach().clone()
    if world.strategy == "tp":           # undo the per-rank reordering of the fused projections
        c = D.unwrap(model).config
        a, g, d, t = c.heads, c.g, c.hidden // c.heads, world.world_size
        for name in list(out):
            if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
                out[name] = _unpermute(out[name], [a * d, g * d, g * d], t)
            if c.ffn_act == "swiglu" and (name.endswith("mlp.up.weight") or name.endswith("mlp.up.bias")):
                out[name] = _unpermute(out[name], [c.ffn, c.ffn], t)
    return out


def _unpermute(w, sizes, t):
    shards = w.chunk(t)
    pieces = [torch.cat([shard.split([s // t for s in sizes])[i] for shard in shards]) for i in range(len(sizes))]
    return torch.cat(pieces)


CASES = [("ddp", True, "gpt2"), ("zero1", True, "llama"), ("fsdp", True, "llama"), ("fsdp", False, "gpt2"),
         ("tp", True, "llama"), ("tp", True, "gpt2")]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fasttrain.lab.model import build

    base = D.init_world(D.ParallelConfig(strategy="ddp", ddp_timeout=60), device="cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for strategy, reshard, style in CASES:
        world = D.World(rank=base.rank, world_size=WORLD, local_rank=rank, backend="gloo", device="cpu",
                        strategy=strategy, reshard_after_forward=reshard, timeout_s=60, mesh=mesh)
        model = D.wrap_model(build(_tiny_config(style), seed=0), world)
        opt = _optimizer(model, world)
        # the same global batch: WORLD x PER_DEVICE rows over dp data-parallel ranks
        losses = _train(model, opt, world, per_device=WORLD * PER_DEVICE // world.dp)
        params = _full_params(model, world)
        key = f"{strategy}-{reshard}-{style}"
        results[key] = losses
        if rank == 0:
            torch.save(params, os.path.join(out_dir, f"{key}.pt"))
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(results, f)
    D.shutdown(base)


def _reference(style: str):
    from fasttrain.lab.model import build

    world = D.World()
    model = build(_tiny_config(style), seed=0)
    opt = _optimizer(model, world)
    # one process at the same global batch: per-device rows = WORLD x PER_DEVICE
    losses = _train(model, opt, world, per_device=WORLD * PER_DEVICE)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def test_two_processes_train_the_same_function_as_one(tmp_path):
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    got = json.loads((tmp_path / "losses.json").read_text())
    refs = {style: _reference(style) for style in ("gpt2", "llama")}
    for strategy, reshard, style in CASES:
        key = f"{strategy}-{reshard}-{style}"
        ref_losses, ref_params = refs[style]
        # the tensor-parallel ranks see the whole batch; the data-parallel ones half of it
        assert got[key] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), key
        params = torch.load(tmp_path / f"{key}.pt")
        assert set(params) == set(ref_params), key
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{key} {name}: {m}")
        # and training moved the weights (a test that cannot fail otherwise)
    first_ref = refs["gpt2"][0]
    assert first_ref[0] != first_ref[-1]


def _dying_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fasttrain.lab.model import build

    world = D.init_world(D.ParallelConfig(strategy="ddp", ddp_timeout=5), device="cpu")
    model = D.wrap_model(build(_tiny_config("gpt2"), seed=0), world)
    opt = _optimizer(model, world)
    start = time.monotonic()
    try:
        with D.collective_errors(world):
            for step in range(50):
                if rank == 1 and step == 2:
                    os._exit(3)                  # dies mid-training, without a word
                _train(model, opt, world, steps=1)
    except FasttrainError as exc:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.1f}\n{exc}")
        os._exit(1)
    os._exit(0)


def test_a_dead_rank_stops_the_others_with_one_line(tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_dying_worker, args=(r, port, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung after the other died"
    assert [p.exitcode for p in procs] == [1, 3]
    seconds, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert float(seconds) < 30
    assert "\n" not in message
    assert message.startswith("rank 0: lost the other ranks in a collective")
    assert "--ddp-timeout" in message


# --- bad input, refused before any process starts ------------------------------------------------

def test_a_strategy_needs_torchrun_and_torchrun_needs_a_strategy():
    with pytest.raises(FasttrainError, match="add --nproc-per-node N"):
        D.init_world(D.ParallelConfig(strategy="ddp"), env={})
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    with pytest.raises(FasttrainError, match="no --strategy given"):
        D.init_world(D.ParallelConfig(), env=env)
    assert D.init_world(D.ParallelConfig(), env={}) == D.World()


def test_unknown_strategy_backend_and_missing_backend():
    with pytest.raises(FasttrainError, match="unknown --strategy 'zero9'"):
        D.validate_parallel(D.ParallelConfig(strategy="zero9"))
    with pytest.raises(FasttrainError, match="unknown --ddp-backend 'mpi'"):
        D.validate_parallel(D.ParallelConfig(strategy="ddp", ddp_backend="mpi"))
    with pytest.raises(FasttrainError, match="--ddp-timeout must be > 0"):
        D.validate_parallel(D.ParallelConfig(strategy="ddp", ddp_timeout=0))
    with pytest.raises(FasttrainError, match="nccl needs CUDA GPUs"):
        D._backend_for("cpu", "nccl")
    assert D._backend_for("cpu", None) == "gloo"


def test_more_processes_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(D, "gpu_count", lambda: 1)
    with pytest.raises(FasttrainError, match="needs 2 GPUs; this machine has 1"):
        D.check_launch(2, "cuda", "ddp")
    D.check_launch(2, "cpu", "ddp")                 # gloo processes on the CPU: any number
    with pytest.raises(FasttrainError, match="needs --strategy"):
        D.check_launch(2, "cpu", "none")


def test_world_size_must_divide_the_batch_and_the_heads():
    from fasttrain.lab.config import preset

    cfg = preset("tiny", gradient_accumulation_steps=2)
    with pytest.raises(FasttrainError, match="--global-batch-size 10 does not split over 2 .* multiple of 4"):
        D.resolve_batch(cfg, D.ParallelConfig(strategy="ddp", global_batch_size=10), dp=2)
    assert D.resolve_batch(cfg, D.ParallelConfig(strategy="ddp", global_batch_size=12), dp=2) \
        .per_device_train_batch_size == 3
    three_heads = preset("tiny", heads=4, width=32).with_(heads=3, width=33)
    with pytest.raises(FasttrainError, match=r"--heads \(3\) divisible by 2"):
        D.check_model_fits(three_heads, 2, "tp")
    D.check_model_fits(three_heads, 2, "ddp")       # data parallelism does not split the model


def test_rows_split_the_global_batch():
    assert [D.World(rank=r, world_size=2, strategy="ddp").rows(3) for r in range(2)] == [slice(0, 3), slice(3, 6)]
    # tensor-parallel ranks all see the whole batch
    assert D.World(rank=1, world_size=2, strategy="tp").rows(3) == slice(0, 3)


def test_estimator_parallelism_by_strategy():
    w = dict(rank=0, world_size=2)
    assert D.estimator_parallelism(D.World(**w, strategy="ddp")) == {"dp": 2, "zero": 0, "tp": 1,
                                                                    "grad_buffers": True}
    assert D.estimator_parallelism(D.World(**w, strategy="zero1"))["zero"] == 1
    assert D.estimator_parallelism(D.World(**w, strategy="fsdp"))["zero"] == 3
    assert D.estimator_parallelism(D.World(**w, strategy="fsdp", reshard_after_forward=False))["zero"] == 2
    assert D.estimator_parallelism(D.World(**w, strategy="fsdp"), bf16=True)["precision"] == "mixed"
    assert D.estimator_parallelism(D.World(**w, strategy="tp")) == {"dp": 1, "zero": 0, "tp": 2}


def test_launcher_flags_and_multicast_off():
    assert D.Launch(2).torchrun_args() == ["--nproc-per-node", "2", "--nnodes", "1", "--max-restarts", "0",
                                           "--standalone"]
    multi = D.Launch(8, nnodes="2", rdzv_endpoint="node0:29400").torchrun_args()
    assert multi[-6:] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "fasttrain-lab"]
    with pytest.raises(FasttrainError, match="needs --rdzv-endpoint"):
        D.Launch(8, nnodes="2").torchrun_args()
    env = D.multicast_off({})
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
