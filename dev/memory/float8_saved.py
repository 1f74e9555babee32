"""What a per-block compiled Llama decoder layer keeps for backward, bf16 autocast vs torchao float8.

    python3 dev/memory/float8_saved.py [--hidden 256 --ffn 1024 --heads 8 --kv 2 --seq 64 --batch 2]
        [--recipes none,tensorwise,rowwise] [--device cpu|cuda] [--backend inductor|aot_eager]

Two-layer transformers Llama, each layer compiled alone (as the lab's ``--torch-compile-scope blocks``),
the Linear layers of the blocks converted with torchao's ``convert_to_float8_training`` (the lab's filter:
not the head), one forward under bf16 autocast counted with saved-tensor hooks (after a compiling step).
On the CPU, torchao's Float8Linear reads CUDA's autocast state only; it is pointed at the CPU's here so that
its input is cast to bf16 as on the GPU. Prints each saved tensor of layer 2 (dtype, shape, bytes per token).
"""

from __future__ import annotations

import argparse
import sys


def patch_float8_for_cpu_autocast():
    import torch
    from torchao.float8 import float8_linear as fl

    def forward(self, input):
        dev = input.device.type
        if torch.is_autocast_enabled(dev):
            input = input.to(torch.get_autocast_dtype(dev))
        out = fl.matmul_with_hp_or_float8_args.apply(input, self.weight.t(), self.linear_mm_config, self.config)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    fl.Float8Linear.forward = forward


def layer_saved(args, recipe: str):
    import torch
    import transformers

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.ffn,
                                   num_hidden_layers=2, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv, max_position_embeddings=args.seq,
                                   tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    model.to(args.device).train()
    if args.mixed:
        model.to(torch.bfloat16)           # bf16 weights, no autocast (the lab's FSDP2 param_dtype bf16: ``mixed``)
    if recipe != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from fasttrain.lab.parallelize import float8_filter

        if args.device == "cpu":
            patch_float8_for_cpu_autocast()
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=float8_filter)
    for layer in model.model.layers if args.backend != "none" else ():
        layer.compile(backend=args.backend)
    ids = torch.randint(0, 256, (args.batch, args.seq), device=args.device)
    seen = {}
    layer2 = model.model.layers[1]
    state = {"in": False}
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def pack(t):
        if state["in"]:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in seen and st.nbytes():
                seen[key] = (st.nbytes(), str(t.dtype).replace("torch.", ""), tuple(t.shape), key in skip)
        return t

    def pre(mod, a, k):
        state["in"] = True

    def post(mod, a, k, o):
        state["in"] = False

    layer2.register_forward_pre_hook(pre, with_kwargs=True)
    layer2.register_forward_hook(post, with_kwargs=True)

    def forward():
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=not args.mixed):
            return model(input_ids=ids, labels=ids, use_cache=False).loss

    forward().backward()
    seen.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()
    if args.graphs:
        print(torch._dynamo.utils.compile_times())
    return sorted(seen.values(), key=lambda v: -v[0])


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--recipes", default="none,tensorwise,rowwise")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="inductor", help="none: eager layers")
    p.add_argument("--graphs", action="store_true")
    p.add_argument("--mixed", action="store_true", help="bf16 weights without autocast")
    args = p.parse_args(argv)
    N = args.seq * args.batch
    for recipe in args.recipes.split(","):
        saved = layer_saved(args, recipe)
        total = sum(n for n, *_, param in saved if not param)
        print(f"== {recipe}: {total} bytes, {total / N:.2f} per token "
              f"(h {args.hidden}, f {args.ffn}, N {N})")
        for n, dtype, shape, param in saved:
            print(f"  {n / N:10.2f} B/token  {dtype:14s} {shape}{'  (a parameter)' if param else ''}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
