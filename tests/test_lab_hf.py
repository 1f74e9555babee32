"""Hugging Face causal LMs in the lab (``fasttrain.lab.hf``), on the CPU with tiny configs the tests
write: Llama, GPT-2 and Qwen2 shapes of 2 layers, width 32-64, vocabularies of 100-300. No hub."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import hf  # noqa: E402
from fasttrain.lab.config import LabConfig, validate  # noqa: E402
from fasttrain.lab.models import forward_logits, forward_loss  # noqa: E402

FAMILIES = ("llama", "gpt2", "qwen2")


def write_config(folder: Path, family: str, vocab: int = 120, **kw) -> Path:
    """A tiny config.json of ``family`` (no weights) in ``folder``."""
    if family == "llama":
        c = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
    elif family == "gpt2":
        c = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    elif family == "qwen2":
        c = transformers.Qwen2Config(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     tie_word_embeddings=True, **kw)
    # families liger has no patch for (its fused cross-entropy alone reaches them through the lab's forward): an
    # untied head, a head with a bias, and a head whose logits the model scales
    elif family == "gpt_neox":
        c = transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
                                       hidden_dropout=0.0, attention_dropout=0.0, **kw)
    elif family == "phi":
        c = transformers.PhiConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attention_dropout=0.0, **kw)
    elif family == "cohere":
        c = transformers.CohereConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      logit_scale=0.0625, **kw)
    else:
        raise ValueError(family)
    c.save_pretrained(folder)
    return folder


def cfg(**kw) -> LabConfig:
    return LabConfig(**{"device": "cpu", "context": 16, "seed": 7, **kw})


def batch(vocab=100, b=2, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_is_the_models_own_path_and_equals_cross_entropy(tmp_path, family):
    write_config(tmp_path, family)
    m = hf.build_hf_model(f"hf:{tmp_path}", cfg(), 100, "cpu")
    assert m.family == family and m.vocab_size == 120 and m.context == 64
    x, y = batch()
    loss = forward_loss(m, m.module, x, y)
    logits = forward_logits(m, m.module, x)
    manual = F.cross_entropy(logits.float().reshape(-1, 120), y.reshape(-1))
    torch.testing.assert_close(loss, manual, rtol=1e-5, atol=1e-6)
    # every target counts: the last position's target changes the loss (labels alone would drop it)
    y2 = y.clone()
    y2[:, -1] = (y2[:, -1] + 1) % 100
    assert forward_loss(m, m.module, x, y2).item() != pytest.approx(loss.item(), abs=1e-7)
    loss.backward()
    assert all(p.grad is not None for p in m.module.parameters() if p.requires_grad)


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    write_config(tmp_path, "llama")
    a = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu").module.state_dict()
    b = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu").module.state_dict()
    c = hf.build_hf_model(f"hf:{tmp_path}", cfg(seed=8), None, "cpu").module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_a_model_from_its_config_is_drawn_by_its_own_initializers(tmp_path):
    """Without weights, the model is built with its matrices on the meta device and drawn by its own
    initialize_weights from the seed: transformers' initialization in distribution (the values of a plain
    from_config differ: it also draws the layers' construction init first), the same whatever the generator held
    before, GPT-2's residual projections at 0.02 / sqrt(2 L)."""
    import math

    for family in ("llama", "gpt2"):
        folder = write_config(tmp_path / family, family, vocab=300)
        torch.manual_seed(123)
        mine = {n: p.detach() for n, p in hf.build_hf_model(f"hf:{folder}", cfg(), None, "cpu").module.named_parameters()}
        again = {n: p.detach() for n, p in hf.build_hf_model(f"hf:{folder}", cfg(), None, "cpu").module.named_parameters()}
        torch.manual_seed(cfg().seed)
        plain = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
        differ = 0
        for name, w in plain.named_parameters():
            w = w.detach()
            assert torch.equal(mine[name], again[name]), name
            if w.dim() < 2:                     # norms' ones, biases' zeros: the same rule, the same values
                assert torch.equal(mine[name], w), name
                continue
            std = 0.02 / (math.sqrt(2 * 2) if family == "gpt2" and name.endswith("c_proj.weight") else 1)
            assert float(mine[name].std()) == pytest.approx(std, rel=0.2), name
            assert float(w.std()) == pytest.approx(std, rel=0.2), name
            assert abs(float(mine[name].mean())) < 4 * std / math.sqrt(w.numel()), name
            differ += not torch.equal(mine[name], w)
        assert differ > 0


@pytest.mark.parametrize("family,extra", [("llama", {}), ("gpt2", {}), ("qwen2", {}), ("llama", {"pad_token_id": 3})],
                         ids=["llama", "gpt2", "qwen2-tied", "llama-padding-row"])
def test_fsdp_shards_a_meta_build_and_draws_the_one_process_weights(tmp_path, monkeypatch, family, extra):
    """Under FSDP a model without weights is built with its matrices on the meta device, sharded, then drawn shard
    by shard: exactly the one-process build's weights and buffers, ties kept, the generator left where that build
    leaves it (one process here; two in the slow test below)."""
    from fasttrain.lab.build import meta_build_for
    from fasttrain.lab.config import preset
    from fasttrain.lab.parallel import distributed as D
    from tests_support import one_rank_world

    folder = write_config(tmp_path / family, family, **extra)
    with one_rank_world(monkeypatch) as world:
        ref, mine, rng = _one_process_and_sharded(folder, world)
    assert rng
    for name, w in ref.named_parameters():
        assert torch.equal(mine[name], w), name
    assert not meta_build_for(preset("tiny", model=f"hf:{folder}", device="cpu"), D.World(strategy="ddp"))


def _one_process_and_sharded(folder, world):
    """The one-process build of ``folder``'s model and its meta build sharded over ``world`` (weights gathered
    whole; ties kept), and whether the generator ends in the same state after both."""
    from fasttrain.lab.config import preset
    from tests_support import meta_build_beside_one_process

    cfg = preset("tiny", model=f"hf:{folder}", device=world.device.split(":")[0], context=16)
    ref, sharded, mine, rng = meta_build_beside_one_process(cfg, 100, world)
    if getattr(ref.config, "tie_word_embeddings", False):
        assert sharded.get_output_embeddings().weight is sharded.get_input_embeddings().weight
    return ref, mine, rng


@pytest.mark.gpu
def test_liger_fused_head_on_a_meta_build_under_fsdp_trains_the_one_process_models_loss_on_the_gpu(tmp_path,
                                                                                                  monkeypatch):
    """liger's head goes on before ``fully_shard`` draws the weights (the stated order), so its check runs while the
    matrices are on the meta device (on a small instance of the class): the sharded Llama then gives the one-process
    plain model's loss and gradients' norm. (Before the check knew the meta device, every FSDP run from scratch with
    the fused head stopped at ``Tensor.item()`` on meta tensors.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("liger_kernel")
    from fasttrain.lab.config import preset
    from tests_support import meta_build_beside_one_process, one_rank_world

    folder = write_config(tmp_path / "llama", "llama")
    fused = preset("tiny", model=f"hf:{folder}", device="cuda", context=16, use_liger_kernel=True,
                   liger_kernels="fused_linear_cross_entropy")
    with one_rank_world(monkeypatch, device="cuda") as world:
        ref, sharded, _, _ = meta_build_beside_one_process(fused, 100, world)
        assert "forward" in vars(sharded)                  # the fused head is this instance's
        x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
        ref.train(), sharded.train()
        own, got = ref(input_ids=x, labels=x).loss, sharded(input_ids=x, labels=x).loss
        own.backward(), got.backward()
        torch.testing.assert_close(got, own, rtol=1e-4, atol=1e-5)
        norm = lambda m: torch.stack([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)  # noqa: E731
                                      .float().norm() for p in m.parameters()]).norm()
        torch.testing.assert_close(norm(sharded), norm(ref), rtol=1e-3, atol=1e-5)


def test_weights_in_the_folder_are_loaded_and_said(tmp_path):
    write_config(tmp_path / "cfg", "gpt2")
    lines = []
    m = hf.build_hf_model(f"hf:{tmp_path / 'cfg'}", cfg(seed=3), None, "cpu", log=lines.append)
    assert "initialized from config.json" in lines[0]
    m.module.save_pretrained(tmp_path / "w")
    lines.clear()
    again = hf.build_hf_model(f"hf:{tmp_path / 'w'}", cfg(seed=99), None, "cpu", log=lines.append)
    assert "weights loaded" in lines[0]
    sd = m.module.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in again.module.state_dict().items())
    assert next(again.module.parameters()).dtype == torch.float32


def test_bf16_config_dtype_still_trains_fp32_master_weights(tmp_path):
    write_config(tmp_path, "qwen2", dtype="bfloat16")
    m = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu")
    assert {p.dtype for p in m.module.parameters()} == {torch.float32}


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_forward_backward(tmp_path, family):
    write_config(tmp_path, family)
    m = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu")
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = forward_loss(m, m.module, x, y)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in m.module.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_and_sdpa_give_the_same_function(tmp_path, family):
    write_config(tmp_path, family)
    eager = hf.build_hf_model(f"hf:{tmp_path}", cfg(attn_implementation="eager"), None, "cpu")
    sdpa = hf.build_hf_model(f"hf:{tmp_path}", cfg(attn_implementation="sdpa"), None, "cpu")
    assert eager.module.config._attn_implementation == "eager"
    assert sdpa.module.config._attn_implementation == "sdpa"
    x, y = batch()
    torch.testing.assert_close(forward_loss(eager, eager.module, x, y), forward_loss(sdpa, sdpa.module, x, y),
                               rtol=1e-5, atol=1e-5)


def trainer_for(folder, **kw):
    """The lab's trainer of the HF model in ``folder`` (a 65-symbol corpus stands in)."""
    from types import SimpleNamespace

    import numpy as np

    from fasttrain.lab.trainer import Trainer

    ids = np.arange(400, dtype=np.int64) % 65
    data = SimpleNamespace(train=ids, val=ids, vocab_size=65, chars=None)
    c = cfg(**kw)
    return Trainer(c, hf.build_hf_model(f"hf:{folder}", c, 65, "cpu"), data, torch.device("cpu"))


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_full_checkpointing_is_the_models_own_and_keeps_gradients(tmp_path, family):
    write_config(tmp_path, family)
    plain = trainer_for(tmp_path)
    ckpt = trainer_for(tmp_path, gradient_checkpointing="full")
    def on(module):     # (transformers 5.2x renamed it activation checkpointing)
        return getattr(module, "is_activation_checkpointing", None) or module.is_gradient_checkpointing

    assert on(ckpt.model) and not on(plain.model)
    x, y = batch(vocab=65)
    for t in (plain, ckpt):
        t.forward_backward_step([(x, y)])
    for (name, a), b in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_selective_checkpointing_is_refused_in_one_line(tmp_path):
    write_config(tmp_path, "llama")
    with pytest.raises(FasttrainError, match="selective.*use --gradient-checkpointing full"):
        hf.build_hf_model(f"hf:{tmp_path}", cfg(gradient_checkpointing="selective"), None, "cpu")


