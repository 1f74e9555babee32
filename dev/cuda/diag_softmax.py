"""Diagnose rungs 0-4 vs 5 on mlp:100x2 batch 37 (device only): per step, the softmax kernel's and
cuDNN's output against float64 softmax of the same logits, and the weight error vs the reference."""
import numpy as np
import cupy as cp
from fasttrain.contract import default_config, epoch_order, initial_weights, parse_model, schedule
from fasttrain.data import load_dataset
from fasttrain.data.datasets import to_inputs
from fasttrain.engines.base import Job
from fasttrain.engines.cuda.ladder_session import LadderSession
from fasttrain.engines.cuda.libs import Cudnn
from fasttrain.reference import sgd_step, relative_max_error

data = load_dataset("mnist")
spec = parse_model("mlp:100x2")
cfg = default_config(spec, epochs=1, steps=None, batch_size=37, lr=0.05)
job = Job(spec, cfg, data, initial_weights(spec, 0), schedule(cfg, data.n_train))
for rung in (4, 5):
    s = LadderSession(job, rung, False)
    dnn = Cudnn(s.stream)
    ref = [(w.copy(), b.copy()) for w, b in job.init_weights]
    x_all = to_inputs(data.train_images, np.float64)
    y_all = data.train_labels.astype(np.int64)
    order = epoch_order(0, 1, data.n_train)
    P2 = cp.empty_like(s.probs)
    worst_k = worst_d = 0.0
    shown = 0
    with s.stream:
        s._upload_order(order)
        for k, (start, stop) in enumerate(s.bounds):
            rows = stop - start
            gather, fwd, loss_ops, bwd = s._plan(rows, True)
            gather(start)
            for op in fwd:
                op()
            dnn.softmax_call(P2, s.acts[-1], rows, 10)()
            z = s.acts[-1][:rows].get(stream=s.stream).astype(np.float64)
            p = s.probs[:rows].get(stream=s.stream)
            p2 = P2[:rows].get(stream=s.stream)
            e = np.exp(z - z.max(1, keepdims=True)); e /= e.sum(1, keepdims=True)
            dk, dd = np.abs(p - e).max(), np.abs(p2 - e).max()
            if (dk > 1e-5 or dd > 1e-5) and shown < 3:
                shown += 1
                r = int(np.abs(p - e).max(1).argmax())
                print(f"rung {rung} step {k}: kernel err {dk:.2e} cudnn err {dd:.2e}; row {r} z={z[r]} p={p[r]} ref={e[r]}")
            worst_k, worst_d = max(worst_k, dk), max(worst_d, dd)
            for op in loss_ops:
                op(k)
            for op in bwd:
                op()
            idx = order[start:stop]
            sgd_step(ref, x_all[idx], y_all[idx], cfg.lr)
            if k % 200 == 0 or k == len(s.bounds) - 1:
                print(f"rung {rung} step {k}: weight err {relative_max_error(s.weights(), ref):.2e}  "
                      f"softmax err so far kernel {worst_k:.2e} cudnn {worst_d:.2e}", flush=True)
    s.close()
