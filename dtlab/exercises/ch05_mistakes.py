"""The one mistake chapter 05 shows the learner (the rest of every chapter's
catalogue of wrong solutions lives with the tests, in ``tests/mistakes/``): hoisting
the gradient receives to the front deadlocks the pipeline, and the checker says
which stage waits for what."""

from __future__ import annotations

from dtlab.exercises import ch05_pipeline  # noqa: F401 - declares the exercises
from dtlab.exercises.ch05_solutions import run_stage
from dtlab.exercises.grading import mistake

__all__ = ["receives_every_gradient_first"]


@mistake("pipeline_executor", expect="Deadlock: stage")
def receives_every_gradient_first(actions, io):
    """Hoists the gradient receives to the front: stage s waits for the gradient of
    a microbatch it has not yet sent forward. Every stage waits: a deadlock."""
    hoisted = [a for a in actions if a.op == "recv_grad"]
    run_stage(hoisted + [a for a in actions if a.op != "recv_grad"], io)
