"""Pipeline parallelism: schedules as data, checked, simulated and executed.

Taught in chapter 05 (pipeline parallelism); chapter 07 composes it with tensor and
data parallelism (:mod:`dtlab.parallelize`).

The model's layers are cut into ``p`` *stages*, one per rank of the ``pp`` axis; a
batch is cut into ``m`` *microbatches* that flow through the stages, activations
forwards and gradients backwards. Which stage does what, and when, is a *schedule*,
and here a schedule is plain data: for every rank an ordered list of actions. A
list can be printed, checked without any process group, turned into the ideal
timeline, executed for real and compared with the measured timeline. One file per
step of that story:

- :mod:`~dtlab.pipeline.schedules`: :class:`Action`, :class:`Schedule` and the
  builders :func:`gpipe`, :func:`one_f_one_b` (1F1B), :func:`interleaved_1f1b`,
  :func:`zb_h1` (:data:`SCHEDULES`, :func:`make_schedule`, :func:`in_flight`).
- :mod:`~dtlab.pipeline.simulator`: :func:`validate` (complete, ordered,
  deadlock-free), :func:`simulate` (the ideal timeline) beside
  :func:`measured_timeline` (the measured one, same format), and :func:`bubble`.
- :mod:`~dtlab.pipeline.stages`: :func:`partition`, :class:`StageModule`,
  :func:`build_stages` (the GPT's layers per rank and chunk).
- :mod:`~dtlab.pipeline.executor`: :class:`Pipeline` runs a schedule over
  ``isend``/``irecv`` (its bookkeeping in :mod:`~dtlab.pipeline.step_state`);
  :func:`train_pipeline` trains with it.
"""

from dtlab.pipeline.executor import Pipeline, train_pipeline
from dtlab.pipeline.schedules import (
    COMPUTE,
    MESSAGES,
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    from_compute_orders,
    gpipe,
    in_flight,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zb_h1,
)
from dtlab.pipeline.simulator import bubble, measured_timeline, simulate, validate
from dtlab.pipeline.stages import StageModule, build_stages, partition

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "SCHEDULES",
    "COMPUTE",
    "MESSAGES",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "make_schedule",
    "from_compute_orders",
    "validate",
    "in_flight",
    "simulate",
    "bubble",
    "partition",
    "StageModule",
    "build_stages",
    "Pipeline",
    "measured_timeline",
    "train_pipeline",
]
