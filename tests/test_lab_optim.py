"""The lab's batched Muon on the CPU: the stacked Newton-Schulz equals the per-matrix one, an optimizer step
matches torch.optim.Muon's and lowers the loss of a tiny model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import optim as lab_optim  # noqa: E402


def test_batched_orthogonalization_equals_the_per_matrix_one():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 24, 40, generator=gen)
    tall = torch.randn(3, 40, 24, generator=gen)
    for stack in (wide, tall):
        batched = lab_optim.orthogonalize(stack).float()
        each = torch.stack([lab_optim.orthogonalize_each(m) for m in stack]).float()
        assert batched.shape == stack.shape and batched.dtype == torch.float32
        # bf16 sums in the same order: equal up to a few bf16 rounding steps
        assert torch.allclose(batched, each, atol=2e-2, rtol=0), (batched - each).abs().max()
        # and what it is for: singular values pulled from anywhere into a band around 1
        s = torch.linalg.svdvals(batched)
        assert s.min() > 0.5 and s.max() < 1.3, s


def test_the_per_matrix_form_is_torchs_own():
    ref = getattr(getattr(torch.optim, "_muon", None), "_zeropower_via_newtonschulz", None)
    if ref is None:
        pytest.skip("this torch has no torch.optim._muon")
    g = torch.randn(40, 24, generator=torch.Generator().manual_seed(1))
    ours = lab_optim.orthogonalize_each(g)
    theirs = ref(g, lab_optim.NS_COEFFICIENTS, lab_optim.NS_STEPS, 1e-7)
    assert torch.equal(ours, theirs)


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32, bias=False), torch.nn.Tanh(), torch.nn.Linear(32, 16, bias=False))


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def test_a_step_matches_torch_muon_and_the_loss_goes_down():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    y = torch.sin(x)
    ours, ref = _tiny_model(), _tiny_model()
    opt = lab_optim.batched_muon(list(ours.parameters()), lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    if hasattr(torch.optim, "Muon"):
        ref_opt = torch.optim.Muon(list(ref.parameters()), lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    else:
        ref_opt = None
    first = _loss(ours, x, y).item()
    for _ in range(15):
        for model, o in ((ours, opt), (ref, ref_opt)):
            if o is None:
                continue
            o.zero_grad()
            _loss(model, x, y).backward()
            o.step()
    assert _loss(ours, x, y).item() < 0.7 * first
    if ref_opt is not None:
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert torch.allclose(p, q, atol=1e-3), (p - q).abs().max()
    # one fp32 momentum buffer per matrix, as torch's Muon keeps
    assert all(set(s) == {"momentum_buffer"} for s in opt.state.values()) and len(opt.state) == 3


def test_muon_refuses_a_vector():
    with pytest.raises(FasttrainError, match="2-D matrices only"):
        lab_optim.batched_muon([torch.nn.Parameter(torch.zeros(4))])


def test_a_tensor_learning_rate_gives_the_float_ones_step():
    """A captured CUDA graph reads the learning rate from a tensor the schedule fills: same update."""
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(3))
    a, b = _tiny_model(), _tiny_model()
    opt_a = lab_optim.batched_muon(list(a.parameters()), lr=0.02, adjust_lr_fn="match_rms_adamw")
    opt_b = lab_optim.batched_muon(list(b.parameters()), lr=torch.tensor(0.02), adjust_lr_fn="match_rms_adamw")
    for model, opt in ((a, opt_a), (b, opt_b)):
        for _ in range(3):
            opt.zero_grad()
            _loss(model, x, torch.cos(x)).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
