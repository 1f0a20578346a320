"""The interview drill's cards and their grading (chapter 10), without widgets: one
:class:`~dtlab.drill.cards.Card` type for every card, graded the way an interviewer
grades. The notebook's session, its widgets and the live measurement behind each
model answer are :mod:`dtlab.lab.drill`; chapter 10's ``drill`` exercise
(:mod:`dtlab.exercises.ch10_drill`) grades five of these cards.

- ``cards.ini`` and :mod:`~dtlab.drill.cards`: the cards' prose, one Card type;
- :mod:`~dtlab.drill.parts`, :mod:`~dtlab.drill.parts_strategies`,
  :mod:`~dtlab.drill.parts_systems`: every card's numbers (computed by
  :mod:`dtlab.estimate`) and structured choices;
- :mod:`~dtlab.drill.grading` and :mod:`dtlab.units`: how they are graded, and how
  a number with a unit is read;
- :mod:`~dtlab.drill.log`: the mistake log and spaced repetition;
- :mod:`~dtlab.drill.mock`: the timed mock round.
"""
