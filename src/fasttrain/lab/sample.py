"""``fasttrain lab sample CHECKPOINT --prompt TEXT``: text from a model saved with ``--save``.

A Hugging Face checkpoint (``--model hf:...``) generates through ``transformers``' ``generate``,
encoding with the tokenizer saved beside it or, for a character corpus, its recorded characters.
The lab's own GPT checkpoint samples token by token here: logits of the last position over the
last ``context`` tokens (its learned positions stop there), divided by the temperature, softmax,
one draw; temperature 0 takes the most likely token.
"""

from __future__ import annotations

from pathlib import Path

import click

from fasttrain.errors import FasttrainError


class _Chars:
    """Character-level encoding over a checkpoint's recorded vocabulary."""

    def __init__(self, chars: str):
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.index})
        if unknown:
            raise FasttrainError(f"the prompt holds characters the model never saw ({''.join(unknown)!r}); use only "
                                 f"characters of its corpus")
        return [self.index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    @property
    def size(self) -> int:
        return len(self.chars)


def _check(prompt: str, max_new_tokens: int, temperature: float) -> None:
    if not prompt:
        raise FasttrainError("--prompt is empty; give the text to continue")
    if max_new_tokens < 1:
        raise FasttrainError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    if not temperature >= 0:
        raise FasttrainError(f"--temperature must be >= 0, got {temperature}")


def sample(checkpoint, prompt: str, *, max_new_tokens: int = 200, temperature: float = 1.0, seed: int = 0,
           device: str = "auto") -> str:
    """The prompt and its continuation of ``max_new_tokens`` tokens, as text."""

    import torch

    from fasttrain.lab import hf

    _check(prompt, max_new_tokens, temperature)
    path = Path(checkpoint)
    if not path.is_dir():
        raise FasttrainError(f"{path}: no such checkpoint folder; write one with fasttrain lab --save {path}")
    if device not in ("auto", "cpu", "cuda") and not str(device).startswith("cuda:"):
        raise FasttrainError(f"unknown --device {device!r}; use auto, cpu, cuda or cuda:N")
    if device != "auto" and device != "cpu" and not torch.cuda.is_available():
        raise FasttrainError(f"--device {device}: no CUDA GPU here; use --device cpu")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    if hf.is_hf_checkpoint(path):
        return _sample_hf(path, prompt, max_new_tokens, temperature, seed, dev)
    return _sample_gpt(path, prompt, max_new_tokens, temperature, seed, dev)


def _sample_hf(path, prompt, max_new_tokens, temperature, seed, dev) -> str:
    import torch

    from fasttrain.lab import hf

    model, meta = hf.load_hf_checkpoint(path, dev)
    tokenizer = hf.load_tokenizer(path)
    if tokenizer is not None:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        known = len(tokenizer)
        decode = lambda row: tokenizer.decode(row, skip_special_tokens=True)  # noqa: E731
    elif meta.get("chars"):
        chars = _Chars(meta["chars"])
        ids = torch.tensor([chars.encode(prompt)])
        known = chars.size
        decode = chars.decode
    else:
        raise FasttrainError(f"{path} holds no tokenizer and no recorded characters; save it with a tokenizer")
    base = hf.base_model_of(model)
    limit = hf.max_positions(base.config)
    if limit is not None and ids.shape[1] + max_new_tokens > limit:
        raise FasttrainError(f"the prompt ({ids.shape[1]} tokens) and --max-new-tokens {max_new_tokens} exceed the "
                             f"model's {limit} positions; lower --max-new-tokens to {max(limit - ids.shape[1], 0)}")
    vocab = base.config.vocab_size
    torch.manual_seed(seed)
    settings = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, use_cache=True,
                    pad_token_id=getattr(base.config, "pad_token_id", None) or 0)
    if temperature > 0:
        settings.update(temperature=temperature, top_k=0, top_p=1.0)
    if known < vocab:
        # rows of the output layer no token of the corpus maps to never win
        settings["suppress_tokens"] = list(range(known, vocab))
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(dev), attention_mask=torch.ones_like(ids).to(dev), **settings)
    return decode(out[0].tolist())


def _sample_gpt(path, prompt, max_new_tokens, temperature, seed, dev) -> str:
    import torch

    from fasttrain.lab.checkpoint import load_weights, read_checkpoint
    from fasttrain.lab.model import GPTConfig, build

    meta = read_checkpoint(path)
    chars = _vocabulary_of(meta, path)
    config = GPTConfig.from_dict(meta["model"])
    model = build(config, dev, seed=0)
    load_weights(model, path)
    model.eval()
    ids = torch.tensor([chars.encode(prompt)], device=dev)
    generator = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(ids[:, -config.seq:])[:, -1, :chars.size].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat((ids, nxt), dim=1)
    return chars.decode(ids[0].tolist())


class _Tokens:
    """A checkpoint's own tokenizer (BPE, tiktoken: saved beside the weights or named by the record)
    with the interface of :class:`_Chars`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    @property
    def size(self) -> int:
        return self.tokenizer.vocab_size


def _vocabulary_of(meta: dict, path):
    """What encodes a prompt for the lab GPT's checkpoint: its characters, else the tokenizer its
    record names (read from the checkpoint folder, where the run saved it)."""
    from fasttrain.lab.tokenizer import load_tokenizer

    if meta.get("chars"):
        return _Chars(meta["chars"])
    desc = (meta.get("data") or {}).get("tokenizer") if isinstance(meta.get("data"), dict) else None
    if not isinstance(desc, dict):
        raise FasttrainError(f"{path} records no vocabulary (chars) and no tokenizer; it cannot encode a prompt "
                             f"(save it again with this version: the tokenizer is saved beside the weights)")
    return _Tokens(load_tokenizer(desc, Path(path).expanduser()))


@click.command("sample")
@click.argument("checkpoint", type=click.Path())
@click.option("--prompt", required=True, help="Text to continue (in the checkpoint's vocabulary).")
@click.option("--max-new-tokens", type=int, default=200, show_default=True, help="Tokens to generate.")
@click.option("--temperature", type=float, default=1.0, show_default=True,
              help="Softmax temperature; 0 takes the most likely token.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the draws.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
def command(checkpoint, prompt, max_new_tokens, temperature, seed, device) -> None:
    """Generate text from a checkpoint written with --save (a HF model or the lab's GPT)."""
    from fasttrain.lab import noise

    noise.filter_known_noise()                  # before peft/torchao are imported
    text = sample(checkpoint, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                  device=device)
    click.echo(text)


__all__ = ["command", "sample"]
