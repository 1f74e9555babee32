"""The lab's corpus: Tiny Shakespeare or the user's text or token files, tokenized, split, batched.

A corpus is a stream of token ids split in two: ``train`` and ``val`` (numpy integer arrays).

- Tiny Shakespeare (the default: 1,115,394 characters, 65 distinct) is found like MNIST and its
  SHA-256 checked against the published file; the first 90% trains, the last 10% validates.
- ``--train-file PATH`` (UTF-8 text) with ``--val-file PATH`` or ``--val-fraction F`` (default 0.1:
  the last F of the tokens validate): the user's text, never checked against our checksums; its
  SHA-256 is recorded (``corpus.sha256``, ``corpus.describe()``).
- ``--train-bin PATH`` (with ``--val-bin`` or ``--val-fraction``): token ids already made, nanoGPT's
  raw ``.bin`` files (``--bin-dtype uint16``, its format, or ``uint32`` for vocabularies over 65,536),
  read through a memory map. A wrong dtype is caught as far as the bytes allow: a size that is no
  multiple of the item size; a uint32 file read as uint16 shows every other id 0 (the high halves of
  little-endian ids below 65,536); a uint16 file read as uint32 gives ids of the order of 2^16 x id
  (beyond any vocabulary); ids at or beyond the tokenizer's vocabulary.

``--tokenizer`` (:mod:`fasttrain.lab.tokenizer`): ``char``, ``hf:PATH`` or ``tiktoken:NAME``; the
default is the model's own tokenizer when it has one, else characters. Ids are held in the narrowest
dtype that holds the vocabulary (uint8 up to 256 symbols, uint16 up to 65,536, else int32); the
validation split as uint8 or int32 (it goes to the device whole, and torch indexes those everywhere).

Training batches are windows of ``context + 1`` tokens at random offsets: the offsets of optimizer
step ``i`` come from a generator seeded with ``(seed, i)`` alone, so every way of loading gives the
same batches -- ``preload`` (the corpus on the device, windows cut there with one gather) and a
``torch.utils.data.DataLoader`` (windows cut in worker processes, optionally pinned and prefetched).
A step is one draw of ``k N b`` offsets (``k`` micro-batches, ``N`` data-parallel ranks, ``b``
sequences each), read as a ``(k, N, b)`` grid: rank ``r``'s micro-batch ``j`` is row ``[j, r]``
(:func:`rank_offsets`). The data layer yields each step as THIS rank's ``k`` micro-batches, so
gradient accumulation sees exactly the tokens one batch of ``k b`` would, and ``N`` ranks at a
global batch ``B`` see exactly the windows one process at ``B`` sees.

Validation reads the split in order, in non-overlapping windows (the last one shorter), and
averages the loss over every predicted token (or over the first ``eval_tokens``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fasttrain.errors import DataError, FasttrainError
from fasttrain.lab.config import check_bin_file, check_data_flags, check_text_file
from fasttrain.lab.tokenizer import CharTokenizer, load_tokenizer, load_tokenizer_spec

TRAIN_FRACTION = 0.9
VAL_FRACTION = 0.1         # the default --val-fraction: 1 - TRAIN_FRACTION, written as it is read
# the largest vocabularies in use have about 2^18 ids (256,000); a uint16 file read as uint32 gives
# ids lo + 65536 hi, at least 2^20 as soon as one id of 16 or more sits at an odd position
IMPLAUSIBLE_ID = 1 << 20


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray                   # token ids (uint8, uint16 or int32; a memory map for token files)
    val: np.ndarray                     # uint8 or int32 (in memory)
    tokenizer: object | None            # fasttrain.lab.tokenizer.*; None: token files without a tokenizer
    vocab_size: int                     # the id space: every id is below it
    source: str = "text"                # "tinyshakespeare", "text" (--train-file), "bin" (--train-bin)
    sha256: str | None = None           # of the training file (the known corpus: its published checksum)
    files: tuple = ()                   # ({"role", "path", "bytes", "sha256"}, ...)
    split: dict = field(default_factory=dict)   # {"val_fraction": f} or {"val_file": path}
    settings: dict = field(default_factory=dict)  # the data flags that rebuild it (corpus_from_description)

    @property
    def chars(self) -> str | None:
        """The characters of a character vocabulary (token i is chars[i]); None for other tokenizers."""
        return getattr(self.tokenizer, "chars", None)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise FasttrainError("these token files came without a tokenizer, so there is no text to encode or "
                                 "decode; give the one that made them: --tokenizer hf:PATH or tiktoken:NAME")
        return self.tokenizer

    def encode(self, text: str) -> np.ndarray:
        return self._need_tokenizer().encode(text)

    def decode(self, ids) -> str:
        return self._need_tokenizer().decode(ids)

    def describe(self) -> dict:
        """What a run record and a checkpoint keep of the corpus (JSON-able): where it came from,
        SHA-256 of each file, the split, the tokenizer (:func:`fasttrain.lab.tokenizer.load_tokenizer`
        rebuilds it), the sizes."""
        return {"source": self.source, "sha256": self.sha256, "files": [dict(f) for f in self.files],
                "split": dict(self.split), "settings": dict(self.settings),
                "tokenizer": None if self.tokenizer is None else self.tokenizer.describe(),
                "vocab_size": self.vocab_size, "train_tokens": int(len(self.train)), "val_tokens": int(len(self.val))}


def _split(ids: np.ndarray, train_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_train = int(len(ids) * train_fraction)
    return ids[:n_train], ids[n_train:]


def _check_sizes(train: np.ndarray, val: np.ndarray) -> None:
    """Both splits must hold a prediction: two tokens at least (one window of context 1)."""
    for name, ids, fix in (("training", train, "give more text"),
                           ("validation", val, "give more text, a longer --val-file or a larger --val-fraction")):
        if len(ids) < 2:
            raise DataError(f"the {name} split holds {len(ids)} token(s), too few to predict one; {fix}")


def corpus_from_text(text: str, tokenizer=None, *, val_text: str | None = None, val_fraction: float | None = None,
                     **meta) -> Corpus:
    """A corpus of ``text``: validated on ``val_text`` when given, else on its last ``val_fraction``
    (default 0.1) of tokens; ``tokenizer`` (default: the characters of the text(s))."""
    texts = (text,) if val_text is None else (text, val_text)
    tok = tokenizer if tokenizer is not None else CharTokenizer.fit(*texts)
    ids = tok.encode(text)
    if val_text is None:
        train, val = _split(ids, TRAIN_FRACTION if val_fraction is None else 1.0 - val_fraction)
        train = train.copy()
    else:
        train, val = ids, tok.encode(val_text)
    meta.setdefault("split", {"val_file": meta.get("settings", {}).get("val_file")} if val_text is not None
                    else {"val_fraction": VAL_FRACTION if val_fraction is None else val_fraction})
    _check_sizes(train, val)
    return Corpus(train, device_ids(val), tok, tok.vocab_size, **meta)


def load_corpus(data_dir=None, name: str = "tinyshakespeare", *, tokenizer=None,
                val_fraction: float | None = None) -> Corpus:
    """Tiny Shakespeare, found like MNIST (``data_dir`` > $FASTTRAIN_DATA_DIR > cache), SHA-256
    checked against the published file; ``tokenizer`` a tokenizer or a ``--tokenizer`` value."""
    from fasttrain.data.text import load_text, text_path, text_spec

    if isinstance(tokenizer, str):
        tokenizer = None if tokenizer == "char" else load_tokenizer_spec(tokenizer)
    text = load_text(name, data_dir)
    spec = text_spec(name)
    path = text_path(name, data_dir)
    return corpus_from_text(text, tokenizer, val_fraction=val_fraction, source=name, sha256=spec.sha256,
                            files=({"role": "train", "path": str(path), "bytes": spec.size, "sha256": spec.sha256},),
                            settings={"val_fraction": val_fraction})


# --- the user's files ----------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def read_text_file(path, flag: str = "--train-file") -> tuple[str, dict]:
    """The text of a user's file and its record (path, bytes, SHA-256); one-line errors for a
    missing file, a folder, an empty file or bytes that are not UTF-8."""
    p = check_text_file(path, flag)
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{flag} {path}: not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); "
                        "convert it to UTF-8, or give token ids with --train-bin") from None
    return text, {"path": str(p.resolve()), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def read_bin_file(path, dtype: str, flag: str, vocab: int | None = None) -> tuple[np.ndarray, dict]:
    """Token ids of a raw ``.bin`` file (memory-mapped) and its record; refuses a file whose ids show
    another dtype or exceed ``vocab`` (see the module docstring). uint32 ids are viewed as int32."""
    p = check_bin_file(path, dtype, flag)
    ids = np.memmap(p, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    top = int(ids.max())
    if dtype == "uint16" and len(ids) >= 16 and ids[0::2].any() and not ids[1::2].any():
        raise DataError(f"{flag} {path}: every other id is 0, as uint32 ids read as uint16 show (their high halves); "
                        f"give --bin-dtype uint32")
    if dtype == "uint32" and top >= IMPLAUSIBLE_ID:
        raise DataError(f"{flag} {path}: ids up to {top:,}, beyond any vocabulary, as uint16 ids read in pairs as "
                        f"uint32 show; give --bin-dtype uint16")
    if vocab is not None and top >= vocab:
        hint = " (or the file is uint32: --bin-dtype uint32)" if dtype == "uint16" else ""
        raise DataError(f"{flag} {path}: id {top:,} is beyond the tokenizer's vocabulary of {vocab:,}: these tokens "
                        f"were made by another tokenizer{hint}; give the tokenizer that made them")
    if dtype == "uint32":
        ids = ids.view(np.int32)        # every id < 2^20 (checked): int32 is the same number, and torch indexes it
    record = {"path": str(p.resolve()), "bytes": p.stat().st_size, "sha256": _sha256(p), "dtype": dtype,
              "max_id": top}
    return ids, record


def check_vocab(corpus_vocab: int, model_vocab: int) -> None:
    """Refuse a model whose vocabulary cannot hold the corpus's ids (its embedding would be indexed out of range)."""
    if corpus_vocab > model_vocab:
        raise FasttrainError(f"the corpus has {corpus_vocab:,} token ids but the model's vocabulary holds "
                             f"{model_vocab:,}: use a model with a vocabulary of at least {corpus_vocab:,} "
                             f"(--vocab-size {corpus_vocab}) or a tokenizer of at most {model_vocab:,} ids")


