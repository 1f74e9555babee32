"""fasttrain: train small neural networks as fast as the hardware allows, and measure what each
optimization buys, every engine held to one float64 reference."""

from fasttrain.contract import ModelSpec, TrainConfig, default_config, epoch_order, initial_weights, parse_model
from fasttrain.errors import DataError, EngineUnavailable, FasttrainError
from fasttrain.sweep import SweepResult, train_sweep
from fasttrain.training import RunRecord, evaluate_weights, load_weights, save_weights, train

__version__ = "0.1.0"

__all__ = [
    "DataError",
    "EngineUnavailable",
    "FasttrainError",
    "ModelSpec",
    "RunRecord",
    "SweepResult",
    "TrainConfig",
    "default_config",
    "epoch_order",
    "evaluate_weights",
    "initial_weights",
    "load_weights",
    "parse_model",
    "save_weights",
    "train",
    "train_sweep",
]
