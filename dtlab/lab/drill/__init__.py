"""The interview drill (chapter 10): twenty-six cards graded the way an interviewer
grades, then revealed with a model answer and the number behind it.

    from dtlab.lab.drill import Drill
    drill = Drill(cluster)                    # cluster = dtlab.lab.start(world_size=4)
    drill.ask("zero_stages")                  # the card's parts, units, options
    drill.answer("zero_stages", {"stage1": "<bytes>", "stage1_shards": [...]})
    drill.reveal("zero_stages")               # only after answering it
    drill.mock_round(minutes=15)              # five cards, timed, scored per topic

A card (:class:`Card`) has a question, a topic, a model answer in the
four-question frame (what is replicated, sharded, synchronized and how often,
what dominates the cost) and graded parts: numbers computed by
:mod:`dtlab.estimate` and checked with their units, and multi-selects checked
exactly, where choosing a misconception costs a point and fails the card. The
explanation is never graded by the program: after the reveal the learner ticks
the model answer's points their own contained. Every attempt goes to a mistake log
(``$DTLAB_HOME/drill.json``) whose Leitner boxes bring missed cards back first.

- :mod:`dtlab.drill`: the cards, their graded parts, the grading, the mistake log
  and the mock round (no widgets: chapter 10's exercise grades with them too);
- :mod:`~dtlab.lab.drill.measurements`: the number behind each model answer
  (live on the cluster: :mod:`dtlab.lab.engine.drill`; simulated; or estimated);
- :mod:`~dtlab.lab.drill.widget`: :class:`Drill`, the session and its widgets.
"""

from dtlab.drill.cards import CARDS, SOURCE_QUESTIONS, TOPICS, Card, load_cards
from dtlab.drill.grading import CardGrade, Choices, Number, PartGrade
from dtlab.drill.log import DrillLog
from dtlab.drill.mock import MockRound
from dtlab.lab.drill.measurements import MEASUREMENTS, Measurement
from dtlab.lab.drill.widget import Drill, NotAnsweredYet
from dtlab.lab.engine.drill import rank_measurements
from dtlab.units import UnitError, parse

load_cards(measurements=MEASUREMENTS)  # every card's number can be measured

__all__ = [
    "CARDS",
    "SOURCE_QUESTIONS",
    "TOPICS",
    "Card",
    "CardGrade",
    "Choices",
    "Drill",
    "DrillLog",
    "Measurement",
    "MockRound",
    "NotAnsweredYet",
    "Number",
    "PartGrade",
    "UnitError",
    "parse",
    "rank_measurements",
]
