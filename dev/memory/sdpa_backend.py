"""Which of torch's scaled-dot-product-attention kernels can take transformers' call, by dtype and head layout.

transformers' sdpa path passes ``enable_gqa=True`` (key/value heads not repeated) when there is no mask;
the kernels that accept grouped heads differ by dtype, so a fp32 GQA model may fall back to the math
kernel, which keeps the (b, heads, s, s) probabilities as eager attention does. Prints, per case, what
``torch.backends.cuda.can_use_{flash,efficient,cudnn}_attention`` answer (their reasons as warnings).

    python3 dev/memory/sdpa_backend.py
"""

import warnings

import torch
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_efficient_attention, can_use_flash_attention


def main() -> None:
    b, s, d = 4, 1024, 64
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads in ((16, 4), (16, 16)):
            q = torch.randn(b, heads, s, d, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(b, kv_heads, s, d, device="cuda", dtype=dtype, requires_grad=True)
            v = torch.randn(b, kv_heads, s, d, device="cuda", dtype=dtype, requires_grad=True)
            gqa = kv_heads != heads
            params = SDPAParams(q, k, v, None, 0.0, True, gqa)
            answers = {}
            for name, check in (("flash", can_use_flash_attention), ("efficient", can_use_efficient_attention),
                                ("cudnn", can_use_cudnn_attention)):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ok = check(params, True)
                answers[name] = "yes" if ok else "no: " + "; ".join(str(w.message)[:90] for w in caught)
            print(f"{str(dtype):15s} heads {heads} kv {kv_heads} enable_gqa={gqa}: {answers}", flush=True)


if __name__ == "__main__":
    main()
