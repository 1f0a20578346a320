"""Right answers written differently from the reference are accepted, chapters 05
and 06: the 1F1B order, the pipeline executor, the loss scaler the ranks agree on,
and the share fp16 flushes. Each answer was written from what the learner sees (the
stub cell, the exercise's markdown, the checker's ``measures=``) before the
reference or the checker's body was read; the wrong answers here are slips a
learner makes that the catalogues (tests/mistakes/chNN.py) did not hold,
each proven rejected with a message that names its cause. Answers that run on the
engines travel by value and import what they use."""

import pytest
import torch

from dtlab.exercises import (
    ExerciseFailed,
    check_loss_scaler,
    check_one_f_one_b,
    check_pipeline_executor,
    check_underflow,
)
from dtlab.lab.kernel.shipping import ship_by_value


# ---- ch05 one_f_one_b: the compute order of one stage --------------------------------
def iterators_zipped(stage, p, m):
    """Two streams of microbatch numbers: the warm-up draws forwards only, the
    steady state one from each, the cool-down drains the backwards."""
    forwards, backwards = iter(range(m)), iter(range(m))
    order = [("F", next(forwards)) for _ in range(min(p - stage - 1, m))]
    for f in forwards:
        order += [("F", f), ("B", next(backwards))]
    return order + [("B", b) for b in backwards]


def greedy_within_the_limit(stage, p, m):
    """One loop: a forward whenever fewer than p − stage are held, else a backward."""
    order, f, b = [], 0, 0
    while b < m:
        if f < m and f - b < p - stage:
            order.append(("F", f))
            f += 1
        else:
            order.append(("B", b))
            b += 1
    return order


def sorted_by_time_slot(stage, p, m):
    """Each compute given its slot on the stage's clock, then sorted by it."""
    warm = min(p - stage - 1, m)
    steady = m - warm
    slot = {}
    for i in range(m):
        slot[("F", i)] = i if i < warm else warm + 2 * (i - warm)
    for j in range(m):
        slot[("B", j)] = warm + 2 * j + 1 if j < steady else warm + steady + j
    return sorted(slot, key=slot.get)


@pytest.mark.parametrize(
    "answer", [iterators_zipped, greedy_within_the_limit, sorted_by_time_slot]
)
def test_one_f_one_b_accepts_other_right_answers(answer):
    assert check_one_f_one_b(answer).passed


def warms_up_past_the_microbatches(stage, p, m):
    """Wrong: p − stage − 1 warm-up forwards even when m is smaller."""
    warm = p - stage - 1
    order = [("F", i) for i in range(warm)]
    for j in range(m - warm):
        order += [("F", warm + j), ("B", j)]
    order += [("B", j) for j in range(max(m - warm, 0), m)]
    return order


def test_one_f_one_b_names_a_microbatch_that_does_not_exist():
    with pytest.raises(ExerciseFailed, match="unexpected action F2"):
        check_one_f_one_b(warms_up_past_the_microbatches)


# ---- ch05 pipeline_executor: the loop over isend/irecv -------------------------------
def executor_with_queues(actions, io):
    """First in, first out: 1F1B runs each stage's forwards and its backwards in
    microbatch order, so queues stand in for tables keyed by microbatch."""
    from collections import deque

    acts, outs, grads_in, grads_out, sends = deque(), deque(), deque(), deque(), []
    for a in actions:
        if a.op.startswith("recv"):
            handle, buf = io.irecv(a.peer)
            handle.wait()
            (acts if a.op == "recv_act" else grads_in).append(buf)
        elif a.op == "F":
            outs.append(io.forward(a.microbatch, acts.popleft() if acts else None))
        elif a.op == "send_act":
            sends.append(io.isend(outs[-1], a.peer))
        elif a.op == "B":
            grad = grads_in.popleft() if grads_in else None
            grads_out.append(io.backward(a.microbatch, outs.popleft(), grad))
        elif a.op == "send_grad":
            sends.append(io.isend(grads_out.popleft(), a.peer))
    for handle in reversed(sends):
        handle.wait()


def executor_waits_receives_at_the_compute(actions, io):
    """Receives posted at their action and waited only by the compute that needs
    them; one dispatch table of small functions."""
    posted, held, sends = {}, {}, []

    def take(key):
        if key not in posted:
            return None
        handle, buf = posted.pop(key)
        handle.wait()
        return buf

    def recv(a, kind):
        posted[(kind, a.microbatch)] = io.irecv(a.peer)

    def forward(a):
        held[a.microbatch] = io.forward(a.microbatch, take(("act", a.microbatch)))

    def backward(a):
        i = a.microbatch
        held[("g", i)] = io.backward(i, held.pop(i), take(("grad", i)))

    def send_act(a):
        sends.append(io.isend(held[a.microbatch], a.peer))

    def send_grad(a):
        sends.append(io.isend(held.pop(("g", a.microbatch)), a.peer))

    table = {
        "recv_act": lambda a: recv(a, "act"),
        "recv_grad": lambda a: recv(a, "grad"),
        "F": forward,
        "B": backward,
        "send_act": send_act,
        "send_grad": send_grad,
    }
    for a in actions:
        table[a.op](a)
    while sends:
        sends.pop().wait()


