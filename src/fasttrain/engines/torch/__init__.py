"""PyTorch engines: ``torch-eager`` (the tutorial row) and ``torch-fast`` (every seed optimization a flag).

No torch import here: the classes import it inside ``prepare``.
"""

from fasttrain.engines.torch.engines import TorchEagerEngine, TorchFastEngine

ENGINES = [TorchEagerEngine, TorchFastEngine]
