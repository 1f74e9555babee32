"""The lab on several processes: DDP, ZeRO-1, FSDP2 (ZeRO-2 and ZeRO-3) and tensor parallelism,
each in 2 gloo processes on the CPU, train the same function as one process at the same global
batch; a dead rank stops the others with one error line; bad input is refused before anything
starts."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab.parallel import distributed as D  # noqa: E402
from fasttrain.lab.parallel import launch as L  # noqa: E402
from tests_support import free_port as _free_port, join_process_group, leave_process_group  # noqa: E402
from tests_support import word_corpus as _corpus  # noqa: E402

WORLD = 2


# (strategy, reshard after forward, model): each case trains 2 processes at global batch 16 in 2
# micro-batches; gpt2 with biases (LayerNorm, tied, learned positions), llama with GQA 4/2
CASES = [("ddp", True, "gpt2"), ("zero1", True, "llama"), ("fsdp", True, "llama"), ("fsdp", False, "gpt2"),
         ("tp", True, "llama"), ("tp", True, "gpt2")]
GLOBAL_BATCH = 16


def _cfg(style: str, save=None, device="cpu"):
    from fasttrain.lab.config import preset

    shape = dict(style="llama", heads=4, kv_heads=2) if style == "llama" else dict(style="gpt2", heads=2, bias=True)
    return preset("tiny", max_steps=3, eval_tokens=512, eval_interval=0, log_interval=1, timing_warmup_steps=1,
                  device=device, gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=0, save=save, **shape)


def _key(strategy, reshard, style):
    return f"{strategy}-{'zero3' if reshard else 'zero2'}-{style}"


def _worker(rank: int, port: int, out_dir: str, device: str = "cpu") -> None:
    # one process group for every case (each run() joins it rather than making its own)
    group = join_process_group(rank, WORLD, port, device, timeout=60)
    from fasttrain.lab.train import run

    corpus = _corpus()
    records = {}
    for strategy, reshard, style in CASES:
        key = _key(strategy, reshard, style)
        save = None if strategy == "tp" else os.path.join(out_dir, key)
        parallel = D.ParallelConfig(strategy=strategy, reshard_after_forward=reshard, global_batch_size=GLOBAL_BATCH)
        records[key] = run(_cfg(style, save, device), corpus=corpus, parallel=parallel)
    if rank == 0:
        with open(os.path.join(out_dir, "records.json"), "w") as f:
            json.dump(records, f, default=str)
    leave_process_group(group)


def _weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.slow
def test_two_processes_train_the_same_function_as_one(tmp_path):
    _same_function(tmp_path, "cpu", rel=1e-5)


@pytest.mark.gpu
def test_two_gpus_train_the_same_function_as_one(tmp_path):
    # NCCL on 2 GPUs; cuBLAS may pick other kernels for a batch of 8 than of 16 (another order of
    # the sums), hence the looser tolerance
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _same_function(tmp_path, "cuda", rel=1e-4)


def _same_function(tmp_path, device: str, rel: float) -> None:
    pytest.importorskip("safetensors")
    from fasttrain.lab.train import run

    mp.start_processes(_worker, args=(_free_port(), str(tmp_path), device), nprocs=WORLD, start_method="spawn")
    records = json.loads((tmp_path / "records.json").read_text())
    corpus = _corpus()
    # one process at the same global batch (2 micro-batches of 8)
    ref = {style: run(_cfg(style, str(tmp_path / f"one-{style}"), device).with_(
        per_device_train_batch_size=GLOBAL_BATCH // 2), corpus=corpus) for style in ("gpt2", "llama")}
    for strategy, reshard, style in CASES:
        key = _key(strategy, reshard, style)
        got, one = records[key], ref[style]
        d = got["distributed"]
        assert (d["world_size"], d["global_batch_size"]) == (WORLD, GLOBAL_BATCH), key
        assert d["dp"] == (1 if strategy == "tp" else 2) and d["tp"] == (2 if strategy == "tp" else 1)
        assert len(d["per_rank"]) == WORLD
        assert got["batch"]["tokens_per_step"] == one["batch"]["tokens_per_step"], key
        # the same losses step by step, and the same validation loss of the trained weights
        assert [p["loss"] for p in got["loss_curve"]] == pytest.approx([p["loss"] for p in one["loss_curve"]],
                                                                      rel=rel), key
        assert got["final"]["val_loss"] == pytest.approx(one["final"]["val_loss"], rel=rel), key
        # the estimator was asked about this strategy
        expect = {"ddp": 0, "zero1": 1, "fsdp": 3 if reshard else 2, "tp": 0}[strategy]
        assert got["estimate"]["setup"]["zero"] == expect and got["estimate"]["setup"]["dp"] == d["dp"], key
        if strategy != "tp":
            # the same weights (FSDP's shards gathered into one checkpoint by rank 0); Adam turns
            # reduction-order noise of near-zero gradients into steps of up to ~lr x 1e-2
            mine, theirs = _weights(tmp_path / key), _weights(tmp_path / f"one-{style}")
            assert set(mine) == set(theirs)
            for name, w in theirs.items():
                torch.testing.assert_close(mine[name], w, rtol=10 * rel, atol=10 * rel, msg=lambda m: f"{key} {name}: {m}")
    # the report over these records: one row per run, the loss difference against one process
    from fasttrain.lab.experiments import scaling

    folder = tmp_path / "records"
    folder.mkdir()
    for style, rec in ref.items():
        (folder / f"{style}.1gpu.json").write_text(json.dumps(rec, default=str))
    for key, rec in records.items():
        strategy, stage, style = key.split("-")
        label = f"fsdp-{stage}" if strategy == "fsdp" else strategy
        (folder / f"{style}.{label}.json").write_text(json.dumps(rec))
    result = scaling.report(folder)
    table = {(r["preset"], r["strategy"]): r for r in result["rows"]}
    assert len(table) == len(CASES) + 2
    for (preset_name, label), row in table.items():
        if label != "1gpu":
            assert row["world"] == 2 and row["efficiency"] > 0 and row["max_rel_loss_diff"] < rel, (preset_name, label)
    assert "| tp | 2 | 1 x 2 | 16 |" in result["markdown"].read_text()
    assert result["csv"].read_text().startswith("preset,strategy,world,device,precision,global_batch,metric,rank,")
    # training moved: the curves are not flat
    assert ref["gpt2"]["loss_curve"][0]["loss"] - ref["gpt2"]["loss_curve"][-1]["loss"] > 0.05
    # sharding shows in the memory by kind: ZeRO-1 halves the optimizer state, FSDP the parameters too
    kinds = {k: r["memory"]["by_kind"] for k, r in records.items()}
    assert kinds["zero1-zero3-llama"]["optimizer_state"] < 0.6 * ref["llama"]["memory"]["by_kind"]["optimizer_state"]
    assert kinds["fsdp-zero3-llama"]["parameters"] < 0.6 * ref["llama"]["memory"]["by_kind"]["parameters"]


def _dying_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fasttrain.lab.train import run

    def progress(step, total):
        if rank == 1 and step == 2:
            os._exit(3)                          # dies mid-training, without a word

    start = time.monotonic()
    try:
        run(_cfg("gpt2").with_(max_steps=50), corpus=_corpus(), progress=progress,
            parallel=D.ParallelConfig(strategy="ddp", ddp_timeout=5))
    except FasttrainError as exc:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.1f}\n{exc}")
        os._exit(1)
    os._exit(0)


@pytest.mark.slow
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
    monkeypatch.setattr(L, "gpu_count", lambda: 1)
    with pytest.raises(FasttrainError, match="needs 2 GPUs; this machine has 1"):
        L.check_launch(2, "cuda", "ddp")
    L.check_launch(2, "cpu", "ddp")                 # gloo processes on the CPU: any number
    with pytest.raises(FasttrainError, match="needs --strategy"):
        L.check_launch(2, "cpu", "none")


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
    assert L.Launch(2).torchrun_args() == ["--nproc-per-node", "2", "--nnodes", "1", "--max-restarts", "0",
                                           "--standalone"]
    multi = L.Launch(8, nnodes="2", rdzv_endpoint="node0:29400").torchrun_args()
    assert multi[-6:] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "fasttrain-lab"]
    with pytest.raises(FasttrainError, match="needs --rdzv-endpoint"):
        L.Launch(8, nnodes="2").torchrun_args()
    env = D.multicast_off({})
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# --- the command line ---------------------------------------------------------------------------

def _cli(args, capsys):
    from fasttrain.cli import main

    code = main(args)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.parametrize("args,message", [
    (["--strategy", "ddp"], "add --nproc-per-node N"),
    (["--nproc-per-node", "2"], "--nproc-per-node needs --strategy"),
    (["--strategy", "tp", "--nproc-per-node", "2", "--heads", "1"], "--heads (1) divisible by 2"),
    (["--strategy", "ddp", "--nproc-per-node", "2", "--global-batch-size", "7"], "--global-batch-size 7 does not split"),
    (["--strategy", "ddp", "--nproc-per-node", "2", "--ddp-backend", "nccl"], "nccl needs CUDA GPUs"),
    (["--strategy", "fsdp", "--nproc-per-node", "2", "--fp16"], "use --bf16"),
    (["--strategy", "ddp", "--nproc-per-node", "2", "--auto-find-batch-size"], "searches on one GPU"),
    (["--strategy", "zero9"], "'zero9' is not one of"),
    (["--nnodes", "2"], "go with --nproc-per-node N"),
])
def test_cli_bad_parallel_input_is_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "run.json"
    code, _, stderr = _cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", *args, "--out", str(out)], capsys)
    assert code != 0
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], stderr
    assert not out.exists()


def test_more_gpus_than_exist_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(L, "gpu_count", lambda: 1)
    code, _, stderr = _cli(["lab", "--preset", "tiny", "--device", "cuda", "--quiet", "--strategy", "ddp",
                            "--nproc-per-node", "2"], capsys)
    assert code == 1 and "needs 2 GPUs; this machine has 1" in stderr and stderr.count("\n") == 1


def test_a_missing_corpus_or_checkpoint_is_one_line_before_torchrun_starts_any_rank(tmp_path, capsys, monkeypatch):
    """Without Tiny Shakespeare where the lab looks, or with a damaged copy, an --init-from / --resume that names
    nothing, a technique the machine cannot run or a logger without its folder, the launcher refuses once, before
    torchrun: not every rank's error, interleaved, after each started."""
    monkeypatch.setenv("FASTTRAIN_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(L, "launch", lambda *a, **k: pytest.fail("torchrun was started"))
    code, _, stderr = _cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--strategy", "ddp",
                            "--nproc-per-node", "2", "--max-steps", "1"], capsys)
    assert code == 1 and stderr.count("\n") == 1 and "Tiny Shakespeare file not found" in stderr, stderr
    assert "fasttrain data download --dataset tinyshakespeare" in stderr
    # a damaged one too (its checksum)
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("not the play\n")
    code, _, stderr = _cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--strategy", "ddp",
                            "--nproc-per-node", "2", "--max-steps", "1"], capsys)
    assert code == 1 and stderr.count("\n") == 1 and "checksum mismatch" in stderr, stderr
    # --init-from and --resume naming nothing
    monkeypatch.setattr("fasttrain.data.text.load_text", lambda *a, **k: "")
    for flag, says in (("--init-from", "is not a lab checkpoint (no such folder)"), ("--resume", "no such folder")):
        code, _, stderr = _cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--strategy", "ddp",
                                "--nproc-per-node", "2", "--max-steps", "1", flag, str(tmp_path / "nothing")], capsys)
        assert code == 1 and stderr.count("\n") == 1 and says in stderr and "rank" not in stderr, stderr
    # a technique this machine cannot run, a logger without its folder
    for extra, says in ((["--float8", "rowwise"], "--float8 trains float8 GEMMs on a CUDA GPU"),
                        (["--report-to", "wandb"], "--report-to wandb: give --logging-dir DIR")):
        code, _, stderr = _cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--strategy", "ddp",
                                "--nproc-per-node", "2", "--max-steps", "1", *extra], capsys)
        assert code == 1 and stderr.count("\n") == 1 and says in stderr and "rank" not in stderr, stderr


