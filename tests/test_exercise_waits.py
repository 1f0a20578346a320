"""Any legitimate wait on an asynchronous collective is a wait: the handle's
``wait()``, its future's ``wait()``, ``torch.futures.wait_all``, or
a future chained with ``then`` (the way DDP's comm hooks are written). Right
answers written with PyTorch's futures API are accepted by the overlap checker; a
future asked for and never waited is still rejected, with the same message. (The
solutions travel to the engines by value: each imports what it uses.)"""

import pytest

from dtlab.exercises import ExerciseFailed, check_overlapped_hooks
from dtlab.lab.kernel.shipping import ship_by_value

pytestmark = pytest.mark.cluster


def futures_wait_all(model):
    """Futures gathered in the hooks, all waited at once in finish()."""
    import torch

    from dtlab import comm

    n, futures, grads = comm.group_size(), [], []

    def launch(p):
        futures.append(comm.all_reduce(p.grad, async_op=True).get_future())
        grads.append(p.grad)

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish():
        torch.futures.wait_all(futures)
        for g in grads:
            g.div_(n)
        futures.clear()
        grads.clear()

    return finish


def comm_hook_style_then(model):
    """As a DDP comm hook: the division chained on the all-reduce's future with
    ``then``; finish() waits on the chained futures, one at a time."""
    from dtlab import comm

    n, chained = comm.group_size(), []

    def launch(p):
        grad = p.grad
        fut = comm.all_reduce(grad, async_op=True).get_future()
        chained.append(fut.then(lambda f: grad.div_(n)))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish():
        while chained:
            chained.pop(0).wait()

    return finish


def future_results(model):
    """Each future waited in finish(), its result (the reduced tensor) used."""
    from dtlab import comm

    n, pending = comm.group_size(), []

    def launch(p):
        pending.append((p, comm.all_reduce(p.grad, async_op=True).get_future()))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish():
        for p, fut in pending:
            (reduced,) = fut.wait()  # value() alone would not wait: it needs done
            p.grad.copy_(reduced / n)
        pending.clear()

    return finish


def future_never_waited(model):
    """Wrong: asks for the futures and chains the division, never waits."""
    from dtlab import comm

    n = comm.group_size()

    def launch(p):
        grad = p.grad
        comm.all_reduce(grad, async_op=True).get_future().then(lambda f: grad.div_(n))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)
    return lambda: None


for _solution in (futures_wait_all, comm_hook_style_then, future_results):
    ship_by_value(_solution)  # a test module the engines cannot import


@pytest.mark.parametrize(
    "solution", [futures_wait_all, comm_hook_style_then, future_results]
)
def test_a_wait_through_the_future_is_a_wait(solution, lab_cluster):
    report = check_overlapped_hooks(solution, lab_cluster(4))
    assert report.passed, report


def test_a_future_never_waited_is_still_never_waited(lab_cluster):
    with pytest.raises(ExerciseFailed, match="was never waited"):
        check_overlapped_hooks(future_never_waited, lab_cluster(4))
