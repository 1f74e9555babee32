"""Diagnose rungs 0-4 vs 5 on MNIST mlp:100x2 batch 37 (device only): per step, the GPU's
activations and gradients against float64 ones computed from the GPU's own pre-step weights."""
import numpy as np
import cupy as cp
from fasttrain.contract import default_config, epoch_order, initial_weights, parse_model, schedule
from fasttrain.data import load_dataset
from fasttrain.data.datasets import to_inputs
from fasttrain.engines.base import Job
from fasttrain.engines.cuda.ladder_session import LadderSession
from fasttrain.engines.cuda.libs import Cudnn
from fasttrain.reference import forward, loss_and_grads

data = load_dataset("mnist")
spec = parse_model("mlp:100x2")
cfg = default_config(spec, epochs=1, steps=None, batch_size=37, lr=float(__import__("os").environ.get("DIAG_LR", "0.05")))
job = Job(spec, cfg, data, initial_weights(spec, 0), schedule(cfg, data.n_train))
x_all = to_inputs(data.train_images, np.float64)
y_all = data.train_labels.astype(np.int64)
order = epoch_order(0, 1, data.n_train)


def rel(a, b):
    a = np.asarray(a, np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


import sys
for variant in sys.argv[1:] or ("kernel", "kernel+cudnn", "cudnn", "kernel-nofused"):
    rung = {"kernel": 4, "kernel+cudnn": 4, "cudnn": 5, "kernel-nofused": 2}[variant]
    s = LadderSession(job, rung, False)
    dnn = Cudnn(s.stream)
    first = None
    worst = {}
    with s.stream:
        s._upload_order(order)
        for k, (start, stop) in enumerate(s.bounds[:300]):
            rows = stop - start
            w_before = [(w.astype(np.float64), b.astype(np.float64)) for w, b in s.weights()]
            idx = order[start:stop]
            x, y = x_all[idx], y_all[idx]
            gather, fwd, loss_ops, bwd = s._plan(rows, True)
            gather(start)
            for op in fwd:
                op()
            if variant == "kernel+cudnn":
                dnn.softmax_call(s.probs, s.acts[-1], rows, 10)()
            got = {"x": s.x[:rows].get(), "y": s.y[:rows].get(), "probs": s.probs[:rows].get()}
            for l in range(len(s.acts)):
                got[f"act{l}"] = s.acts[l][:rows].get()
            for op in loss_ops:
                op(k)
            for op in bwd:
                op()
            for l in range(len(s.dW)):
                got[f"dW{l}"], got[f"db{l}"] = s.dW[l].get(), s.db[l].get()
                got[f"delta{l}"] = s.deltas[l][:rows].get()
            acts = forward(w_before, x)
            _, _, grads = loss_and_grads(w_before, x, y)
            e = np.exp(acts[-1] - acts[-1].max(1, keepdims=True)); e /= e.sum(1, keepdims=True)
            want = {"x": x, "y": y, "probs": e}
            for l in range(len(s.acts)):
                want[f"act{l}"] = acts[l + 1]
            for l, (dw, db) in enumerate(grads):
                want[f"dW{l}"], want[f"db{l}"] = dw, db
            for name in want:
                r = rel(got[name], want[name])
                worst[name] = max(worst.get(name, 0.0), r)
                if r > 1e-3 and first is None:
                    first = (k, name, r)
                    diff = np.abs(np.asarray(got[name], np.float64) - want[name])
                    at = np.unravel_index(np.nanargmax(np.where(np.isfinite(diff), diff, np.inf)), diff.shape)
                    print(f"{variant}: FIRST bad step {k} {name} rel {r:.2e} at {at}: got {np.asarray(got[name])[at]} "
                          f"want {want[name][at]}; rows {rows}; labels {y.tolist()}")
                    print("  probs finite:", np.isfinite(got["probs"]).all(), " logits max |.|",
                          np.abs(got[f"act{len(s.acts)-1}"]).max(), " probs min", got["probs"].min())
                    print("  all rel at this step:", {n: f"{rel(got[n], want[n]):.1e}" for n in want})
    print(f"{variant} (rung {rung}): worst over 300 steps:", {n: f"{v:.1e}" for n, v in worst.items()},
          "first bad:", first, flush=True)
    s.close()
