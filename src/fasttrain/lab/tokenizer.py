"""Tokenizers for the lab: characters, a Hugging Face tokenizer from a local path, or tiktoken.

``--tokenizer`` takes one of

- ``char``: one token per distinct character of the corpus (sorted, token ``i`` is ``chars[i]``);
- ``hf:PATH``: a ``tokenizer.json`` file, or a folder holding one (read with ``tokenizers``), or a
  folder ``transformers.AutoTokenizer`` reads offline (``tokenizer_config.json`` with
  ``vocab.json``/``merges.txt`` or a SentencePiece model);
- ``tiktoken:NAME``: a tiktoken encoding (``gpt2``, ``cl100k_base``, ...) when tiktoken is installed
  and the encoding is in its cache (tiktoken downloads encodings on first use).

Every tokenizer has ``vocab_size`` (the size of its id space: every id it emits is below it),
``encode(text) -> np.ndarray`` (no special tokens added: a corpus is a stream of text tokens, as
nanoGPT prepares it), ``decode(ids) -> str``, ``chars`` (the characters for ``char``, else None) and
``describe()``: a JSON-able dict from which :func:`load_tokenizer` builds the same tokenizer again
(a checkpoint stores it; a ``hf`` tokenizer is also copied into the checkpoint folder by
:func:`save_tokenizer`, so the checkpoint does not depend on the original path).

``fasttrain lab tokenizer train --vocab-size N --train-file F --out DIR`` trains a byte-level BPE
tokenizer (GPT-2's scheme) on local text with ``tokenizers``: offline machines make their own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import click
import numpy as np

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import check_spec, check_text_file, hf_tokenizer_file, missing_extra

END_OF_TEXT = "<|endoftext|>"
# texts longer than this are encoded in pieces cut after a newline, in parallel (tokenizers'
# encode_batch, tiktoken's encode_ordinary_batch); shorter ones in one call, exactly as one string
CHUNK_CHARS = 1 << 22


def id_dtype(vocab_size: int):
    """The narrowest id dtype for ``vocab_size`` symbols: uint8 up to 256, uint16 up to 65,536, else
    int32 (ids < 2^31; torch indexes int32 everywhere)."""
    if vocab_size <= 1 << 8:
        return np.uint8
    if vocab_size <= 1 << 16:
        return np.uint16
    return np.int32


def _pieces(text: str, size: int | None = None) -> list[str]:
    """``text`` cut into pieces of about ``size`` (default CHUNK_CHARS) characters, each ending after a
    newline where one exists."""
    size = size or CHUNK_CHARS
    if len(text) <= size:
        return [text]
    out, start = [], 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        out.append(text[start:end])
        start = end
    return out


class CharTokenizer:
    """One token per character; ``chars`` sorted."""

    kind = "char"

    def __init__(self, chars: str):
        if not chars:
            raise FasttrainError("a character tokenizer needs at least one character (the text is empty)")
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def fit(cls, *texts: str) -> "CharTokenizer":
        return cls("".join(sorted(set().union(*map(set, texts)))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        # a lookup table over code points: one vectorized gather instead of a dict per character
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        if not len(codes):
            return np.zeros(0, dtype=id_dtype(self.vocab_size))
        top = max(int(codes.max()), max(map(ord, self.chars))) + 1
        lut = np.full(top, -1, dtype=np.int64)
        lut[[ord(c) for c in self.chars]] = np.arange(len(self.chars))
        ids = lut[codes]
        if (ids < 0).any():
            bad = text[int(np.argmax(ids < 0))]
            raise FasttrainError(f"character {bad!r} is not in the corpus vocabulary")
        return ids.astype(id_dtype(self.vocab_size))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def describe(self) -> dict:
        return {"kind": "char", "vocab_size": self.vocab_size, "chars": self.chars}

    def __repr__(self) -> str:
        return f"char ({self.vocab_size} characters)"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from ``tokenizer.json``), or a ``transformers`` tokenizer for
    folders without one."""

    kind = "hf"
    chars = None

    def __init__(self, backend, source: str, *, transformers_tokenizer=None, file: Path | None = None):
        self.backend = backend                      # tokenizers.Tokenizer, or None
        self.hf = transformers_tokenizer            # a transformers tokenizer when there is no tokenizer.json
        self.source = source
        self.file = file
        if backend is not None:
            # ids may have holes; the id space is what matters for the embedding
            self._vocab = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        else:
            self._vocab = max(len(transformers_tokenizer), max(transformers_tokenizer.get_vocab().values()) + 1)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def encode(self, text: str) -> np.ndarray:
        pieces = _pieces(text)
        if self.backend is not None:
            encs = self.backend.encode_batch(pieces, add_special_tokens=False) if len(pieces) > 1 else \
                [self.backend.encode(pieces[0], add_special_tokens=False)]
            lists = [e.ids for e in encs]
        else:
            lists = [self.hf.encode(p, add_special_tokens=False) for p in pieces]
        return np.fromiter((i for ids in lists for i in ids), dtype=np.int64).astype(id_dtype(self.vocab_size))

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=False)
        return self.hf.decode(ids, skip_special_tokens=False)

    def sha256(self) -> str | None:
        if self.backend is not None:
            return hashlib.sha256(self.backend.to_str().encode()).hexdigest()
        return None

    def describe(self) -> dict:
        return {"kind": "hf", "vocab_size": self.vocab_size, "path": self.source, "sha256": self.sha256()}

    def __repr__(self) -> str:
        return f"hf:{self.source} ({self.vocab_size} tokens)"


