"""Chapter 12's exercises, the first two: the frontier's precision and its
pipeline, each checked in this process against the library that runs them (the
third, the owners of sharded Muon, is in :mod:`.ch12_muon`).

1. ``delayed_scaling_update``: one step of FP8 delayed scaling (Micikevicius et al.
   2022, *FP8 Formats for Deep Learning*, §4.3), on four hidden amax sequences (an
   amax jump, history length 1, a margin of 1, all-zero tensors), step by step
   against the state of :class:`dtlab.fp8.DelayedScaling` driven on the same
   tensors; then, driving a loop of casts, it must clip the elements the library
   clips, the jump step's saturation included. The caller's history and scale must
   come back untouched.
2. ``split_backward``: the zero-bubble split of a backward pass into B (the input's
   gradient) and W (the weights') (Qi et al. 2023, "Zero Bubble Pipeline
   Parallelism", §2), run in place of :func:`dtlab.pipeline.backward_pass` by
   dtlab's real :class:`dtlab.pipeline.Pipeline` on one rank (ZB-V, both chunks of
   the V on it, and ZB-H1), against the plain model's gradients, bit for bit; after
   every B the weights' ``.grad`` must be unchanged (deferred), after every W the
   input's.
"""

from __future__ import annotations

import torch

from dtlab.exercises.ch12_solutions import delayed_scaling_update, split_backward
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.watch import Watch
from dtlab.fp8 import DelayedScaling
from dtlab.fp8.formats import amax as amax_of
from dtlab.fp8.formats import fp8_format, saturated_fraction, scale_from_amax
from dtlab.model import GPTConfig, SyntheticTokens, param_generator
from dtlab.pipeline import Pipeline
from dtlab.pipeline import executor as pipeline_executor
from dtlab.reference import accumulated_gradients
from dtlab.topology import Layout, Topology

__all__ = ["check_delayed_scaling_update", "check_split_backward"]


# ---- 1. delayed scaling ------------------------------------------------------------
FMT = fp8_format("e4m3")
# fp32 scales: the same rule written another way, e.g. fp8_max * (1 / max), rounds
# twice and lands an ulp (1.2e-7 relative) away; 1e-6 is a few ulps
RTOL = 1e-6
SEQUENCES = (  # (what, history length, margin, amax of each tensor in turn)
    ("an amax jump", 4, 0.0, (2.0, 3.0, 1.5, 2.5, 8.0, 2.0, 1.0, 0.5, 0.25, 0.75)),
    ("history length 1", 1, 0.0, (1.0, 3.0, 0.5, 6.0, 2.0)),
    ("margin 1", 4, 1.0, (1.0, 4.0, 2.0, 8.0, 3.0, 0.5)),
    ("all-zero tensors", 4, 0.0, (0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)),
    # a zero amax while the window still remembers larger ones: the window's max,
    # not this amax, says whether to keep the scale
    ("zeros while the window remembers", 4, 0.0, (5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0)),
    # margins where 2**margin differs from 1 + margin and from 2**int(margin)
    ("margin 3", 3, 3.0, (1.0, 2.0, 0.5, 4.0, 1.0)),
    ("margin 0.5", 2, 0.5, (1.0, 3.0, 2.0, 0.25)),
)
JUMP = 4  # the step of the first sequence whose amax jumps past its history


def _tensors(what: str, amaxes):
    """One tensor per step whose amax is exactly the one given (x / max|x| has
    amax exactly 1)."""
    gen = param_generator(0, f"delayed/{what}")
    out = []
    for a in amaxes:
        x = torch.randn(256, generator=gen)
        out.append(x / x.abs().max() * a)
    return out


def _library_steps(what, L, margin, xs):
    """``[(history, scale before, amax, history, scale after)]`` of the library's
    DelayedScaling on ``xs``, and its saturated share at each cast."""
    ds = DelayedScaling(FMT, L, margin)
    steps, saturated = [], []
    for x in xs:
        before = None if ds.scale is None else (ds.history.clone(), ds.scale.clone())
        _, used = ds.quantize(x)
        if before is None:  # the first cast: no history yet, its own scale
            before = (torch.zeros(L), used.clone())
        steps.append((*before, amax_of(x), ds.history.clone(), ds.scale.clone()))
        saturated.append(saturated_fraction(x, FMT, used))
    return steps, saturated