def load_user_corpus(*, train_file=None, val_file=None, train_bin=None, val_bin=None, bin_dtype: str = "uint16",
                     val_fraction: float | None = None, tokenizer=None) -> Corpus:
    """The user's corpus from text files or token files (see the module docstring). ``tokenizer``: a
    tokenizer object, a ``--tokenizer`` value, or None (characters for text; ids only for token files)."""
    settings = {"train_file": train_file, "val_file": val_file, "train_bin": train_bin, "val_bin": val_bin,
                "bin_dtype": bin_dtype, "val_fraction": val_fraction}
    if isinstance(tokenizer, str):
        tokenizer = None if tokenizer == "char" else load_tokenizer_spec(tokenizer)
    if train_file is not None:
        text, rec = read_text_file(train_file, "--train-file")
        files = [{"role": "train", **rec}]
        val_text = None
        if val_file is not None:
            val_text, vrec = read_text_file(val_file, "--val-file")
            files.append({"role": "val", **vrec})
        return corpus_from_text(text, tokenizer, val_text=val_text, val_fraction=val_fraction, source="text",
                                sha256=rec["sha256"], files=tuple(files), settings=settings)
    if train_bin is None:
        raise FasttrainError("no corpus given: --train-file PATH (text) or --train-bin PATH (token ids)")
    vocab = None if tokenizer is None else tokenizer.vocab_size
    ids, rec = read_bin_file(train_bin, bin_dtype, "--train-bin", vocab)
    files = [{"role": "train", **rec}]
    if val_bin is not None:
        val, vrec = read_bin_file(val_bin, bin_dtype, "--val-bin", vocab)
        files.append({"role": "val", **vrec})
        train, split = ids, {"val_file": val_bin}
    else:
        train, val = _split(ids, TRAIN_FRACTION if val_fraction is None else 1.0 - val_fraction)
        split = {"val_fraction": VAL_FRACTION if val_fraction is None else val_fraction}
    _check_sizes(train, val)
    top = max(int(r["max_id"]) for r in files)
    vocab_size = vocab if vocab is not None else top + 1
    return Corpus(train, device_ids(val), tokenizer, vocab_size, source="bin", sha256=rec["sha256"],
                  files=tuple(files), split=split, settings=settings)


