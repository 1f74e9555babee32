"""The cold start's tools on the CPU: the compile cache's checks (bad paths, a file that is no cache), the
regional compilation's shape, the optimizer reset in place; the captured whole step on the GPU."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab.experiments import coldstart  # noqa: E402


def test_compile_cache_paths_are_checked_before_any_work(tmp_path):
    with pytest.raises(FasttrainError, match="not a file"):
        coldstart.check_compile_cache(tmp_path)
    with pytest.raises(FasttrainError, match="does not exist; create it first"):
        coldstart.check_compile_cache(tmp_path / "no" / "cache.bin")
    fresh = tmp_path / "cache.bin"
    assert coldstart.load_compile_cache(fresh) == {"path": str(fresh), "loaded": False, "bytes": 0, "load_s": 0.0}


def test_a_file_that_is_not_a_compile_cache_is_one_line(tmp_path):
    bad = tmp_path / "cache.bin"
    bad.write_bytes(b"this is not a cache")
    with pytest.raises(FasttrainError) as info:
        coldstart.load_compile_cache(bad)
    text = str(info.value)
    assert "not a torch compile cache" in text and "delete it" in text and "\n" not in text
    assert bad.read_bytes() == b"this is not a cache"        # nothing lost


def test_saving_with_nothing_compiled_writes_nothing(tmp_path):
    # a fresh process: the compiler's artifacts are per process, and another test in this worker may
    # have compiled something already
    import subprocess
    import sys

    code = ("import json, sys; from fasttrain.lab.experiments import coldstart; "
            "print(json.dumps(coldstart.save_compile_cache(sys.argv[1])))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache.bin")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["saved"] is False and not (tmp_path / "cache.bin").exists()


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("overrides,message", [
    (dict(torch_compile_backend="tvm"), "unknown --torch-compile-backend 'tvm'"),
    (dict(torch_compile=True, torch_compile_backend="cudagraphs", torch_compile_mode="max-autotune"), "inductor's"),
    (dict(cuda_graph_step=True, torch_compile=True, optim="adamw_torch_fused"), "drop --torch-compile"),
    (dict(cuda_graph_step=True, optim="adamw_torch", preload=True), "adamw_torch_fused or muon"),
    (dict(cuda_graph_step=True, optim="muon"), "add --preload"),
    (dict(cuda_graph_step=True, optim="muon", preload=True, gradient_accumulation_steps=2), "one micro-batch"),
])
def test_bad_compile_options_are_one_line(overrides, message):
    from fasttrain.lab.config import preset

    with pytest.raises(FasttrainError) as info:
        preset("tiny", **overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_cudagraphs_backend_reaches_torch_compile(corpus, monkeypatch):
    from fasttrain.lab.build import make_trainer
    from fasttrain.lab.config import preset

    seen = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: seen.append(kw) or module)
    make_trainer(preset("tiny", torch_compile=True, torch_compile_backend="cudagraphs", device="cpu"), corpus,
                 torch.device("cpu"))
    make_trainer(preset("tiny", torch_compile=True, torch_compile_mode="reduce-overhead", device="cpu"), corpus,
                 torch.device("cpu"))
    assert seen == [{"backend": "cudagraphs"}, {"mode": "reduce-overhead"}]


def test_a_graph_step_on_the_cpu_is_one_line(corpus):
    from fasttrain.lab.config import preset
    from fasttrain.lab.experiments.speedrun import build_trainer

    cfg = preset("tiny", cuda_graph_step=True, optim="adamw_torch_fused", preload=True, device="cpu")
    with pytest.raises(FasttrainError, match="needs a CUDA GPU"):
        build_trainer(cfg, corpus, torch.device("cpu"))


def test_the_optimizer_reset_in_place_restarts_like_a_fresh_one():
    from fasttrain.lab.optim import OptimizerGroup, batched_muon

    torch.manual_seed(0)
    a, b = Tiny(), Tiny()
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 8)

    def make(model):
        mats = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2]
        rest = [p for n, p in model.named_parameters() if not (n.startswith("blocks") and p.dim() == 2)]
        return OptimizerGroup(batched_muon(mats, lr=0.01), torch.optim.AdamW(rest, lr=0.01))

    def train(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    start = {k: v.clone() for k, v in a.state_dict().items()}
    opt_a = make(a)
    train(a, opt_a, 3)                       # state exists and has moved
    tensors = [v for o in opt_a.optimizers for s in o.state.values() for v in s.values()]
    with torch.no_grad():
        a.load_state_dict(start)
    coldstart.reset_optimizer_state(opt_a)
    assert all(v is w for v, w in zip(tensors, [v for o in opt_a.optimizers for s in o.state.values()
                                                 for v in s.values()]))
    train(a, opt_a, 2)
    train(b, make(b), 2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_the_graphed_step_refuses_the_cpu():
    model = Tiny()
    with pytest.raises(FasttrainError, match="need a CUDA device"):
        coldstart.GraphedTrainStep(lambda x, y: model(x).sum(), model.parameters(),
                                   torch.optim.SGD(model.parameters(), lr=0.1), torch.zeros(2, 8), torch.zeros(2))


@pytest.mark.gpu
def test_gpu_the_graphed_step_trains_like_the_eager_one():
    from fasttrain.lab.optim import OptimizerGroup, batched_muon

    torch.manual_seed(0)
    a, b = Tiny().cuda(), Tiny().cuda()
    b.load_state_dict(a.state_dict())
    xs = torch.randn(6, 16, 8, device="cuda")

    def make(model, capturable):
        mats = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2]
        rest = [p for n, p in model.named_parameters() if not (n.startswith("blocks") and p.dim() == 2)]
        lr = torch.tensor(0.01, device="cuda") if capturable else 0.01
        return OptimizerGroup(batched_muon(mats, lr=lr, compile=False),
                              torch.optim.AdamW(rest, lr=lr, fused=True, capturable=capturable))

    def loss_fn(model):
        return lambda x, y: (model(x) - y).square().mean()

    def forward_backward(x, y):
        loss = loss_fn(a)(x, y)
        loss.backward()
        return loss.detach()

    opt_a = make(a, True)
    start = {k: v.clone() for k, v in a.state_dict().items()}
    step = coldstart.GraphedTrainStep(forward_backward, a.parameters(), opt_a, xs[0], xs[0][:, :2], max_grad_norm=1.0)
    with torch.no_grad():                     # the warm-up trained a: back to the start, state zeroed in place
        a.load_state_dict(start)
    coldstart.reset_optimizer_state(opt_a)
    opt_b = make(b, False)
    for x in xs:
        got = step(x, x[:, :2])
        opt_b.zero_grad()
        want = loss_fn(b)(x, x[:, :2])
        want.backward()
        torch.nn.utils.clip_grad_norm_(list(b.parameters()), 1.0)
        opt_b.step()
        assert torch.allclose(got, want.detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-4)


def test_the_plain_lab_refuses_the_graph_step_instead_of_ignoring_it(corpus):
    from fasttrain.lab.build import make_trainer
    from fasttrain.lab.config import preset

    with pytest.raises(FasttrainError, match="speedrun rung"):
        make_trainer(preset("tiny", cuda_graph_step=True, optim="adamw_torch_fused", preload=True, device="cpu"),
                     corpus, torch.device("cpu"))
