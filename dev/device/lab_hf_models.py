"""The two Hugging Face models of the GPU's `bench lab --model hf:` runs, written as config folders
(random init: no weights), and a byte-level BPE tokenizer trained here on Tiny Shakespeare, saved
beside each model (so a model's own tokenizer is found) and on its own.

    python3 dev/device/lab_hf_models.py WORKDIR [--vocab 8192]

WORKDIR/bpe/             the tokenizer (tokenizer.json + tokenizer_config.json: AutoTokenizer loads it)
WORKDIR/gpt2-124m/       GPT-2 small: 12 x 768, 12 heads, 1024 positions, vocabulary 50304
                         (50257 padded to 64; the tokenizer uses the first --vocab rows), tied: 124.5M
WORKDIR/llama-0.5b/      Llama: 16 x 1536, 12 heads over 4 key/value heads (head 128), SwiGLU 4096,
                         vocabulary 32000, untied, 2048 positions: 0.50B
Prints each model's parameter count (built on the meta device: nothing allocated).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def train_tokenizer(text_file: Path, vocab: int, folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train([str(text_file)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return fast


def main() -> None:
    import torch
    import transformers as tf

    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    data = Path(os.environ.get("FASTTRAIN_DATA_DIR", ".data")) / "tinyshakespeare" / "input.txt"
    if not data.is_file():
        raise SystemExit(f"{data}: Tiny Shakespeare not found (set FASTTRAIN_DATA_DIR)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(data, args.vocab, args.workdir / "bpe")
    print(f"bpe: {len(tok)} tokens, {len(tok(data.read_text()).input_ids):,} tokens in the corpus")
    configs = {
        "gpt2-124m": tf.GPT2Config(vocab_size=50304, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id),
        "llama-0.5b": tf.LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                                     num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                                     tie_word_embeddings=False, bos_token_id=tok.eos_token_id,
                                     eos_token_id=tok.eos_token_id),
    }
    for name, config in configs.items():
        folder = args.workdir / name
        config.save_pretrained(folder)
        tok.save_pretrained(folder)
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
        print(f"{name}: {config.model_type}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
              f"-> {folder}")


if __name__ == "__main__":
    main()
