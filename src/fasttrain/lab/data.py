"""Tiny Shakespeare at the character level: vocabulary, the standard split, seeded batches.

The corpus (1,115,394 characters, 65 distinct) is encoded one byte per character; the first 90%
trains, the last 10% validates. Training batches are windows of ``context + 1`` characters at
random offsets: the offsets of optimizer step ``i`` come from a generator seeded with
``(seed, i)`` alone, so every way of loading gives the same batches -- ``preload`` (the corpus on
the device, windows cut there with one gather) and a ``torch.utils.data.DataLoader`` (windows cut
in worker processes, optionally pinned and prefetched). A step's ``k`` micro-batches of ``b`` are
the ``k`` slices of one draw of ``k b`` windows, so gradient accumulation sees exactly the tokens
one batch of ``k b`` would.

Validation reads the split in order, in non-overlapping windows (the last one shorter), and
averages the loss over every predicted character (or over the first ``eval_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fasttrain.errors import DataError

TRAIN_FRACTION = 0.9


@dataclass(frozen=True)
class CharCorpus:
    chars: str                 # the vocabulary, sorted: token i is chars[i]
    train: np.ndarray          # uint8 token ids
    val: np.ndarray

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return np.array([index[c] for c in text], dtype=np.uint8)
        except KeyError as exc:
            raise DataError(f"character {exc.args[0]!r} is not in the corpus vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def corpus_from_text(text: str) -> CharCorpus:
    chars = "".join(sorted(set(text)))
    if len(chars) > 256:
        raise DataError(f"{len(chars)} distinct characters do not fit one byte each")
    lut = np.zeros(0x110000 if max(map(ord, chars)) > 255 else 256, dtype=np.uint8)
    for i, c in enumerate(chars):
        lut[ord(c)] = i
    ids = lut[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
    n_train = int(len(ids) * TRAIN_FRACTION)
    return CharCorpus(chars, ids[:n_train].copy(), ids[n_train:].copy())


def load_corpus(data_dir=None, name: str = "tinyshakespeare") -> CharCorpus:
    """Tiny Shakespeare, found like MNIST (``data_dir`` > $FASTTRAIN_DATA_DIR > cache), SHA-256 checked."""
    from fasttrain.data.text import load_text

    return corpus_from_text(load_text(name, data_dir))


def step_offsets(seed: int, step: int, n_windows: int, context: int, n_tokens: int) -> np.ndarray:
    """The window starts of one optimizer step: ``n_windows`` uniform offsets in [0, n - context - 1]."""
    high = n_tokens - context - 1
    if high < 1:
        raise DataError(f"the training split ({n_tokens} tokens) is shorter than one context of {context} + 1")
    rng = np.random.default_rng((seed, step))
    return rng.integers(0, high + 1, size=n_windows, dtype=np.int64)


def windows(ids: np.ndarray, offsets: np.ndarray, context: int) -> np.ndarray:
    """(n, context + 1) int64 token windows; inputs are [:, :-1], targets [:, 1:]."""
    return ids[offsets[:, None] + np.arange(context + 1)].astype(np.int64)


class StepBatches:
    """Map-style dataset: item ``i`` is step ``i``'s ``(x, y)``, each (k b, context) int64."""

    def __init__(self, ids: np.ndarray, seed: int, batch: int, context: int, steps: int, start: int = 0):
        self.ids, self.seed, self.batch, self.context = ids, seed, batch, context
        self.steps, self.start = steps, start

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int):
        import torch

        w = torch.from_numpy(windows(self.ids, step_offsets(self.seed, self.start + i, self.batch, self.context,
                                                             len(self.ids)), self.context))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def train_batches(ids: np.ndarray, *, seed: int, batch: int, context: int, steps: int, device, preload: bool,
                  num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int | None = None, start: int = 0):
    """An iterator over ``steps`` steps' ``(x, y)`` on ``device``; ``batch`` = windows per step (under
    data parallelism every rank draws the global step and keeps its rows: ``lab.train.Trainer``)."""
    import torch

    if preload:
        # the corpus (1 byte a character) and every step's window starts go to the device once,
        # here, at setup; a step is then one gather on the device, no host work and no copy
        corpus = torch.from_numpy(ids).to(device)
        starts = torch.from_numpy(np.stack([step_offsets(seed, start + i, batch, context, len(ids))
                                            for i in range(steps)]) if steps else np.zeros((0, batch), np.int64))
        starts = starts.to(device)
        ramp = torch.arange(context + 1, device=device)

        def gen():
            for i in range(steps):
                w = corpus[starts[i][:, None] + ramp].long()
                yield w[:, :-1].contiguous(), w[:, 1:].contiguous()
        return gen()
    # its own generator: starting an iterator draws a seed for its workers, which must not come
    # from the global generator (dropout's): a resumed run starts its iterator at another moment
    loader = torch.utils.data.DataLoader(
        StepBatches(ids, seed, batch, context, steps, start), batch_size=None, shuffle=False,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers, pin_memory=pin_memory and torch.device(device).type == "cuda",
        prefetch_factor=prefetch_factor if num_workers else None, persistent_workers=False)
    non_blocking = pin_memory

    def gen():
        for x, y in loader:
            yield x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
    return gen()


def eval_windows(ids: np.ndarray, context: int, tokens: int | None = None) -> list[tuple[int, int]]:
    """(start, length) of the validation windows: in order, non-overlapping, predicting each of the
    first ``tokens`` (default all) characters after the first exactly once."""
    n_pred = len(ids) - 1 if tokens is None else min(tokens, len(ids) - 1)
    out = []
    start = 0
    while start < n_pred:
        length = min(context, n_pred - start)
        out.append((start, length))
        start += length
    return out
