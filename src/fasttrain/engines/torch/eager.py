"""torch-eager: the seed study's "Python + PyTorch" row, written the way the tutorials write it.

Per step: a ``DataLoader`` (the shared epoch order through a sampler) collates ``B`` samples, each
converted to a float tensor by the Dataset's ``__getitem__``; the batch is copied to the device;
``nn.Sequential`` forward, ``nn.CrossEntropyLoss``, ``loss.backward()``, ``torch.optim.SGD.step()``.
Nothing is compiled, captured or preloaded. The loss is kept on the device and read back once
per epoch (as the seed's version prints it per epoch), not per step.

fp16/bf16 are ``torch.autocast`` mixed precision (fp32 master weights, fp32 loss); fp16 adds a
``GradScaler``, whose unfused ``step`` reads the overflow flag on the host every step: that sync
is part of what the tutorial recipe costs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fasttrain.contract import batch_bounds
from fasttrain.engines.base import EpochStats, Job
from fasttrain.engines.torch.common import (
    AMP_DTYPES,
    FP16_INIT_SCALE,
    StrictMath,
    TorchSession,
    autocast,
    build_model,
    load_weights,
    resolve_device,
    to_tensor_inputs,
)


class MnistTensors(torch.utils.data.Dataset):
    """The tutorial Dataset: sample ``i`` becomes a float tensor ``pixel / 255`` of 784 features."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, dtype: torch.dtype):
        self.images = images
        self.labels = labels
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        # torch.tensor copies the 784 bytes, as ToTensor does: loaded datasets are read-only arrays.
        x = torch.tensor(self.images[i]).to(self.dtype).div_(255.0).reshape(-1)
        return x, int(self.labels[i])


class EpochOrderSampler(torch.utils.data.Sampler):
    """Yields the shared epoch order, set by the session before each epoch."""

    def __init__(self, n: int):
        self.order = np.arange(n)

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        return iter(self.order.tolist())


class EagerSession(TorchSession):
    def __init__(self, job: Job, options):
        config = job.config
        self.strict = StrictMath()
        self.device = resolve_device(options.device)
        self.config = config
        self.amp_dtype = AMP_DTYPES.get(config.precision)
        self.dtype = torch.float64 if config.precision == "fp64" else torch.float32
        self.model = build_model(job.spec, job.init_weights, self.device, self.dtype)
        self.init_weights = job.init_weights
        self.loss_fn = nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=config.lr)
        self.scaler = self._new_scaler()
        data = job.data
        self.sampler = EpochOrderSampler(data.n_train)
        self.loader = torch.utils.data.DataLoader(
            MnistTensors(data.train_images, data.train_labels, self.dtype),
            batch_size=config.batch_size,
            sampler=self.sampler,
            drop_last=config.drop_last,
            num_workers=options.num_workers,
        )
        self.n_batches = len(batch_bounds(data.n_train, config.batch_size, config.drop_last))
        self.test_x = to_tensor_inputs(data.test_images).to(self.device)
        self.test_y = torch.from_numpy(data.test_labels.astype(np.int64)).to(self.device)
        self._warm_up(data)
        self.sync()

    def _new_scaler(self):
        return torch.amp.GradScaler(self.device.type, init_scale=FP16_INIT_SCALE,
                                    enabled=self.config.precision == "fp16")

    def _warm_up(self, data) -> None:
        """One step on a scratch batch so CUDA context, cuBLAS handles and kernels load outside the
        timed epochs; then the initial weights and scaler state go back (warm-up must not train)."""
        self.sampler.order = np.arange(min(self.config.batch_size, data.n_train))
        self._run(steps=1)
        load_weights(self.model, self.init_weights)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler = self._new_scaler()  # a fresh scale and growth count, as at the start of training

    def _run(self, steps: int):
        losses, corrects, counts = [], [], []
        for k, (x, y) in enumerate(self.loader):
            if k == steps:
                break
            x, y = x.to(self.device), y.to(self.device)
            with autocast(self.device.type, self.amp_dtype):
                logits = self.model(x)
            loss = self.loss_fn(logits.to(self.dtype), y)  # softmax and loss in fp32 (fp64 under fp64)
            self.optimizer.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            losses.append(loss.detach())
            corrects.append((logits.argmax(dim=1) == y).sum())
            counts.append(len(y))
        return losses, corrects, counts

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        self.sampler.order = order
        losses, corrects, counts = self._run(steps)
        # One read per epoch: the per-step losses stayed on the device until here.
        step_losses = torch.stack(losses).double().cpu().numpy()
        correct = int(torch.stack(corrects).sum().item())
        counts = np.asarray(counts)
        return EpochStats(count=int(counts.sum()), loss_sum=float(step_losses @ counts), correct=correct,
                          step_losses=step_losses)

    def close(self) -> None:
        self.strict.restore()