def test_a_per_device_batch_that_disagrees_with_the_global_batch_is_one_line(capsys, monkeypatch):
    """--per-device-train-batch-size beside --global-batch-size: b x k x dp must be the global batch, or the run
    would train another micro-batch than asked (it did, silently: the global batch's); agreeing flags launch."""
    monkeypatch.setattr("fasttrain.data.text.load_text", lambda *a, **k: "")
    launched = []
    monkeypatch.setattr(L, "launch", lambda spec, argv: launched.append(argv))
    base = ["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--max-steps", "1"]
    for extra, says in ((["--strategy", "ddp", "--nproc-per-node", "2", "--per-device-train-batch-size", "3"],
                         "3 x 1 accumulation step(s) x 2 data-parallel rank(s) is 6 sequences a step, not "
                         "--global-batch-size 8: give one of the two (the global batch alone sets the micro-batch to 4)"),
                        (["--strategy", "fsdp", "--tp", "2", "--nproc-per-node", "4", "--per-device-train-batch-size",
                          "2"], "x 2 data-parallel rank(s) is 4 sequences"),
                        (["--per-device-train-batch-size", "3"], "x 1 data-parallel rank(s) is 3 sequences")):
        code, _, stderr = _cli(base + extra + ["--global-batch-size", "8"], capsys)
        assert code == 1 and stderr.count("\n") == 1 and says in stderr, stderr
    assert not launched
    code, _, stderr = _cli(base + ["--strategy", "ddp", "--nproc-per-node", "2", "--per-device-train-batch-size", "4",
                                   "--global-batch-size", "8"], capsys)
    assert code == 0 and len(launched) == 1, stderr


