"""The notebook layer: the live cluster, control panels and live figures.

The only part of dtlab that imports ipyparallel, ipywidgets and plotly (lazily, so
``import dtlab.lab`` stays cheap)."""

from dtlab.lab.cluster import LabCluster, start, stop_all
from dtlab.lab.failures import EngineDied
from dtlab.launch import RankError

__all__ = ["EngineDied", "LabCluster", "RankError", "start", "stop_all"]
