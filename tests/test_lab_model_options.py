"""The speedrun's architecture and schedule options as functions, on the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import model_options as mo  # noqa: E402


def test_qk_norm_gives_unit_rms_vectors():
    q, k = torch.randn(2, 3, 5, 8) * 7, torch.randn(2, 3, 5, 8) * 0.1
    nq, nk = mo.qk_norm(q, k)
    for t in (nq, nk):
        assert torch.allclose(t.square().mean(-1), torch.ones(2, 3, 5), atol=1e-3)   # eps 1e-6 against mean(k^2) = 0.01
    assert torch.allclose(nq / nq.norm(dim=-1, keepdim=True), q / q.norm(dim=-1, keepdim=True), atol=1e-6)


def test_relu_squared_and_softcap():
    x = torch.tensor([-2.0, 0.0, 3.0])
    assert mo.relu_squared(x).tolist() == [0.0, 0.0, 9.0]
    z = torch.tensor([-1e4, -1.0, 0.0, 0.5, 1e4])
    capped = mo.softcap(z, 30.0)
    assert capped.abs().max() <= 30.0 and capped[-1] > 29.99 and abs(capped[3] - 0.5) < 1e-4
    assert mo.softcap(z, 0) is z


def test_zero_output_projections_zero_exactly_those():
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList()
    for _ in range(2):
        block = torch.nn.Module()
        block.attn, block.mlp = torch.nn.Module(), torch.nn.Module()
        block.attn.proj, block.attn.qkv = torch.nn.Linear(4, 4), torch.nn.Linear(4, 12)
        block.mlp.down = torch.nn.Linear(8, 4)
        model.blocks.append(block)
    assert mo.zero_output_projections(model) == 4
    named = dict(model.named_parameters())
    assert all(not named[f"blocks.{i}.{n}.weight"].any() for i in range(2) for n in ("attn.proj", "mlp.down"))
    assert named["blocks.0.attn.qkv.weight"].any()
    with pytest.raises(FasttrainError, match="no parameter named"):
        mo.zero_output_projections(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("layers", [5, 6])
def test_unet_skips_feed_block_i_into_block_l_minus_1_minus_i(layers):
    seen = []

    class Record:
        def __init__(self, j):
            self.j = j

        def __call__(self, x):
            seen.append((self.j, x))
            return x * 0 + 10 ** self.j         # block j outputs 10^j: the inputs show which skips arrived

    weights = mo.unet_skip_weights(layers)
    assert weights.shape == (layers // 2,) and torch.all(weights == 1)
    with torch.no_grad():
        weights[0] = 2.0
    mo.unet_forward([Record(j) for j in range(layers)], torch.zeros(1), weights)
    inputs = {j: float(x.detach()) for j, x in seen}
    last = layers - 1
    assert inputs[last] == 10 ** (last - 1) + 2.0 * 10 ** 0          # block 0's output, weighted 2
    assert inputs[last - 1] == 10 ** (last - 2) + 10 ** 1
    if layers % 2:
        assert inputs[layers // 2] == 10 ** (layers // 2 - 1)         # the middle block: no skip
    with pytest.raises(FasttrainError, match="at least 2 layers"):
        mo.unet_skip_weights(1)


def test_ramp_grows_in_stages_and_ends_at_the_end():
    # stage s of 4 holds 64 + (256 - 64) s / 4 = 64, 112, 160, 208, rounded down to multiples of 64
    values = [mo.ramp(s, 64, 256, 100, multiple=64, stages=4) for s in range(0, 120, 10)]
    assert values == [64, 64, 64, 64, 64, 128, 128, 128, 192, 192, 256, 256]
    assert mo.ramp(5, 0, 256, 100) == 256 and mo.ramp(5, 64, 256, 0) == 256
    assert sorted({mo.ramp(s, 32, 256, 1000, multiple=32) for s in range(1001)}) == [32, 64, 128, 192, 256]


def test_the_gpt_takes_every_option_and_stays_unchanged_without_them():
    from fasttrain.lab.model import GPTConfig, build

    base = dict(layers=4, heads=2, hidden=16, ffn=32, vocab=11, seq=8, norm="layer", pos="learned", ffn_act="gelu",
                tied=True)
    plain = build(GPTConfig(**base), seed=0)
    names = {n for n, _ in plain.named_parameters()}
    model = build(GPTConfig(**base, qk_norm=True, zero_init_proj=True, unet_skips=True, logit_softcap=5.0), seed=0)
    assert {n for n, _ in model.named_parameters()} == names | {"skip_weights"}
    assert all(not p.any() for n, p in model.named_parameters() if n.endswith(("attn.proj.weight", "mlp.down.weight")))
    idx = torch.randint(0, 11, (3, 8))
    logits = model(idx)
    assert logits.abs().max() <= 5.0
    loss = model(idx, idx)
    loss.backward()
    assert model.skip_weights.grad is not None and model.blocks[0].attn.qkv.weight.grad is not None
    relu2 = build(GPTConfig(**{**base, "ffn_act": "relu2"}), seed=0)
    x = torch.randn(2, 8, 16)
    assert torch.equal(relu2.blocks[0].mlp(x), relu2.blocks[0].mlp.down(torch.relu(relu2.blocks[0].mlp.up(x)) ** 2))
    # the same seed draws the same weights with the options off: checkpoints and records are unchanged
    again = build(GPTConfig(**base), seed=0)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), again.parameters()))
    with pytest.raises(FasttrainError, match="U-net skips"):
        build(GPTConfig(**base, unet_skips=True, recompute="full"))


def test_the_lab_config_reaches_the_model(corpus):
    from fasttrain.lab.build import make_trainer
    from fasttrain.lab.config import preset

    cfg = preset("tiny", device="cpu", activation="relu2", qk_norm=True, zero_init_proj=True, unet_skips=True,
                 logit_softcap=30.0)
    c = make_trainer(cfg, corpus, torch.device("cpu")).model.config
    assert (c.ffn_act, c.qk_norm, c.zero_init_proj, c.unet_skips, c.logit_softcap) == ("relu2", True, True, True, 30.0)
    with pytest.raises(FasttrainError, match="unknown --activation"):
        preset("tiny", activation="tanh")
