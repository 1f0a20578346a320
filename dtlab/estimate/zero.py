"""ZeRO: what ``dtlab.zero`` holds and sends per rank.

The model-state bytes one rank holds (on the device and, with offload, on the
host) and the communication of one ZeRO-DP step; the same for HSDP, ZeRO within a
shard group and replicas across groups.

Taught in chapter 03 (ZeRO) and chapter 11 (HSDP); chapter 09's layouts build on it.
"""

from __future__ import annotations

from dtlab.checks import positive_int
from dtlab.estimate.collectives import wire_bytes
from dtlab.estimate.states import bytes_per_param, zero_memory_per_device
from dtlab.events import state_precision


# ---- ZeRO: what dtlab.zero holds and sends per rank (chapter 03) ---------------------
def zero_states_per_rank(
    n_params: float,
    world_size: int,
    stage: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    *,
    offload: bool = False,
) -> dict[str, float]:
    """Model-state bytes one rank of :class:`dtlab.zero.FullyShardedDataParallel`
    holds at the end of a backward pass: :func:`zero_memory_per_device` (ZeRO §5.1),
    plus the one thing a plain torch optimizer adds, split into device and host.

    A torch optimizer steps a tensor with a ``.grad`` of its own dtype, so when the
    master weights differ from the compute weights (``"mixed"``, or any ``offload``)
    the optimizer reads a *master-precision gradient slice* of ``4Ψ/N_s`` bytes
    (``N_s`` = N from stage 1 on, 1 at stage 0), where the paper counts the 2-byte
    gradient. FSDP2 does the same. Everything else is the paper's: params and the
    optimizer's K (master copy included) agree exactly.

    ``offload=True`` (ZeRO-Offload, Ren et al. 2021): the master slice, its
    gradient and the optimizer state are on the host (``host_*`` keys); the device
    keeps the compute weights and, at stages 0-1, the full gradients.
    Returns ``params, grads, optimizer, total`` (device) and ``host_params,
    host_grads, host_optimizer, host``.
    """
    paper = zero_memory_per_device(n_params, world_size, stage, precision, optimizer)
    precision = state_precision(precision)
    b = bytes_per_param(precision, optimizer)
    n_s = world_size if stage >= 1 else 1
    master_bytes = 2 if precision == "pure_bf16" else 4
    separate = precision == "mixed" or bool(offload)
    # the optimizer's own states (momentum, variance): K without the master copy
    states = (b.optimizer - (4 if precision == "mixed" else 0)) * n_params / n_s
    master = master_bytes * n_params / n_s if separate else 0.0
    full_grads = b.grads * n_params if stage <= 1 else 0.0
    # without a separate master, stages 0-1 step a view of the full gradients
    grad_slice = master_bytes * n_params / n_s if (separate or stage >= 2) else 0.0
    out = {"params": paper["params"], "host_params": 0.0}
    if offload:
        out.update(grads=full_grads, optimizer=0.0)
        out.update(host_grads=grad_slice, host_optimizer=states + master)
    else:
        out.update(grads=full_grads + grad_slice, optimizer=states + master)
        out.update(host_grads=0.0, host_optimizer=0.0)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["host"] = out["host_params"] + out["host_grads"] + out["host_optimizer"]
    return out


