"""lab/measure.py: the process-wide switches a run sets are the ones the process already uses, and restored."""

import subprocess
import sys
import textwrap


def run_isolated(code: str) -> str:
    # PyTorch's precision switches are process-wide and, once the newer family is set, the legacy getters
    # raise for the rest of the process: each case runs in a process of its own
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_tf32_matmuls_sets_and_restores_the_legacy_switches():
    out = run_isolated("""
        import torch
        from fasttrain.lab.measure import tf32_matmuls
        torch.backends.cudnn.allow_tf32 = False
        with tf32_matmuls(True):
            print(torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
        print(torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    """)
    assert out.split() == ["high", "True", "highest", "False"]


def test_tf32_matmuls_works_after_the_newer_switches_were_set_as_the_hf_trainer_sets_them():
    # after `matmul.fp32_precision = "tf32"` the legacy getter raises "mix of the legacy and new APIs":
    # a lab run in that process must use the newer switches, not fail
    out = run_isolated("""
        import torch
        from fasttrain.lab.measure import tf32_matmuls
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        try:
            torch.get_float32_matmul_precision()
            print("legacy-readable")
        except RuntimeError:
            print("legacy-refused")
        with tf32_matmuls(False):
            print(torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision)
        with tf32_matmuls(True):
            print(torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision)
        print(torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision)
    """)
    words = out.split()
    assert words[0] == "legacy-refused"     # the state the HF Trainer leaves, reproduced
    assert words[1:] == ["ieee", "ieee", "tf32", "tf32", "tf32", "none"]
