"""Running a lab run on several processes: the world, the mesh and the strategies (:mod:`.distributed`); starting
the processes with torchrun and `fasttrain lab dist` (:mod:`.launch`)."""