@pytest.mark.parametrize("family,path", [("llama", "model.layers"), ("gpt2", "transformer.h"),
                                         ("qwen2", "model.layers")])
def test_blocks_are_the_decoder_layers(tmp_path, family, path):
    write_config(tmp_path, family)
    m = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu")
    expected = m.module.get_submodule(path)
    assert m.blocks(m.module) is expected and len(expected) == 2
    lora = trainer_for(tmp_path, lora_r=2)                           # with LoRA's wrappers inside
    assert len(lora.lab_model.blocks(lora.model)) == 2
    prompt = hf.build_hf_model(f"hf:{tmp_path}", cfg(prompt_tuning_tokens=2), None, "cpu")   # through peft's model
    assert len(prompt.blocks(prompt.module)) == 2


@pytest.mark.slow           # a first inductor compile in the process: 30-50 s of CPU on a cold cache
def test_compile_per_block_gives_the_same_loss(tmp_path):
    write_config(tmp_path, "llama")
    plain = trainer_for(tmp_path)
    blocks = trainer_for(tmp_path, torch_compile=True, torch_compile_scope="blocks")
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks.lab_model.blocks(blocks.model))
    x, y = batch(vocab=65)
    assert blocks.forward_backward_step([(x, y)]).item() == pytest.approx(plain.forward_backward_step([(x, y)]).item(),
                                                                       rel=1e-5)


@pytest.mark.parametrize("family,targets", [("llama", ("q_proj", "v_proj")), ("gpt2", ("c_attn",)),
                                            ("qwen2", ("q_proj", "v_proj"))])
def test_lora_default_targets_per_family_and_merge_on_save(tmp_path, family, targets):
    from fasttrain.lab.adapters import merge_lora

    write_config(tmp_path / "cfg", family)
    trainer = trainer_for(tmp_path / "cfg", lora_r=4)
    assert trainer.lab_model.lora_targets == targets
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == set(targets)
    # move B off zero so the adapter changes the function, then merge and save
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    x, y = batch(vocab=65)
    trainer.model.eval()
    with torch.no_grad():
        expected = forward_logits(trainer.lab_model, trainer.model, x)
    hf.save_hf(merge_lora(trainer.model), tmp_path / "saved", lab={"lora_r": 4}, extra={"val_loss": 1.5})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, expected, rtol=1e-4, atol=1e-5)
    meta = json.loads((tmp_path / "saved" / "fasttrain.json").read_text())
    assert meta["val_loss"] == 1.5 and meta["lab"] == {"lora_r": 4} and hf.is_hf_checkpoint(tmp_path / "saved")


def test_lora_targets_in_the_models_own_names(tmp_path):
    write_config(tmp_path, "llama")
    trainer = trainer_for(tmp_path, lora_r=2, lora_target_modules=("o_proj", "down_proj"))
    trainable = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in trainer.model.named_parameters()
                 if p.requires_grad}
    assert trainable == {"o_proj", "down_proj"}
    with pytest.raises(FasttrainError, match="unknown --lora-target-modules c_attn.*q_proj"):
        trainer_for(tmp_path, lora_r=2, lora_target_modules=("c_attn",))


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_prompt_tuning_trains_the_prompt_only_and_scores_real_positions(tmp_path, family):
    write_config(tmp_path / "cfg", family)
    m = hf.build_hf_model(f"hf:{tmp_path / 'cfg'}", cfg(prompt_tuning_tokens=3), None, "cpu")
    trainable = [(n, p) for n, p in m.module.named_parameters() if p.requires_grad]
    assert len(trainable) == 1 and trainable[0][1].shape == (3, 32)
    assert trainer_for(tmp_path / "cfg", prompt_tuning_tokens=3).trainable[0].shape == (3, 32)
    x, y = batch()
    logits = forward_logits(m, m.module, x)
    assert logits.shape == (2, 16, 120)
    loss = forward_loss(m, m.module, x, y)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 120), y.reshape(-1)), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert trainable[0][1].grad is not None
    # saved: the base loads with from_pretrained; the prompt comes back with the checkpoint
    hf.save_hf(m.module, tmp_path / "saved")
    again, meta = hf.load_hf_checkpoint(tmp_path / "saved")
    assert meta["prompt_tuning_tokens"] == 3
    m.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf.hf_logits(again, x), forward_logits(m, m.module, x), rtol=1e-5, atol=1e-5)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")


def test_save_is_whole_or_absent_and_replaces_an_old_checkpoint(tmp_path):
    write_config(tmp_path / "cfg", "gpt2")
    m = hf.build_hf_model(f"hf:{tmp_path / 'cfg'}", cfg(), None, "cpu")
    hf.save_hf(m.module, tmp_path / "out", extra={"val_loss": 2.0})
    hf.save_hf(m.module, tmp_path / "out", extra={"val_loss": 1.0})
    assert hf.read_hf_checkpoint(tmp_path / "out")["val_loss"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg", "out"]      # no temporary folders left


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(FasttrainError, match="no such folder"):
        hf.build_hf_model(f"hf:{tmp_path / 'missing'}", cfg(), None, "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FasttrainError, match="has no config.json"):
        hf.build_hf_model(f"hf:{tmp_path / 'empty'}", cfg(), None, "cpu")
    write_config(tmp_path / "unknown", "llama")
    raw = json.loads((tmp_path / "unknown" / "config.json").read_text())
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({**raw, "model_type": "no-such-family"}))
    with pytest.raises(FasttrainError, match="unknown model_type 'no-such-family'"):
        hf.build_hf_model(f"hf:{tmp_path / 'unknown'}", cfg(), None, "cpu")
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "config.json").write_text("{oops")
    with pytest.raises(FasttrainError, match="is not valid JSON"):
        hf.build_hf_model(f"hf:{tmp_path / 'notjson'}", cfg(), None, "cpu")
    with pytest.raises(FasttrainError, match="after 'hf:'"):
        hf.build_hf_model("hf:", cfg(), None, "cpu")
    write_config(tmp_path / "ok", "llama")
    with pytest.raises(FasttrainError, match="corpus has 500 symbols.*vocabulary of 120"):
        hf.build_hf_model(f"hf:{tmp_path / 'ok'}", cfg(), 500, "cpu")
    with pytest.raises(FasttrainError, match="--context 128 exceeds.*64 positions"):
        hf.build_hf_model(f"hf:{tmp_path / 'ok'}", LabConfig(device="cpu", context=128), None, "cpu")


def test_hub_name_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(hf.config, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(FasttrainError, match="hub cannot be reached.*local folder") as info:
        hf.build_hf_model("hf:someone/some-model", cfg(), None, "cpu")
    assert "\n" not in str(info.value)
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")        # the hub's own offline switch is honoured without a probe
    assert hf.config._hub_reachable() is False
    with pytest.raises(FasttrainError, match="no such folder; give a folder"):
        hf.build_hf_model("hf:./not/here", cfg(), None, "cpu")


def test_liger_is_refused_on_the_cpu_and_for_families_it_does_not_patch(tmp_path):
    pytest.importorskip("liger_kernel")
    write_config(tmp_path / "llama", "llama")
    with pytest.raises(FasttrainError, match="needs a CUDA GPU"):
        hf.build_hf_model(f"hf:{tmp_path / 'llama'}", cfg(use_liger_kernel=True), None, "cpu")
    assert {"llama", "qwen2", "mistral", "gemma", "phi3"} <= hf.liger_families()
    assert "gpt2" not in hf.liger_families()
    config, _ = hf.load_hf_config(f"hf:{write_config(tmp_path / 'gpt2', 'gpt2')}")
    with pytest.raises(FasttrainError, match="no patches for model_type 'gpt2'"):
        hf.check_hf_setup(cfg(use_liger_kernel=True), config, None, "cuda")


def test_tensor_parallel_is_refused_in_one_line_for_a_family_without_a_plan(tmp_path):
    spec = f"hf:{write_config(tmp_path, 'gpt2')}"
    hf.check_hf_parallel("ddp", spec)
    with pytest.raises(FasttrainError, match="--strategy tp: the gpt2 model ships no tensor-parallel plan"):
        hf.check_hf_parallel("tp", spec)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("llama", "qwen2"))