def zero_comm_per_step(
    n_params: float, world_size: int, stage: int, bytes_per_value: float = 2
) -> dict[str, float]:
    """Communication of one ZeRO-DP step per rank (ZeRO §7.2).

    Payload S = Ψ · ``bytes_per_value``: stage 0 all-reduces the gradients (S);
    stages 1-2 reduce-scatter the gradients and all-gather the updated parameters
    (S + S); stage 3 all-gathers the parameters before forward and again before
    backward and reduce-scatters the gradients (2S + S). Under the ring algorithm
    an all-reduce sends as much as a reduce-scatter plus an all-gather, so the wire
    bytes are ``2(N-1)/N · S`` for stages 0-2 and ``3(N-1)/N · S`` for stage 3: the
    paper's 2Ψ and 3Ψ (``psi_multiple``), ZeRO-3's 1.5x.

    Returns the payload bytes per op (``all_reduce``, ``reduce_scatter``,
    ``all_gather``), ``payload`` and ``wire`` totals, and ``psi_multiple``.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {stage!r}: expected 0, 1, 2 or 3")
    if n_params < 0 or bytes_per_value <= 0:
        raise ValueError("n_params must be >= 0 and bytes_per_value positive")
    S = n_params * bytes_per_value
    ops = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    if stage == 0:
        ops["all_reduce"] = S
    else:
        ops["reduce_scatter"] = S
        ops["all_gather"] = 2 * S if stage == 3 else S
    wire = sum(wire_bytes(op, s, world_size) for op, s in ops.items())
    return {
        **ops,
        "payload": sum(ops.values()),
        "wire": wire,
        "psi_multiple": 3 if stage == 3 else 2,
    }


# ---- HSDP: ZeRO within a shard group, replicas across groups (chapter 11) ------------
def hsdp_states_per_rank(
    n_params: float,
    shard_size: int,
    replicate_size: int,
    stage: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    *,
    offload: bool = False,
) -> dict[str, float]:
    """Model-state bytes one rank of HSDP holds (:mod:`dtlab.zero.hsdp`): the state
    is sharded over the S ranks of a shard group only, so the divisor is S, not the
    data-parallel degree R·S; the R replicas each hold a whole sharded copy. That is
    :func:`zero_states_per_rank` with ``world_size = shard_size`` (same keys);
    ``replicate_size`` is checked and changes nothing: memory does not shrink as
    replicas are added, only the batch grows."""
    positive_int("shard_size", shard_size)
    positive_int("replicate_size", replicate_size)
    return zero_states_per_rank(
        n_params, shard_size, stage, precision, optimizer, offload=offload
    )


def hsdp_comm_per_step(
    n_params: float,
    shard_size: int,
    replicate_size: int,
    stage: int,
    bytes_per_value: float = 2,
) -> dict[str, dict[str, float]]:
    """Communication of one HSDP step per rank, per axis (payload S = Ψ ·
    ``bytes_per_value``).

    - ``shard``: ZeRO over the shard group of size S, :func:`zero_comm_per_step`
      with ``world_size = shard_size``: reduce-scatter S (stage 0: all-reduce) and
      the all-gathers, each ``(S−1)/S`` of its payload on the wire;
    - ``replicate``: one all-reduce of each reduced gradient slice over the R
      replicas, payload ``S/shard_size`` (stage 0 keeps no slice: all of S), wire
      ``2(R−1)/R`` of it.

    Across nodes (the replicate axis, when each shard group is one node) a rank
    sends ``2(R−1)/R · Ψ/S`` instead of full sharding's ``3(N−1)/N · Ψ``: the reason
    for HSDP. Returns ``{"shard": {...}, "replicate": {...}, "wire": total}``; each
    axis has its ops' payloads, ``payload`` and ``wire``."""
    positive_int("shard_size", shard_size)
    positive_int("replicate_size", replicate_size)
    shard = zero_comm_per_step(n_params, shard_size, stage, bytes_per_value)
    kept = n_params * bytes_per_value / (shard_size if stage >= 1 else 1)
    replicate = {
        "all_reduce": float(kept),
        "payload": float(kept),
        "wire": wire_bytes("all_reduce", kept, replicate_size),
    }
    return {
        "shard": shard,
        "replicate": replicate,
        "wire": shard["wire"] + replicate["wire"],
    }


def zero_states_conventions(
    n_params: float, world_size: int, stage: int, *, largest_layer_params: float = 0
) -> dict[str, float]:
    """Model-state bytes per rank of mixed-precision Adam under ZeRO ``stage``, as
    three accounts count them (the differences named, not hidden):

    - ``"paper"``: ZeRO §5.1, ``2Ψ + 2Ψ + 12Ψ`` split by stage
      (:func:`zero_memory_per_device`): 16 bytes a parameter at stage 3;
    - ``"dtlab"``: what dtlab.zero holds (:func:`zero_states_per_rank`): the
      optimizer steps an fp32 gradient slice of its own, ``4Ψ/N`` where the paper
      counts the 16-bit ``2Ψ/N``: 18 bytes a parameter at stage 3, ``2Ψ +
      16Ψ/N`` at stage 2;
    - ``"deepspeed"``: DeepSpeed's estimators
      (``estimate_zero2_model_states_mem_needs``, ``..._zero3_...`` without
      offload): ``2Ψ + 18Ψ/N`` at stage 2 (the 16-bit gradient slice *and* the
      fp32 one) and, at stage 3, ``18Ψ/N`` plus the largest layer gathered,
      ``4 · largest_layer_params`` (its 16-bit weights and gradients), a
      transient dtlab does not count.
    """
    if stage not in (2, 3):
        raise ValueError(f"DeepSpeed estimates stages 2 and 3, got {stage!r}")
    positive_int("world_size", world_size)
    paper = zero_memory_per_device(n_params, world_size, stage, "mixed")["total"]
    ours = zero_states_per_rank(n_params, world_size, stage, "mixed")["total"]
    if stage == 2:
        deepspeed = 2 * n_params + int(18 * n_params / world_size)
    else:
        deepspeed = 4 * largest_layer_params + int(18 * n_params / world_size)
    return {"paper": paper, "dtlab": ours, "deepspeed": float(deepspeed)}
