"""The reference math, in NumPy, shared by the NumPy engine, the tests and the benchmarks.

Forward, for layers l = 1..L with ``h_0 = x``:
    z_l = h_{l-1} @ W_l + b_l,   h_l = relu(z_l) for l < L,   logits = z_L
Loss: mean over the batch of ``-log softmax(logits)[y]``.
Backward, with ``d = dL/dlogits = (softmax(logits) - onehot(y)) / B``:
    dW_l = h_{l-1}.T @ d,   db_l = sum_rows(d),   d <- (d @ W_l.T) * [h_{l-1} > 0]
SGD: ``W_l -= lr * dW_l`` (the backward uses the pre-update ``W_l``).
Run in float64 this is the reference every engine is held to.
"""

from __future__ import annotations

import numpy as np

from fasttrain.data.datasets import Dataset, to_inputs

Weights = list[tuple[np.ndarray, np.ndarray]]


def forward(weights: Weights, x: np.ndarray) -> list[np.ndarray]:
    """Activations ``[x, h_1, ..., h_{L-1}, logits]``."""
    acts = [x]
    last = len(weights) - 1
    for i, (w, b) in enumerate(weights):
        z = acts[-1] @ w
        z += b
        if i < last:
            np.maximum(z, 0, out=z)
        acts.append(z)
    return acts


def softmax_xent(logits: np.ndarray, labels: np.ndarray) -> tuple[float, int, np.ndarray]:
    """(summed loss, number correct, softmax probabilities) for a batch; loss in the logits' dtype."""
    rows = np.arange(len(labels))
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    denom = exp.sum(axis=1)
    loss_sum = float(np.sum(np.log(denom) - shifted[rows, labels], dtype=np.float64))
    correct = int(np.count_nonzero(logits.argmax(axis=1) == labels))
    probs = exp / denom[:, None]
    return loss_sum, correct, probs


def loss_and_grads(weights: Weights, x: np.ndarray, labels: np.ndarray):
    """Mean loss, number correct and ``[(dW_l, db_l)]`` of one batch."""
    acts = forward(weights, x)
    batch = len(labels)
    loss_sum, correct, d = softmax_xent(acts[-1], labels)
    d[np.arange(batch), labels] -= 1
    d /= d.dtype.type(batch)
    grads = [None] * len(weights)
    for i in range(len(weights) - 1, -1, -1):
        h_in = acts[i]
        grads[i] = (h_in.T @ d, d.sum(axis=0))  # dW = h_in.T @ d, db = sum_rows(d)
        if i > 0:
            d = d @ weights[i][0].T
            d *= h_in > 0  # relu'(z) = [h > 0]
    return loss_sum / batch, correct, grads


def sgd_step(weights: Weights, x: np.ndarray, labels: np.ndarray, lr: float) -> tuple[float, int]:
    """One in-place SGD step; returns (mean loss, number correct) before the update."""
    loss, correct, grads = loss_and_grads(weights, x, labels)
    lr = weights[0][0].dtype.type(lr)
    for (w, b), (dw, db) in zip(weights, grads):
        w -= lr * dw
        b -= lr * db
    return loss, correct


def evaluate(weights: Weights, data: Dataset, dtype=np.float64, chunk: int = 2000) -> tuple[float, float]:
    """(mean loss, accuracy) over the test set, in chunks to bound memory for wide models."""
    loss_sum, correct = 0.0, 0
    labels = data.test_labels.astype(np.int64)
    for start in range(0, len(labels), chunk):
        x = to_inputs(data.test_images[start : start + chunk], dtype)
        chunk_loss, chunk_correct, _ = softmax_xent(forward(weights, x)[-1], labels[start : start + chunk])
        loss_sum += chunk_loss
        correct += chunk_correct
    return loss_sum / len(labels), correct / len(labels)


def relative_max_error(weights: Weights, reference: Weights) -> float:
    """``max|W - W_ref| / max|W_ref|`` over all weight matrices and biases."""
    num = max(float(np.max(np.abs(np.asarray(w, np.float64) - r))) for (w, b), (r, _) in zip(weights, reference))
    num = max(num, max(float(np.max(np.abs(np.asarray(b, np.float64) - rb))) for (w, b), (_, rb) in zip(weights, reference)))
    den = max(max(float(np.max(np.abs(r))), float(np.max(np.abs(rb)))) for r, rb in reference)
    return num / den
