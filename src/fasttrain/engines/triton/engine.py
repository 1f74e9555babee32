"""The Triton engine: every training step written as Triton kernels, as few launches as the math
allows, the step loop replayed from a CUDA graph.

Two ways to run an epoch (``--mode``; auto = persistent for logreg, graph for MLPs):
- ``persistent`` (logreg; MLPs of width <= 256 and batch <= 64): ONE kernel launch runs every
  step of the epoch with the weights carried across steps inside the kernel
  (:mod:`.persistent`): logreg as P cooperating programs that split the 784 features and meet
  at one grid barrier per step (``--programs``, 1 = a single program), MLPs as one program
  (correct, but slower than the graph path on an H200: 68 vs 35 us/step for mlp:128x3 fp16).
- ``graph``: per step, (L-1) x [GEMM + bias + ReLU], the last GEMM fused with softmax +
  cross-entropy + accuracy + dlogits, then per layer the input gradient (ReLU' fused) and the
  weight-gradient GEMM fused with the SGD update: 3L-1 launches per step (``--backward v3``
  merges each hidden layer's two backward kernels into one pass over W: 2L)
  (:mod:`.linear_forward`, :mod:`.linear_backward`), an epoch of them captured once in a CUDA
  graph at setup and replayed. ``eager`` launches the same kernels from Python (what the graph
  buys); ``--no-fused`` runs the unfused version-1 kernels (what fusion buys).
In both, the batch is gathered inside the first kernel from the uint8 images resident on the
device (x = pixel/255 on load), and the per-step loss and accuracy land in device arrays read
once per epoch.

Without a GPU, with ``TRITON_INTERPRET=1`` set before triton is imported, the same kernels run on
the CPU through Triton's interpreter (slowly; tests use it), without graphs.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from fasttrain.contract import batch_bounds
from fasttrain.engines.base import Engine, EpochStats, Job, Session, option
from fasttrain.errors import FasttrainError

MODES = ("auto", "persistent", "graph", "eager")
PERSISTENT_MAX_WIDTH = 256  # the one-program MLP kernel keeps [batch x width] tiles in registers
PERSISTENT_MAX_BATCH_MLP = 64
PERSISTENT_MAX_BATCH_LOGREG = 256
# auto picks persistent for MLPs up to this width: 0, since the one-program MLP kernel measured
# slower than the graph path (mlp:128x3 fp16: 68 vs 35 us/step on an H200, results/triton/)
AUTO_MLP_WIDTH = 0
DEFAULT_PROGRAMS = 49  # logreg: 49 programs x 16 features
DEFAULT_WARPS = 8  # measured: 2.35 ms/epoch vs 2.70 at 4 warps (H200, results/triton/)
EVAL_CHUNK = 2048
V3_MIN_WEIGHTS = 1 << 20  # backward v3 where W is big enough for its bytes to matter (1024 x 1024 and up)


@dataclass(frozen=True)
class TritonOptions:
    mode: str = option("auto", "persistent (one launch per epoch), graph (per-step kernels replayed from a CUDA "
                       "graph), eager (the same kernels launched from Python); auto = persistent for logreg, graph "
                       "for MLPs (the one-program MLP kernel measured slower)", choices=MODES)
    programs: int = option(0, "programs of the persistent logreg kernel, splitting the 784 features (0 = auto: "
                           f"{DEFAULT_PROGRAMS} on a GPU, 1 under the interpreter; 1 = the single-program kernel)")
    fp32_dot: str = option("ieee", "fp32 matrix products: ieee (exact fp32), tf32x3 (tensor cores, ~fp32 accuracy), "
                           "tf32 (tensor cores, 10-bit mantissa)", choices=("ieee", "tf32x3", "tf32"))
    fused: bool = option(True, "fused kernels (graph/eager modes); --no-fused runs the unfused version-1 kernels")
    backward: str = option("v2", "hidden layers' backward in graph/eager modes: v2 = input-gradient kernel + "
                           "fused dW/SGD kernel (W read twice); v3 = both in one pass over W (batch <= 64; "
                           "experimental: checked under the interpreter and compiled for sm_90, not yet timed on a "
                           f"GPU); auto = v3 for layers of >= {V3_MIN_WEIGHTS} weights", choices=("auto", "v2", "v3"))
    warps: int = option(0, f"warps per program of the persistent kernels (0 = auto: {DEFAULT_WARPS} for logreg, "
                        "4 or 8 for MLPs by width)", choices=(0, 1, 2, 4, 8, 16))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class TritonEngine(Engine):
    name = "triton"
    description = ("Triton kernels: fused GEMM+bias+ReLU, GEMM+softmax/xent/grad, dW GEMM+SGD; persistent epoch "
                   "kernels; CUDA graph replay")
    Options = TritonOptions
    precisions = ("fp32", "fp16", "bf16")
    order = 50
    color = "Blues"
    libraries = ("triton", "torch")
    needs_gpu = True
    conformance_options = ({"mode": "persistent"}, {"mode": "graph"})
    suites = {"triton": "Triton: its modes, program counts and precisions on the four benchmarks."}

    @classmethod
    def rows(cls, suite: str) -> tuple:
        from fasttrain.engines.triton.rows import rows

        return rows(suite)

    @classmethod
    def available(cls) -> str | None:
        for module in ("triton", "torch"):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed (pip install 'fasttrain[triton]')"
        if _interpreting():
            return None
        import torch

        if not torch.cuda.is_available():
            return ("needs a CUDA GPU (torch sees none); on a CPU, TRITON_INTERPRET=1 runs the kernels through "
                    "Triton's interpreter (slow, for tests)")
        return None

    def check(self, job: Job) -> None:
        super().check(job)
        spec, cfg, opts = job.spec, job.config, self.options
        interp = _interpreting()
        if interp and cfg.precision == "bf16":
            raise FasttrainError("bf16 matrix products are wrong under Triton's interpreter; run bf16 on a GPU")
        if opts.programs < 0:
            raise FasttrainError(f"--programs must be >= 0, got {opts.programs}")
        if opts.programs > 1 and interp:
            raise FasttrainError("the interpreter runs programs one after another, so the grid barrier of "
                                 "--programs > 1 never opens; use --programs 1 without a GPU")
        if opts.backward == "v3" and cfg.batch_size > 64:
            raise FasttrainError("--backward v3 keeps the whole batch in one tile: batch <= 64; use --backward v2")
        if opts.mode == "persistent":
            if spec.is_logreg and cfg.batch_size > PERSISTENT_MAX_BATCH_LOGREG:
                raise FasttrainError(f"--mode persistent supports logreg batches up to {PERSISTENT_MAX_BATCH_LOGREG}; "
                                     "use --mode graph")
            if not spec.is_logreg and (max(spec.hidden) > PERSISTENT_MAX_WIDTH
                                       or cfg.batch_size > PERSISTENT_MAX_BATCH_MLP):
                raise FasttrainError(f"--mode persistent supports MLPs up to width {PERSISTENT_MAX_WIDTH} and batch "
                                     f"{PERSISTENT_MAX_BATCH_MLP}; use --mode graph")

    def prepare(self, job: Job) -> Session:
        return TritonSession(job, self.options)


def resolve_mode(spec, config, requested: str) -> str:
    if requested != "auto":
        return requested
    if spec.is_logreg:
        return "persistent" if config.batch_size <= PERSISTENT_MAX_BATCH_LOGREG else "graph"
    if max(spec.hidden) <= AUTO_MLP_WIDTH and config.batch_size <= PERSISTENT_MAX_BATCH_MLP:
        return "persistent"
    return "graph"


class TritonSession(Session):
    def __init__(self, job: Job, options: TritonOptions):
        import torch
        import triton

        from fasttrain.engines.triton import common  # noqa: F401  (installs the interpreter fix when interpreting)
        from fasttrain.engines.triton.common import next_pow2
        from fasttrain.engines.triton.persistent import mlp_block, split_programs

        self.torch, self.triton = torch, triton
        self.interp = common.INTERPRET
        self.cuda = torch.cuda.is_available() and not self.interp
        dev = self.device = "cuda" if self.cuda else "cpu"
        spec, cfg, data = job.spec, job.config, job.data
        self.spec, self.config, self.job = spec, cfg, job
        self.prec = options.fp32_dot if cfg.precision == "fp32" else cfg.precision
        self.fused = options.fused
        self.warps = options.warps
        self.backward = options.backward
        self.lr = float(cfg.lr)
        self.batch = cfg.batch_size
        self.n_train = data.n_train
        self.bounds = batch_bounds(data.n_train, cfg.batch_size, cfg.drop_last)
        self.mode = resolve_mode(spec, cfg, options.mode)
        if self.mode == "graph" and not self.cuda:
            self.mode = "eager"  # no CUDA graphs without CUDA

        def to_dev(a, dtype):
            return torch.from_numpy(np.array(a)).to(device=dev, dtype=dtype)  # a writable copy (datasets are read-only)

        # data resident on the device: uint8 pixels (converted inside the kernels), int32 labels
        self.x = to_dev(data.train_images.reshape(data.n_train, -1), torch.uint8)
        self.y = to_dev(data.train_labels, torch.int32)
        self.x_test = to_dev(data.test_images.reshape(len(data.test_labels), -1), torch.uint8)
        self.y_test = to_dev(data.test_labels, torch.int32)
        self.idx = torch.arange(data.n_train, dtype=torch.int32, device=dev)  # valid until the first epoch
        self.idx_host = torch.empty(data.n_train, dtype=torch.int32, pin_memory=self.cuda)

        # weights (fp32 masters); an MLP's middle layers live stacked so the persistent kernel
        # reaches them through one pointer, and each layer is a view into that stack
        f32 = torch.float32
        n_layers = spec.n_layers
        middle = job.init_weights[1:-1]
        self.wm = to_dev(np.stack([w for w, _ in middle]), f32) if middle else torch.zeros(1, device=dev)
        self.bm = to_dev(np.stack([b for _, b in middle]), f32) if middle else torch.zeros(1, device=dev)
        first, last = job.init_weights[0], job.init_weights[-1]
        self.layers = [(to_dev(first[0], f32), to_dev(first[1], f32))]
        if n_layers > 1:
            self.layers += [(self.wm[i], self.bm[i]) for i in range(len(middle))]
            self.layers.append((to_dev(last[0], f32), to_dev(last[1], f32)))

        # per-step statistics, read once per epoch
        max_steps = max(job.schedule.steps_per_epoch)
        self.loss = torch.zeros(max_steps, dtype=f32, device=dev)
        self.correct = torch.zeros(max_steps, dtype=torch.int32, device=dev)
        self.eval_loss = torch.zeros(1, dtype=f32, device=dev)
        self.eval_correct = torch.zeros(1, dtype=torch.int32, device=dev)

        widths = spec.widths
        b_rows = self.batch
        # graph/eager buffers: act[l] = h_{l+1} (B x width), d[l] = gradient of layer l's output
        self.act = [torch.zeros(b_rows, widths[l + 1], device=dev) for l in range(n_layers - 1)]
        self.d = [torch.zeros(b_rows, widths[l + 1], device=dev) for l in range(n_layers)]
        self.z = torch.zeros(b_rows, widths[-1], device=dev)  # unfused: logits
        self.scratch = [(torch.zeros_like(w), torch.zeros_like(b)) for w, b in self.layers] if not self.fused else None
        e_rows = min(EVAL_CHUNK, len(data.test_labels))
        self.eval_act = [torch.zeros(e_rows, widths[l + 1], device=dev) for l in range(n_layers - 1)]
        self.eval_d = torch.zeros(1, device=dev)
        # persistent buffers
        self.programs = 1
        if self.mode == "persistent":
            bb = max(16, next_pow2(self.batch))
            if spec.is_logreg:
                requested = options.programs or (DEFAULT_PROGRAMS if self.cuda else 1)
                self.programs = 1 if requested == 1 else split_programs(requested)[0]
                if self.cuda:
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    if self.programs > sms:
                        raise FasttrainError(f"--programs {self.programs} exceeds this GPU's {sms} SMs: the grid "
                                             "barrier needs every program resident at once")
                self.zbuf = torch.zeros(3 * bb * 16, device=dev)
                self.bar = torch.zeros(1, dtype=torch.int32, device=dev)
            else:
                bh = mlp_block(spec.hidden[0])
                self.pact = torch.zeros(n_layers - 1, bb, bh, device=dev)
                self.pdbuf = torch.zeros(2, bb, bh, device=dev)

        # compile every kernel once (warm-up trains one step), put the initial weights back,
        # then capture one CUDA graph per distinct epoch length
        self.graphs = {}
        if self.cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run_steps(1)
                self.evaluate_async()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            self._restore_weights()
            if self.mode in ("graph", "persistent"):
                from fasttrain.engines.torch.common import capture_graph

                for steps in sorted(set(job.schedule.steps_per_epoch)):
                    self.graphs[steps] = capture_graph(lambda: self._run_steps(steps))
            torch.cuda.synchronize()
        else:
            self._run_steps(1)
            self._restore_weights()

    # --- the step loop ----------------------------------------------------------------------

    def _restore_weights(self) -> None:
        torch = self.torch
        for (w, b), (w0, b0) in zip(self.layers, self.job.init_weights):
            w.copy_(torch.from_numpy(np.asarray(w0, np.float32)))
            b.copy_(torch.from_numpy(np.asarray(b0, np.float32)))

    def _run_steps(self, steps: int) -> None:
        """Queue ``steps`` SGD steps over the batches of ``self.idx`` (captured into a graph on CUDA)."""
        from fasttrain.engines.triton.persistent import logreg_epoch, mlp_epoch

        if self.mode == "persistent":
            common = dict(n_rows=self.n_train, batch=self.batch, steps=steps, lr=self.lr, prec=self.prec)
            if self.spec.is_logreg:
                self.zbuf.zero_()
                self.bar.zero_()
                (w, b), = self.layers
                logreg_epoch(self.x, self.y, self.idx, w, b, self.loss, self.correct, programs=self.programs,
                             zbuf=self.zbuf, bar=self.bar, num_warps=self.warps or DEFAULT_WARPS, **common)
            else:
                (w1, b1), (wl, bl) = self.layers[0], self.layers[-1]
                mlp_epoch(self.x, self.y, self.idx, w1, b1, self.wm, self.bm, wl, bl, self.pact, self.pdbuf,
                          self.loss, self.correct, num_warps=self.warps, **common)
            return
        self.loss.zero_()
        self.correct.zero_()
        for k in range(steps):
            self._step(k)

    def _step(self, k: int) -> None:
        """One SGD step of the graph/eager path: 3L-1 launches fused (more unfused)."""
        from fasttrain.engines.triton.linear_backward import backward_fused, grad_input, sgd_update
        from fasttrain.engines.triton.linear_forward import linear, linear_xent
        from fasttrain.engines.triton.softmax_xent import softmax_xent

        start, stop = self.bounds[k]
        m, mb, prec = stop - start, self.batch, self.prec
        version = 2 if self.fused else 1
        n_layers = len(self.layers)
        inp = self.x
        for l in range(n_layers - 1):  # h_{l+1} = relu(h_l @ W_l + b_l), layer 0 gathers the batch
            w, b = self.layers[l]
            gather = dict(idx=self.idx, start=start) if l == 0 else {}
            linear(inp, w, b, self.act[l], m=m, m_max=mb, relu=True, prec=prec, version=version, **gather)
            inp = self.act[l]
        w, b = self.layers[-1]
        if self.fused:  # logits -> loss, accuracy, dlogits without leaving registers
            linear_xent(inp, w, b, self.y, self.d[-1], self.loss, self.correct, idx=self.idx,
                        gather_x=n_layers == 1, start=start, m=m, m_max=mb, step=k, prec=prec)
        else:
            gather = dict(idx=self.idx, start=start) if n_layers == 1 else {}
            linear(inp, w, b, self.z, m=m, m_max=mb, relu=False, prec=prec, version=1, **gather)
            softmax_xent(self.z, self.y, self.d[-1], self.loss, self.correct, idx=self.idx, start=start, m=m, step=k)
        for l in range(n_layers - 1, -1, -1):
            w, b = self.layers[l]
            if l > 0 and self._v3(w):  # input gradient and update in one pass over W_l
                backward_fused(self.act[l - 1], self.d[l], w, b, self.d[l - 1], self.lr, m=m, m_max=mb, prec=prec)
                continue
            if l > 0:  # d_{l-1} = (d_l @ W_l.T) * [h_l > 0], before W_l changes
                grad_input(self.d[l], w, self.act[l - 1], self.d[l - 1], m=m, m_max=mb, prec=prec)
            src = self.x if l == 0 else self.act[l - 1]
            gather = dict(idx=self.idx, start=start) if l == 0 else {}
            sgd_update(src, self.d[l], w, b, self.lr, m=m, m_max=mb, prec=prec, version=version,
                       scratch=self.scratch[l] if self.scratch else None, **gather)

    def _v3(self, w) -> bool:
        """Backward version 3 for this hidden-input layer?"""
        if not self.fused or self.backward == "v2" or self.batch > 64:
            return False
        return self.backward == "v3" or w.numel() >= V3_MIN_WEIGHTS

    def launches_per_step(self) -> float:
        n = len(self.layers)
        if self.mode == "persistent":
            return 1.0 / max(1, len(self.bounds))
        fwd = (n - 1) * (1 if self.fused else 2) + (1 if self.fused else 3)
        bwd = (n - 1) + n * (1 if self.fused else 3)
        bwd -= sum(1 for w, _ in self.layers[1:] if self._v3(w))
        return float(fwd + bwd)

    # --- Session protocol ----------------------------------------------------------------------

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        torch = self.torch
        self.idx_host.numpy()[:] = order  # int64 -> int32
        self.idx.copy_(self.idx_host, non_blocking=self.cuda)
        graph = self.graphs.get(steps)
        if graph is not None:
            graph.replay()
        else:
            self._run_steps(steps)
        sums = self.loss[:steps].to("cpu", torch.float64).numpy()
        correct = self.correct[:steps].to("cpu").numpy()
        counts = np.array([stop - start for start, stop in self.bounds[:steps]], dtype=np.float64)
        return EpochStats(count=int(counts.sum()), loss_sum=float(sums.sum()), correct=int(correct.sum()),
                          step_losses=sums / counts)

    def evaluate_async(self) -> None:
        from fasttrain.engines.triton.linear_forward import linear, linear_xent

        self.eval_loss.zero_()
        self.eval_correct.zero_()
        n_test = self.x_test.shape[0]
        rows = self.eval_act[0].shape[0] if self.eval_act else min(EVAL_CHUNK, n_test)
        for c0 in range(0, n_test, rows):
            m = min(rows, n_test - c0)
            inp = self.x_test[c0:c0 + m]
            for l, (w, b) in enumerate(self.layers[:-1]):
                linear(inp, w, b, self.eval_act[l], m=m, m_max=rows, relu=True, prec=self.prec)
                inp = self.eval_act[l]
            w, b = self.layers[-1]
            linear_xent(inp, w, b, self.y_test[c0:c0 + m], self.eval_d, self.eval_loss, self.eval_correct, m=m,
                        m_max=rows, write_grad=False, prec=self.prec)

    def evaluate(self) -> tuple[float, float]:
        self.evaluate_async()
        n_test = self.x_test.shape[0]
        return float(self.eval_loss.item()) / n_test, int(self.eval_correct.item()) / n_test

    def weights(self):
        return [(w.detach().to("cpu", self.torch.float64).numpy(), b.detach().to("cpu", self.torch.float64).numpy())
                for w, b in self.layers]

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def environment(self) -> dict:
        torch = self.torch
        env = {
            "device": torch.cuda.get_device_name() if self.cuda else "cpu (Triton interpreter)",
            "triton": self.triton.__version__,
            "torch": torch.__version__,
            "mode": self.mode,
            "kernels": "fused" if self.fused else "unfused (version 1)",
            "backward_v3_layers": [l for l, (w, _) in enumerate(self.layers) if l > 0 and self._v3(w)]
            if self.mode != "persistent" else [],
            "dot_precision": self.prec,
            "launches_per_step": self.launches_per_step(),
            "cuda_graph": bool(self.graphs),
        }
        if self.mode == "persistent" and self.spec.is_logreg:
            env["programs"] = self.programs
            env["warps"] = self.warps or DEFAULT_WARPS
        elif self.mode == "persistent":
            env["warps"] = self.warps or "auto"
        return env

    def close(self) -> None:
        self.graphs.clear()
