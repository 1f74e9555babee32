"""The lab's one trainer: a user's nn.Module through ``fasttrain.lab.run`` (a notebook-style
script), the single training loop, the lab's imports (no circle, none upward), the techniques a
built model gets (compile per block, LoRA in the model's own names, checkpointing through the
model's own switch)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
LAB = ROOT / "src" / "fasttrain" / "lab"


# --- a user's model from Python -------------------------------------------------------------------

NOTEBOOK = '''
import torch
import torch.nn as nn

import fasttrain.lab
from tests_support import toy_text

class TinyLM(nn.Module):
    """Token ids -> logits: an embedding, two GRU-free MLP blocks, an output layer."""
    def __init__(self, vocab, width=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(2))
        self.out = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)

text = toy_text()
torch.manual_seed(0)
model = TinyLM(len(set(text)))
record = fasttrain.lab.run("tiny", model=model, data=text, device="cpu", max_steps=12, eval_interval=6,
                           learning_rate=3e-3, min_lr=3e-3, warmup_steps=0)
assert record.model is model
print("LOSSES", record.losses[0], record.losses[-1])
print("VAL", [e["val_loss"] for e in record.evals])
print("MODEL", record.to_dict()["model_source"]["name"], record.to_dict()["model"]["class"])
'''


def test_a_notebook_trains_its_own_module_with_fasttrain_lab_run(tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK)
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    first, last = map(float, lines["LOSSES"].split())
    assert last < first - 0.5                          # it learned
    assert lines["MODEL"] == "TinyLM __main__.TinyLM"
    assert len(eval(lines["VAL"])) == 2


def test_run_takes_a_module_that_returns_its_loss_and_compiles_its_blocks(corpus):
    import fasttrain.lab

    class LossLM(torch.nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 16)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
            self.out = torch.nn.Linear(16, vocab)

        def forward(self, ids, targets=None):
            x = self.emb(ids)
            for b in self.blocks:
                x = x + torch.tanh(b(x))
            logits = self.out(x)
            if targets is None:
                return logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    rec = fasttrain.lab.run("tiny", model=LossLM(corpus.vocab_size), data=corpus, returns_loss=True, device="cpu",
                            max_steps=3, eval_interval=0)
    assert len(rec.losses) == 3 and rec.val_loss is not None
    assert rec.to_dict()["estimate"]["precise_bytes"] is None          # no memory model of a user's module
    torch.manual_seed(0)
    compiled = fasttrain.lab.run("tiny", model=LossLM(corpus.vocab_size), data=corpus, returns_loss=True,
                                 device="cpu", max_steps=3, eval_interval=0, torch_compile=True,
                                 torch_compile_scope="blocks")
    # per-block compilation: the blocks' forwards are compiled in place, the model itself is not wrapped
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.model.blocks)
    assert compiled.losses == pytest.approx(rec.losses, rel=1e-4)


def test_a_user_module_gets_lora_in_its_own_names_and_its_own_checkpointing(corpus):
    pytest.importorskip("peft")
    import fasttrain.lab
    from fasttrain.lab.models import LabModel

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.v_proj = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return x + self.v_proj(torch.tanh(self.q_proj(x)))

    class LM(torch.nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.emb, self.block, self.out = torch.nn.Embedding(vocab, 16), Block(), torch.nn.Linear(16, vocab)
            self.checkpointing = None

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.checkpointing = gradient_checkpointing_kwargs

        def forward(self, ids):
            return self.out(self.block(self.emb(ids)))

    module = LM(corpus.vocab_size)
    model = LabModel(module=module, name="lm", vocab_size=corpus.vocab_size, lora_targets=("q_proj", "v_proj"))
    rec = fasttrain.lab.run("tiny", model=model, data=corpus, device="cpu", max_steps=2, eval_interval=0, lora_r=2,
                            gradient_checkpointing="full")
    assert module.checkpointing == {"use_reentrant": False}
    trained = {n for n, p in rec.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert any("q_proj.lora_A" in n for n in trained) and any("v_proj.lora_A" in n for n in trained)
    assert rec.to_dict()["params"]["trainable"] == 2 * 2 * (16 + 16)


def test_a_module_without_checkpointing_or_with_the_wrong_output_says_so(corpus):
    import fasttrain.lab
    from fasttrain.errors import FasttrainError

    lm = torch.nn.Sequential(torch.nn.Embedding(corpus.vocab_size, 8), torch.nn.Linear(8, corpus.vocab_size))
    with pytest.raises(FasttrainError, match="gradient_checkpointing_enable"):
        fasttrain.lab.run("tiny", model=lm, data=corpus, device="cpu", max_steps=1, gradient_checkpointing="full")
    flat = torch.nn.Sequential(torch.nn.Embedding(corpus.vocab_size, 8), torch.nn.Flatten(1))
    with pytest.raises(FasttrainError, match=r"\(batch, seq, vocab\)"):
        fasttrain.lab.run("tiny", model=flat, data=corpus, device="cpu", max_steps=1)


# --- one loop ------------------------------------------------------------------------------------

def _functions_with_training_loops(path: Path) -> set[str]:
    """Functions holding a ``for``/``while`` whose body calls ``backward()``, ``train_step()``,
    ``forward_backward_step()`` or an optimizer's ``step()``."""
    tree = ast.parse(path.read_text())
    found = set()

    class Visitor(ast.NodeVisitor):
        def __init__(self):
            self.stack = []

        def visit_FunctionDef(self, node):
            self.stack.append(node.name)
            self.generic_visit(node)
            self.stack.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_ClassDef(self, node):
            self.stack.append(node.name)
            self.generic_visit(node)
            self.stack.pop()

        def _loop(self, node):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                    name = sub.func.attr
                    owner = ast.unparse(sub.func.value)
                    if name in ("backward", "train_step", "forward_backward_step") or \
                            (name == "step" and ("opt" in owner or "trainer" in owner)):
                        found.add(".".join(self.stack))
            self.generic_visit(node)

        visit_For = visit_While = _loop

    Visitor().visit(tree)
    return found


