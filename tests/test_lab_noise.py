"""Known-harmless third-party noise (fasttrain.lab.noise): dropped and counted; anything else from
the same loggers still comes through."""

from __future__ import annotations

import logging

from fasttrain.lab import noise


def test_known_lines_are_dropped_and_summarized_others_kept(caplog):
    noise.filter_known_noise()
    noise.filter_known_noise()                  # idempotent: one filter per logger
    assert len(logging.getLogger("torchao").filters) >= 1
    before = {f.meaning: f.count for f in noise._installed}
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310.so: nope")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
            "opaque value type.")
        logging.getLogger("torchao").warning("a real problem")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["a real problem"]
    torchao = {meaning for name, _, meaning in noise.KNOWN if name in ("torchao", "torch.utils._pytree")}
    assert {f.meaning: f.count for f in noise._installed} == {k: v + (k in torchao) for k, v in before.items()}
    line = noise.summary()
    assert line.startswith("third-party notes left out: torchao's prebuilt C++ extensions do not load here")


def test_liger_transformers_and_warnings_noise_dropped_others_shown(caplog, monkeypatch):
    import warnings

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda *a, **k: shown.append(str(a[0])))
    monkeypatch.setattr(noise, "_installed", [])
    monkeypatch.setattr(noise, "_warnings", [])
    for name, *_ in noise.KNOWN:                       # the filters of earlier tests, put back afterwards
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    noise.filter_known_noise()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("liger_kernel.backends.registry").warning(
            "Backend impl '%s' for op '%s' could not be imported: %s: %s", "liger_kernel.ops.backends._cutedsl.rope",
            "rope", "ImportError", "cutedsl backend requires the NVIDIA CUTLASS Python DSL")
        logging.getLogger("transformers.configuration_utils").warning(
            "`use_return_dict` is deprecated! Use `return_dict` instead!")
        logging.getLogger("liger_kernel.backends.registry").warning("a kernel failed")
    assert [r.getMessage() for r in caplog.records] == ["a kernel failed"]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = noise._warnings[0]          # catch_warnings restores the one installed above
        warnings.warn_explicit("invalid escape sequence '\\.'", SyntaxWarning,
                               "/tmp/site/torchao/quantization/quant_api.py", 1542)
        warnings.warn_explicit("invalid escape sequence '\\.'", SyntaxWarning, "/home/me/mine.py", 3)
        warnings.warn("Dynamo detected a call to a `functools.lru_cache`-wrapped function at 'swiglu.py:34'. "
                      "Dynamo ignores the cache wrapper", UserWarning)
        warnings.warn("TensorFloat32 tensor cores available but not enabled", UserWarning)
    assert shown == ["invalid escape sequence '\\.'", "TensorFloat32 tensor cores available but not enabled"]
    line = noise.summary()
    assert "liger-kernel's backends for other hardware" in line and "use_return_dict" in line
    assert "torchao's docstrings' invalid escape sequences (warned when its sources compile) (1 line)" in line and "liger-kernel's cached SwiGLU" in line
