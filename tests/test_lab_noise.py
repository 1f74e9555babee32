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
    assert {f.meaning: f.count for f in noise._installed} == {k: v + 1 for k, v in before.items()}
    line = noise.summary()
    assert line.startswith("third-party notes left out: torchao's prebuilt C++ extensions do not load here")
