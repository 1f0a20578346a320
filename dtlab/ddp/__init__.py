"""Data parallelism, chapter 02.

- :mod:`dtlab.ddp.reducer`: :class:`DistributedDataParallel`, the wrapper whose
  per-parameter hooks launch each bucket's all-reduce while backward runs;
- :mod:`dtlab.ddp.buckets`: which gradients travel together, in which order;
- :mod:`dtlab.ddp.unused`: ``find_unused_parameters``;
- :mod:`dtlab.ddp.timing`: overlap and the telemetry chapter 02 plots.

PyTorch's old single-process ``nn.DataParallel``, for comparison, is
:class:`dtlab.data_parallel.DataParallel` (also importable from here).
"""

from dtlab.data_parallel import DataParallel
from dtlab.ddp.buckets import MB, Bucket
from dtlab.ddp.reducer import DistributedDataParallel

__all__ = ["DistributedDataParallel", "Bucket", "MB", "DataParallel"]
