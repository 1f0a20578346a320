"""Independent answers to chapter 03's ``fully_shard`` exercise, written from the
stub, the budget the notebook prints and PyTorch's FSDP2 documentation alone.

Right answers differ in how they are written (block loop vs ``model.modules()``
filtered by type, ``mesh=`` explicit vs the default world mesh, one shared policy
vs one per block, ``reshard_after_forward`` default vs explicit, the root resharded
after forward too, the last block kept gathered as torchtitan does); each must be
accepted. Wrong answers are mistakes that break the printed budget; each must be
rejected. (The solutions travel to the engines by value: each imports what it
uses.)"""

import pytest

from dtlab.exercises import ExerciseFailed, check_fully_shard
from dtlab.lab.kernel.shipping import ship_by_value

pytestmark = pytest.mark.cluster


# ---------------------------------------------------------------- right answers


def blocks_loop_shared_policy(model, mesh):
    """Each of model.blocks, then the root; one policy object shared by all calls;
    reshard_after_forward left to its default (True for blocks, False for root)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def modules_by_type_policy_per_block(model, mesh):
    """Blocks found through model.modules() by type, a fresh policy per call,
    reshard_after_forward spelled out: True on blocks, False on the root."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dtlab.model import Block

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=True,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            ),
        )
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=False,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        ),
    )
    return model


def default_world_mesh(model, mesh):
    """No mesh= at all: fully_shard's default is the 1-D mesh over the whole
    world, here the same four ranks (gloo/CPU) as the mesh given."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    assert dist.get_world_size() == mesh.size()  # the given mesh is the world
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def root_resharded_too(model, mesh):
    """The root also reshards after forward (gathered again for backward): two
    all-gathers for every unit, 10 calls, 2 x 2Psi B, the peak unchanged."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in range(len(model.blocks)):
        model.blocks[i] = fully_shard(model.blocks[i], mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)


def last_block_kept_gathered(model, mesh):
    """torchtitan's choice: every block but the last reshards after forward (the
    last is needed at once by backward); the root keeps its default. Whole at
    once: at most the root, the last block and the one prefetched for backward."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < last)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


RIGHT = [
    blocks_loop_shared_policy,
    modules_by_type_policy_per_block,
    default_world_mesh,
    root_resharded_too,
    last_block_kept_gathered,
]


# ---------------------------------------------------------------- wrong answers


def no_policy(model, mesh):
    """Wrong: no MixedPrecisionPolicy, so the weights are gathered in fp32."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def no_reduce_dtype(model, mesh):
    """Wrong: param_dtype only, so the gradients are reduce-scattered in bf16."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def blocks_kept_gathered(model, mesh):
    """Wrong: no block reshards after forward (ZeRO-2's peak: all blocks whole
    at the end of forward)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def root_forgotten(model, mesh):
    """Wrong: the blocks only; the embeddings and final norm stay plain tensors."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return model


def root_only(model, mesh):
    """Wrong: one unit for the whole model; it is gathered whole at once."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


WRONG = [no_policy, no_reduce_dtype, blocks_kept_gathered, root_forgotten, root_only]


for _solution in RIGHT + WRONG:
    ship_by_value(_solution)  # a test module the engines cannot import


@pytest.mark.parametrize("solution", RIGHT, ids=lambda f: f.__name__)
def test_right_answer_accepted(solution, lab_cluster):
    report = check_fully_shard(solution, lab_cluster(4))
    assert report.passed, report


@pytest.mark.parametrize("solution", WRONG, ids=lambda f: f.__name__)
def test_wrong_answer_rejected(solution, lab_cluster):
    with pytest.raises(ExerciseFailed) as err:
        check_fully_shard(solution, lab_cluster(4))
    print(f"{solution.__name__}: {err.value}")
