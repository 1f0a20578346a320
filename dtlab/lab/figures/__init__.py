"""Plotly figures built from dtlab telemetry, each measurement next to its
prediction, and live figures that update while a run goes on.

One module per chapter, plus what they share:

- :mod:`~dtlab.lab.figures.collectives` (chapter 01): bytes per rank against the
  ring formulas, time against message size with the α-β fit, tensors per rank;
- :mod:`~dtlab.lab.figures.timeline` (chapter 01): compute spans and comm calls per
  rank on one clock;
- :mod:`~dtlab.lab.figures.data_parallel` (chapter 02): loss curves, DDP's bucket
  overlap, bucket sizes, memory per device;
- :mod:`~dtlab.lab.figures.zero` (chapter 03): memory per rank and traffic per
  ZeRO stage against the paper's formulas;
- :mod:`~dtlab.lab.figures.tensor_parallel` (chapter 04): who holds which weights,
  collectives per layer, compute against communication time;
- :mod:`~dtlab.lab.figures.pipeline` (chapter 05): schedules as Gantt charts, the
  bubble, activations in flight;
- :mod:`~dtlab.lab.figures.dashboard` and :mod:`~dtlab.lab.figures.traffic`
  (chapter 07): the live dashboard of a 3D run, who sends to whom;
  :mod:`~dtlab.lab.figures.composed`: runs side by side, ranks on nodes;
- :mod:`~dtlab.lab.figures.bench`: ``dtlab bench --plot``;
- :mod:`~dtlab.lab.figures.live`: :class:`~dtlab.lab.figures.live.LiveFigure`, any
  figure redrawn in place as events arrive;
- :mod:`~dtlab.lab.figures.export`: static PNGs;
- :mod:`~dtlab.lab.figures.base`: colours, subplot cells, and the bars of a
  measurement next to its prediction.

Figures that take ``fig=, row=, col=`` draw into one cell of a
``plotly.subplots.make_subplots`` grid, so a dashboard is a few calls.
"""