def executor_keeps_one_output(actions, io):
    """Wrong: one variable for the stage's output, so a backward runs through the
    latest forward's output rather than its own microbatch's."""
    x = grad = out = None
    sends = []
    for a in actions:
        if a.op in ("recv_act", "recv_grad"):
            handle, buf = io.irecv(a.peer)
            handle.wait()
            x, grad = (buf, grad) if a.op == "recv_act" else (x, buf)
        elif a.op == "F":
            out = io.forward(a.microbatch, x)
        elif a.op == "B":
            grad = io.backward(a.microbatch, out, grad)
        else:
            sends.append(io.isend(out if a.op == "send_act" else grad, a.peer))
    for handle in sends:
        handle.wait()


for _answer in (
    executor_with_queues,
    executor_waits_receives_at_the_compute,
    executor_keeps_one_output,
):
    ship_by_value(_answer)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "answer", [executor_with_queues, executor_waits_receives_at_the_compute]
)
def test_pipeline_executor_accepts_other_right_answers(answer, lab_cluster):
    assert check_pipeline_executor(answer, lab_cluster(4)).passed


@pytest.mark.cluster
def test_pipeline_executor_names_the_wrong_output(lab_cluster):
    # Two ranks fail on their own and the first to fail is reported: a middle stage
    # is told its output is another microbatch's; the last stage, handed a received
    # activation as its loss's gradient, fails in autograd on the shapes. Which one
    # comes first is the machine's timing; both name the mix-up.
    with pytest.raises(
        ExerciseFailed,
        match="is the output of microbatch 1, not|Mismatch in shape: grad_output",
    ):
        check_pipeline_executor(executor_keeps_one_output, lab_cluster(4))


# ---- ch06 loss_scaler: a verdict every rank agrees on --------------------------------
def scaler_with_foreach_and_a_max(grads, state):
    """Unscaled by multiplying by 1/S with torch's foreach op; the flag a 0/1 float."""
    import torch

    from dtlab import comm

    torch._foreach_mul_(grads, 1.0 / state["scale"])
    bad = any(not torch.isfinite(g).all() for g in grads)
    flag = torch.tensor([1.0 if bad else 0.0])
    comm.all_reduce(flag, op=comm.ReduceOp.MAX)
    found = bool(flag.item())
    if found:
        state["scale"] *= state["backoff_factor"]
        state["clean_steps"] = 0
    else:
        state["clean_steps"] += 1
        if state["clean_steps"] == state["growth_interval"]:
            state["scale"] *= state["growth_factor"]
            state["clean_steps"] = 0
    return found


def scaler_counting_ranks_with_a_sum(grads, state):
    """The flag summed (how many ranks overflowed) rather than maxed; the verdict
    taken before unscaling, the state updated with a modulo."""
    import torch

    from dtlab import comm

    flags = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
    count = flags.to(torch.int32).reshape(1)
    comm.all_reduce(count, op=comm.ReduceOp.SUM)
    for g in grads:
        g.div_(state["scale"])
    if count.item() > 0:
        state["scale"] = state["scale"] * state["backoff_factor"]
        state["clean_steps"] = 0
        return True
    state["clean_steps"] = (state["clean_steps"] + 1) % state["growth_interval"]
    if state["clean_steps"] == 0:
        state["scale"] = state["scale"] * state["growth_factor"]
    return False


def scaler_agrees_on_the_sum_of_everything(grads, state):
    """One number all-reduced: the sum of every gradient of every rank, which is
    finite only if every element is (inf − inf is a nan); state.update."""
    import torch

    from dtlab import comm

    total = torch.stack([g.sum() for g in grads]).sum().reshape(1)
    comm.all_reduce(total)
    torch._foreach_div_(grads, state["scale"])
    found = not torch.isfinite(total).item()
    if found:
        state.update(scale=state["scale"] * state["backoff_factor"], clean_steps=0)
    elif state["clean_steps"] + 1 == state["growth_interval"]:
        state.update(scale=state["scale"] * state["growth_factor"], clean_steps=0)
    else:
        state["clean_steps"] += 1
    return found


