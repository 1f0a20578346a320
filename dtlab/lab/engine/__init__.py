"""Everything that runs inside an engine of the live cluster.

Taught in chapter 01 (what an engine is), used by every chapter that starts one.

The notebook side (:mod:`dtlab.lab.kernel.cluster`) starts one ipyparallel engine per
rank and calls the functions of this package there, each in that engine's own process:

- :mod:`~dtlab.lab.engine.state`: which rank this engine is, in which world, and
  whether that world is still usable; the namespace ``%%px`` cells run in;
- :mod:`~dtlab.lab.engine.world`: join the world (:func:`~.world.setup`), report
  where the engine runs, its health, and leave;
- :mod:`~dtlab.lab.engine.board`: the status file in which a rank says what it is
  doing, readable by the notebook while the rank is stuck or after it died;
- :mod:`~dtlab.lab.engine.failfast`: tear the world down on an error so that the
  peers fail within milliseconds instead of waiting out the timeout;
- :mod:`~dtlab.lab.engine.call`: run the user's function with telemetry on and
  carry a failure back with the rank, the time and what the rank was doing;
- :mod:`~dtlab.lab.engine.publish`: the telemetry sink that streams events to the
  notebook through ipyparallel's data publication;
- :mod:`~dtlab.lab.engine.stop`: the signal handler the Stop button reaches;
- :mod:`~dtlab.lab.engine.training`: the training loops the notebook's
  :func:`dtlab.lab.kernel.training.train_on_cluster` and
  :func:`~dtlab.lab.kernel.training.start_run` run;
- :mod:`~dtlab.lab.engine.replica`: a training run that keeps copies of its state,
  to resume on a new engine from a replica's (:mod:`dtlab.lab.kernel.replicas`);
- :mod:`~dtlab.lab.engine.rawdist`: raw ``torch.distributed`` calls recorded on
  the board like ``dtlab.comm``'s;
- :mod:`~dtlab.lab.engine.drill`: the interview drill's runs on every rank;
- :mod:`~dtlab.lab.engine.collectives`: the collectives the README picture times.

Nothing here imports the notebook side: a function of this package reads and
writes only its own engine's state.
"""
