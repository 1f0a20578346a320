"""``dtlab bench``: dtlab against PyTorch's own implementations, and measurements
against :mod:`dtlab.estimate`, in one run and one table.

One module per comparison, each with a ``run(**settings)`` that starts fresh
processes and returns raw results: :mod:`~dtlab.bench.ddp`, :mod:`~dtlab.bench.zero`,
:mod:`~dtlab.bench.tensor_parallel`, :mod:`~dtlab.bench.pipeline`,
:mod:`~dtlab.bench.composed` (dp × tp) and :mod:`~dtlab.bench.telemetry` (bytes and
memory against the estimates, the recorder's cost). :mod:`~dtlab.bench.table` runs
them and turns their results into the table's rows; ``dtlab bench`` (:mod:`dtlab.cli`)
prints it.
"""

from dtlab.bench.table import PARTS, assemble, collect, format_table, report

__all__ = ["PARTS", "collect", "assemble", "format_table", "report"]