def _as_step(got, history, what):
    if not (isinstance(got, tuple | list) and len(got) == 2):
        raise ExerciseFailed(f"{what}: return the pair (new_history, next_scale)")
    new, scale = got
    if not isinstance(new, torch.Tensor):
        raise ExerciseFailed(
            f"{what}: new_history is a {type(new).__name__}; return a tensor like "
            f"history ({history.dtype}, shape {tuple(history.shape)}): it is the "
            "state the next step receives"
        )
    try:
        scale = torch.as_tensor(scale, dtype=torch.float32).reshape(())
    except (TypeError, ValueError, RuntimeError):
        raise ExerciseFailed(
            f"{what}: next_scale must be one number (a 0-dim tensor), got {scale!r}"
        ) from None
    return new, scale


def _close(a, b) -> bool:
    return bool(torch.allclose(a, b, rtol=RTOL, atol=0.0))


def _history_hint(new, history, a, L) -> str:
    if new.numel() == L + 1:
        return (
            f"it has {L + 1} entries, history {L}: drop the oldest amax (the first) "
            "as you append this one, so the window keeps its length"
        )
    if new.shape != history.shape:
        return f"it has shape {tuple(new.shape)}; keep history's {tuple(history.shape)}"
    if L > 1 and torch.equal(new, torch.cat([history[:-1], a.reshape(1)])):
        return (
            "you dropped the newest amax (the last entry) and kept the oldest: the "
            "history runs oldest first, newest last, and the oldest leaves"
        )
    if torch.equal(new, history):
        return "it is unchanged: this tensor's amax goes in at the end"
    return "drop the oldest amax (the first entry) and append this tensor's at the end"


def _scale_hint(got, history, a, window, fp8_max, margin) -> str:
    """Why ``got`` is not the next scale: the rule of a mistake it matches."""
    head = 2.0**margin
    if window.max() == 0:
        return (
            "every amax in the window is 0 (the recent tensors were all zero), and "
            "fp8_max / 0 has no meaning: keep the scale you were given (any scale "
            "casts zeros exactly)"
        )
    candidates = [  # (the scale a mistaken rule gives, the hint)
        (
            fp8_max / (a * head),
            "that is the scale of this tensor's own amax (current scaling); delayed "
            "scaling takes the largest amax of the whole window",
        ),
        (
            fp8_max * head / window.max() if margin else None,
            "the margin leaves 2^margin of headroom below fp8_max: it makes the "
            "scale smaller, and you multiplied the scale by it",
        ),
        (
            fp8_max / (window.mean() * head),
            "that is the scale of the window's mean amax; take its max, so that no "
            "amax of the window saturates",
        ),
        (
            fp8_max / (history.max() * head),
            "that scale comes from the history before this tensor's amax went in "
            "(the scale of this cast); the NEXT cast's scale is taken after the roll",
        ),
    ]
    for wrong, hint in candidates:
        if wrong is None:
            continue
        wrong = torch.as_tensor(wrong, dtype=torch.float32)
        if torch.isinf(wrong) and torch.isinf(got) or _close(got, wrong):
            return hint
    if not torch.isfinite(got):
        return "it is not finite, though the window's largest amax is not 0"
    return "the next scale is fp8_max over the window's largest amax times 2^margin"


def _judge_step(solution, step, what, t, margin):
    history, scale, a, want_history, want_scale = step
    where = f"{what}, tensor {t} (amax {float(a):g})"
    h_in, s_in, a_in = history.clone(), scale.clone(), a.clone()
    got = attempt(solution, h_in, s_in, a_in, FMT.max, margin)
    if not (torch.equal(h_in, history) and torch.equal(s_in, scale)):
        changed = "history" if not torch.equal(h_in, history) else "scale"
        raise ExerciseFailed(
            f"{where}: your function changed the caller's {changed} in place: "
            "whoever holds that tensor (the scaler's state, a record of the last "
            "step, another layer handed the same one) sees it change under them; "
            "build a new tensor and return it"
        )
    new, next_scale = _as_step(got, history, where)
    if new.dtype != history.dtype:
        raise ExerciseFailed(
            f"{where}: new_history is {new.dtype}; keep history's {history.dtype}"
        )
    if new.shape != want_history.shape or not torch.equal(new, want_history):
        raise ExerciseFailed(
            f"{where}: new_history is {new.tolist()}, from {history.tolist()}: "
            + _history_hint(new, history, a, history.numel())
        )
    if not (torch.isfinite(next_scale) and _close(next_scale, want_scale)):
        raise ExerciseFailed(
            f"{where}: next_scale is {float(next_scale):g}, for the window "
            f"{want_history.tolist()} (margin {margin:g}): "
            + _scale_hint(next_scale, history, a, want_history, FMT.max, margin)
        )