class TiktokenTokenizer:
    kind = "tiktoken"
    chars = None

    def __init__(self, encoding, name: str):
        self.encoding, self.name = encoding, name

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> np.ndarray:
        pieces = _pieces(text)
        lists = self.encoding.encode_ordinary_batch(pieces) if len(pieces) > 1 else \
            [self.encoding.encode_ordinary(pieces[0])]
        return np.fromiter((i for ids in lists for i in ids), dtype=np.int64).astype(id_dtype(self.vocab_size))

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {"kind": "tiktoken", "vocab_size": self.vocab_size, "name": self.name}

    def __repr__(self) -> str:
        return f"tiktoken:{self.name} ({self.vocab_size} tokens)"


# --- building one from a --tokenizer value ------------------------------------------------------

def model_tokenizer(folder: str | os.PathLike) -> str | None:
    """``hf:FOLDER`` when a model folder ships a tokenizer (the default --tokenizer for that model), else None."""
    try:
        hf_tokenizer_file(folder)
    except FasttrainError:
        return None
    return f"hf:{folder}" if Path(folder).expanduser().is_dir() else None


def _load_hf(path: str) -> HFTokenizer:
    file = hf_tokenizer_file(path)
    source = str(Path(path).expanduser().resolve())
    if file is not None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise missing_extra("tokenizers (--tokenizer hf:)", exc) from None
        try:
            backend = Tokenizer.from_file(str(file))
        except Exception as exc:
            raise FasttrainError(f"--tokenizer hf:{path}: {file} is not a tokenizers file "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}); "
                                 "give a tokenizer.json written by tokenizers or transformers") from None
        return HFTokenizer(backend, source, file=file)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise missing_extra("transformers (--tokenizer hf: folder without tokenizer.json)", exc) from None
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as exc:
        raise FasttrainError(f"--tokenizer hf:{path}: transformers cannot read this tokenizer folder offline "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})") from None
    backend = getattr(tok, "backend_tokenizer", None)
    return HFTokenizer(backend, source, transformers_tokenizer=None if backend is not None else tok)


def _load_tiktoken(name: str) -> TiktokenTokenizer:
    try:
        import tiktoken
    except ImportError:
        raise FasttrainError(f"--tokenizer tiktoken:{name} needs tiktoken: pip install tiktoken (it downloads "
                             f"{name}'s encoding on first use, which needs the network; offline, use hf:PATH)"
                             ) from None
    names = tiktoken.list_encoding_names()
    if name not in names:
        raise FasttrainError(f"unknown tiktoken encoding {name!r}; use one of {', '.join(names)}")
    try:
        enc = tiktoken.get_encoding(name)
    except Exception as exc:
        raise FasttrainError(f"--tokenizer tiktoken:{name}: tiktoken needs to download the {name} encoding and "
                             f"cannot ({type(exc).__name__}): this machine is offline; copy its cache folder here "
                             "and set TIKTOKEN_CACHE_DIR, or use hf:PATH") from None
    return TiktokenTokenizer(enc, name)


def load_tokenizer_spec(spec: str, *texts: str):
    """The tokenizer a ``--tokenizer`` value names; ``char`` is fitted to ``texts``."""
    check_spec(spec)
    if spec == "char":
        return CharTokenizer.fit(*texts)
    kind, arg = spec.split(":", 1)
    return _load_hf(arg) if kind == "hf" else _load_tiktoken(arg)


def load_tokenizer(desc: dict, folder: str | os.PathLike | None = None):
    """The tokenizer :meth:`describe` described. A ``hf`` tokenizer is read from ``folder`` when
    :func:`save_tokenizer` wrote it there (a checkpoint), else from its recorded path; its SHA-256
    must match the recorded one."""
    kind = desc.get("kind") if isinstance(desc, dict) else None
    if kind == "char":
        return CharTokenizer(desc["chars"])
    if kind == "tiktoken":
        return _load_tiktoken(desc["name"])
    if kind != "hf":
        raise FasttrainError(f"unknown tokenizer description {desc!r}: expected kind char, hf or tiktoken")
    path = desc["path"]
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        path = str(Path(folder) / "tokenizer.json")
    tok = _load_hf(path)
    if desc.get("sha256") and tok.sha256() != desc["sha256"]:
        raise FasttrainError(f"tokenizer {path} is not the one recorded (SHA-256 {str(tok.sha256())[:12]}..., "
                             f"recorded {desc['sha256'][:12]}...): restore that tokenizer")
    return tok


