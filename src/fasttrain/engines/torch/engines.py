"""The PyTorch engine classes: options and availability only; torch is imported inside ``prepare``."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from fasttrain.engines.base import (Engine, Job, Session, SweepJob, SweepMemory, SweepSession,
                                   host_available_bytes, option)

DEVICES = ("auto", "cuda", "cpu")


def _torch_missing() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed; install it with: pip install 'fasttrain[torch]'"
    return None


@dataclass(frozen=True)
class TorchEagerOptions:
    device: str = option("auto", "cuda or cpu (auto: cuda when torch sees a GPU)", choices=DEVICES)
    num_workers: int = option(0, "DataLoader worker processes (the tutorials' default 0)", bounds=(0, 256))


@dataclass(frozen=True)
class TorchFastOptions:
    preload: bool = option(True, "whole training set on the device as uint8, batches gathered and converted there")
    pin_memory: bool = option(True, "without --preload: copy batches through pinned host buffers, asynchronously")
    amp: str = option("auto", "mixed precision type; follows --precision (fp16/bf16), which decides",
                      choices=("auto", "off", "fp16", "bf16"))
    compile: str = option("auto", "torch.compile mode (auto: default on CUDA, off on the CPU)",
                          choices=("auto", "off", "default", "reduce-overhead", "max-autotune"), flag_value="default")
    cuda_graph: str = option("auto", "capture and replay one step per batch or a whole epoch "
                             "(auto: epoch on CUDA with --preload)",
                             choices=("auto", "off", "step", "epoch"), flag_value="epoch")
    fused_sgd: bool = option(True, "torch.optim.SGD(fused=True): one kernel updates every parameter (--step autograd)")
    step: str = option("auto", "autograd: loss.backward() + optim.SGD + GradScaler; func: torch.func.grad and the "
                       "update in one compiled function, half weight copies refreshed by the update (auto: func)",
                       choices=("auto", "autograd", "func"))
    device: str = option("auto", "cuda or cpu (auto: cuda when torch sees a GPU)", choices=DEVICES)


class TorchEagerEngine(Engine):
    name = "torch-eager"
    description = "PyTorch as the tutorials write it: DataLoader, nn.Sequential, autograd, optim.SGD, no compile"
    Options = TorchEagerOptions
    precisions = ("fp32", "fp64", "fp16", "bf16")
    order = 10
    color = "Oranges"
    libraries = ("torch",)
    conformance_options = ({"device": "cpu"},)

    @classmethod
    def rows(cls, suite: str) -> tuple:
        from fasttrain.engines.torch.rows import eager_rows

        return eager_rows(suite)

    @classmethod
    def available(cls) -> str | None:
        return _torch_missing()

    def prepare(self, job: Job) -> Session:
        from fasttrain.engines.torch.eager import EagerSession

        return EagerSession(job, self.options)


class TorchFastEngine(Engine):
    name = "torch-fast"
    description = ("PyTorch with each seed optimization as a flag: preload, pinned memory, AMP, compile, CUDA graphs, "
                   "fused SGD, whole-step compile")
    Options = TorchFastOptions
    precisions = ("fp32", "fp64", "fp16", "bf16")
    order = 20
    color = "Reds"
    libraries = ("torch",)
    conformance_options = ({"device": "cpu"}, {"device": "cpu", "step": "autograd"})

    @classmethod
    def rows(cls, suite: str) -> tuple:
        from fasttrain.engines.torch.rows import fast_rows

        return fast_rows(suite)

    @classmethod
    def available(cls) -> str | None:
        return _torch_missing()

    def prepare(self, job: Job) -> Session:
        from fasttrain.engines.torch.fast import FastSession

        return FastSession(job, self.options)

    sweep = "batched matmuls (bmm) over the models' stacked weights, a CUDA graph per epoch on the GPU"

    def prepare_sweep(self, job: SweepJob) -> SweepSession:
        from fasttrain.engines.torch.sweep import FastSweepSession

        return FastSweepSession(job, self.options)

    def sweep_memory(self, spec, config, n_train: int, n_test: int, n_epochs: int) -> SweepMemory:
        import torch

        from fasttrain.engines.torch.common import device_name, resolve_device
        from fasttrain.engines.torch.sweep import sweep_memory_bytes

        shared, per_model = sweep_memory_bytes(spec, config, n_train, n_test, n_epochs)
        device = resolve_device(self.options.device)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return SweepMemory(shared, per_model, int(free), f"GPU memory ({device_name(device)})")
        return SweepMemory(shared, per_model, host_available_bytes(), "host memory")
