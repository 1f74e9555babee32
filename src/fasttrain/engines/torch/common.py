"""What both PyTorch engines share: device choice, strict fp32, the model, weights in and out, evaluation.

This module imports torch at import time; the engine classes (``engines.py``) import it only
inside ``prepare``, so listing engines never loads torch.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.contract import ModelSpec
from fasttrain.engines.base import Session
from fasttrain.errors import FasttrainError

# GradScaler's first scale for fp16. Its default, 2**16, can overflow dW on the very first step
# (|dW_ij| = |sum_b x_bi * S * d_bj| <= S when every d_bj = 1/B pushes the same way, and fp16
# tops out at 65504) and then silently skips that step; 2**10 keeps d = S*(p - y)/B well inside
# fp16's range while lifting gradients of 1e-7 out of its subnormals. Growth stays the default.
FP16_INIT_SCALE = 2.0**10

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast(device_type: str, amp_dtype):
    """``torch.autocast`` to ``amp_dtype`` (mixed precision), or nothing when it is None."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=amp_dtype)


def resolve_device(choice: str) -> torch.device:
    """``auto`` = cuda when available, else cpu; ``cuda`` without a GPU is a one-line error."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise FasttrainError("--device cuda: torch sees no CUDA GPU here; use --device cpu or install a CUDA build of torch")
    return torch.device(choice)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class StrictMath:
    """fp32 means fp32: no TF32 in matmuls or convolutions, no reduced-precision split-K sums in fp16/bf16 GEMMs.

    PyTorch's switches are process-wide, so the previous values are restored on ``restore()``.
    PyTorch refuses to mix its legacy (``allow_tf32``) and newer (``fp32_precision``) switches in
    one process, so the newer ones are used only when someone already chose them.
    """

    def __init__(self):
        matmul = torch.backends.cuda.matmul
        self._saved_reductions = (matmul.allow_fp16_reduced_precision_reduction,
                                  matmul.allow_bf16_reduced_precision_reduction)
        # fp32 accumulation is part of the mixed-precision contract: forbid fp16/bf16 partial sums.
        matmul.allow_fp16_reduced_precision_reduction = False
        matmul.allow_bf16_reduced_precision_reduction = False
        try:
            self._legacy = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        except RuntimeError:  # the process already uses the fp32_precision switches
            self._legacy = None
            self._new = (matmul.fp32_precision, torch.backends.cudnn.fp32_precision)
            matmul.fp32_precision = "ieee"
            torch.backends.cudnn.fp32_precision = "ieee"

    def restore(self) -> None:
        matmul = torch.backends.cuda.matmul
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = (
            self._saved_reductions)
        if self._legacy is not None:
            matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._legacy
        else:
            matmul.fp32_precision, torch.backends.cudnn.fp32_precision = self._new


def build_model(spec: ModelSpec, init_weights, device: torch.device, dtype: torch.dtype) -> nn.Sequential:
    """``nn.Sequential`` of ``nn.Linear`` with ``nn.ReLU`` between them, holding the shared initial weights."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(spec.layer_shapes()):
        layers.append(nn.Linear(fan_in, fan_out, device=device, dtype=dtype))
        if i < spec.n_layers - 1:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    load_weights(model, init_weights)
    return model


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def load_weights(model: nn.Module, weights) -> None:
    """Copy the contract's ``W`` (fan_in, fan_out) and ``b`` into the layers, in place (storage kept,
    so captured CUDA graphs and compiled code keep pointing at the same tensors)."""
    for lin, (w, b) in zip(linears(model), weights, strict=True):
        dtype = lin.weight.dtype
        # nn.Linear computes x @ weight.T + bias, so weight = W.T of shape (fan_out, fan_in).
        w_t = torch.from_numpy(np.ascontiguousarray(np.asarray(w).T)).to(dtype)
        lin.weight.copy_(w_t)
        lin.bias.copy_(torch.from_numpy(np.asarray(b)).to(dtype))


@torch.no_grad()
def export_weights(model: nn.Module) -> list[tuple[np.ndarray, np.ndarray]]:
    """The master weights as NumPy, ``W`` (fan_in, fan_out)."""
    return [
        (lin.weight.detach().cpu().numpy().T.copy(), lin.bias.detach().cpu().numpy().copy())
        for lin in linears(model)
    ]


def to_tensor_inputs(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) -> uint8 (N, 784) tensor; the float conversion happens where the engine says.

    Loaded datasets are read-only arrays, which torch will not wrap: those are copied (47 MB, once)."""
    flat = images.reshape(len(images), -1)
    if not (flat.flags.writeable and flat.flags.c_contiguous):
        flat = flat.copy()
    return torch.from_numpy(flat)


@torch.no_grad()
def evaluate(model: nn.Module, x_u8: torch.Tensor, labels: torch.Tensor, amp_dtype, in_dtype,
             chunk: int = 5000) -> tuple[float, float]:
    """(mean loss, accuracy) on a test set held as uint8 ``x_u8`` (N, 784) on the model's device."""
    device = x_u8.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    n = len(labels)
    for start in range(0, n, chunk):
        x = x_u8[start : start + chunk].to(in_dtype) / 255.0  # x = pixel / 255
        y = labels[start : start + chunk]
        with autocast(device.type, amp_dtype):
            logits = model(x)
        logits = logits.to(in_dtype)  # softmax and loss in fp32 (fp64 under fp64)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").to(torch.float64)
        correct += (logits.argmax(dim=1) == y).sum()
    return float(loss_sum.item()) / n, int(correct.item()) / n


def check_amp(amp: str, precision: str, engine: str) -> None:
    """``--amp`` only restates the precision: the run record's precision must say what ran."""
    if amp == "auto":
        return
    wanted = precision if precision in AMP_DTYPES else "off"
    if amp != wanted:
        hint = f"--precision {amp}" if amp in AMP_DTYPES else "--precision fp32 (or fp64)"
        raise FasttrainError(
            f"engine {engine}: --amp {amp} contradicts --precision {precision}; mixed precision follows "
            f"the precision, so use {hint} (or leave --amp out)"
        )


# CUDA-graph capture mode for every torch-driven engine (torch-fast, triton). "global" capture is
# broken by a CUDA call from any thread of the process, and a JAX runtime that has run in the same
# process keeps threads that make such calls (seen on an H200, for torch-fast and for triton: the
# capture failed after JAX had trained, sometimes, and the CUDA context was unusable afterwards);
# "thread_local" only forbids them on the capturing thread. Kernels reach the capturing stream
# from any thread either way.
CAPTURE_MODE = "thread_local"


def capture_graph(record) -> torch.cuda.CUDAGraph:
    """Capture what ``record()`` launches into a new CUDA graph (thread-local capture, see above)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):
        record()
    return graph


class TorchSession(Session):
    """What both PyTorch sessions do alike once trained: evaluate, export weights, synchronize.
    Subclasses set ``model``, ``test_x``, ``test_y``, ``amp_dtype``, ``dtype`` and ``device``."""

    def evaluate(self) -> tuple[float, float]:
        return evaluate(self.model, self.test_x, self.test_y, self.amp_dtype, self.dtype)

    def weights(self):
        return export_weights(self.model)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def environment(self) -> dict:
        return {"device": device_name(self.device), "torch": torch.__version__,
                "cuda": torch.version.cuda if self.device.type == "cuda" else None}