def corpus_for(cfg, default_tokenizer=None) -> Corpus:
    """The corpus a :class:`~fasttrain.lab.config.LabConfig` names. ``default_tokenizer`` (a tokenizer
    or a ``--tokenizer`` value): the model's own, used when ``--tokenizer`` is not given; without
    one, characters for text and none for token files."""
    check_data_flags(cfg)
    spec = cfg.tokenizer if cfg.tokenizer is not None else default_tokenizer
    # the tokenizer first: a bad one fails before any file is read
    if spec is None or spec == "char":
        tok = None                              # characters for text (fitted to it), none for token files
    else:
        tok = load_tokenizer_spec(spec) if isinstance(spec, str) else spec
    if cfg.train_file or cfg.train_bin:
        return load_user_corpus(train_file=cfg.train_file, val_file=cfg.val_file, train_bin=cfg.train_bin,
                                val_bin=cfg.val_bin, bin_dtype=cfg.bin_dtype, val_fraction=cfg.val_fraction,
                                tokenizer=tok)
    if tok is None and cfg.val_fraction is None:
        return load_corpus(cfg.data_dir)        # today's path, exactly (tests replace load_corpus)
    return load_corpus(cfg.data_dir, tokenizer=tok, val_fraction=cfg.val_fraction)


def corpus_from_description(desc: dict, data_dir=None, tokenizer_folder=None) -> Corpus:
    """The corpus :meth:`Corpus.describe` described, read again (``lab eval``): the same files (their
    SHA-256 must match the recorded ones: another text would give another loss), the same split and
    tokenizer (a ``hf`` tokenizer from ``tokenizer_folder`` when the checkpoint holds it)."""
    tok = None if desc.get("tokenizer") is None else load_tokenizer(desc["tokenizer"], tokenizer_folder)
    s = desc.get("settings") or {}
    if desc.get("source") in ("text", "bin"):
        corpus = load_user_corpus(train_file=s.get("train_file"), val_file=s.get("val_file"),
                                  train_bin=s.get("train_bin"), val_bin=s.get("val_bin"),
                                  bin_dtype=s.get("bin_dtype") or "uint16", val_fraction=s.get("val_fraction"),
                                  tokenizer=tok)
        for was, now in zip(desc.get("files", ()), corpus.files):
            if was.get("sha256") != now["sha256"]:
                raise DataError(f"{now['path']} changed since it was recorded (SHA-256 {now['sha256'][:12]}..., "
                                f"recorded {str(was.get('sha256'))[:12]}...): restore the file the run used")
        return corpus
    return load_corpus(data_dir, desc.get("source") or "tinyshakespeare", tokenizer=tok,
                       val_fraction=s.get("val_fraction"))