def _judge_loop(solution, what, L, margin, xs, want_saturated) -> None:
    """The learner's update driving the casts, as DelayedScaling's own loop
    does: it must clip exactly the elements the library clips."""
    history, scale = torch.zeros(L), None
    for t, x in enumerate(xs):
        a = amax_of(x)
        if scale is None:  # the first cast has no history: its own amax
            scale = scale_from_amax(a, FMT, margin)
        saturated = saturated_fraction(x, FMT, scale)
        if saturated != want_saturated[t]:
            raise ExerciseFailed(
                f"{what}, cast {t} in a loop driven by your function's state: "
                f"{saturated:.1%} of the elements saturate, with the library "
                f"{want_saturated[t]:.1%}: return a new history and scale each "
                "step, the next call's inputs"
            )
        got = attempt(solution, history, scale, a, FMT.max, margin)
        history, scale = _as_step(got, history, f"{what}, cast {t}")


@exercise(
    "delayed_scaling_update",
    chapter=12,
    reference=delayed_scaling_update,
    local=True,
    measures=(
        "new history and next scale == dtlab.fp8.DelayedScaling's state at every "
        "step of 7 hidden sequences (an amax jump, history 1, margins 1, 3 and "
        "0.5, zero tensors, zeros while the window remembers); the caller's "
        "history untouched; in a loop of casts, the library's saturated elements, "
        "the jump step's included"
    ),
)
def check_delayed_scaling_update(solution, cluster=None):
    jump = None
    for what, L, margin, amaxes in SEQUENCES:
        xs = _tensors(what, amaxes)
        steps, saturated = _library_steps(what, L, margin, xs)
        for t, step in enumerate(steps):
            _judge_step(solution, step, what, t, margin)
        _judge_loop(solution, what, L, margin, xs, saturated)
        jump = saturated[JUMP] if jump is None else jump  # the first sequence's
    assert jump > 0  # its point: the stale scale of the jump step saturates
    return [
        "the rolled history and the next scale of dtlab.fp8.DelayedScaling at every "
        "step of 7 hidden sequences (an amax jump, history 1, three margins, zeros)",
        "the caller's history and scale left as they were",
        f"driving the casts, it clips what the library clips: {jump:.0%} of the "
        "jump step's elements saturate, the price of a stale scale",
    ]


# ---- 2. the zero-bubble split of backward ------------------------------------------
PIPE_CFG = GPTConfig(
    vocab_size=64, seq_len=16, n_layers=2, n_heads=2, d_model=32, tied_head=False
)
PIPE_BATCH = 8
PIPE_CASES = (  # (what, schedule, microbatches): one rank, every hand-over local
    ("ZB-V on one rank (both chunks of the V)", "zb_v", 4),
    ("ZB-H1 on one rank (the first stage: no input)", "zb_h1", 2),
)


def _grad_of(t):
    return None if t is None or t.grad is None else t.grad.detach().clone()


def _changed(before, tensors) -> int:
    """How many of ``tensors`` have a ``.grad`` other than ``before``."""
    n = 0
    for was, t in zip(before, tensors):
        now = t.grad
        if (was is None) != (now is None) or (
            was is not None and not torch.equal(was, now)
        ):
            n += 1
    return n


