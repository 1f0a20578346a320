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

- :mod:`~dtlab.pipeline.schedules`: :class:`Action`, :class:`Schedule` (with its
  placement: which rank and chunk runs each virtual stage) and the builders
  :func:`gpipe`, :func:`one_f_one_b` (1F1B), :func:`interleaved_1f1b`,
  :func:`zb_h1`; :func:`in_flight`.
- :mod:`~dtlab.pipeline.zero_bubble`: :func:`zb_v` and :func:`dualpipe_v`, two
  chunks per rank in a V; :mod:`~dtlab.pipeline.catalogue`: every schedule by
  name (:data:`BUILDERS`, :func:`make_schedule`).
- :mod:`~dtlab.pipeline.simulator`: :func:`validate` (complete, ordered,
  deadlock-free), :func:`simulate` (the ideal timeline) beside
  :func:`measured_timeline` (the measured one, same format), and :func:`bubble`.
- :mod:`~dtlab.pipeline.stages`: :func:`partition`, :class:`StageModule`,
  :func:`build_stages` (the GPT's layers per rank and chunk).
- :mod:`~dtlab.pipeline.executor`: :class:`Pipeline` runs a schedule over
  ``isend``/``irecv`` (its bookkeeping in :mod:`~dtlab.pipeline.step_state`);
  :func:`train_pipeline` trains with it.
"""

from dtlab.pipeline.catalogue import BUILDERS, make_schedule
from dtlab.pipeline.executor import Pipeline, backward_pass, train_pipeline
from dtlab.pipeline.schedules import (
    COMPUTE,
    MESSAGES,
    PLACEMENTS,
    Action,
    Schedule,
    ScheduleError,
    from_compute_orders,
    gpipe,
    in_flight,
    interleaved_1f1b,
    one_f_one_b,
    stage_place,
    virtual_stage,
    zb_h1,
)
from dtlab.pipeline.simulator import bubble, measured_timeline, simulate, validate
from dtlab.pipeline.stages import StageModule, build_stages, partition
from dtlab.pipeline.zero_bubble import dualpipe_v, zb_v

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "BUILDERS",
    "COMPUTE",
    "MESSAGES",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_v",
    "dualpipe_v",
    "PLACEMENTS",
    "virtual_stage",
    "stage_place",
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
    "backward_pass",
    "measured_timeline",
    "train_pipeline",
]
