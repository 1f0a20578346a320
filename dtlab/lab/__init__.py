"""The notebook layer: the live cluster, control panels and live figures.

The only part of dtlab that imports ipyparallel, ipywidgets and plotly. Which
process a function runs in is told by where it lives:

- :mod:`dtlab.lab.engine`: everything that runs *inside an engine*, one process
  per rank (joining the world, running the user's function, the status board,
  fail-fast, the Stop handler, the training loops, the drill's runs, the telemetry
  sink that streams to the notebook);
- everything else runs in the *notebook's* kernel:

  - :mod:`~dtlab.lab.cluster`: start, reset, restart and stop the engines; run a
    function on every rank (:mod:`~dtlab.lab.placement`: which rank goes where;
    :mod:`~dtlab.lab.waiting`: waiting for the ranks;
    :mod:`~dtlab.lab.failures`: the errors, and what each rank was doing;
    :mod:`~dtlab.lab.processes`: the engines as processes;
    :mod:`~dtlab.lab.engines`: a dropped engine named, and replaced;
    :mod:`~dtlab.lab.shipping`: how a function travels to the engines);
  - :mod:`~dtlab.lab.notebook`: ``start()``, the notebook's cluster, which
    ``%%px`` and :mod:`~dtlab.lab.magics` (``%%rank``, ``%ranks``, ``%push``,
    ``%pull``, ``%status``) follow; :mod:`~dtlab.lab.output`: one output area per
    rank; :mod:`~dtlab.lab.variables`: push and pull; :mod:`~dtlab.lab.status`:
    every rank at a glance;
  - :mod:`~dtlab.lab.lifeline` (run in every process of the cluster) and
    :mod:`~dtlab.lab.teardown` (in the kernel): nothing outlives its kernel;
  - :mod:`~dtlab.lab.replicas`: a training run that survives a lost replica;
  - :mod:`~dtlab.lab.timing`: how long the cluster makes a learner wait;
  - :mod:`~dtlab.lab.training`: training on the cluster, live or in the background;
  - :mod:`~dtlab.lab.figures`: every chapter's figures, the dashboard, live figures;
  - :mod:`~dtlab.lab.widgets` (the control panel), :mod:`~dtlab.lab.planner` (the
    planner panel), :mod:`~dtlab.lab.drill` (the interview drill);
  - :mod:`~dtlab.lab.predictions`: the learner's predictions (``predict``,
    ``compare``, ``prediction_log``), kept on disk across the course;
  - :mod:`~dtlab.lab.snapshot`: the README picture, ``python -m dtlab.lab.snapshot``.
"""

from dtlab.lab.cluster import LabCluster
from dtlab.lab.failures import EngineDied
from dtlab.lab.notebook import start
from dtlab.lab.predictions import compare, predict, prediction_log
from dtlab.lab.teardown import stop_all
from dtlab.launch import RankError

__all__ = [
    "EngineDied",
    "LabCluster",
    "RankError",
    "compare",
    "predict",
    "prediction_log",
    "start",
    "stop_all",
]
