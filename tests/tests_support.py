"""Helpers shared by the tests: run the CLI (in a subprocess or in-process), check a one-line error, a toy
text corpus for the lab."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys

import pytest


def fasttrain_cli(*args, env=None, cwd=None, timeout=300):
    environ = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "fasttrain", *map(str, args)], capture_output=True, text=True,
                          env=environ, cwd=cwd, timeout=timeout)


def one_line_error(result, pattern):
    """Exit non-zero, no traceback, exactly one ``error: ...`` line on stderr, matching ``pattern``."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def run_cli(args, capsys):
    """``fasttrain ARGS`` in this process: (exit code, stdout, stderr)."""
    from fasttrain.cli import main

    code = main(args)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def fasttrain_in_process(*args, env=None) -> subprocess.CompletedProcess:
    """:func:`fasttrain_cli` without the interpreter's start: ``fasttrain.cli.main`` in this process, its exit code
    and what it printed, under ``env`` added to the environment. The test's monkeypatches (a toy corpus) hold.
    For the many bad-input cases of a command; its real entry point keeps a subprocess test of its own."""
    import contextlib
    import io

    from fasttrain.cli import main

    args = list(map(str, args))
    out, err = io.StringIO(), io.StringIO()
    saved = {key: os.environ.get(key) for key in (env or {})}
    os.environ.update({key: str(value) for key, value in (env or {}).items()})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def toy_text(n=20000, seed=0):
    """A learnable toy language for the lab's tests: words from a small vocabulary with punctuation."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = ["the", "king", "shall", "speak", "to", "thee", "my", "lord", "and", "we", "will", "go"]
    out = []
    while sum(map(len, out)) < n:
        out.append(words[rng.integers(len(words))] + (",\n" if rng.random() < 0.1 else " "))
    return "".join(out)


def free_port() -> int:
    """A TCP port free on this machine now (a process group's MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def word_corpus():
    """A small word-level text corpus (characters as tokens): the distributed tests' data."""
    import numpy as np

    from fasttrain.lab.data import corpus_from_text

    rng = np.random.default_rng(0)
    words = ["the", "king", "shall", "speak", "to", "thee", "my", "lord", "and", "we", "will", "go"]
    return corpus_from_text("".join(words[i] + " " for i in rng.integers(0, len(words), 4000)))


def join_process_group(rank: int, world: int, port: int, device: str = "cpu", timeout: float = 120):
    """In a spawned worker: torchrun's environment for ``rank`` of ``world``, one thread, and the
    process group every lab run of the worker then joins (returns its World; end it with
    ``leave_process_group``)."""
    import torch

    from fasttrain.lab.parallel import distributed as D

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    return D.init_world(D.ParallelConfig(strategy="ddp", ddp_timeout=timeout), device=device)


@contextlib.contextmanager
def one_rank_world(monkeypatch, strategy: str = "fsdp", device: str = "cpu"):
    """In this process, the process group of a one-rank run of ``strategy`` (torchrun's environment set through
    ``monkeypatch``): its World, left at the end."""
    from fasttrain.lab.parallel import distributed as D

    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    world = D.init_world(D.ParallelConfig(strategy=strategy), device=device)
    try:
        yield world
    finally:
        world.owns_group = True
        D.shutdown(world)


def meta_build_beside_one_process(cfg, vocab: int, world):
    """The model ``cfg`` names built plainly in one process, and built on the meta device then sharded by FSDP
    over ``world``: (the one-process module, the sharded module, its weights gathered whole, whether the
    generator ends where the one-process build left it). Checked on the way: the matrices stay on the meta
    device until sharded, the record says so, the buffers are the one-process build's."""
    import torch

    from fasttrain.lab import parallelize as P
    from fasttrain.lab.build import build_model, meta_build_for

    device = torch.device(world.device)

    def rng_state():
        return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()

    assert meta_build_for(cfg, world)
    ref = build_model(cfg, vocab, device).module
    after = rng_state()
    lab_model = build_model(cfg, vocab, device, meta=True)
    matrices = [p for p in lab_model.module.parameters() if p.dim() >= 2]
    assert matrices and all(p.device.type == "meta" for p in matrices)
    done = P.parallelize(lab_model, cfg, world)
    assert ("data_parallel", "weights initialized shard by shard (meta-device build)") in done.applied
    buffers = dict(done.module.named_buffers())
    assert all(torch.equal(buffers[n], b) for n, b in ref.named_buffers())
    rng = torch.equal(rng_state(), after)
    from torch.distributed.tensor import DTensor

    # (an offloaded shard lives in host memory: gathered from the device the collectives run on)
    whole = {n: DTensor.from_local(p.to_local().to(device), p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride()).full_tensor() for n, p in done.module.named_parameters()}
    return ref, done.module, whole, rng


def leave_process_group(group) -> None:
    from fasttrain.lab.parallel import distributed as D

    group.owns_group = True
    D.shutdown(group)


def one_error_line(stderr: str) -> str:
    """The single ``error: ...`` line a refused command prints (no traceback, nothing else)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in stderr, stderr
    return lines[0]


def slow_beyond(cases, keep: int) -> list:
    """Parametrize cases of which the first ``keep`` run in the default suite and the rest carry the ``slow``
    marker (run by ``pytest -m slow``, which the device run takes): one representative of each kind stays in the
    six-minute CPU suite, none is dropped."""
    return [case if i < keep else pytest.param(*(case if isinstance(case, tuple) else (case,)),
                                               marks=pytest.mark.slow)
            for i, case in enumerate(cases)]


def no_compile(fn=None, **options):
    """``torch.compile`` as the identity (monkeypatched in where a test asks what a library's compiled step makes,
    not how fast: torchao's 8-bit AdamW compiles its step, half a minute of CPU, and makes the same state)."""
    return fn if fn is not None else (lambda f: f)


def parallelized_step_peak(done, x, accumulation: int = 1, bf16: bool = False) -> int:
    """The CPU allocator's peak over one training step of a parallelized lab model (``done``: parallelize's result)
    on the batch ``x``, after a first step has made the optimizer state: the bytes an estimate is checked against.
    With accumulation k, every micro-batch's loss is divided by k and only the last one synchronizes gradients.
    ``bf16``: each forward under the CPU's bf16 autocast, as the trainer runs it."""
    import torch

    from fasttrain.memory.tracker import allocator_peak_step

    def step():
        for j in range(accumulation):
            if accumulation > 1:
                done.train_model.set_requires_gradient_sync(j == accumulation - 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = done.train_model(x, x) / accumulation
            loss.backward()
            del loss
        done.optimizer.step()
        done.optimizer.zero_grad(set_to_none=True)

    step()                                       # the optimizer state exists from here on
    measured, _ = allocator_peak_step(step, done.module, done.optimizer)
    return measured