def scaler_reduces_a_flag_per_tensor(grads, state):
    """Wrong: agrees tensor by tensor, one all-reduce each."""
    import torch

    from dtlab import comm

    found = False
    for g in grads:
        g.div_(state["scale"])
        flag = torch.tensor([0.0 if torch.isfinite(g).all() else 1.0])
        comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        found = found or bool(flag.item())
    state["clean_steps"] = 0 if found else state["clean_steps"] + 1
    if found:
        state["scale"] *= state["backoff_factor"]
    elif state["clean_steps"] == state["growth_interval"]:
        state["scale"] *= state["growth_factor"]
        state["clean_steps"] = 0
    return found


def scaler_grows_one_step_late(grads, state):
    """Wrong: grows after more than growth_interval clean steps (> for ==)."""
    import torch

    from dtlab import comm

    bad = any(not torch.isfinite(g).all() for g in grads)
    for g in grads:
        g.div_(state["scale"])
    flag = torch.tensor([float(bad)])
    comm.all_reduce(flag, op=comm.ReduceOp.MAX)
    if flag.item():
        state["scale"] *= state["backoff_factor"]
        state["clean_steps"] = 0
        return True
    state["clean_steps"] += 1
    if state["clean_steps"] > state["growth_interval"]:
        state["scale"] *= state["growth_factor"]
        state["clean_steps"] = 0
    return False


for _answer in (
    scaler_with_foreach_and_a_max,
    scaler_counting_ranks_with_a_sum,
    scaler_agrees_on_the_sum_of_everything,
    scaler_reduces_a_flag_per_tensor,
    scaler_grows_one_step_late,
):
    ship_by_value(_answer)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "answer",
    [
        scaler_with_foreach_and_a_max,
        scaler_counting_ranks_with_a_sum,
        scaler_agrees_on_the_sum_of_everything,
    ],
)
def test_loss_scaler_accepts_other_right_answers(answer, lab_cluster):
    assert check_loss_scaler(answer, lab_cluster(4)).passed


@pytest.mark.cluster
@pytest.mark.parametrize(
    "answer, cause",
    [
        (scaler_reduces_a_flag_per_tensor, "a flag per tensor all-reduced"),
        (scaler_grows_one_step_late, "scale is 512 after a clean step, expected 1024"),
    ],
)
def test_loss_scaler_names_the_cause(answer, cause, lab_cluster):
    with pytest.raises(ExerciseFailed, match=cause):
        check_loss_scaler(answer, lab_cluster(4))


# ---- ch06 underflow: the share a cast flushes to zero --------------------------------
def zero_bits_of_the_cast(grads, dtype, scale=1.0):
    """The cast read as 16-bit integers: zero (either sign) is every bit but the
    sign bit clear; the share as a mean over the nonzero values."""
    bits = (grads * scale).to(dtype).view(torch.int16)
    became_zero = (bits & 0x7FFF) == 0
    return became_zero[grads != 0].float().mean().item()


def below_half_the_smallest_subnormal(grads, dtype, scale=1.0):
    """No cast: a value rounds to 0 when it is at most half the dtype's smallest
    subnormal (smallest normal × eps; the tie rounds to even, which is 0)."""
    info = torch.finfo(dtype)
    half_tiny = info.smallest_normal * info.eps / 2
    nonzero = grads != 0
    flushed = (grads * scale).abs() <= half_tiny
    return int((flushed & nonzero).sum()) / int(nonzero.sum())


def round_trip_in_double(grads, dtype, scale=1.0):
    """Scaled in float64, cast and brought back; counted with count_nonzero."""
    scaled = grads.double() * scale
    back = scaled.to(dtype).double()
    lost = torch.count_nonzero((back == 0) & (scaled != 0))
    return float(lost) / float(torch.count_nonzero(grads))


@pytest.mark.parametrize(
    "answer",
    [zero_bits_of_the_cast, below_half_the_smallest_subnormal, round_trip_in_double],
)
def test_underflow_accepts_other_right_answers(answer):
    assert check_underflow(answer).passed


def ties_are_kept(grads, dtype, scale=1.0):
    """Wrong: strictly below half the smallest subnormal, so exactly 2⁻²⁵ (a tie,
    which rounds to even: 0) counts as kept."""
    info = torch.finfo(dtype)
    nonzero = grads != 0
    flushed = (grads * scale).abs() < info.smallest_normal * info.eps / 2
    return int((flushed & nonzero).sum()) / int(nonzero.sum())


def answers_a_percentage(grads, dtype, scale=1.0):
    """Wrong: the share × 100 (the prediction cell asks for a percentage)."""
    nonzero = grads != 0
    return 100 * ((grads * scale).to(dtype)[nonzero] == 0).float().mean().item()


@pytest.mark.parametrize(
    "answer, cause",
    [
        (ties_are_kept, "Exactly 2⁻²⁵ is halfway"),
        (answers_a_percentage, "That is the percentage"),
    ],
)
def test_underflow_names_the_cause(answer, cause):
    with pytest.raises(ExerciseFailed, match=cause):
        check_underflow(answer)
