"""``fasttrain tune``: the fastest configuration of a model that fits this device, predicted then measured.

The space is rows of :class:`~fasttrain.lab.config.LabConfig` overrides over the lab's one trainer
(tune has no loop of its own): by default only what keeps the training math -- the same optimizer,
the same tokens per optimizer step ``T``:

- micro-batch ``b`` x accumulation ``k`` with ``b k seq = T`` (so ``b`` runs over the divisors of ``T / seq``);
- bf16 autocast (tf32 or fp16 where asked, ``precisions=``);
- the attention implementation (eager, sdpa);
- ``torch.compile`` (none, default, reduce-overhead -- CUDA graphs of the step's forward and backward, the
  batches' shapes being fixed --; per block where the lab has the setting);
- activation checkpointing (none, selective, full);
- liger-kernel's fused kernels (all of a family's, or its fused linear cross-entropy alone; a transformers
  family liger has no patch for, GPT-2, gets that one alone on its head);
- the AdamW implementation (for-each, fused);
- data preloading.

Techniques that change the math (LoRA, prompt tuning, 8-bit AdamW, Adafactor) join only when asked
(``allow=("lora", "adamw_8bit", ...)``). A setting the user fixed (``fixed=``) is not searched.

Predict, then measure:

1. every configuration's peak is predicted by the memory estimator (``predict(cfg) -> bytes``); one
   whose ``predicted x (1 + reserve) + context`` exceeds the device's memory is pruned before
   anything is allocated (``context``: what is already taken on the device -- the CUDA context,
   other processes -- and ``reserve``: the caching allocator's reserved-over-allocated fraction,
   measured once on this device and raised by every probe that reserves more);
2. the survivors are measured by short runs through the lab's trainer (``measure(cfg, steps) ->
   Probe``, injected so that the search is testable with fakes). When they are few, all of them
   enter successive halving; when they are many, a screen first measures one change at a time
   from the plain configuration (every axis' first choice: the lab's GPT with eager attention, a
   transformers model with sdpa, its library's default; each at its largest predicted-fitting micro-batch), a
   multiplicative model ranks the combinations of every axis' choices
   (``speed(c) = speed(base) prod_axis speed(base with c's choice) / speed(base)``), and the
   halving's first rung takes the best-ranked combination, the screen's fastest, the best-ranked
   combination with each of its changes undone or swapped for another measured choice of its axis
   (changes that help alone can hurt together), then the ranking;
3. successive halving: every candidate of a rung runs ``s`` timed steps (3 at the first rung, after
   untimed ones that cover compilation and CUDA graphs' recording: ``warmup_steps_for``; the screen's
   probes time one step); the faster half goes on with ``eta s`` steps (``eta = 2``); the last one
   standing is the pick. An out-of-memory probe is recorded, its memory freed, and every larger
   micro-batch of the same settings is skipped; a probe that fails (a library that cannot run its
   choices together) has no candidate holding all of its choices tried after it, and the first rung
   goes further down the ranking instead;
4. ``budget_s`` bounds the search: no probe starts after it, a running probe is stopped at it, and the
   answer is the best so far (a probe cut by the budget is no measurement: what its configuration
   measured before stands). A probe is also stopped once it has run ``SLOW_GRACE_S`` plus
   ``SLOW_FACTOR`` times its steps at the best speed so far (it cannot win; a pathological
   configuration must not spend the budget).

Probes run at a constant learning rate (the configuration's peak one, no warm-up) so that the
loss after a probe's steps is comparable across probes: a configuration that trains differently
(the opt-in techniques, or a numerical problem) shows in its loss against the baseline's.

Measured probes are cached in a JSON file keyed by (model, device, versions, configuration,
steps): a second call measures nothing it has measured before.

The package, one concern a file: :mod:`.space` (axes, candidates, a probe's measurement), :mod:`.device` (the
device's memory, the probe cache), :mod:`.search` (pure: measure, predict and clock injected), :mod:`.probes`
(prediction and probes through the lab's trainer), :mod:`.run` (``tune()``), :mod:`.report`, :mod:`.cli`.
"""

from __future__ import annotations

from fasttrain.lab.tune.space import Axis, Candidate, MIB, PER_BLOCK_COMPILE, PRECISION_OVERRIDES, Probe, build_axes, enumerate_space, liger_support, make_candidate, micro_batches, parse_allow, parse_budget  # noqa: F401
from fasttrain.lab.tune.device import DeviceMemory, ProbeCache, default_cache_path, device_memory, identity, probe_cache  # noqa: F401
from fasttrain.lab.tune.search import BUDGET_ENDS, CPU_NOTE, Entry, SLOW_FACTOR, SLOW_GRACE_S, Search, TuneResult, check_shape, nothing_fits_message, rank, run_probe, search, slow_probe_limit  # noqa: F401
from fasttrain.lab.tune.probes import ProbeStopped, WARM_MICRO_STEPS, lab_measure, lab_predictor, load_corpus_for, model_of, model_refusal, probe_config, warmup_steps_for  # noqa: F401
from fasttrain.lab.tune.run import tune  # noqa: F401