def test_worker_command_line_drops_the_launcher_options():
    import click

    from fasttrain.lab.cli import command

    ctx = command.make_context("lab", ["--preset", "tiny", "--bf16", "--gradient-checkpointing", "--strategy", "fsdp",
                                       "--no-reshard-after-forward", "--nproc-per-node", "2", "--global-batch-size",
                                       "16", "--out", "r.json"], parent=click.Context(click.Group("fasttrain")))
    argv = L.worker_argv(ctx, skip=L.LAUNCH_OPTIONS)
    assert argv[0] == "lab" and "--nproc-per-node" not in argv
    for part in (["--preset", "tiny"], ["--bf16"], ["--gradient-checkpointing", "full"], ["--strategy", "fsdp"],
                 ["--no-reshard-after-forward"], ["--global-batch-size", "16"], ["--out", "r.json"]):
        i = argv.index(part[0])
        assert argv[i:i + len(part)] == part, argv


def _fasttrain(args, env_extra=None, timeout=120):
    import subprocess
    from pathlib import Path

    src = str(Path(D.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "fasttrain", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_fasttrain_lab_starts_torchrun_itself(tmp_path, shakespeare_dir):
    """``fasttrain lab --nproc-per-node 2``: torchrun's launcher, 2 gloo workers, rank 0 writes the
    record; the loss curve is the one process's at the same global batch."""
    root = shakespeare_dir
    common = ["lab", "--preset", "tiny", "--max-steps", "3", "--device", "cpu", "--eval-tokens", "512",
              "--data-dir", root, "--gradient-accumulation-steps", "2"]
    two = _fasttrain([*common, "--strategy", "zero1", "--nproc-per-node", "2", "--global-batch-size", "16",
                      "--out", str(tmp_path / "two.json")])
    assert two.returncode == 0, two.stderr[-2000:]
    assert "zero1 over 2 processes (gloo, dp 2, tp 1): global batch 16" in two.stdout
    assert two.stdout.count("val loss") == 1                 # rank 0 alone prints
    from fasttrain.lab.config import preset
    from fasttrain.lab.train import run

    one = run(preset("tiny", max_steps=3, device="cpu", eval_tokens=512, data_dir=root, gradient_accumulation_steps=2,
                     per_device_train_batch_size=8))
    rec = json.loads((tmp_path / "two.json").read_text())
    assert rec["distributed"]["multicast_off"] == D.MULTICAST_OFF     # what the workers' environment held
    assert [p["loss"] for p in rec["loss_curve"]] == pytest.approx([p["loss"] for p in one["loss_curve"]], rel=1e-5)


@pytest.mark.slow
def test_a_failing_worker_stops_the_launch_with_one_line(tmp_path, shakespeare_dir):
    root = shakespeare_dir
    # a world the model cannot split is caught before launch; a failure only the workers see
    # (here: the rendezvous' world has 2 processes while the command asks for tensor parallelism
    # of a model whose checkpoint does not exist) ends the launch with one line of the launcher
    res = _fasttrain(["lab", "--preset", "tiny", "--max-steps", "3", "--device", "cpu", "--quiet", "--data-dir", root,
                      "--strategy", "ddp", "--nproc-per-node", "2", "--init-from", str(tmp_path / "missing")])
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: rank ") and "torchrun stopped the others" in lines[-1], res.stderr
    assert any("is not a lab checkpoint" in line for line in lines[:-1])
    assert "Traceback" not in res.stderr


# --- the sweep's and the launcher's inputs, checked before anything starts -----------------------

@pytest.mark.parametrize("args,message", [
    (["--max-steps", "0"], "--max-steps must be a positive integer"),
    (["--strategies", ""], "--strategies is empty"),
    (["--strategies", " , "], "--strategies is empty"),
    (["--strategies", "ddp,zero9"], "unknown strategy 'zero9'"),
    (["--presets", ""], "--presets is empty"),
    (["--nproc-per-node", "1"], "--nproc-per-node must be at least 2"),
])
def test_sweep_inputs_are_refused_even_for_a_dry_run(tmp_path, args, message):
    from click.testing import CliRunner

    from fasttrain.lab.experiments import scaling

    out = tmp_path / "sweep"
    result = CliRunner().invoke(scaling.command, ["sweep", "--out", str(out), "--device", "cpu", "--dry-run", *args])
    assert result.exit_code != 0 and isinstance(result.exception, FasttrainError), result.output
    assert message in str(result.exception)
    assert not out.exists()


def test_a_dry_run_starts_nothing_and_says_so(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fasttrain.lab.experiments import scaling

    monkeypatch.setattr(scaling, "sweep", lambda *a, **k: pytest.fail("a dry run started a run"))
    out = tmp_path / "sweep"
    result = CliRunner().invoke(scaling.command, ["sweep", "--out", str(out), "--device", "cpu", "--dry-run",
                                                  "--presets", "tiny", "--strategies", "ddp", "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    assert "dry run: 5 runs planned, none started" in result.output and not out.exists()


@pytest.mark.parametrize("nnodes", ["abc", "0", "2:1", "1:x", ""])
def test_nnodes_must_be_a_count_or_a_range(nnodes):
    with pytest.raises(FasttrainError, match="--nnodes must be a number of machines"):
        L.parallel_from_options({"strategy": "ddp", "nproc_per_node": 2, "nnodes": nnodes})
    L.parallel_from_options({"strategy": "ddp", "nproc_per_node": 2, "nnodes": "1:4", "rdzv_endpoint": "h:1"})


def test_more_cpu_processes_than_cores_warns(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    line = L.cpu_oversubscription(8, "cpu")
    assert line.startswith("warning: 8 processes on 2 CPU cores") and "--nproc-per-node 2" in line
    assert L.cpu_oversubscription(2, "cpu") is None and L.cpu_oversubscription(8, "cuda") is None


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_ctrl_c_under_the_launcher_is_one_line(monkeypatch, signum):
    """Ctrl-C reaches torchrun's agent, which stops the ranks and raised SignalException (a traceback)."""
    import signal

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def interrupted(args):
        raise SignalException(f"Process got signal: {signum}", sigval=getattr(signal, signum))
    monkeypatch.setattr(torchrun, "run", interrupted)
    with pytest.raises(FasttrainError) as exc:
        L.launch(L.Launch(2), ["lab", "--preset", "tiny"])
    assert str(exc.value).startswith(f"interrupted ({signum}): the 2 ranks were stopped") and "\n" not in str(exc.value)
