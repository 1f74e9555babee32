"""Count live tensor bytes op by op, on any device (the CPU check of the ``precise`` model).

A ``TorchDispatchMode`` sees every ATen op that runs (forward, backward, optimizer), registers
each new output storage with its byte size and a finalizer that subtracts it when the storage
dies, and keeps the running peak. Storages alive before the mode (parameters, optimizer state)
are excluded: ``baseline`` bytes are added by the caller. Allocations made inside a kernel
(workspaces) and allocator rounding are invisible here; on a GPU ``max_memory_allocated`` sees
them, which is what ``validate`` compares against.
"""

from __future__ import annotations

import weakref


def _storages(obj, out):
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _storages(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _storages(item, out)
    return out


def make_tracker(existing=(), detail=False):
    """A dispatch mode with ``.live``, ``.peak`` and ``.peak_op`` (op name at the peak); with
    ``detail``, ``.at_peak`` lists (bytes, op that made it) of every storage alive at the peak."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveTracker(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = 0
            self.peak = 0
            self.peak_op = ""
            self.ops = 0
            self._seen: dict[int, int] = {}
            self._made: dict[int, str] = {}
            self.at_peak: list[tuple[int, str]] = []
            for t in existing:
                self._seen[t.untyped_storage().data_ptr()] = 0

        def _forget(self, key, nbytes):
            if self._seen.pop(key, None) is not None:
                self.live -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            self.ops += 1
            for t in _storages(result, []):
                if t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in self._seen or st.nbytes() == 0:
                    continue
                nbytes = st.nbytes()
                self._seen[key] = nbytes
                if detail:
                    self._made[key] = str(func)
                self.live += nbytes
                weakref.finalize(st, self._forget, key, nbytes)
            if self.live > self.peak:
                self.peak, self.peak_op = self.live, str(func)
                if detail:
                    self.at_peak = sorted(((n, self._made.get(k, "?")) for k, n in self._seen.items() if n),
                                          reverse=True)
            return result

    return LiveTracker()


def tracked_peak_step(model, opt, idx, targets, autocast_dtype=None, detail=False):
    """Peak bytes of one training step (forward, backward, optimizer) on top of the live
    parameters, buffers and optimizer state, counted by :func:`make_tracker`.

    Returns ``(peak_total, baseline, tracker)``; run one step before so the optimizer state exists.
    """
    import contextlib

    import torch

    existing = [*model.parameters(), *model.buffers()]
    for state in opt.state.values():
        existing += [v for v in state.values() if isinstance(v, torch.Tensor)]
    baseline = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in existing}.values())
    tracker = make_tracker(existing, detail)
    ctx = torch.autocast(idx.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with tracker:
        with ctx:
            loss = model(idx, targets)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    return baseline + tracker.peak, baseline, tracker


def saved_tensor_bytes(forward, exclude=(), detail=False):
    """Bytes autograd keeps for backward while ``forward()`` runs: every tensor a ``saved_tensors_hooks``
    pack hook sees, counted once per storage (views of one tensor share it), storages of ``exclude``
    (parameters, buffers: alive anyway) left out. Returns ``(bytes, result)``; with ``detail``,
    ``(bytes, result, [(nbytes, dtype, shape), ...])`` largest first.

    This is what the estimator's "activations at the end of forward" counts; tensors autocast caches
    (the bf16 weight copies) count when a matmul saves them, as on the GPU."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, tuple] = {}

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in skip and key not in seen and t.device.type != "meta" and st.nbytes():
            seen[key] = (st.nbytes(), t.dtype, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = forward()
    total = sum(v[0] for v in seen.values())
    if detail:
        return total, result, sorted(seen.values(), key=lambda v: -v[0])
    return total, result


def allocator_peak_step(step, model, opt):
    """Peak bytes of ``step()`` (one training step) measured at the CPU allocator: the running sum of
    the profiler's memory events (every allocation and free of PyTorch's CPU allocator, those made by
    compiled (inductor) kernels too, which a dispatch mode does not see, and FSDP's storage resized under
    its parameters), on top of the live parameters, buffers and optimizer state (a DTensor's: its local
    shard). Returns ``(peak_total, baseline)``; run a step before (compilation, optimizer state)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    existing = [*model.parameters(), *model.buffers()]
    for state in opt.state.values():
        existing += [v for v in state.values() if isinstance(v, torch.Tensor)]
    # a DTensor (FSDP's shards, their optimizer state) holds its local tensor's storage
    existing = [t.to_local() if hasattr(t, "to_local") else t for t in existing]
    baseline = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in existing}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return baseline + peak, baseline