def test_grep_finds_a_single_training_loop_in_the_lab():
    loops = {f"{p.name}:{fn}" for p in sorted(LAB.glob("*.py")) for fn in _functions_with_training_loops(p)}
    # the loop (Trainer.train), the micro-batches of one step, and Muon + AdamW stepped as one optimizer
    assert loops == {"trainer.py:Trainer.train", "trainer.py:accumulate_gradients", "optim.py:OptimizerGroup.step"}
    callers = {p.name for p in LAB.glob("*.py") if ".backward(" in p.read_text()}
    assert callers == {"trainer.py"}


# --- imports: no circle in the lab, none upward ---------------------------------------------------

def _imports(path: Path, package: str) -> set[str]:
    """Every fasttrain module ``path`` imports, at its top or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("fasttrain"):
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fasttrain"))
    return out


def test_the_lab_imports_form_no_circle_and_nothing_imports_upward():
    modules = {f"fasttrain.lab.{p.stem}": p for p in LAB.glob("*.py") if p.stem != "__init__"}
    graph = {m: {i for i in _imports(p, "fasttrain.lab") if i in modules and i != m} for m, p in modules.items()}
    for m, p in modules.items():
        upward = {i for i in _imports(p, "") if i.startswith(("fasttrain.bench", "fasttrain.training"))}
        assert not upward, f"{m} imports {upward}"
    state: dict[str, int] = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError("import circle: " + " -> ".join(path + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for n in sorted(graph[m]):
            visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])
    memory = ROOT / "src" / "fasttrain" / "memory"
    for p in memory.glob("*.py"):
        assert not {i for i in _imports(p, "") if i.startswith("fasttrain.lab")}, f"memory/{p.name} imports the lab"


def test_the_gpt_classes_live_at_module_level_and_keep_their_weights():
    """The classes moved to module level; a seed still draws the weights it drew before the move
    (the checksums were taken from the earlier model.py, whose classes were made inside a function)."""
    from fasttrain.lab import model as M

    assert all(isinstance(getattr(M, n), type) for n in ("GPT", "Block", "Attention", "MLP", "RMSNorm", "GPTConfig"))
    shapes = [(M.GPTConfig(layers=2, heads=2, hidden=16, ffn=32, vocab=20, seq=8), 636.9757885126553),
              (M.GPTConfig(layers=2, heads=4, kv_heads=2, hidden=16, ffn=32, vocab=20, seq=8, norm="layer",
                           pos="learned", tied=True, bias=True, prompt_tokens=2), 1280.3889117950112)]
    for cfg, checksum in shapes:
        state = M.build(cfg, "cpu", seed=3).state_dict().values()
        assert float(sum((p.double() * (i + 1)).sum() for i, p in enumerate(state))) == checksum


def test_memory_validation_is_a_command_of_the_memory_group_defined_by_the_lab(capsys):
    from tests_support import run_cli

    from fasttrain.cli import cli

    code, out, _ = run_cli(["memory", "validate", "--help"], capsys)
    assert code == 0 and "--rescore" in out
    memory = cli.commands["memory"]
    assert "validate" in memory.commands
    assert memory.commands["validate"].callback.__module__ == "fasttrain.lab.experiments.memory_check"


# --- a Hugging Face model through the seam (what lab/hf.py builds) --------------------------------

def _tiny_llama(vocab):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("technique", [
    dict(), dict(bf16=True), dict(gradient_checkpointing="full"), dict(lora_r=4), dict(preload=True),
    dict(optim="adafactor"), dict(gradient_accumulation_steps=2, per_device_train_batch_size=4),
    dict(auto_find_batch_size=True),
], ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()) or "plain")
def test_a_hugging_face_model_trains_through_the_trainer_with_each_technique(corpus, tmp_path, technique):
    pytest.importorskip("peft")
    import fasttrain.lab
    from fasttrain.lab.models import LabModel

    module = _tiny_llama(corpus.vocab_size)
    saved = []
    model = LabModel(module=module, name="hf:tiny-llama", vocab_size=corpus.vocab_size, context=64,
                     config=module.config.to_dict(), family="llama", blocks=lambda m: list(m.model.layers),
                     save=lambda m, folder: saved.append(folder), lora_targets=("q_proj", "v_proj"))
    rec = fasttrain.lab.run("tiny", model=model, data=corpus, device="cpu", max_steps=3, eval_interval=0,
                            save=str(tmp_path / "saved"), **technique)
    d = rec.to_dict()
    assert len(rec.losses) == 3 and all(l == l for l in rec.losses) and rec.val_loss is not None
    # a model handed in as an object has no config.json to fingerprint: nothing for resume to compare
    assert d["model_source"] == {"name": "hf:tiny-llama", "family": "llama", "vocab_size": corpus.vocab_size,
                                 "context": 64, "config_file": None}
    assert d["model"]["model_type"] == "llama" and saved == [str(tmp_path / "saved")]
    if technique.get("lora_r"):
        # the model's own default targets: q_proj (32 -> 32) and v_proj (32 -> 2 x 8), r (in + out) each, 2 layers
        assert d["params"]["trainable"] == 2 * 4 * ((32 + 32) + (32 + 16))
    if technique.get("gradient_checkpointing"):
        assert getattr(module, "is_activation_checkpointing", None) or module.is_gradient_checkpointing
