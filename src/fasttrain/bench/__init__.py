"""Timing, benchmark suites and reports.

Commands: ``fasttrain bench ladder|sweep|curves|all`` run the suites (``bench lab``: the lecture's table
of single-GPU techniques measured on the lab's transformer, :mod:`fasttrain.bench.lab`) (``--quick`` for a short smoke
run; ``--engines``, ``--repeats``, ``--hidden``, ``--out``; ``--list`` shows what would run and why
not); results land in ``results/<gpu-or-cpu-slug>/`` as ``<suite>.json`` (every run record),
``<suite>.csv`` (long format), ``<suite>.md`` and PNG plots, and a run merges with the results
already there. ``bench merge`` folds runs split over several calls, ``bench render`` redraws the
reports from the JSON (e.g. after a machine without matplotlib), ``bench readme`` prints (or, with
``--into results/README.md``, writes) a section of the results index from committed result files.

Layout: each suite is a module of :mod:`fasttrain.bench.suites` whose ``SPEC`` carries its builder,
its Markdown, its plots and (where its cases are not single runs) its runner; :mod:`~fasttrain.bench.runner`
and :mod:`~fasttrain.bench.report` reach a suite only through that registration, and the pieces every
report shares are :mod:`~fasttrain.bench.tables` and :mod:`~fasttrain.bench.figures`.

Protocol
--------
What is timed. Every run goes through the shared driver (:func:`fasttrain.training.run`), so every
engine is measured the same way (:mod:`fasttrain.timing` is the one definition): an epoch's
time runs from just before ``train_epoch`` is called to the end of its device work, with the
session's ``sync()`` (a device synchronization on GPUs) before the clock is read at both ends.
Test-set evaluation is timed apart (``eval_ms``) and is not in the epoch time.

Warm-up. Data upload, compilation (``torch.compile``, XLA, NVRTC, Triton), autotuning, CUDA graph
capture and warm-up steps happen in the engine's ``prepare`` and are reported apart as
``setup_ms``; they never fall inside an epoch. ``total_ms`` is the wall time of the whole run:
setup, every epoch and every evaluation.

Figures. The ladder's figure is the seed study's: the mean epoch time over the second half of
training (epochs n//2+1..n, once caches and clocks are warm). The sweep's figure is the training
time of the whole run (the sum of its epochs' times: all 5000 SGD steps, no setup, no evaluation).
Each row is run ``--repeats`` times with seeds 0, 1, ...; tables give the median (p50) across those
runs with the 20th and 80th percentiles (NumPy's linear interpolation) and ``n``; accuracy is the
mean over seeds. Runs of one suite execute one after another in one process, never concurrently;
between runs the harness returns cached device memory (PyTorch's and CuPy's pools), and JAX is
told not to preallocate 75% of the GPU (``XLA_PYTHON_CLIENT_PREALLOCATE=false``) so that it does not
starve the engines after it.

Recorded environment. Every run record holds the CPU model and core count, the GPU's name,
driver, memory and maximum SM/memory clocks (``nvidia-smi``), the Python version, the versions of
numpy/torch/jax/triton/cupy/nvmath/cuDNN, the engine's own facts (device, flags) and the git sha
(``-dirty`` when the tree had uncommitted changes). The CSV repeats GPU, versions and sha on every
line; the JSON keeps the full run records.

Fairness. All engines start from the same float64 initial weights and see the same batches in the
same order (:mod:`fasttrain.contract`); the curves suite checks this by comparing every engine's
loss curve to the NumPy float64 reference. The seed study's figures are printed beside ours for
orientation only: they were measured elsewhere, on an unknown GPU.
"""
