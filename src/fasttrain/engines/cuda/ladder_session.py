"""Rungs 0..6 of the CUDA ladder: Python on the host, the numbered CUDA C kernels on the device.

Each rung is the previous one plus exactly one change:

    0  baseline: hand-written kernels only (02 naive matmul on a 2-D grid of 2-D blocks, 03 bias,
       04 softmax, 05 cross-entropy, 06 accuracy, 07 softmax backward, 08 bias gradient,
       09 relu backward, 10 SGD); loss and accuracy every step, and every step a host
       synchronization with device-to-host copies of them (the batch's indices also go up
       per step), as a first program does
    1  + reduced synchronization and copies: the epoch's order goes up once (pinned, async), the
       per-step losses and the correct count stay on the device, read once per epoch
    2  + cuBLAS sgemm for every GEMM, forward and backward (nvmath-python bindings)
    3  + loss and accuracy computed only every 10th epoch (and in the last): other epochs skip
       the two kernels and the read-back, and report ``None``
    4  + one fused loss-and-accuracy kernel (11) instead of 05 and 06
    5  + cuDNN's softmax (cudnnSoftmaxForward) instead of 04
    6  + CUDA graphs: each epoch's steps captured once (CuPy stream capture) and replayed; the
       order goes into a static device buffer before the launch

One step, for layers l = 1..L with h_0 = x (see :mod:`fasttrain.reference`):
    x, y   = gather(order[start:stop])              01
    z_l    = h_{l-1} @ W_l + b_l, h_l = relu(z_l)   02 / sgemm, 03
    p      = softmax(z_L)                           04 / cuDNN
    loss, correct                                   05 + 06 / 11   (rung >= 3: some epochs only)
    d_L    = (p - onehot(y)) / B                    07
    dW_l   = h_{l-1}.T @ d_l, db_l = sum_rows(d_l)  02 / sgemm, 08
    d_{l-1}= (d_l @ W_l.T) * [h_{l-1} > 0]          02 / sgemm, 09   (before W_l changes)
    W_l   -= lr dW_l, b_l -= lr db_l                10
"""

from __future__ import annotations

import numpy as np

from fasttrain.contract import batch_bounds
from fasttrain.engines.base import EpochStats, Job, Session
from fasttrain.engines.cuda.layout import naive_strides

LOSS_EVERY = 10  # rung >= 3: loss and accuracy in epochs 10, 20, ... and the last one
THREADS = 256
H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind


def _blocks(n: int, threads: int = THREADS) -> tuple[int, int, int]:
    return ((n + threads - 1) // threads, 1, 1)


class LadderSession(Session):
    def __init__(self, job: Job, rung: int, debug: bool):
        import cupy as cp

        from fasttrain.engines.cuda.kernels import compile_kernels

        self._cp = cp
        self.rung = rung
        self.debug = debug
        self._capturing = False
        self._closed = False
        config = job.config
        self.batch = config.batch_size
        self.lr = np.float32(config.lr)
        self.widths = job.spec.widths
        self.shapes = job.spec.layer_shapes()
        self.n_layers = len(self.shapes)
        self.classes = self.widths[-1]
        self.features = self.widths[0]
        self.n_epochs = job.schedule.n_epochs
        self.bounds = batch_bounds(job.data.n_train, config.batch_size, config.drop_last)
        self.n_test = len(job.data.test_labels)
        self.eval_rows = min(self.n_test, 10000)

        self.stream = cp.cuda.Stream(non_blocking=True)
        self.k = compile_kernels()
        self.blas = self.dnn = None
        if rung >= 2:
            from fasttrain.engines.cuda.libs import Cublas

            self.blas = Cublas(self.stream)
        if rung >= 5:
            from fasttrain.engines.cuda.libs import Cudnn

            self.dnn = Cudnn(self.stream)

        f32, i32 = cp.float32, cp.int32
        with self.stream:
            data = job.data
            # the whole uint8 training set resides on the device; 01 gather turns rows into floats
            self.train_images = cp.asarray(data.train_images.reshape(len(data.train_images), -1))
            self.train_labels = cp.asarray(data.train_labels.astype(np.uint8))
            self.test_images = cp.asarray(data.test_images.reshape(len(data.test_images), -1))
            self.test_labels = cp.asarray(data.test_labels.astype(np.uint8))
            self.test_order = cp.arange(self.n_test, dtype=i32)
            self.order = cp.zeros(job.data.n_train, dtype=i32)
            # weights: fp32 master copies; the initial ones kept to undo the warm-up
            self.W = [cp.asarray(w.astype(np.float32)) for w, _ in job.init_weights]
            self.b = [cp.asarray(b.astype(np.float32)) for _, b in job.init_weights]
            self.W0 = [w.copy() for w in self.W]
            self.b0 = [b.copy() for b in self.b]
            self.dW = [cp.empty_like(w) for w in self.W]
            self.db = [cp.empty_like(b) for b in self.b]
            # training buffers for the largest batch; a partial batch uses their leading rows
            B = self.batch
            self.x = cp.empty((B, self.features), f32)
            self.y = cp.empty(B, i32)
            self.acts = [cp.empty((B, fan_out), f32) for _, fan_out in self.shapes]  # z_l, then h_l in place
            self.deltas = [cp.empty((B, fan_out), f32) for _, fan_out in self.shapes]  # dL/dz_l
            self.probs = cp.empty((B, self.classes), f32)
            # per-step summed losses (double) and the epoch's correct count
            self.loss_steps = cp.zeros(max(len(self.bounds), 1), cp.float64)
            self.correct = cp.zeros(1, i32)
            # evaluation buffers, one chunk of the test set
            E = self.eval_rows
            self.ex = cp.empty((E, self.features), f32)
            self.ey = cp.empty(E, i32)
            self.eacts = [cp.empty((E, fan_out), f32) for _, fan_out in self.shapes]
            self.eprobs = cp.empty((E, self.classes), f32)
            self.eloss = cp.zeros(1, cp.float64)
            self.ecorrect = cp.zeros(1, i32)
        # pinned host memory for the once-per-epoch copies (rung >= 1)
        import cupyx

        self.order_host = cupyx.empty_pinned(job.data.n_train, dtype=np.int32)
        self.loss_host = cupyx.empty_pinned(self.loss_steps.shape, dtype=np.float64)
        self.correct_host = cupyx.empty_pinned(1, dtype=np.int32)
        self.order_copied = cp.cuda.Event(disable_timing=True)
        self.order_copied.record(self.stream)
        self._plans: dict = {}
        self._graphs: dict = {}
        self._warm_up(job)

    # --- launching -------------------------------------------------------------------------

    def _checked(self, name: str, fn):
        """``fn`` itself, or in debug mode ``fn`` followed by a synchronize and error check."""
        if not self.debug:
            return fn

        def call(*args):
            fn(*args)
            if not self._capturing:  # a capturing stream cannot be synchronized
                try:  # launch errors raise at the call; faults inside a kernel raise here
                    self.stream.synchronize()
                except Exception as exc:
                    raise RuntimeError(f"CUDA error after {name} (rung {self.rung}): {exc}") from exc

        return call

    def _kernel(self, name: str, grid, block, args):
        fn = self.k[name]
        return self._checked(name, lambda: fn(grid, block, args))

    def _matmul(self, C, A, B, M, N, K, trans_a=False, trans_b=False):
        """An op computing the row-major ``C[M,N] = op(A) @ op(B)``: 02 naive (rungs 0-1) or sgemm."""
        if self.rung >= 2:
            return self._checked("cublasSgemm", self.blas.gemm_call(C, A, B, M, N, K, trans_a, trans_b))
        strides = naive_strides(M, N, K, trans_a, trans_b)
        grid = ((N + 15) // 16, (M + 15) // 16, 1)
        args = (C, A, B, np.int32(M), np.int32(N), np.int32(K), *map(np.int32, strides))
        return self._kernel("matmul_kernel1", grid, (16, 16, 1), args)

    def _memset(self, array, nbytes=None):
        ptr, n, runtime, stream = array.data.ptr, array.nbytes if nbytes is None else nbytes, \
            self._cp.cuda.runtime, self.stream

        return self._checked("memset", lambda: runtime.memsetAsync(ptr, 0, n, stream.ptr))

    # --- the step, as a list of ops ---------------------------------------------------------

    def _forward_ops(self, rows, x, acts, probs, y, loss_buf, correct, with_loss):
        """Ops from x (rows, 784) to probs, and with_loss the loss/accuracy ops. Each op takes
        ``slot`` (the loss slot this step writes) when it is the loss op, else nothing."""
        ops = []
        h = x
        for l, (fan_in, fan_out) in enumerate(self.shapes):
            z = acts[l]
            ops.append(self._matmul(z, h, self.W[l], rows, fan_out, fan_in))  # z = h @ W
            relu = np.int32(l < self.n_layers - 1)
            ops.append(self._kernel("bias_forward_kernel1", _blocks(rows * fan_out), (THREADS, 1, 1),
                                    (z, self.b[l], np.int32(rows), np.int32(fan_out), relu)))
            h = z
        logits, C = h, self.classes
        if self.rung >= 5:
            ops.append(self._checked("cudnnSoftmaxForward", self.dnn.softmax_call(probs, logits, rows, C)))
        else:
            ops.append(self._kernel("softmax_forward_kernel1", _blocks(rows), (THREADS, 1, 1),
                                    (probs, logits, np.int32(rows), np.int32(C))))
        loss_ops = []
        if with_loss:
            n, c = np.int32(rows), np.int32(C)
            if self.rung >= 4:
                fused = self.k["loss_accuracy_kernel1"]
                loss_ops.append(lambda slot: fused(_blocks(rows), (THREADS, 1, 1),
                                                   (loss_buf, np.int32(slot), correct, probs, logits, y, n, c)))
            else:
                xent, acc = self.k["crossentropy_forward_kernel1"], self.k["accuracy_kernel1"]
                loss_ops.append(lambda slot: xent(_blocks(rows), (THREADS, 1, 1), (loss_buf, np.int32(slot), probs, y, n, c)))
                loss_ops.append(lambda slot: acc(_blocks(rows), (THREADS, 1, 1), (correct, logits, y, n, c)))
            loss_ops = [self._checked("loss/accuracy", op) for op in loss_ops]
        return ops, loss_ops

    def _plan(self, rows: int, with_loss: bool):
        """(gather, forward ops, loss ops, backward ops) of a training step of ``rows`` examples."""
        key = (rows, with_loss)
        if key in self._plans:
            return self._plans[key]
        gather_fn = self.k["gather_kernel1"]
        n_feat = np.int32(self.features)
        grid = _blocks(rows * self.features)
        args_head = (self.x, self.y, self.train_images, self.train_labels, self.order)
        gather = self._checked("gather_kernel1", lambda start: gather_fn(
            grid, (THREADS, 1, 1), (*args_head, np.int32(start), np.int32(rows), n_feat)))
        forward, loss_ops = self._forward_ops(rows, self.x, self.acts, self.probs, self.y, self.loss_steps,
                                              self.correct, with_loss)
        backward = [self._kernel("softmax_crossentropy_backward_kernel1", _blocks(rows * self.classes),
                                 (THREADS, 1, 1), (self.deltas[-1], self.probs, self.y, np.int32(rows),
                                                   np.int32(self.classes), np.float32(rows)))]
        col_threads = min(THREADS, max(32, (rows + 31) // 32 * 32))
        for l in range(self.n_layers - 1, -1, -1):
            fan_in, fan_out = self.shapes[l]
            d = self.deltas[l]
            h_in = self.x if l == 0 else self.acts[l - 1]
            backward.append(self._matmul(self.dW[l], h_in, d, fan_in, fan_out, rows, trans_a=True))  # dW = h.T @ d
            backward.append(self._kernel("bias_backward_kernel1", (fan_out, 1, 1), (col_threads, 1, 1),
                                         (self.db[l], d, np.int32(rows), np.int32(fan_out))))  # db = sum_rows(d)
            if l > 0:
                d_prev = self.deltas[l - 1]
                backward.append(self._matmul(d_prev, d, self.W[l], rows, fan_in, fan_out, trans_b=True))  # d @ W.T
                backward.append(self._kernel("relu_backward_kernel1", _blocks(rows * fan_in), (THREADS, 1, 1),
                                             (d_prev, self.acts[l - 1], np.int64(rows * fan_in))))
            # W_l changes only now: d_{l-1} above used the pre-update W_l
            backward.append(self._kernel("sgd_kernel1", _blocks(self.W[l].size), (THREADS, 1, 1),
                                         (self.W[l], self.dW[l], self.lr, np.int64(self.W[l].size))))
            backward.append(self._kernel("sgd_kernel1", _blocks(self.b[l].size), (THREADS, 1, 1),
                                         (self.b[l], self.db[l], self.lr, np.int64(self.b[l].size))))
        plan = (gather, tuple(forward), tuple(loss_ops), tuple(backward))
        self._plans[key] = plan
        return plan

    def _queue_steps(self, bounds, with_loss: bool, first_slot: int = 0, order_offset: int | None = None):
        """Queue the SGD steps of ``bounds`` on the stream (eagerly or into a capture)."""
        for k, (start, stop) in enumerate(bounds):
            gather, forward, loss_ops, backward = self._plan(stop - start, with_loss)
            gather(start if order_offset is None else order_offset)
            for op in forward:
                op()
            for op in loss_ops:
                op(first_slot + k)
            for op in backward:
                op()

    # --- epochs ----------------------------------------------------------------------------

    def _loss_epoch(self, epoch: int) -> bool:
        return self.rung < 3 or epoch % LOSS_EVERY == 0 or epoch == self.n_epochs

    def _upload_order(self, order: np.ndarray) -> None:
        """The epoch's permutation into the device buffer: pinned host copy, async on our stream."""
        self.order_copied.synchronize()  # the previous copy has left the pinned buffer
        n = len(order)
        self.order_host[:n] = order
        self._cp.cuda.runtime.memcpyAsync(self.order.data.ptr, self.order_host.ctypes.data, n * 4, H2D,
                                          self.stream.ptr)
        self.order_copied.record(self.stream)

    def _read_losses(self, steps: int) -> tuple[np.ndarray, int]:
        runtime = self._cp.cuda.runtime
        runtime.memcpyAsync(self.loss_host.ctypes.data, self.loss_steps.data.ptr, steps * 8, D2H, self.stream.ptr)
        runtime.memcpyAsync(self.correct_host.ctypes.data, self.correct.data.ptr, 4, D2H, self.stream.ptr)
        self.stream.synchronize()
        return np.array(self.loss_host[:steps]), int(self.correct_host[0])

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        bounds = self.bounds[:steps]
        sizes = np.array([stop - start for start, stop in bounds], dtype=np.float64)
        count = int(sizes.sum())
        with_loss = self._loss_epoch(epoch)
        if self.rung == 0:
            return self._train_epoch_rung0(order, bounds, sizes, count)
        with self.stream:
            self._upload_order(order)
            if with_loss:
                self._memset(self.loss_steps, steps * 8)()
                self._memset(self.correct)()
            if self.rung >= 6:
                self._graph(steps, with_loss).launch(stream=self.stream)
                if self.debug:
                    self._checked("graph launch", lambda: None)()
            else:
                self._queue_steps(bounds, with_loss)
        if not with_loss:
            return EpochStats(count=count)
        step_sums, correct = self._read_losses(steps)
        return EpochStats(count=count, loss_sum=float(step_sums.sum()), correct=correct,
                          step_losses=step_sums / sizes)

    def _train_epoch_rung0(self, order, bounds, sizes, count) -> EpochStats:
        """Every step: the batch's indices up, the step, its loss and the running correct count
        down, and a host synchronization (pageable memory, as a first program does)."""
        runtime, stream = self._cp.cuda.runtime, self.stream
        step_sums = np.empty(len(bounds))
        loss_one = np.zeros(1, np.float64)
        correct_one = np.zeros(1, np.int32)
        with stream:
            self._memset(self.loss_steps, len(bounds) * 8)()
            self._memset(self.correct)()
            for k, (start, stop) in enumerate(bounds):
                idx = np.ascontiguousarray(order[start:stop], dtype=np.int32)
                runtime.memcpyAsync(self.order.data.ptr, idx.ctypes.data, idx.nbytes, H2D, stream.ptr)
                self._queue_steps([(start, stop)], True, first_slot=k, order_offset=0)
                runtime.memcpyAsync(loss_one.ctypes.data, self.loss_steps.data.ptr + 8 * k, 8, D2H, stream.ptr)
                runtime.memcpyAsync(correct_one.ctypes.data, self.correct.data.ptr, 4, D2H, stream.ptr)
                stream.synchronize()
                step_sums[k] = loss_one[0]
        correct = int(correct_one[0])  # the running count after the last step
        return EpochStats(count=count, loss_sum=float(step_sums.sum()), correct=correct,
                          step_losses=step_sums / sizes)

    # --- rung 6: CUDA graphs ----------------------------------------------------------------

    def _graph(self, steps: int, with_loss: bool):
        """The captured epoch of ``steps`` steps (the partial last batch included, with its own
        shapes); captured on first use, which :meth:`_warm_up` makes happen in ``prepare``."""
        key = (steps, with_loss)
        if key not in self._graphs:
            stream = self.stream
            with stream:
                stream.begin_capture()
                self._capturing = True
                try:
                    self._queue_steps(self.bounds[:steps], with_loss)
                finally:
                    self._capturing = False
                    graph = stream.end_capture()  # ends the capture even when a call above failed
            graph.upload(stream)
            self._graphs[key] = graph
        return self._graphs[key]

    # --- setup, evaluation, weights ---------------------------------------------------------

    def _warm_up(self, job: Job) -> None:
        """Load every kernel, plan every cuBLAS/cuDNN shape, capture the graphs (rung 6), then
        put the initial weights back: the session starts from ``job.init_weights``."""
        with self.stream:
            epoch_keys = []
            for epoch, steps in enumerate(job.schedule.steps_per_epoch, start=1):
                key = (steps, self._loss_epoch(epoch))
                if key not in epoch_keys:
                    epoch_keys.append(key)
            order = np.arange(job.data.n_train, dtype=np.int64)
            self._upload_order(order)
            self._memset(self.loss_steps)()
            self._memset(self.correct)()
            # one eager step of each shape and loss variant the run will use: loads every kernel
            # and lets cuBLAS/cuDNN pick their kernels before any capture
            variants = set()
            for steps, with_loss in epoch_keys:
                for start, stop in (self.bounds[0], self.bounds[steps - 1]):
                    variants.add(((start, stop), with_loss))
            for bounds, with_loss in sorted(variants):
                self._queue_steps([bounds], with_loss)
            if self.rung >= 6:
                for steps, with_loss in epoch_keys:  # capture each epoch variant, replay it once
                    self._graph(steps, with_loss).launch(stream=self.stream)
            self.evaluate()
            for dst, src in zip(self.W + self.b, self.W0 + self.b0):
                self._cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, D2D, self.stream.ptr)
        self.stream.synchronize()

    def evaluate(self) -> tuple[float, float]:
        """Test loss and accuracy with the rung's own forward path, in chunks of ``eval_rows``."""
        with self.stream:
            self._memset(self.eloss)()
            self._memset(self.ecorrect)()
            for start in range(0, self.n_test, self.eval_rows):
                rows = min(self.eval_rows, self.n_test - start)
                ops = self._eval_ops(rows)
                ops[0](start)
                for op in ops[1]:
                    op()
                for op in ops[2]:
                    op(0)
            runtime = self._cp.cuda.runtime
            loss, correct = np.zeros(1, np.float64), np.zeros(1, np.int32)
            runtime.memcpyAsync(loss.ctypes.data, self.eloss.data.ptr, 8, D2H, self.stream.ptr)
            runtime.memcpyAsync(correct.ctypes.data, self.ecorrect.data.ptr, 4, D2H, self.stream.ptr)
            self.stream.synchronize()
        return float(loss[0]) / self.n_test, int(correct[0]) / self.n_test

    def _eval_ops(self, rows: int):
        key = ("eval", rows)
        if key not in self._plans:
            gather_fn = self.k["gather_kernel1"]
            grid = _blocks(rows * self.features)
            head = (self.ex, self.ey, self.test_images, self.test_labels, self.test_order)
            n_feat = np.int32(self.features)
            gather = self._checked("gather_kernel1", lambda start: gather_fn(
                grid, (THREADS, 1, 1), (*head, np.int32(start), np.int32(rows), n_feat)))
            forward, loss_ops = self._forward_ops(rows, self.ex, self.eacts, self.eprobs, self.ey, self.eloss,
                                                  self.ecorrect, True)
            self._plans[key] = (gather, forward, loss_ops)
        return self._plans[key]

    def weights(self):
        with self.stream:
            out = [(w.get(stream=self.stream), b.get(stream=self.stream)) for w, b in zip(self.W, self.b)]
        self.stream.synchronize()
        return out

    def sync(self) -> None:
        self.stream.synchronize()

    def environment(self) -> dict:
        cp = self._cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        env = {
            "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "cuda_rung": self.rung,
            "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cp.cuda.runtime.driverGetVersion(),
        }
        if self.blas is not None:
            from importlib.metadata import version

            env["nvmath"] = version("nvmath-python")
            env["cublas"] = self.blas.version
        if self.dnn is not None:
            env["cudnn"] = self.dnn.version
        return env

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stream.synchronize()
        self._graphs.clear()
        self._plans.clear()
        if self.blas is not None:
            self.blas.close()
        if self.dnn is not None:
            self.dnn.close()
