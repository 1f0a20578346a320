"""Interview practice cards: a question, a box for your answer, and a Reveal button
that shows a model answer in the four-question frame next to a number the course
measured or computed.

Taught in chapter 10 (interview drill).

    from dtlab.lab.drill import Drill
    drill = Drill(cluster)          # cluster = dtlab.lab.start(world_size=4)
    drill                            # every card
    drill.reveal("zero_stages")      # what the Reveal button does; returns the number

Every card's number comes from somewhere the learner can re-run: a short run on the
live cluster (world 2-4: bytes per rank by category, wire bytes per step, from
dtlab's telemetry and memory accounting), the pipeline simulator
(:func:`dtlab.pipeline.simulate`), a computation on the kernel's own process, or
the analytic model (:mod:`dtlab.estimate`). The live runs happen once, on the first
card that needs them, in one bounded ``cluster.run``.

- ``cards.ini``: the cards as text, read by :mod:`~dtlab.lab.drill.cards`;
- :mod:`~dtlab.lab.drill.measurements`: the number behind each card;
- :mod:`~dtlab.lab.drill.widget`: :class:`Drill`, the cards as widgets;
- :mod:`dtlab.lab.engine.drill`: what the live measurements run on every rank.
"""

from dtlab.lab.drill.cards import CARDS, SOURCE_QUESTIONS, Card
from dtlab.lab.drill.measurements import Measurement
from dtlab.lab.drill.widget import Drill
from dtlab.lab.engine.drill import rank_measurements

__all__ = [
    "CARDS",
    "SOURCE_QUESTIONS",
    "Card",
    "Measurement",
    "Drill",
    "rank_measurements",
]
