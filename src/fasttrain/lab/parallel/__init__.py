"""Running a lab run on several processes: the world, the mesh and the strategies (:mod:`.distributed`); starting
the processes with torchrun and the options ``fasttrain lab`` takes for it (:mod:`.launch`). The strategy sweep
``fasttrain lab dist`` is an experiment above this wing (:mod:`fasttrain.lab.experiments.scaling`)."""