def save_tokenizer(tok, folder: str | os.PathLike) -> None:
    """Write what :func:`load_tokenizer` needs besides ``tok.describe()`` into ``folder``: for a
    ``hf`` tokenizer its files (``tokenizer.json`` and transformers' ``tokenizer_config.json``,
    so ``AutoTokenizer.from_pretrained(folder)`` reads it too); nothing for characters or tiktoken."""
    if getattr(tok, "kind", None) != "hf":
        return
    folder = Path(folder)
    if tok.hf is not None:
        tok.hf.save_pretrained(str(folder))
        return
    tok.backend.save(str(folder / "tokenizer.json"))
    if tok.file is not None:
        cfg = tok.file.parent / "tokenizer_config.json"
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (tok.file.parent / name).is_file():
                shutil.copyfile(tok.file.parent / name, folder / name)
        if cfg.is_file():
            return
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))


# --- training a BPE tokenizer locally -----------------------------------------------------------

def check_utf8_file(path, flag: str) -> Path:
    """A text file whose bytes decode as UTF-8, read in blocks (the tokenizers library panics with a
    Rust traceback on the first invalid byte); one line naming the byte's offset otherwise."""
    import codecs

    p = check_text_file(path, flag)
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(p, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                at = offset + exc.start
                raise FasttrainError(f"{flag} {path}: not UTF-8 text (byte {at}: {block[exc.start:exc.start + 1]!r});"
                                     f" convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise FasttrainError(f"{flag} {path}: not UTF-8 text (it ends inside a character); convert it to "
                             f"UTF-8") from None
    return p


def train_bpe(files, vocab_size: int, out: str | os.PathLike | None = None, *, min_frequency: int = 2) -> HFTokenizer:
    """A byte-level BPE tokenizer (GPT-2's scheme: any text encodes, nothing is unknown) with
    ``vocab_size`` ids: the 256 byte symbols, ``<|endoftext|>`` and the merges learned from
    ``files``. With ``out``, written there as a folder that ``hf:OUT`` and transformers'
    ``PreTrainedTokenizerFast``/``AutoTokenizer`` load (written to a temporary folder, then renamed)."""
    files = [str(Path(f).expanduser()) for f in ([files] if isinstance(files, (str, os.PathLike)) else files)]
    for f in files:
        check_utf8_file(f, "--train-file")
    smallest = 256 + 1
    if not isinstance(vocab_size, int) or vocab_size < smallest:
        raise FasttrainError(f"--vocab-size must be at least {smallest} (256 byte symbols and {END_OF_TEXT}), "
                             f"got {vocab_size!r}")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:
        raise missing_extra("tokenizers (lab tokenizer train)", exc) from None
    if out is not None:
        from fasttrain.files import check_new_folder

        check_new_folder(out, "--out")
        if Path(out).expanduser().exists():
            raise FasttrainError(f"--out {out}: the folder exists; give a new folder (nothing is overwritten)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    if out is None:
        return HFTokenizer(tok, f"(trained on {', '.join(files)})")
    final = Path(out).expanduser()
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.resolve().parent))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        # transformers' own config beside it: AutoTokenizer / PreTrainedTokenizerFast read the folder
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT,
             "unk_token": END_OF_TEXT, "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}, indent=1))
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _load_hf(str(final))


@click.group("tokenizer", context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """Tokenizers for the lab's --tokenizer hf:PATH (trained here, offline)."""


@command.command("train")
@click.option("--vocab-size", type=int, required=True, help="Ids in all (>= 257: 256 bytes + <|endoftext|>).")
@click.option("--train-file", "train_files", multiple=True, required=True, help="UTF-8 text to learn merges from "
              "(repeatable).")
@click.option("--out", required=True, help="New folder to write (tokenizer.json + tokenizer_config.json).")
@click.option("--min-frequency", type=click.IntRange(1), default=2, show_default=True,
              help="A pair merges only if it occurs this often.")
def train_cmd(vocab_size, train_files, out, min_frequency) -> None:
    """Train a byte-level BPE tokenizer on local text; use it with: fasttrain lab --tokenizer hf:OUT."""
    tok = train_bpe(list(train_files), vocab_size, out, min_frequency=min_frequency)
    click.echo(f"{out}: byte-level BPE, {tok.vocab_size} ids; train with: fasttrain lab --tokenizer hf:{out}")


__all__ = ["CharTokenizer", "HFTokenizer", "TiktokenTokenizer", "id_dtype", "load_tokenizer", "load_tokenizer_spec",
           "model_tokenizer", "save_tokenizer", "train_bpe", "command"]
