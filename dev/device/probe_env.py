"""What the GPU machine's Python stack can do for the lab, in one short call (run it first in a session).

Prints the versions of the lab's libraries (carried wheels included), the GPU and its free memory, then
checks the two things the lab's Hugging Face path relies on: a transformers causal LM accepts
``labels`` with ``shift_labels`` (the lab passes targets already shifted), and liger-kernel's patches
train a bf16 step (the fused loss returns no logits). Run from the repository root:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site python3 dev/device/probe_env.py
"""

from __future__ import annotations

import importlib
import time

LIBRARIES = ("transformers", "tokenizers", "peft", "liger_kernel", "torchao", "safetensors", "scipy", "rich",
             "matplotlib")


def main() -> None:
    import torch

    start = time.perf_counter()
    for name in LIBRARIES:
        try:
            module = importlib.import_module(name)
            print(name, getattr(module, "__version__", "?"))
        except ImportError as exc:
            print(name, "missing:", exc)
    free, total = torch.cuda.mem_get_info()
    print(torch.__version__, torch.cuda.get_device_name(), f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")

    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config).cuda()
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    print("labels with shift_labels:", model(input_ids=ids, labels=ids, shift_labels=ids).loss.item())
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids, shift_labels=ids)
        out.loss.backward()
        print("liger bf16 step:", out.loss.item(), "logits kept:", out.logits is not None)
    except Exception as exc:  # noqa: BLE001 - a probe reports what fails and goes on
        print("liger failed:", repr(exc)[:300])
    print(f"probe {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
