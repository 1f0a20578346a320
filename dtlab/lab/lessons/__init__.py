"""Per-chapter lesson helpers that run in the notebook kernel: the widgets, tables and
check lines a chapter shows, kept out of the learner's cells so that a page holds the
idea and the numbers rather than the harness. One module per chapter
(``dtlab.lab.lessons.ch00`` for ``notebooks/00_why_distribute.ipynb``, and so on);
:mod:`~dtlab.lab.lessons.confirm` prints the visible checks every chapter uses. Nothing
here runs on an engine, and the core never imports it.
"""
