"""Experiments over the lab's one trainer, each rows of configuration and a runner (:mod:`.experiment`): the
speedrun, its protocol and report, cold start, scaling, the timing pitfall, the memory check, the summation demo."""