def step_offsets(seed: int, step: int, n_windows: int, context: int, n_tokens: int) -> np.ndarray:
    """The window starts of one optimizer step: ``n_windows`` uniform offsets in [0, n - context - 1]."""
    high = n_tokens - context - 1
    if high < 1:
        raise DataError(f"the training split ({n_tokens} tokens) is shorter than one context of {context} + 1")
    rng = np.random.default_rng((seed, step))
    return rng.integers(0, high + 1, size=n_windows, dtype=np.int64)


def device_ids(ids: np.ndarray) -> np.ndarray:
    """``ids`` as the device holds them: uint8 as they are, anything wider as int32; always in writable
    memory (a read-only memory map is copied: torch does not take read-only arrays)."""
    out = np.ascontiguousarray(ids, dtype=np.uint8 if ids.dtype == np.uint8 else np.int32)
    return out if out.flags.writeable else out.copy()


def windows(ids: np.ndarray, offsets: np.ndarray, context: int) -> np.ndarray:
    """(n, context + 1) int64 token windows; inputs are [:, :-1], targets [:, 1:]."""
    return ids[offsets[:, None] + np.arange(context + 1)].astype(np.int64)


def rank_offsets(seed: int, step: int, *, micro_batch: int, accumulation: int, ranks: int, rank: int,
                 context: int, n_tokens: int) -> np.ndarray:
    """This rank's window starts of one optimizer step, ``(accumulation, micro_batch)``: the step's one
    draw of ``accumulation * ranks * micro_batch`` offsets read as a ``(k, N, b)`` grid, column ``rank``
    (one process: ``N = 1``, the draw cut into ``k`` consecutive slices of ``b``)."""
    drawn = step_offsets(seed, step, accumulation * ranks * micro_batch, context, n_tokens)
    return drawn.reshape(accumulation, ranks, micro_batch)[:, rank]


