"""Chapter 09's lesson helpers (``notebooks/09_planning_at_scale.ipynb``): the
planner's formulas held against a live run, and the chapter's questions.

:func:`run_layout` runs on every engine: it trains a small GPT with one strategy
of dtlab's trainer and returns, for the last step, the memory record dtlab's
accounting made (weights, gradients, optimizer state, activations, in bytes), the
bytes this rank sent (the loss and the gradient norm's scalars left out: they are
not the model's traffic) and the number of parameter tensors (AdamW keeps a 4-byte
step counter for each, which the planner does not model). The chapter sets those
numbers beside ``est.layout_memory`` and ``est.layout_traffic``; its optional
dry run (:func:`dtlab.dryrun.dry_run`) does the same at Llama 3 405B's scale.
"""

from __future__ import annotations

from dtlab.lab.predictions import Question

__all__ = ["QUESTIONS", "IGNORED", "run_layout"]

QUESTIONS = [
    Question(
        "zero3_states_4ranks",
        "09",
        "bytes of model states (fp32 weights, gradients and AdamW moments) one of 4 "
        "ranks holds under ZeRO-3, for the chapter's small GPT",
        "kB",
    ),
    Question(
        "zero3_wire_4ranks",
        "09",
        "bytes one of 4 ranks sends per step under ZeRO-3 (fp32), for the chapter's "
        "small GPT",
        "kB",
    ),
    Question(
        "states_70b_zero3_dp8",
        "09",
        "bytes of model states per GPU for LLaMA-2 70B under ZeRO-3 over 8 GPUs "
        "(mixed-precision Adam, the paper's 16 bytes a parameter)",
        "GB",
    ),
    Question(
        "dryrun_405b_activations",
        "09",
        "bytes of activations rank 0 (the first of 16 pipeline stages) holds at its "
        "peak in Llama 3 405B's 8K layout (tp8, pp16, dp64; no recomputation), for "
        "dtlab's GPT stand-in on the dry run",
        "GB",
    ),
]

# a loss and a gradient norm: a few bytes each step that are not the model's traffic
IGNORED = ("metrics", "zero/grad-norm")


def run_layout(model, global_batch: int, strategy: str, steps: int = 2) -> dict:
    """On every rank: train ``model`` with ``strategy`` for ``steps`` steps and
    return the last step's memory record (``"memory"``), the bytes this rank sent
    in it (``"wire"``) and the number of parameter tensors (``"tensors"``)."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.train import TrainConfig, Trainer

    rec = telemetry.Recorder(dist.get_rank())
    config = TrainConfig(
        model=model, strategy=strategy, steps=steps, global_batch_size=global_batch
    )
    with telemetry.use(rec):
        trainer = Trainer(config)
        trainer.fit()
        tensors = len(list(trainer.parameters()))
    last = steps - 1
    mem = [e for e in rec.events if e["kind"] == "memory" and e["step"] == last]
    wire = sum(
        e["wire_bytes"]
        for e in rec.events
        if e["kind"] == "comm" and e["step"] == last and e["tag"] not in IGNORED
    )
    return {"memory": mem[-1], "wire": wire, "tensors": tensors}