def test_liger_fused_loss_equals_the_plain_loss_on_the_gpu(tmp_path, family):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("liger_kernel")
    write_config(tmp_path, family)
    x, y = (t.cuda() for t in batch())
    plain = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cuda")
    plain.module.train()
    expected = forward_loss(plain, plain.module, x, y).item()       # before liger patches the class
    liger = hf.build_hf_model(f"hf:{tmp_path}", cfg(use_liger_kernel=True), None, "cuda")
    # the patch swaps the instance's modules and forwards in place (its class name stays transformers')
    assert "Liger" in repr(liger.module.model.norm)
    liger.module.train()
    loss = forward_loss(liger, liger.module, x, y)
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    loss.backward()


# --- through the lab: fasttrain lab --model hf:DIR ------------------------------------------------

def lab_cfg(folder, **kw):
    from fasttrain.lab.config import preset

    base = dict(model=f"hf:{folder}", max_steps=6, eval_tokens=256, eval_interval=0, log_interval=1,
                timing_warmup_steps=1, device="cpu", context=16, per_device_train_batch_size=4, warmup_steps=1)
    return preset("tiny", **{**base, **kw})


def losses(record):
    return [p["loss"] for p in record["loss_curve"]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-configs")
    return {family: write_config(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_through_the_lab_and_techniques_keep_the_function(folders, corpus, family):
    from fasttrain.lab.train import run

    folder = folders[family]
    base = run(lab_cfg(folder), corpus=corpus)
    assert base["model_source"]["name"] == f"hf:{folder}" and base["model_source"]["family"] == family
    assert base["model"]["model_type"] == family
    assert base["params"]["total"] == base["params"]["trainable"] > 0
    assert losses(base)[-1] < losses(base)[0]                       # it learns
    assert base["estimate"]["precise_bytes"] > 0 and "error" not in base["estimate"]   # the HF config's estimate
    # the same function, other kernels / schedules of the same sums
    same = {"sdpa": dict(attn_implementation="sdpa"), "checkpointing": dict(gradient_checkpointing="full"),
            "accumulation": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)}
    for name, kw in same.items():
        rec = run(lab_cfg(folder, **kw), corpus=corpus)
        assert losses(rec) == pytest.approx(losses(base), rel=2e-4), name
    # bf16 autocast and Muon (which finds the family's decoder layers): they train, finite and falling
    for kw in (dict(bf16=True), dict(optim="muon")):
        rec = run(lab_cfg(folder, max_steps=8, **kw), corpus=corpus)
        assert all(np.isfinite(losses(rec))) and losses(rec)[-1] < losses(rec)[0], kw


def test_model_independent_techniques_through_the_lab(folders, corpus):
    """Data loading, the allocator and the batch finder do not look inside the model: one family."""
    from fasttrain.lab.train import run

    folder = folders["llama"]
    base = run(lab_cfg(folder), corpus=corpus)
    for kw in (dict(preload=True), dict(torch_empty_cache_steps=1), dict(auto_find_batch_size=True)):
        assert losses(run(lab_cfg(folder, **kw), corpus=corpus)) == pytest.approx(losses(base), rel=2e-4), kw
    for kw in (dict(optim="adafactor"), dict(optim="sgd", learning_rate=0.5), dict(optim="adamw_torch_fused")):
        rec = run(lab_cfg(folder, max_steps=8, **kw), corpus=corpus)
        assert all(np.isfinite(losses(rec))) and losses(rec)[-1] < losses(rec)[0], kw


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_through_the_lab(folders, corpus, family):
    from fasttrain.lab.train import run

    lora = run(lab_cfg(folders[family], lora_r=2), corpus=corpus)
    prompt = run(lab_cfg(folders[family], prompt_tuning_tokens=4), corpus=corpus)
    assert 0 < lora["params"]["trainable"] < lora["params"]["total"]
    width = 48 if family == "qwen2" else 32
    assert prompt["params"]["trainable"] == 4 * width
    assert all(np.isfinite(losses(lora) + losses(prompt)))
    # the estimator models both (fasttrain.memory.hf_config): LoRA on the modules the trainer adapted, in the
    # model's own names, and the soft prompt
    for rec in (lora, prompt):
        assert rec["estimate"]["precise_bytes"] > 0 and "error" not in rec["estimate"], rec["estimate"]
    assert lora["estimate"]["setup"]["lora_targets"] == list(hf.LORA_TARGETS[family])
    assert lora["estimate"]["setup"]["lora_rank"] == 2 and prompt["estimate"]["setup"]["prompt_tokens"] == 4


def test_peft_of_a_pretrained_folder_carries_an_estimate(tmp_path, corpus):
    """The technique table's rows: a checkpoint folder (config.json + weights), LoRA on named modules and a
    soft prompt; the lab's record carries the estimator's prediction for each."""
    from fasttrain.lab.train import run
    from fasttrain.memory import estimate
    from fasttrain.memory.hf_config import setup_from_hf_config

    folder = write_config(tmp_path / "llama", "llama")
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    assert hf.has_weights(folder)
    config = json.loads((folder / "config.json").read_text())
    for kw, setup_kw in ((dict(lora_r=8, lora_target_modules=("q_proj", "o_proj")),
                          dict(lora_rank=8, lora_targets=("q_proj", "o_proj"))),
                         (dict(prompt_tuning_tokens=4), dict(prompt_tokens=4))):
        rec = run(lab_cfg(folder, max_steps=2, **kw), corpus=corpus)
        assert "error" not in rec["estimate"], rec["estimate"]
        expected = estimate(setup_from_hf_config(config, micro_batch=4, seq=16, attention="eager", optim="adamw_torch",
                                                 **setup_kw), "precise")
        assert rec["estimate"]["precise_bytes"] == expected.total
        assert rec["params"]["trainable"] == expected.extra["trainable_params"]


@pytest.mark.slow
def test_compile_through_the_lab(folders, corpus):
    from fasttrain.lab.train import run

    base = run(lab_cfg(folders["llama"], max_steps=2), corpus=corpus)
    compiled = run(lab_cfg(folders["llama"], max_steps=2, torch_compile=True), corpus=corpus)
    assert losses(compiled) == pytest.approx(losses(base), rel=1e-4)


@pytest.mark.parametrize("family,extra", [("llama", {}), ("gpt2", {"lora_r": 2}),
                                          ("qwen2", {"prompt_tuning_tokens": 3})])
def test_save_loads_with_from_pretrained_and_lab_eval_rescores(folders, corpus, tmp_path, family, extra):
    from fasttrain.lab.evaluate import evaluate_checkpoint
    from fasttrain.lab.train import run

    out = tmp_path / "saved"
    rec = run(lab_cfg(folders[family], save=str(out), **extra), corpus=corpus)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.model_type == family
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    meta = hf.read_hf_checkpoint(out)
    assert meta["val_loss"] == rec["final"]["val_loss"] and meta["lab"]["model"] == f"hf:{folders[family]}"
    again = evaluate_checkpoint(out, device="cpu", corpus=corpus)
    if extra.get("lora_r"):     # merged weights: the same function up to rounding
        assert again["val_loss"] == pytest.approx(rec["final"]["val_loss"], rel=1e-5)
    else:
        assert again["val_loss"] == rec["final"]["val_loss"]
    # the saved folder is a model to train on: --model hf:SAVED loads its weights
    from fasttrain.lab.build import build_model

    lines = []
    build_model(lab_cfg(out), corpus.vocab_size, torch.device("cpu"), log=lines.append)
    assert "weights loaded" in lines[0]


@pytest.mark.slow
def test_cli_trains_saves_evaluates_and_samples(folders, tmp_path, shakespeare_dir):
    from tests_support import fasttrain_cli

    ck = tmp_path / "ck"
    res = fasttrain_cli("lab", "--preset", "tiny", "--model", f"hf:{folders['gpt2']}", "--max-steps", "4",
                        "--device", "cpu", "--eval-tokens", "256", "--context", "16", "--save", ck, "--out",
                        tmp_path / "run.json", "--quiet")
    assert res.returncode == 0, res.stderr[-2000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["config"]["model"] == f"hf:{folders['gpt2']}"
    ev = fasttrain_cli("lab", "eval", ck, "--device", "cpu")
    assert ev.returncode == 0 and "(identical)" in ev.stdout, ev.stderr[-2000:]
    sample = fasttrain_cli("lab", "sample", ck, "--prompt", "ROMEO:", "--max-new-tokens", "8", "--device", "cpu")
    assert sample.returncode == 0 and sample.stdout.startswith("ROMEO:"), sample.stderr[-2000:]


@pytest.mark.parametrize("args,message", [
    (["--model", "bert"], "unknown --model 'bert'"),
    (["--model", "hf:/no/such/folder"], "no such folder"),
    (["--model", "hf:{folder}", "--gradient-checkpointing", "selective"], "transformers checkpoints whole"),
    (["--model", "hf:{folder}", "--init-from", "x"], "--init-from loads the lab GPT"),
    (["--model", "hf:{folder}", "--context", "1000"], "exceeds the llama model's 64 positions"),
    (["--model", "hf:{gpt2}", "--strategy", "tp", "--nproc-per-node", "2"], "gpt2 model ships no tensor-parallel"),
    (["--model", "hf:{folder}", "--strategy", "tp", "--nproc-per-node", "3"],
     r"num_attention_heads\) \(4\) divisible by 3"),
])
def test_cli_bad_input_is_one_line(folders, tmp_path, args, message, fake_corpus):
    from tests_support import fasttrain_in_process, one_line_error

    # (GPT-2's default bos/eos id 50256 lies outside the tiny vocabulary: transformers would warn on load)
    gpt2 = write_config(tmp_path / "gpt2", "gpt2", bos_token_id=0, eos_token_id=0)
    args = [a.replace("{folder}", str(folders["llama"])).replace("{gpt2}", str(gpt2)) for a in args]
    # in this process, on the toy corpus: the refusal comes before any data is needed (a fresh machine has none)
    one_line_error(fasttrain_in_process("lab", "--preset", "tiny", "--device", "cpu", "--max-steps", "1", *args), message)


# --- several processes (gloo on the CPU) ---------------------------------------------------------

def _join_local_job(rank: int, port: int, world: int = 2):
    """A spawned worker's rank of a ``world``-process job on this machine; returns the toy corpus it trains on."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from tests_support import toy_text
    from fasttrain.lab.data import corpus_from_text

    return corpus_from_text(toy_text())


def _dist_worker(rank: int, port: int, folder: str, out_dir: str) -> None:
    import os

    from fasttrain.lab.parallel import distributed as D
    from fasttrain.lab.train import run

    corpus = _join_local_job(rank, port)
    torch.set_num_threads(1)
    group = D.init_world(D.ParallelConfig(strategy="ddp", ddp_timeout=60), device="cpu")
    records = {}
    for strategy in ("ddp", "fsdp"):
        parallel = D.ParallelConfig(strategy=strategy, global_batch_size=8)
        records[strategy] = run(lab_cfg(folder, max_steps=3, save=os.path.join(out_dir, strategy)), corpus=corpus,
                                parallel=parallel)
    if rank == 0:
        with open(os.path.join(out_dir, "records.json"), "w") as f:
            json.dump({k: losses(v) for k, v in records.items()}, f)
    group.owns_group = True
    D.shutdown(group)


@pytest.mark.slow
def test_ddp_and_fsdp_in_two_processes_train_the_same_function_as_one(folders, corpus, tmp_path):
    import socket

    import torch.multiprocessing as mp

    from fasttrain.lab.train import run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_dist_worker, args=(port, str(folders["llama"]), str(tmp_path)), nprocs=2, start_method="spawn")
    two = json.loads((tmp_path / "records.json").read_text())
    one = losses(run(lab_cfg(folders["llama"], max_steps=3, per_device_train_batch_size=8), corpus=corpus))
    for strategy in ("ddp", "fsdp"):
        assert two[strategy] == pytest.approx(one, rel=1e-5), strategy
        # FSDP's shards gathered into one folder from_pretrained loads
        assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / strategy).config.model_type == "llama"


def _meta_worker(rank: int, port: int, folders: dict, out: str, device: str = "cpu", offload: bool = False) -> None:
    from fasttrain.lab.parallel import distributed as D

    _join_local_job(rank, port)
    torch.set_num_threads(1)
    world = D.init_world(D.ParallelConfig(strategy="fsdp", ddp_timeout=60, offload_optimizer=offload), device=device)
    differ = {}
    for name, folder in folders.items():
        ref, mine, rng = _one_process_and_sharded(folder, world)
        differ[name] = [n for n, w in ref.named_parameters() if not torch.equal(mine[n], w)] + ([] if rng else ["rng"])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(differ, f)
    world.owns_group = True
    D.shutdown(world)


def _meta_in_two_processes(folders, tmp_path, device: str = "cpu", offload: bool = False) -> dict:
    """The meta build of every tiny family (and a Llama with a padding row) sharded over 2 processes: per model,
    the parameters whose gathered shards differ from the one-process build (and "rng" if the generator does)."""
    import socket

    import torch.multiprocessing as mp

    padded = write_config(tmp_path / "padded", "llama", pad_token_id=3)
    cases = {**{k: str(v) for k, v in folders.items()}, "llama-padding-row": str(padded)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "differ.json"
    mp.start_processes(_meta_worker, args=(port, cases, str(out), device, offload), nprocs=2, start_method="spawn")
    differ = json.loads(out.read_text())
    assert set(differ) == set(cases)
    return differ


@pytest.mark.slow
def test_fsdp_over_two_processes_draws_the_one_process_weights_shard_by_shard(folders, tmp_path):
    """The meta build sharded over 2 gloo processes (each matrix's rows split, a padding row on one rank only):
    every rank's shards gathered are the one-process build's weights."""
    differ = _meta_in_two_processes(folders, tmp_path)
    assert differ == {name: [] for name in differ}


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_fsdp_on_two_gpus_draws_the_one_process_weights_shard_by_shard(folders, tmp_path, offload):
    """The same on 2 GPUs (NCCL; the CUDA generator); with --offload-optimizer the shards live in host memory
    while the draws stay on the GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    differ = _meta_in_two_processes(folders, tmp_path, "cuda", offload)
    assert differ == {name: [] for name in differ}


# qwen3: per-head q/k norms on split heads (their gradients summed over the ranks), over 2 micro-batches;
# qwen2: with its decoder layers recomputed in backward
TP_EXTRA = {"qwen3": {"gradient_accumulation_steps": 2}, "qwen2": {"gradient_checkpointing": "full"}}


def _tp_worker(rank: int, port: int, folders: dict, out_dir: str) -> None:
    import os

    from fasttrain.lab.parallel import distributed as D
    from fasttrain.lab.train import execute

    corpus = _join_local_job(rank, port)
    torch.set_num_threads(1)
    group = D.init_world(D.ParallelConfig(strategy="tp", ddp_timeout=60), device="cpu")
    out = {}
    for family, folder in folders.items():
        extra = TP_EXTRA.get(family, {})
        record, module = execute(lab_cfg(folder, max_steps=4, save=os.path.join(out_dir, family), **extra),
                                 corpus=corpus, parallel=D.ParallelConfig(strategy="tp", global_batch_size=8),
                                 keep_model=True)
        from torch.distributed.tensor import DTensor

        out[family] = {"losses": losses(record), "val": record["final"]["val_loss"],
                       "distributed": record["distributed"], "estimate": record["estimate"].get("precise_bytes"),
                       "estimate_notes": record["estimate"].get("notes", []),
                       "split": sorted(n for n, p in module.named_parameters() if isinstance(p, DTensor)
                                       and any(pl.is_shard() for pl in p.placements))}
    if rank == 0:
        with open(os.path.join(out_dir, "records.json"), "w") as f:
            json.dump(out, f)
    group.owns_group = True
    D.shutdown(group)


@pytest.mark.slow
def test_tensor_parallel_in_two_processes_trains_the_same_function_as_one(folders, corpus, tmp_path):
    """tp over 2 gloo processes by the family's own plan: Llama (embedding and lm_head split, GQA 4/2),
    Qwen2 (tied embeddings kept whole, q/k/v biases split), Qwen3 (per-head norms replicated, their
    gradients summed; 2 micro-batches) and Phi-3 (fused projections gathered) give one process's loss curve, with gradient clipping and
    AdamW on the slices; --save gathers the slices into a folder from_pretrained loads, the same
    function as the trained one."""
    import socket

    import torch.multiprocessing as mp

    from fasttrain.lab.evaluate import evaluate_checkpoint
    from fasttrain.lab.train import run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    qwen3 = transformers.Qwen3Config(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=64)
    qwen3.save_pretrained(tmp_path / "config-qwen3")
    # phi3: fused qkv and gate_up gathered whole (colwise_gather_output), o and down split from a
    # replicated input (rowwise_split_input); a padding row keeps its embedding whole
    phi3 = transformers.Phi3Config(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    phi3.save_pretrained(tmp_path / "config-phi3")
    chosen = {family: str(folders[family]) for family in ("llama", "qwen2")} | {
        family: str(tmp_path / f"config-{family}") for family in ("qwen3", "phi3")}
    mp.start_processes(_tp_worker, args=(port, chosen, str(tmp_path)), nprocs=2, start_method="spawn")
    two = json.loads((tmp_path / "records.json").read_text())
    for family, folder in chosen.items():
        extra = TP_EXTRA.get(family, {})
        k = extra.get("gradient_accumulation_steps", 1)
        one = run(lab_cfg(folder, max_steps=4, per_device_train_batch_size=8 // k, **extra), corpus=corpus)
        assert two[family]["losses"] == pytest.approx(losses(one), rel=1e-5, abs=1e-6), family
        assert two[family]["val"] == pytest.approx(one["final"]["val_loss"], rel=1e-5), family
        d = two[family]["distributed"]
        assert (d["strategy"], d["tp"], d["dp"], d["global_batch_size"]) == ("tp", 2, 1, 8)
        assert d["tp_plan"]["model.layers.*.self_attn.o_proj"] == ("rowwise_split_input" if family == "phi3"
                                                                   else "rowwise")
        if family == "qwen3":
            assert d["tp_plan"]["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
        if family != "qwen3":           # (the memory estimator models llama and qwen2, not qwen3)
            assert two[family]["estimate"] and two[family]["estimate"] > 0
            assert any("logits are gathered whole" in note for note in two[family]["estimate_notes"])
        split = two[family]["split"]
        assert "model.layers.1.mlp.down_proj.weight" in split
        if family == "phi3":
            assert "model.layers.0.self_attn.qkv_proj.weight" in split and "model.embed_tokens.weight" not in split
        else:
            assert "model.layers.0.self_attn.k_proj.weight" in split
        if family in ("llama", "qwen3"):
            assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(split)
        if family == "qwen2":
            assert "model.layers.0.self_attn.q_proj.bias" in split and "lm_head.weight" not in split
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family)
        assert loaded.config.model_type == family
        again = evaluate_checkpoint(tmp_path / family, device="cpu", corpus=corpus)
        assert again["val_loss"] == pytest.approx(two[family]["val"], rel=1e-5), family


def _tp_gpu_worker(rank: int, nprocs: int, port: int, folder: str, out_dir: str) -> None:
    import os

    from fasttrain.lab.parallel import distributed as D
    from fasttrain.lab.train import run

    corpus = _join_local_job(rank, port, world=nprocs)
    group = D.init_world(D.ParallelConfig(strategy="tp", ddp_timeout=120), device="cuda")
    parallel = D.ParallelConfig(strategy="tp", global_batch_size=8)
    out = {"fp32": losses(run(lab_cfg(folder, device="cuda", max_steps=4, attn_implementation="sdpa"), corpus=corpus,
                              parallel=parallel)),
           "bf16_compiled": losses(run(lab_cfg(folder, device="cuda", max_steps=8, bf16=True, torch_compile=True,
                                               torch_compile_scope="blocks", attn_implementation="sdpa"),
                                       corpus=corpus, parallel=parallel))}
    if rank == 0:
        with open(os.path.join(out_dir, "records.json"), "w") as f:
            json.dump(out, f)
    group.owns_group = True
    D.shutdown(group)


@pytest.mark.gpu
def test_tensor_parallel_on_gpus_with_nccl(folders, corpus, tmp_path):
    """tp of a HF Llama over NCCL on min(2, GPUs) GPUs (one GPU: a mesh of one rank, the DTensor path
    on CUDA all the same): fp32 gives one process's curve; bf16 autocast with the decoder layers
    compiled trains."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import socket

    import torch.multiprocessing as mp

    from fasttrain.lab.train import run

    nprocs = 2 if torch.cuda.device_count() >= 2 else 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_tp_gpu_worker, args=(nprocs, port, str(folders["llama"]), str(tmp_path)), nprocs=nprocs,
                       start_method="spawn")
    got = json.loads((tmp_path / "records.json").read_text())
    one = run(lab_cfg(folders["llama"], device="cuda", max_steps=4, per_device_train_batch_size=8,
                      attn_implementation="sdpa"), corpus=corpus)
    assert got["fp32"] == pytest.approx(losses(one), rel=1e-4)
    assert all(np.isfinite(got["bf16_compiled"])) and got["bf16_compiled"][-1] < got["bf16_compiled"][0]


def test_tensor_parallel_refusals_are_one_line(folders, tmp_path):
    from fasttrain.lab.parallel import distributed as D

    # GPT-2 ships no plan; a Llama of 4 heads does not split over 3 ranks, nor 2 key/value heads over 4
    with pytest.raises(FasttrainError, match="gpt2 model ships no tensor-parallel plan"):
        D.check_config(lab_cfg(folders["gpt2"]), D.ParallelConfig(strategy="tp"))
    D.check_config(lab_cfg(folders["llama"]), D.ParallelConfig(strategy="tp"))
    D.check_model_fits(lab_cfg(folders["llama"]), 2, "tp")
    with pytest.raises(FasttrainError, match=r"attention heads \(num_attention_heads\) \(4\) divisible by 3"):
        D.check_model_fits(lab_cfg(folders["llama"]), 3, "tp")
    with pytest.raises(FasttrainError, match=r"key/value heads \(num_key_value_heads\) \(2\) divisible by 4"):
        D.check_model_fits(lab_cfg(folders["llama"]), 4, "tp")
    config, _ = hf.load_hf_config(f"hf:{folders['llama']}")
    config.num_attention_heads, config.num_key_value_heads, config.intermediate_size = 8, 4, 66
    with pytest.raises(FasttrainError, match=r"intermediate_size\) \(66\) divisible by 4"):
        hf.check_hf_tensor_parallel(config, 4)
    config.base_model_tp_plan = {**hf.tp_plan_of(config), "layers.*.mlp.experts": "moe_tp_experts"}
    with pytest.raises(FasttrainError, match="styles the lab does not apply .*moe_tp_experts"):
        hf.check_hf_tensor_parallel(config, 2)
    # peft and liger wrap or fuse the layers the plan splits
    with pytest.raises(FasttrainError, match="does not combine with LoRA"):
        D.check_config(lab_cfg(folders["llama"], lora_r=2), D.ParallelConfig(strategy="tp"))


@pytest.mark.gpu
def test_a_hf_model_trains_on_the_gpu_with_its_kernels(folders, corpus):
    """bf16 autocast, sdpa, liger's patches and torch.compile on a HF Llama: it trains, its peak is
    measured."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("liger_kernel")
    from fasttrain.lab.train import run

    rec = run(lab_cfg(folders["llama"], device="cuda", max_steps=8, bf16=True, attn_implementation="sdpa",
                      use_liger_kernel=True, torch_compile=True, torch_compile_scope="blocks"), corpus=corpus)
    assert all(np.isfinite(losses(rec))) and losses(rec)[-1] < losses(rec)[0]
    assert rec["memory"]["peak_allocated_bytes"] > 0
    # the fused cross-entropy alone beside the compiled layers: the same losses (the same math) within bf16's noise
    flce = run(lab_cfg(folders["llama"], device="cuda", max_steps=8, bf16=True, attn_implementation="sdpa",
                       use_liger_kernel=True, liger_kernels="fused_linear_cross_entropy", torch_compile=True,
                       torch_compile_scope="blocks"), corpus=corpus)
    assert np.allclose(losses(flce), losses(rec), rtol=2e-2)
    # the whole model compiled, the lab's fused head after its graph: the same losses
    whole = run(lab_cfg(folders["llama"], device="cuda", max_steps=8, bf16=True, attn_implementation="sdpa",
                        use_liger_kernel=True, liger_kernels="fused_linear_cross_entropy", torch_compile=True,
                        torch_compile_scope="model"), corpus=corpus)
    assert np.allclose(losses(whole), losses(rec), rtol=2e-2)
    # liger's layer kernels inside a whole compiled model are not run: refused in one line, before any work
    with pytest.raises(FasttrainError, match="--torch-compile-scope blocks"):
        run(lab_cfg(folders["llama"], device="cuda", max_steps=2, bf16=True, use_liger_kernel=True,
                    torch_compile=True), corpus=corpus)


def test_the_memory_setup_follows_the_compile_flags():
    """--torch-compile (whole model or blocks) reaches the estimator's Setup; its note is gone for a
    transformers model (modelled) and says how the lab's GPT is counted."""
    from fasttrain.lab.estimate import estimate_notes

    gpt2 = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=120, n_positions=64,
                embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    setup_of = hf.memory_setup_for(gpt2)
    cfg = LabConfig(context=32, per_device_train_batch_size=2)
    assert setup_of(cfg, 2).compiled == "none"
    assert setup_of(cfg.with_(torch_compile=True), 2).compiled == "model"
    assert setup_of(cfg.with_(torch_compile=True, torch_compile_scope="blocks"), 2).compiled == "blocks"
    compiled = cfg.with_(torch_compile=True)
    assert not any("torch.compile" in n for n in estimate_notes(compiled.with_(model="hf:some/folder")))
    assert any("counted as eager" in n for n in estimate_notes(compiled))


def test_the_memory_setup_follows_the_liger_flag():
    """--use-liger-kernel reaches the estimator's Setup of a transformers model as liger's kernels of its family
    (modelled: the record carries no 'not modelled' note); GPT-2, which liger does not patch, gets no estimate;
    the lab's GPT keeps its note."""
    from fasttrain.lab.estimate import estimate_notes
    from fasttrain.memory import estimate

    llama = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=120, max_position_embeddings=64)
    setup_of = hf.memory_setup_for(llama)
    cfg = LabConfig(context=32, per_device_train_batch_size=2, attn_implementation="eager")
    assert setup_of(cfg, 2).liger == ()
    liger = cfg.with_(use_liger_kernel=True)
    assert setup_of(liger, 2).liger == ("rms_norm", "rope", "glu", "fused_linear_cross_entropy")
    assert estimate(setup_of(liger, 2), "precise").total < estimate(setup_of(cfg, 2), "precise").total
    assert not any("liger" in n for n in estimate_notes(liger.with_(model="hf:some/folder")))
    assert any("liger" in n and "not modelled" in n for n in estimate_notes(liger))
    gpt2 = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=120, n_positions=64,
                embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    assert hf.memory_setup_for(gpt2)(liger, 2) is None
    # under a per-block compile the head and the loss stay eager beside the compiled layers: all of liger's kernels
    # and the fused cross-entropy alone are modelled there; a whole compiled model with liger is not (no estimate)
    blocks = dict(torch_compile=True, torch_compile_scope="blocks")
    assert setup_of(liger.with_(**blocks), 2).compiled == "blocks"
    assert setup_of(liger.with_(torch_compile=True), 2) is None
    graphs = setup_of(cfg.with_(torch_compile=True, torch_compile_mode="reduce-overhead"), 2)
    assert graphs.cuda_graphs and graphs.compiled == "model" and not setup_of(cfg.with_(**blocks), 2).cuda_graphs
    flce = setup_of(liger.with_(model="hf:x", liger_kernels="fused_linear_cross_entropy", **blocks), 2)
    assert flce.liger == ("fused_linear_cross_entropy",) and flce.compiled == "blocks"
    big_vocab = hf.memory_setup_for({**llama, "vocab_size": 4096})     # where the logits are the peak's
    assert estimate(big_vocab(liger.with_(model="hf:x", liger_kernels="fused_linear_cross_entropy", **blocks), 64),
                    "precise").total < estimate(big_vocab(cfg.with_(**blocks), 64), "precise").total


def test_liger_kernels_applies_the_fused_cross_entropy_alone(tmp_path):
    """--liger-kernels fused_linear_cross_entropy: the model's loss path is the lab's fused head, its layers
    transformers' own (left to torch.compile); all: liger's norms and MLP too. Asked without liger, or for the lab's
    GPT, it is refused."""
    pytest.importorskip("liger_kernel")
    write_config(tmp_path, "llama")
    for kernels, layers_from in (("fused_linear_cross_entropy", "transformers."), ("all", "liger_kernel.")):
        model = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu").module
        hf.apply_liger(model, kernels)
        try:
            assert model.forward.__func__.__module__ == "fasttrain.lab.hf.liger"
            assert model.model.norm.forward.__func__.__module__.startswith(layers_from)
            assert model.model.layers[0].mlp.forward.__func__.__module__.startswith(layers_from)
        finally:
            hf.undo_liger_patches()
    for bad in (cfg(liger_kernels="fused_linear_cross_entropy"), cfg(liger_kernels="rope"),
                LabConfig(use_liger_kernel=True, liger_kernels="fused_linear_cross_entropy")):
        with pytest.raises(FasttrainError, match="liger-kernels"):
            validate(bad)


def test_liger_patches_of_transformers_modules_are_undone_after_the_run(tmp_path, monkeypatch):
    """liger rebinds module-level names of transformers' modeling module when it patches one instance; a later
    model of the family (the next row of a table) must be built and run without them."""
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers import monkey_patch
    from transformers.models.llama import modeling_llama

    from fasttrain.lab.measure import release_run_state

    original_rope, original_norm = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm
    fake_rope = object()

    def fake_apply(model, **switches):      # what liger's llama patch does to the module (CUDA-only kernels)
        modeling_llama.apply_rotary_pos_emb = fake_rope
        modeling_llama.LlamaRMSNorm = type("LigerLikeNorm", (torch.nn.Module,), {})
        modeling_llama.LlamaForCausalLM.liger_marker = True

    monkeypatch.setattr(monkey_patch, "_apply_liger_kernel_to_instance", fake_apply)
    write_config(tmp_path, "llama")
    model = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu").module
    hf.apply_liger(model)
    assert modeling_llama.apply_rotary_pos_emb is fake_rope
    release_run_state(cfg(use_liger_kernel=True))
    assert modeling_llama.apply_rotary_pos_emb is original_rope and modeling_llama.LlamaRMSNorm is original_norm
    assert not hasattr(modeling_llama.LlamaForCausalLM, "liger_marker")
    assert hf.undo_liger_patches() == 0                       # nothing left to undo


def test_a_compiled_run_resets_the_compilers_caches_when_it_ends(monkeypatch):
    """reduce-overhead's CUDA-graph pools live until the trees are reset: the next run would start without that
    memory."""
    import torch._dynamo
    import torch._inductor.cudagraph_trees as trees

    from fasttrain.lab.measure import release_run_state

    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("dynamo"))
    monkeypatch.setattr(trees, "reset_cudagraph_trees", lambda: calls.append("trees"))
    release_run_state(cfg())
    assert calls == []                                         # an eager run leaves the user's compiled code alone
    release_run_state(cfg(torch_compile=True))
    assert calls == ["dynamo", "trees"]


# --- liger's fused linear cross-entropy on any causal LM's head (lab/hf/liger.py) ---------------------------------

def reference_flce(calls: list):
    """What liger's kernel computes, written with the logits made (its Triton kernel needs a GPU): CE(x W^T + b, t)
    over the targets that are not ``ignore_index``, mean or sum. ``calls`` gets the shape of each input."""
    def kernel(x, w, t, bias=None, ignore_index=-100, reduction="mean", accum_dtype=None):
        calls.append(tuple(x.shape))
        return F.cross_entropy(F.linear(x, w, bias).float(), t, ignore_index=ignore_index, reduction=reduction)
    return kernel


def dtype_recording_flce(seen: list):
    """:func:`reference_flce` that records the dtypes it is handed: (input, weight, accum_dtype) at each call."""
    def kernel(x, w, t, bias=None, ignore_index=-100, reduction="mean", accum_dtype=None):
        seen.append((x.dtype, w.dtype, accum_dtype))
        return F.cross_entropy(F.linear(x, w, bias).float(), t, ignore_index=ignore_index, reduction=reduction)
    return kernel


def graph_recording_backend(graphs: list):
    """A torch.compile backend that keeps each dynamo graph in ``graphs`` and runs it through AOT autograd without
    inductor's code generation (aot_eager: seconds on a CPU)."""
    def backend(gm, inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, inputs)
    return backend


def awkward_batch(vocab=100, b=3, t=13):
    """Odd sizes, and targets ignored (-100) in a run at a row's start and here and there."""
    x, y = batch(vocab=vocab, b=b, t=t, seed=3)
    y = y.clone()
    y[0, :5] = -100
    y[2, ::4] = -100
    return x, y


def fused_pair(folder, kernel, **kw):
    """The model in ``folder`` twice, the same weights: as built, and with the fused head on this one instance."""
    plain = hf.build_hf_model(f"hf:{folder}", cfg(**kw), None, "cpu")
    fused = hf.build_hf_model(f"hf:{folder}", cfg(**kw), None, "cpu")
    hf.apply_fused_linear_cross_entropy(hf.base_model_of(fused.module), kernel=kernel)
    return plain, fused


@pytest.mark.parametrize("family", ("gpt2", "gpt_neox", "phi"))
def test_the_fused_head_trains_the_models_own_loss(tmp_path, family):
    """GPT-2 (tied head), GPT-NeoX (untied), Phi (a head with a bias): in training the fused path hands the last
    hidden state, the head's weight and bias and the shifted targets to the kernel once, never the logits, and its
    loss and every gradient are the model's own -- with the lab's already shifted targets, with transformers' own
    shift of ``labels``, and summed over ``num_items_in_batch``."""
    write_config(tmp_path, family)
    calls = []
    plain, fused = fused_pair(tmp_path, reference_flce(calls))
    plain.module.train(), fused.module.train()
    x, y = awkward_batch()
    hidden = fused.module.get_output_embeddings().in_features
    a, b = forward_loss(plain, plain.module, x, y), forward_loss(fused, fused.module, x, y)
    assert calls == [(3 * 13, hidden)]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    a.backward(), b.backward()
    for (name, p), q in zip(plain.module.named_parameters(), fused.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    labels = x.clone()
    labels[1, 3:7] = -100
    own = plain.module(input_ids=x, labels=labels, use_cache=False)
    out = fused.module(input_ids=x, labels=labels, use_cache=False)
    assert out.logits is None and own.logits.shape == (3, 13, 120)
    torch.testing.assert_close(out.loss, own.loss, rtol=1e-5, atol=1e-6)
    items = torch.tensor(17)
    torch.testing.assert_close(fused.module(input_ids=x, labels=x, shift_labels=y, num_items_in_batch=items).loss,
                               plain.module(input_ids=x, labels=x, shift_labels=y, num_items_in_batch=items).loss,
                               rtol=1e-5, atol=1e-6)
    assert fused.module(input_ids=x, shift_labels=y).loss is None      # as the model's own: no labels, no loss


@pytest.mark.parametrize("family", ("gpt2", "qwen2"))
def test_under_autocast_the_fused_head_casts_its_weight_once_and_sums_its_gradient_in_fp32(tmp_path, family):
    """liger's kernel under autocast with fp32 weights would cast the whole v x h weight at each chunk of tokens;
    the lab's head hands it the input and the weight in autocast's dtype, once a micro-batch, and asks for the
    weight's gradient summed in fp32. The loss and the gradients are the model's own under autocast."""
    write_config(tmp_path, family)
    seen = []
    kernel = dtype_recording_flce(seen)
    plain, fused = fused_pair(tmp_path, kernel)
    plain.module.train(), fused.module.train()
    x, y = awkward_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = forward_loss(plain, plain.module, x, y), forward_loss(fused, fused.module, x, y)
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.float32)]
    torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)
    a.backward(), b.backward()
    for (name, p), q in zip(plain.module.named_parameters(), fused.module.parameters()):
        assert q.grad.dtype == torch.float32, name
        torch.testing.assert_close(q.grad, p.grad, rtol=0.05, atol=2e-3, msg=name)
    seen.clear()
    forward_loss(fused, fused.module, x, y)                     # outside autocast: the weights as they are
    assert seen == [(torch.float32, torch.float32, None)]


def test_liger_families_get_the_labs_head_unless_their_loss_is_more_than_its_cross_entropy(tmp_path):
    """Llama (in liger's table, a plain head): the fused cross-entropy is the lab's head on the instance and liger
    patches nothing module-level for it; Gemma 2 soft-caps its logits: liger's own forward for its family."""
    pytest.importorskip("liger_kernel")
    from fasttrain.lab.hf import liger as lab_liger

    write_config(tmp_path / "llama", "llama")
    llama = hf.build_hf_model(f"hf:{tmp_path / 'llama'}", cfg(), None, "cpu").module
    lab_liger.apply_liger(llama, "fused_linear_cross_entropy")
    assert llama.forward.__func__ is lab_liger._fused_forward and lab_liger.undo_liger_patches() == 0
    gemma2 = transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(
        vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, final_logit_softcapping=30.0))
    try:
        lab_liger.apply_liger(gemma2, "fused_linear_cross_entropy")
        assert getattr(gemma2.forward, "__func__", None) is not lab_liger._fused_forward
        assert "forward" in vars(gemma2)                        # liger's forward on the instance
    finally:
        lab_liger.undo_liger_patches()


def test_the_fused_head_with_a_soft_prompt_ignores_the_prompts_positions(tmp_path):
    """peft's prompt model calls the fused model with the n prompt vectors in front and n ignored targets."""
    write_config(tmp_path, "gpt2")
    plain, fused = fused_pair(tmp_path, reference_flce([]), prompt_tuning_tokens=3)
    plain.module.train(), fused.module.train()
    x, y = awkward_batch()
    torch.testing.assert_close(forward_loss(fused, fused.module, x, y), forward_loss(plain, plain.module, x, y),
                               rtol=1e-5, atol=1e-6)


def test_the_fused_head_is_this_instances_alone(tmp_path):
    """Evaluation, and a training call without labels, run the class's forward (logits, no kernel); a model of
    the family built later in the process, and the class itself, are untouched; a deep copy fuses the copy."""
    import copy

    write_config(tmp_path, "gpt2")
    calls = []
    kernel = reference_flce(calls)
    plain, fused = fused_pair(tmp_path, kernel)
    cls = type(fused.module)
    x, y = awkward_batch()
    fused.module.eval()
    torch.testing.assert_close(forward_logits(fused, fused.module, x), forward_logits(plain, plain.module, x))
    fused.module.train()
    assert fused.module(input_ids=x).logits.shape == (3, 13, 120) and calls == []
    later = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu")
    later.module.train()
    assert "forward" not in vars(later.module) and cls.forward is type(plain.module).forward
    forward_loss(later, later.module, x, y)
    assert calls == []                                      # the later model made its logits
    twin = copy.deepcopy(fused.module)
    assert twin.forward.__self__ is twin
    twin.train()
    twin(input_ids=x, labels=x, shift_labels=y)
    assert len(calls) == 1


def test_a_head_the_fused_loss_cannot_replace_is_refused_in_one_line(tmp_path):
    """Cohere scales its logits (the fused loss would train another function); a head that is not a Linear has no
    weight to hand over; a head wrapped after the check (LoRA on it) is refused when it runs, and validate refuses
    LoRA on the head (the lab's or transformers' name) with liger."""
    write_config(tmp_path / "cohere", "cohere")
    cohere = hf.build_hf_model(f"hf:{tmp_path / 'cohere'}", cfg(), None, "cpu").module
    with pytest.raises(FasttrainError, match="scales or caps the logits"):
        hf.apply_fused_linear_cross_entropy(cohere, kernel=reference_flce([]))
    assert "forward" not in vars(cohere)
    # Gemma 2's soft cap is the logits themselves while they are small, as on a few tokens of a fresh model: its
    # config says it
    gemma2 = transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(
        vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, final_logit_softcapping=30.0))
    with pytest.raises(FasttrainError, match="soft-caps its logits"):
        hf.apply_fused_linear_cross_entropy(gemma2, kernel=reference_flce([]))
    write_config(tmp_path / "gpt2", "gpt2")
    gpt2 = hf.build_hf_model(f"hf:{tmp_path / 'gpt2'}", cfg(), None, "cpu").module

    class Scaled(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, h):
            return self.linear(h)

    head = gpt2.get_output_embeddings()
    gpt2.set_output_embeddings(Scaled(head))
    with pytest.raises(FasttrainError, match="output layer is Scaled"):
        hf.apply_fused_linear_cross_entropy(gpt2, kernel=reference_flce([]))
    gpt2.set_output_embeddings(head)
    hf.apply_fused_linear_cross_entropy(gpt2, kernel=reference_flce([]))
    gpt2.set_output_embeddings(Scaled(head))
    gpt2.train()
    x, y = awkward_batch()
    with pytest.raises(FasttrainError, match="leave the head out of --lora-target-modules"):
        gpt2(input_ids=x, labels=x, shift_labels=y)
    for name in ("lm_head", "head"):
        with pytest.raises(FasttrainError, match=f"drop '{name}' from --lora-target-modules"):
            validate(cfg(model="hf:x", use_liger_kernel=True, liger_kernels="fused_linear_cross_entropy", lora_r=2,
                         lora_target_modules=("c_attn", name)))


@pytest.mark.parametrize("family", ("llama", "qwen2", "cohere"))
def test_the_head_check_of_a_model_built_on_the_meta_device_runs_on_a_small_one_of_its_class(tmp_path, monkeypatch,
                                                                                               family):
    """A model built to be sharded (its matrices on the meta device until ``fully_shard`` draws them) has nothing to
    compute the head check with: the check runs on a fresh instance of its class from its config, one layer and a
    vocabulary of 256 (Qwen2's per-layer ``layer_types`` cut with the depth; a padding id past 256 dropped). A plain
    head passes and the model stays on the meta device; Cohere's scaled logits are still refused."""
    extra = {"pad_token_id": 290} if family == "llama" else {}
    write_config(tmp_path, family, vocab=300, **extra)
    module = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu", meta=True).module
    assert any(p.device.type == "meta" for p in module.parameters())
    if family == "cohere":
        with pytest.raises(FasttrainError, match="scales or caps the logits"):
            hf.apply_fused_linear_cross_entropy(module, kernel=reference_flce([]))
        return
    generator = torch.get_rng_state()
    hf.apply_fused_linear_cross_entropy(module, kernel=reference_flce([]))
    assert torch.equal(torch.get_rng_state(), generator)     # the small instance's draws are not the run's
    assert "forward" in vars(module) and module.config.num_hidden_layers == 2 and module.config.vocab_size == 300
    assert module.get_output_embeddings().weight.device.type == "meta"
    # a class that cannot be built small is one line
    again = hf.build_hf_model(f"hf:{tmp_path}", cfg(), None, "cpu", meta=True).module

    def refuses(*args, **kwargs):
        raise ValueError("this family needs its full depth")
    monkeypatch.setattr(type(again), "_from_config", classmethod(lambda cls, *a, **k: refuses()))
    with pytest.raises(FasttrainError, match="could not be built .ValueError: this family needs its full depth"):
        hf.apply_fused_linear_cross_entropy(again, kernel=reference_flce([]))


def test_liger_sends_a_family_it_does_not_patch_to_the_fused_head(tmp_path, monkeypatch):
    """--liger-kernels fused_linear_cross_entropy on GPT-2 (no liger patch) is the lab's forward of the instance,
    allowed under a whole-model compile (the kernel stays outside the graph); all of liger's kernels it cannot
    have: refused before any weights, saying what can run. Llama keeps liger's own patch and its refusal."""
    pytest.importorskip("liger_kernel")
    from fasttrain.lab.hf import liger

    monkeypatch.setattr(liger, "fused_linear_cross_entropy_kernel", lambda: reference_flce([]))
    write_config(tmp_path / "gpt2", "gpt2")
    model = hf.build_hf_model(f"hf:{tmp_path / 'gpt2'}", cfg(), None, "cpu").module
    hf.apply_liger(model, "fused_linear_cross_entropy")
    assert model.forward.__func__ is liger._fused_forward
    with pytest.raises(FasttrainError, match="only its fused linear cross-entropy applies"):
        hf.apply_liger(hf.build_hf_model(f"hf:{tmp_path / 'gpt2'}", cfg(), None, "cpu").module, "all")
    assert hf.undo_liger_patches() == 0                      # nothing module-level was changed
    config, _ = hf.load_hf_config(f"hf:{tmp_path / 'gpt2'}")
    flce = dict(use_liger_kernel=True, liger_kernels="fused_linear_cross_entropy")
    with pytest.raises(FasttrainError, match="add --liger-kernels fused_linear_cross_entropy"):
        hf.check_hf_setup(cfg(use_liger_kernel=True), config, None, "cuda")
    for scope in ("model", "blocks"):
        hf.check_hf_setup(cfg(torch_compile=True, torch_compile_scope=scope, **flce), config, None, "cuda")
    with pytest.raises(FasttrainError, match="needs a CUDA GPU"):
        hf.check_hf_setup(cfg(**flce), config, None, "cpu")
    # a family liger patches: the fused loss alone is the lab's head, outside a whole compiled graph; liger's layer
    # kernels are not, nor is liger's own forward, which a soft-capping family's loss needs
    llama, _ = hf.load_hf_config(f"hf:{write_config(tmp_path / 'llama', 'llama')}")
    hf.check_hf_setup(cfg(torch_compile=True, **flce), llama, None, "cuda")
    with pytest.raises(FasttrainError, match="--torch-compile-scope blocks"):
        hf.check_hf_setup(cfg(torch_compile=True, use_liger_kernel=True), llama, None, "cuda")
    transformers.Gemma2Config(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              max_position_embeddings=64).save_pretrained(tmp_path / "gemma2")
    gemma2, _ = hf.load_hf_config(f"hf:{tmp_path / 'gemma2'}")
    with pytest.raises(FasttrainError, match="--torch-compile-scope blocks"):
        hf.check_hf_setup(cfg(torch_compile=True, **flce), gemma2, None, "cuda")


def test_a_compiled_qwen2_under_autocast_runs_the_fused_head_after_one_graph(tmp_path):
    """A family liger patches (Qwen2, tied head), whole-model compiled under autocast: one graph from the ids to the
    last hidden state and the head's weight in bf16 (the casts inside it), the kernel after it once, the loss the
    model's own under autocast."""
    import torch._dynamo

    write_config(tmp_path, "qwen2")
    seen = []
    kernel = dtype_recording_flce(seen)
    plain, fused = fused_pair(tmp_path, kernel)
    plain.module.train(), fused.module.train()
    x, y = awkward_batch()
    graphs = []
    backend = graph_recording_backend(graphs)

    torch._dynamo.reset()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = forward_loss(plain, plain.module, x, y)
            loss = forward_loss(fused, torch.compile(fused.module, backend=backend), x, y)
        assert len(graphs) == 1 and seen == [(torch.bfloat16, torch.bfloat16, torch.float32)]
        torch.testing.assert_close(loss, expected, rtol=1e-2, atol=1e-2)
        loss.backward()
        assert all(q.grad is not None and q.grad.dtype == torch.float32 for q in fused.module.parameters())
    finally:
        torch._dynamo.reset()


def test_a_compiled_model_runs_the_fused_loss_outside_its_graph(tmp_path):
    """torch.compile of the whole model: one graph, from the ids to the last hidden state; the kernel runs after it,
    eager (dynamo cannot trace liger's), once a step; the loss and the gradients are the model's. Per-block
    compile leaves the head outside the blocks anyway. (aot_eager: dynamo's graphs and AOT autograd without
    inductor's code generation, seconds on a CPU; the lab's inductor compile is the slow test below and the GPU's.)"""
    import torch._dynamo

    write_config(tmp_path, "gpt2")
    calls = []
    plain, fused = fused_pair(tmp_path, reference_flce(calls))
    plain.module.train(), fused.module.train()
    x, y = awkward_batch()
    expected = forward_loss(plain, plain.module, x, y)
    expected.backward()
    graphs = []
    backend = graph_recording_backend(graphs)

    torch._dynamo.reset()
    try:
        whole = torch.compile(fused.module, backend=backend)
        loss = forward_loss(fused, whole, x, y)
        assert len(graphs) == 1 and calls == [(39, 32)]
        last = [n for n in graphs[0].graph.nodes if n.op == "call_function"][-1]
        assert "layer_norm" in str(last.target)                 # the graph ends at GPT-2's final LayerNorm
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        loss.backward()
        for (name, p), q in zip(plain.module.named_parameters(), fused.module.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
        for block in fused.blocks(fused.module):
            block.compile(backend="aot_eager")
        torch.testing.assert_close(forward_loss(fused, fused.module, x, y), expected, rtol=1e-5, atol=1e-6)
        assert len(calls) == 2
    finally:
        torch._dynamo.reset()


@pytest.mark.slow           # two inductor compiles: a minute of CPU
def test_the_fused_head_through_the_lab_trainer_under_its_compiles(tmp_path):
    """The lab's trainer compiles (inductor) the fused GPT-2 per block and whole: the same step as eager."""
    from types import SimpleNamespace

    from fasttrain.lab.trainer import Trainer

    write_config(tmp_path, "gpt2")
    ids = np.arange(400, dtype=np.int64) % 65
    data = SimpleNamespace(train=ids, val=ids, vocab_size=65, chars=None)
    x, y = batch(vocab=65, b=3, t=13)
    steps = []
    for compiled in ({}, dict(torch_compile=True, torch_compile_scope="blocks"), dict(torch_compile=True)):
        c = cfg(**compiled)
        m = hf.build_hf_model(f"hf:{tmp_path}", c, 65, "cpu")
        calls = []
        hf.apply_fused_linear_cross_entropy(m.module, kernel=reference_flce(calls))
        t = Trainer(c, m, data, torch.device("cpu"))
        steps.append(t.forward_backward_step([(x, y), (x.flip(0), y.flip(0))]).item())
        assert len(calls) == 2, compiled
    assert steps[1] == pytest.approx(steps[0], rel=1e-5) and steps[2] == pytest.approx(steps[0], rel=1e-5)


def _gpu_trainer(folder, **kw):
    """The lab's trainer of the HF model in ``folder`` on the GPU (a 65-symbol corpus stands in)."""
    from types import SimpleNamespace

    from fasttrain.lab.trainer import Trainer

    ids = np.arange(400, dtype=np.int64) % 65
    data = SimpleNamespace(train=ids, val=ids, vocab_size=65, chars=None)
    c = cfg(**{"device": "cuda", "context": 37, "optim": "sgd", "learning_rate": 0.05, "warmup_steps": 0,
               "max_grad_norm": 0.0, "max_steps": 4, **kw})
    return Trainer(c, hf.build_hf_model(f"hf:{folder}", c, 65, "cuda"), data, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("precision,compiled", [
    ("fp32", {}), ("bf16", {}), ("bf16", dict(torch_compile=True, torch_compile_scope="blocks")),
    ("bf16", dict(torch_compile=True)), ("bf16", dict(torch_compile=True, torch_compile_mode="reduce-overhead"))],
    ids=["fp32-eager", "bf16-eager", "bf16-blocks", "bf16-model", "bf16-reduce-overhead"])
def test_liger_fused_head_on_gpt2_trains_as_the_plain_model_on_the_gpu(tmp_path, precision, compiled):
    """liger's real kernel on GPT-2's tied head (the lab's forward: liger has no GPT-2 patch), eager, per-block and
    whole compiled (the kernel outside the graph; under reduce-overhead between CUDA graphs): 3 SGD steps of two
    micro-batches of 3 x 37 (awkward shapes, ignored targets), the vocabulary of 2000 in many chunks; every step's
    loss and every weight's change (-lr x its gradient summed) as the plain model's, in fp32 closely, in bf16 within
    its rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("liger_kernel")
    from fasttrain.lab.hf import liger

    write_config(tmp_path, "gpt2", vocab=2000)
    kw = dict(bf16=precision == "bf16", gradient_accumulation_steps=2, **compiled)
    plain = _gpu_trainer(tmp_path, **kw)
    fused = _gpu_trainer(tmp_path, use_liger_kernel=True, liger_kernels="fused_linear_cross_entropy", **kw)
    assert fused.model.forward.__func__ is liger._fused_forward and "forward" not in vars(plain.model)
    start = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    g = torch.Generator().manual_seed(5)
    steps = []
    for _ in range(3):
        ids = torch.randint(0, 65, (2, 3, 38), generator=g)
        targets = ids[..., 1:].clone()
        targets[:, 0, :6] = -100
        targets[:, 2, ::5] = -100
        steps.append([(ids[j, :, :-1].cuda(), targets[j].cuda()) for j in range(2)])
    losses = {name: [t.train_step(s).item() for s in steps] for name, t in (("plain", plain), ("fused", fused))}
    loss_tol, change_tol = (1e-5, 1e-4) if precision == "fp32" else (1e-2, 3e-2)
    assert losses["fused"] == pytest.approx(losses["plain"], rel=loss_tol)
    after = dict(fused.model.named_parameters())
    for name, p in plain.model.named_parameters():
        want, got = p.detach() - start[name], after[name].detach() - start[name]
        assert (got - want).norm() <= change_tol * want.norm() + 1e-7, name


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt2s_fused_cross_entropy_peak_is_the_estimators_on_the_gpu(tmp_path, corpus, precision):
    """GPT-2 (width 128, 4 layers) with a vocabulary of 16,384 at 16 x 256 tokens, where the logits are most of the
    step's memory: the fused cross-entropy's measured peak is below the plain model's by more than one fp32 copy of
    the logits, and the estimator's prediction of each (the generic head counted as liger's) within 10% of what was
    measured."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("liger_kernel")
    from fasttrain.lab.train import run

    folder = tmp_path / "gpt2"
    transformers.GPT2Config(vocab_size=16384, n_embd=128, n_layer=4, n_head=4, n_positions=256, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0).save_pretrained(folder)
    kw = dict(device="cuda", max_steps=3, context=256, per_device_train_batch_size=16, bf16=precision == "bf16",
              attn_implementation="sdpa")
    plain = run(lab_cfg(folder, **kw), corpus=corpus)
    fused = run(lab_cfg(folder, use_liger_kernel=True, liger_kernels="fused_linear_cross_entropy", **kw),
                corpus=corpus)
    assert fused["estimate"]["setup"]["liger"] == ["fused_linear_cross_entropy"]
    logits_fp32 = 4 * 16 * 256 * 16384
    assert fused["memory"]["peak_allocated_bytes"] < plain["memory"]["peak_allocated_bytes"] - logits_fp32
    for rec in (plain, fused):
        assert abs(rec["estimate"]["error_pct"]) <= 10.0, rec["estimate"]
    assert np.allclose(losses(fused), losses(plain), rtol=2e-2 if precision == "bf16" else 1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpoint_blocks_recomputes_the_first_blocks_only_and_trains_the_same(tmp_path, family):
    """--checkpoint-blocks k: transformers' checkpointing on the first k decoder layers, the rest keep their
    activations; the loss and the gradients are those of no checkpointing; k past the layers is one line
    before any weights are built."""
    from fasttrain.lab import parallelize as P
    from fasttrain.lab.hf.config import check_hf_setup, load_hf_config

    write_config(tmp_path, family)
    x, y = batch()
    grads = {}
    for k, ckpt in ((0, "none"), (1, "full"), (0, "full")):
        torch.manual_seed(0)
        c = cfg(gradient_checkpointing=ckpt, checkpoint_blocks=k)
        m = hf.build_hf_model(f"hf:{tmp_path}", c, 100, "cpu")
        done = P.parallelize(m, c)
        flags = [b.gradient_checkpointing for b in m.blocks(done.module)]
        assert flags == {(0, "none"): [False, False], (1, "full"): [True, False], (0, "full"): [True, True]}[(k, ckpt)]
        if k:
            assert ("activation_checkpointing", "full, the first 1 of 2 blocks (the model's "
                                                "gradient_checkpointing_enable)") in done.applied
        done.module.train()
        m.loss(done.module, x, y).backward()
        grads[(k, ckpt)] = [p.grad.clone() for p in done.module.parameters() if p.grad is not None]
    for a, b in zip(grads[(0, "none")], grads[(1, "full")]):
        torch.testing.assert_close(a, b)
    with pytest.raises(FasttrainError, match="--checkpoint-blocks 3: the .* model has 2 decoder layers"):
        check_hf_setup(cfg(gradient_checkpointing="full", checkpoint_blocks=3), load_hf_config(f"hf:{tmp_path}")[0],
                       None, "cpu")


def test_the_memory_setup_follows_the_float8_flag():
    """--float8 reaches the estimator's Setup of a transformers model (modelled, D24: its layers keep less); the
    lab's GPT gets a note that it is counted as bf16."""
    from fasttrain.lab.estimate import estimate_notes
    from fasttrain.memory import estimate

    llama = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=120, max_position_embeddings=64)
    setup_of = hf.memory_setup_for(llama)
    cfg = LabConfig(context=32, per_device_train_batch_size=2, bf16=True, torch_compile=True,
                    torch_compile_scope="blocks")
    assert setup_of(cfg, 2).float8 == "none"
    f8 = cfg.with_(float8="rowwise")
    assert setup_of(f8, 2).float8 == "rowwise"
    kept = lambda setup: estimate(setup, "precise").line("activations at the end of forward").bytes
    assert kept(setup_of(f8, 2)) < kept(setup_of(cfg, 2))
    # what the estimator does not model gives no estimate (a whole compiled model under float8)
    assert setup_of(f8.with_(torch_compile_scope="model"), 2) is None
    assert not any("float8" in n for n in estimate_notes(f8.with_(model="hf:some/folder")))
    assert any("float8" in n and "counted as bf16" in n for n in estimate_notes(f8))
