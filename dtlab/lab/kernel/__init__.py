"""The kernel side of the live cluster: what runs in the notebook's own process to
start, drive and stop the engines (:mod:`dtlab.lab.engine` is the code that runs
inside them). Taught from chapter 01 on; ``from dtlab.lab import start`` is the
entry point.

- :mod:`~dtlab.lab.kernel.cluster`: :class:`~dtlab.lab.kernel.cluster.LabCluster`,
  start, reset, restart and stop the engines, run a function on every rank;
  :mod:`~dtlab.lab.kernel.placement`: which rank goes where;
  :mod:`~dtlab.lab.kernel.waiting`: waiting for the ranks, interruptibly;
  :mod:`~dtlab.lab.kernel.failures`: the errors, and what each rank was doing;
  :mod:`~dtlab.lab.kernel.processes`: the engines as processes;
  :mod:`~dtlab.lab.kernel.replacing`: a dropped engine named, and replaced;
  :mod:`~dtlab.lab.kernel.shipping`: how a function travels to the engines;
  :mod:`~dtlab.lab.kernel.netns`: a second host on one machine;
- :mod:`~dtlab.lab.kernel.notebook`: ``start()``, the notebook's cluster, which
  ``%%px`` and :mod:`~dtlab.lab.kernel.magics` (``%%rank``, ``%ranks``, ``%push``,
  ``%pull``, ``%status``) follow; :mod:`~dtlab.lab.kernel.output`: one output area
  per rank; :mod:`~dtlab.lab.kernel.variables`: push and pull;
  :mod:`~dtlab.lab.kernel.status`: every rank at a glance;
- :mod:`~dtlab.lab.kernel.lifeline` (run in every process of the cluster) and
  :mod:`~dtlab.lab.kernel.teardown` (in the kernel): nothing outlives its kernel;
- :mod:`~dtlab.lab.kernel.training`: training on the cluster, live or in the
  background; :mod:`~dtlab.lab.kernel.replicas`: a run that survives a lost
  replica; :mod:`~dtlab.lab.kernel.timing`: how long the cluster makes a learner
  wait.

Where ipyparallel already does the job, dtlab uses it: engines are ipyparallel's,
started by its ``Cluster``; ``%%px`` is ipyparallel's magic; push and pull go
through ``DirectView.push``/``pull``. dtlab's own versions remain where the course
needs more than ipyparallel gives: ``%%rank`` and :mod:`~dtlab.lab.kernel.output`
keep one output area per rank, labelled by rank and filled while the ranks run
(``%%px`` interleaves their lines as they arrive, labelled by engine);
:mod:`~dtlab.lab.kernel.waiting` names a dead or stopped rank instead of waiting on
it; the lifeline ends every process with its kernel.
"""
