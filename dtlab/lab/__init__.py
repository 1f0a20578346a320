"""The notebook layer: the live cluster, control panels and live figures.

The only part of dtlab that imports ipyparallel, ipywidgets and plotly. Which
process a function runs in is told by where it lives:

- :mod:`dtlab.lab.engine`: everything that runs *inside an engine*, one process
  per rank (joining the world, running the user's function, the status board,
  fail-fast, the Stop handler, the training loops, the drill's runs, the telemetry
  sink that streams to the notebook);
- :mod:`dtlab.lab.kernel`: everything that runs in the *notebook's kernel* to drive
  the engines (start, run, wait, fail, replace, tear down; the ``%%rank`` magics,
  push and pull, per-rank output; training on the cluster);
- what the learner sees, also in the kernel: :mod:`~dtlab.lab.figures` (every
  chapter's figures, the dashboard, live figures), :mod:`~dtlab.lab.widgets` (the
  control panel), :mod:`~dtlab.lab.planner_panel` (the planner panel),
  :mod:`~dtlab.lab.drill` (the interview drill), :mod:`~dtlab.lab.lessons` (each
  chapter's helpers), :mod:`~dtlab.lab.predictions` (``predict``, ``compare``,
  ``prediction_log``, kept on disk across the course), :mod:`~dtlab.lab.source`
  (dtlab's code on the page) and :mod:`~dtlab.lab.snapshot` (the README picture,
  ``python -m dtlab.lab.snapshot``).
"""

from dtlab.lab.kernel.cluster import LabCluster
from dtlab.lab.kernel.failures import EngineDied
from dtlab.lab.kernel.notebook import start
from dtlab.lab.kernel.teardown import stop_all
from dtlab.lab.predictions import compare, predict, prediction_log
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