def _micro_batches(x, y) -> list:
    """``(k, b, T)`` inputs and targets as the step's ``k`` micro-batches ``[(x_j, y_j), ...]``."""
    return [(x[j], y[j]) for j in range(x.shape[0])]


class StepBatches:
    """Map-style dataset: item ``i`` is step ``i``'s ``(x, y)`` of this rank, each (k, b, context) int64."""

    def __init__(self, ids: np.ndarray, seed: int, context: int, steps: int, start: int = 0, *,
                 micro_batch: int, accumulation: int = 1, ranks: int = 1, rank: int = 0):
        self.ids, self.seed, self.context = ids, seed, context
        self.steps, self.start = steps, start
        self.grid = dict(micro_batch=micro_batch, accumulation=accumulation, ranks=ranks, rank=rank)

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int):
        import torch

        starts = rank_offsets(self.seed, self.start + i, context=self.context, n_tokens=len(self.ids), **self.grid)
        w = torch.from_numpy(windows(self.ids, starts.reshape(-1), self.context))
        w = w.view(*starts.shape, self.context + 1)
        return w[..., :-1].contiguous(), w[..., 1:].contiguous()


def train_batches(ids: np.ndarray, *, seed: int, micro_batch: int, context: int, steps: int, device, preload: bool,
                  accumulation: int = 1, ranks: int = 1, rank: int = 0, num_workers: int = 0,
                  pin_memory: bool = False, prefetch_factor: int | None = None, start: int = 0):
    """An iterator over ``steps`` steps from step ``start``: each THIS rank's ``accumulation``
    micro-batches ``[(x, y), ...]`` of ``micro_batch`` windows on ``device`` (see :func:`rank_offsets`)."""
    import torch

    grid = dict(micro_batch=micro_batch, accumulation=accumulation, ranks=ranks, rank=rank)
    if preload:
        # the corpus and this rank's window starts of every step go to the device once, here, at
        # setup; a step is then one gather on the device, no host work and no copy. Ids stay compact
        # there: uint8 for up to 256 symbols (Tiny Shakespeare's characters), else int32 (torch's
        # uint16 and uint32 have only limited operator support); the gather widens to int64
        corpus = torch.from_numpy(device_ids(ids)).to(device)
        starts = torch.from_numpy(np.stack([rank_offsets(seed, start + i, context=context, n_tokens=len(ids), **grid)
                                            for i in range(steps)]) if steps
                                  else np.zeros((0, accumulation, micro_batch), np.int64))
        starts = starts.to(device)
        ramp = torch.arange(context + 1, device=device)

        def gen():
            for i in range(steps):
                w = corpus[starts[i][..., None] + ramp].long()          # (k, b, context + 1)
                yield _micro_batches(w[..., :-1].contiguous(), w[..., 1:].contiguous())
        return gen()
    # its own generator: starting an iterator draws a seed for its workers, which must not come
    # from the global generator (dropout's): a resumed run starts its iterator at another moment
    loader = torch.utils.data.DataLoader(
        StepBatches(ids, seed, context, steps, start, **grid), batch_size=None, shuffle=False,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers, pin_memory=pin_memory and torch.device(device).type == "cuda",
        prefetch_factor=prefetch_factor if num_workers else None, persistent_workers=False)
    non_blocking = pin_memory

    def gen():
        for x, y in loader:
            yield _micro_batches(x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking))
    return gen()


def eval_windows(ids: np.ndarray, context: int, tokens: int | None = None) -> list[tuple[int, int]]:
    """(start, length) of the validation windows: in order, non-overlapping, predicting each of the
    first ``tokens`` (default all) tokens after the first exactly once."""
    n_pred = len(ids) - 1 if tokens is None else min(tokens, len(ids) - 1)
    out = []
    start = 0
    while start < n_pred:
        length = min(context, n_pred - start)
        out.append((start, length))
        start += length
    return out


def tokens_sha256(corpus) -> str:
    """SHA-256 of the corpus' token ids: the training split's bytes, then the validation split's."""
    import numpy as np

    digest = hashlib.sha256()
    for ids in (corpus.train, corpus.val):
        arr = np.ascontiguousarray(ids)
        digest.update(str(arr.dtype).encode() + b":" + str(arr.shape[0]).encode() + b":")
        digest.update(arr.tobytes())
    return digest.hexdigest()