class _LearnersPipeline(Pipeline):
    """dtlab's :class:`~dtlab.pipeline.Pipeline`, its backward passes run by the
    learner's function (in :func:`~dtlab.pipeline.backward_pass`'s place), each
    watched: what B and W changed, and whether the library's was called."""

    def __init__(self, solution, what, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.solution, self.what = solution, what
        self.b_inputs: dict = {}  # (chunk, mb) -> the input B saw (gone by W)

    def _backward(self, op, key, st) -> None:
        chunk, mb = key
        weights = [q for q in self.stages[chunk].parameters() if q.requires_grad]
        out, grad, inp = st.outputs[key], st.grads.get(key), st.inputs.get(key)
        if op == "B":
            self.b_inputs[key] = inp
        else:  # the executor sent the input's gradient after B: take B's input
            inp = self.b_inputs.pop(key, inp)
        where = f"{self.what}: {op} of chunk {chunk}, microbatch {mb}"
        weights_before, inp_before = [_grad_of(q) for q in weights], _grad_of(inp)
        forbidden = {pipeline_executor.backward_pass: "dtlab.pipeline.backward_pass"}
        # which gradients autograd computes in this pass (a hook fires when a
        # tensor's gradient is computed, whatever is done with it afterwards)
        watched = weights if op == "B" else [inp] if inp is not None else []
        computed = []
        hooks = [t.register_hook(lambda g: computed.append(1)) for t in watched]
        try:
            with Watch(forbidden) as seen:
                _run_split(self.solution, op, out, grad, inp, weights, where)
        finally:
            for h in hooks:
                h.remove()
        if seen.forbidden:
            raise ExerciseFailed(
                f"you called {', '.join(seen.forbidden)}: write the split yourself "
                "(torch.autograd.backward and its inputs= argument)"
            )
        if computed:
            other = "the weights'" if op == "B" else "the input's"
            raise ExerciseFailed(
                f"{where}: {op} computed {other} gradients ({len(computed)} of them), "
                "even if .grad looks untouched afterwards: "
                + (
                    "B computes only dL/d(inp) (backward's inputs=); the weights' "
                    "share is W's work, done later in a bubble"
                    if op == "B"
                    else "W computes only dL/d(weights); B already did the input's"
                )
            )
        if op == "B":
            changed = _changed(weights_before, weights)
            if changed:
                raise ExerciseFailed(
                    f"{where}: B changed the weights' gradients ({changed} of "
                    f"{len(weights)}): B computes only dL/d(inp), what the stage "
                    "before waits for, and stops there (backward's inputs=); the "
                    "weight gradients wait for W, which would add them a second time"
                )
            if inp is not None and inp.grad is None:
                raise ExerciseFailed(
                    f"{where}: after B, inp.grad is empty: the stage before waits "
                    "for dL/d(inp); B computes it into inp.grad"
                )
        else:
            if inp is not None and _changed([inp_before], [inp]):
                raise ExerciseFailed(
                    f"{where}: W changed the input's gradient, which B already "
                    "computed and the executor already handed upstream: W computes "
                    "only dL/d(weights) (backward's inputs=)"
                )
            if not _changed(weights_before, weights):
                raise ExerciseFailed(
                    f"{where}: W left the weights' .grad unchanged; the optimizer "
                    "reads .grad: add each weight's gradient into it (torch."
                    "autograd.backward accumulates there, autograd.grad only "
                    "returns them)"
                )


def _run_split(solution, op, out, grad, inp, weights, where) -> None:
    try:
        solution(op, out, grad, inp, weights)
    except (ExerciseFailed, NotImplementedError):
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's error, explained
        first = (str(exc).splitlines() or [""])[0].split(". ")[0][:160]
        text = f"{type(exc).__name__}: {first}"
        if op == "W" and "second time" in str(exc):
            raise ExerciseFailed(
                f"{where}: your W raised {text}. B's backward freed the graph W "
                "has to walk: keep the graph in B (retain_graph=True); W, the last "
                "pass over it, may let it go"
            ) from exc
        if op == "B" and inp is None:
            raise ExerciseFailed(
                f"{where}: your B raised {text}, where inp is None: the first stage "
                "has no input, so no input gradient to compute or send; its B has "
                "nothing to do"
            ) from exc
        raise ExerciseFailed(f"{where}: your function raised {text}") from exc


@exercise(
    "split_backward",
    chapter=12,
    reference=split_backward,
    local=True,
    measures=(
        "weight gradients == the plain model's, bit for bit, with dtlab's Pipeline "
        "running ZB-V and ZB-H1 on one rank through your B and W; B computes no "
        "weight gradient and W no input gradient (hooks on autograd), and each "
        "leaves the other's .grad unchanged"
    ),
)
def check_split_backward(solution, cluster=None):
    x, y = SyntheticTokens(PIPE_CFG.vocab_size, PIPE_CFG.seq_len).batch(0, PIPE_BATCH)
    for what, name, m in PIPE_CASES:
        want_loss, want = accumulated_gradients(PIPE_CFG, x, y, m)
        topo = Topology(Layout(), 0)
        pipe = _LearnersPipeline(solution, what, PIPE_CFG, topo, name, microbatches=m)
        loss = pipe.step(x, y)["loss"]
        assert loss == want_loss, what  # the forward is the library's
        for n, q in pipe.named_parameters():
            if q.grad is None:
                raise ExerciseFailed(f"{what}: {n} has no gradient after the step")
            if torch.equal(q.grad, 2 * want[n]):
                raise ExerciseFailed(
                    f"{what}: {n}'s gradient is twice the model's: B and W both "
                    "computed the weights' share"
                )
            # B and W run, op for op, the backward one process runs, and each
            # weight gathers its m terms in microbatch order: equal bit for bit
            if not torch.equal(q.grad, want[n]):
                gap = (q.grad - want[n]).abs().max().item()
                raise ExerciseFailed(
                    f"{what}: {n}'s gradient differs from the model's by {gap:.3g}: "
                    "each W adds its microbatch's share into .grad (accumulate, "
                    "never replace)"
                )
    return [
        "dtlab's Pipeline ran ZB-V (both chunks on one rank) and ZB-H1 through your "
        "B and W: every weight gradient equals the plain model's, bit for bit",
        "every B left the weights' .grad alone (deferred to W); every W left the "
        "input's gradient alone",
    ]
