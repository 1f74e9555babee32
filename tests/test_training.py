"""`fasttrain.train` and `evaluate_weights` in Python: every bad argument refused before any work with
one clear message, result files written whole, divergence detected and recorded as strict JSON."""

from __future__ import annotations

import json
import stat

import numpy as np
import pytest


def small_data():
    """256 training and 64 test examples: the smallest data the checks below need."""
    from fasttrain.data.synthetic import synthetic_dataset

    return synthetic_dataset(256, 64)


def test_output_path_checks_in_the_python_api(tmp_path):
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match="name the same file"):
        fasttrain.train("numpy", "logreg", data=small_data(), epochs=1, out=tmp_path / "x", save_weights_to=tmp_path / "x")
    with pytest.raises(fasttrain.FasttrainError, match="that is a folder"):
        fasttrain.train("numpy", "logreg", data=small_data(), epochs=1, out=tmp_path)
    with pytest.raises(fasttrain.FasttrainError, match="is a folder, not a weights file"):
        fasttrain.load_weights(tmp_path)


def test_result_files_get_the_usual_mode(tmp_path):
    import fasttrain
    from fasttrain.files import default_file_mode

    fasttrain.train("numpy", "logreg", data=small_data(), epochs=1, out=tmp_path / "run.json",
                    save_weights_to=tmp_path / "w.npz")
    for name in ("run.json", "w.npz"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == default_file_mode(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "w.npz"]  # no temporary file left


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(seed=-1), "seed must be"), (dict(epochs=10**12), "epochs must be"), (dict(batch_size=True), "batch_size"),
    (dict(lr=float("nan")), "lr must be"), (dict(steps=2.5), "steps must be"),
])
def test_ranges_in_the_python_api(kwargs, pattern):
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match=pattern):
        fasttrain.default_config("logreg", **kwargs)
    with pytest.raises(fasttrain.FasttrainError, match=pattern):
        fasttrain.train("numpy", "logreg", data=small_data(), **kwargs)


def test_engine_option_ranges_in_the_python_api():
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match="--threads must be between 0 and 1024"):
        fasttrain.train("numpy", "logreg", data=small_data(), epochs=1, engine_options={"threads": -1})


def test_batch_larger_than_the_dataset_is_refused():
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match="batch size 1000 is larger than the 256 training examples; "
                                                       "give --batch-size at most 256"):
        fasttrain.train("numpy", "logreg", data=small_data(), epochs=1, batch_size=1000)


def test_divergence_is_detected_said_and_recorded_as_strict_json(tmp_path):
    import fasttrain

    out = tmp_path / "run.json"
    record = fasttrain.train("numpy", "logreg", data=small_data(), epochs=5, lr=1e38, out=out)
    assert record.diverged is not None and record.diverged["epoch"] == 1
    assert len(record.epochs) == 1  # stopped: later epochs would only train NaN weights
    text = out.read_text()
    data = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in the run record"))
    assert data["diverged"]["what"] == "train loss" and data["final"]["test_loss"] is None


def test_evaluate_weights_api_checks_too(tmp_path):
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match="NaN or inf"):
        fasttrain.evaluate_weights([(np.full((784, 10), np.nan), np.zeros(10))], small_data())
    with pytest.raises(fasttrain.FasttrainError, match="expected \\(784, width\\)"):
        fasttrain.evaluate_weights([(np.zeros((10, 784)), np.zeros(784))], small_data())
