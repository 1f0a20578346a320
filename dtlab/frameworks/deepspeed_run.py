"""DeepSpeed ZeRO-1/2/3 and ZeRO-Offload from a JSON config, on the lab's engines,
beside :mod:`dtlab.zero`; and DeepSpeed's memory estimators beside dtlab's.

Taught in chapter 03 ("from dtlab to the real thing"). The JSON is
:func:`dtlab.frameworks.translate.deepspeed_config` of the same
:class:`~dtlab.train.TrainConfig` dtlab trains; :func:`train_deepspeed` hands it to
``deepspeed.initialize`` with dtlab's GPT and trains the same batch slices.

**On CPU** (deepspeed 0.19.8, torch 2.13.0+cpu, measured on these machines):
DeepSpeed picks its ``cpu`` accelerator (communication backend gloo), and after
``deepspeed.init_distributed(dist_backend="gloo")`` (which wraps the world that
already exists) ZeRO stages 0-3, ``offload_optimizer`` and ``offload_param`` to
``cpu``, bf16 and fp16 all train. It JIT-compiles a shared-memory communication
op with the machine's C++ compiler on first use (cached in
``~/.cache/torch_extensions``). Its own optimizers compile too: ``FusedAdam`` (the
default ``AdamW``, ~60 s the first time) and ``DeepSpeedCPUAdam`` (the default
with offload, ~110 s), so the JSON asks for ``torch_adam``, torch's AdamW, which
is also dtlab's. What does not run on CPU, with DeepSpeed's words, is
:data:`CANNOT_RUN_ON_CPU`; :func:`probe` tries one of them live.

Memory: :func:`estimates` puts DeepSpeed's ``estimate_zero2_/zero3_model_states_
mem_needs`` (the functions behind its ``..._all_live`` printouts) next to
:func:`dtlab.estimate.zero_states_per_rank` and the ZeRO paper's formula for the
7B and 70B presets, and :func:`model_for_estimates` builds the stand-in module the
``_all_live`` functions count (every weight a view of one number: the real shapes,
4 bytes each).
"""

from __future__ import annotations

import contextlib
import io
import os

import torch
from torch import nn

from dtlab import estimate
from dtlab.capabilities import lacking
from dtlab.frameworks import deepspeed_on_gloo, require
from dtlab.frameworks.job import (
    build_data,
    build_model,
    check_job,
    local_batch,
    mean_over_world,
    state_bytes,
    world,
)
from dtlab.frameworks.traffic import CollectiveCounter
from dtlab.frameworks.translate import deepspeed_config

__all__ = [
    "CANNOT_RUN_ON_CPU",
    "init_distributed",
    "train_deepspeed",
    "probe",
    "model_for_estimates",
    "estimates",
]

# Features that do not run on DeepSpeed's cpu accelerator: the JSON that asks for
# them, and what DeepSpeed 0.19.8 answered (measured on these machines).
CANNOT_RUN_ON_CPU = {
    "offload to NVMe (ZeRO-Infinity)": {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/dtlab-nvme"},
        },
        "answer": "RuntimeError: Unable to JIT load the async_io op due to it not "
        "being compatible due to hardware/software issue. (the async_io op needs "
        "libaio, which this machine lacks)",
        "builder": "AsyncIOBuilder",
    },
    "ZeRO++ (quantized weights and gradients)": {
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
        },
        "answer": "ValueError: This op had not been implemented on CPU backend.",
        "builder": "QuantizerBuilder",
    },
}


def init_distributed():
    """Make DeepSpeed's communication backend wrap this rank's existing world:
    ``deepspeed.init_distributed`` wants the launcher's variables even then (it
    goes looking for MPI without them), so they are set from the world itself;
    nothing connects to ``MASTER_PORT``, the world exists already."""
    deepspeed = deepspeed_on_gloo()
    rank, n = world()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(n))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _held(engine) -> dict[str, int]:
    """Model-state bytes this rank holds: the module's parameters (under ZeRO-3
    their partitions, ``ds_tensor``) and the inner torch optimizer's tensors
    (ZeRO's flat fp32 partitions, Adam's moments)."""
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out = state_bytes(params, inner)
    del out["grads"]  # ZeRO frees its gradient partitions after the step
    return out


def _current_scale(engine) -> float:
    """The loss scale the next backward multiplies by (1 without fp16).
    ``engine.loss_scale()`` is the config's static scale (0: dynamic); the live one
    is the optimizer's, under one of two names depending on the optimizer."""
    scaler = getattr(engine.optimizer, "loss_scale_config", None)
    if scaler is not None:
        return float(scaler.cur_scale)
    return float(getattr(engine.optimizer, "cur_scale", 1.0))


def train_deepspeed(config, ds_config: dict | None = None) -> dict:
    """Train ``config`` with ``deepspeed.initialize`` on every rank of the current
    world, from ``ds_config`` (default: the translation of ``config``). Returns
    ``{"losses", "loss_scale", "skipped", "traffic" (per step), "memory",
    "optimizer", "ds_config"}``."""
    check_job(config, "train_deepspeed")
    deepspeed = init_distributed()
    linear = torch.nn.functional.linear
    try:
        return _train(deepspeed, config, ds_config)
    finally:
        # ZeRO-3 replaces torch.nn.functional.linear for the whole process with its
        # "memory-efficient" one ("This will persist unless manually reset", its log
        # says), which rounds differently from torch's: every later model on this
        # engine, dtlab's included, would silently compute with DeepSpeed's linear.
        torch.nn.functional.linear = linear


def _train(deepspeed, config, ds_config: dict | None) -> dict:
    _, n = world()
    ds = ds_config or deepspeed_config(config, n)
    for dtype in ("fp16", "bf16"):  # DeepSpeed's refusal, also when told to lack it
        reason = ds.get(dtype, {}).get("enabled") and lacking(f"deepspeed_{dtype}")
        if reason:
            raise ValueError(reason)
    model = build_model(config)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds
    )
    data = build_data(config)
    counter = CollectiveCounter()
    losses, scales, skipped = [], [], []
    for step in range(config.steps):
        x, y = local_batch(data, step, config)  # (B/N, T)
        before = engine.skipped_steps
        scales.append(_current_scale(engine))  # the scale this step multiplies by
        counter.step = step
        with counter:
            _, loss = engine(x, y)
            engine.backward(loss)  # scales the loss, reduces (ZeRO-2/3: scatters)
            engine.step()  # unscale, overflow check, step, all-gather (ZeRO-1/2)
        skipped.append(engine.skipped_steps > before)
        losses.append(mean_over_world(loss.item()))
    return {
        "losses": losses,
        "loss_scale": scales,
        "skipped": skipped,
        "traffic": [counter.per_step(s) for s in range(config.steps)],
        "memory": _held(engine),
        "optimizer": type(engine.optimizer).__name__,
        "ds_config": ds,
    }


def probe(feature: str, config) -> str:
    """Try one of :data:`CANNOT_RUN_ON_CPU` on every rank: ``"ran"``, or the
    error DeepSpeed raised. The op builder is asked first (``is_compatible``):
    NVMe's would otherwise spend a minute trying to compile before it fails."""
    from deepspeed.accelerator import get_accelerator

    entry = CANNOT_RUN_ON_CPU[feature]
    builder = get_accelerator().create_op_builder(entry["builder"])
    if builder is None or not builder.is_compatible(verbose=False):
        return (
            f"{entry['builder']} is not compatible with the "
            f"{get_accelerator().device_name()} accelerator; tried, DeepSpeed says: "
            f"{entry['answer']}"
        )
    _, n = world()
    ds = deepspeed_config(config, n)
    ds["zero_optimization"] = entry["zero_optimization"]
    try:
        train_deepspeed(config.replace(steps=1), ds)
    except Exception as exc:  # noqa: BLE001 - the error is the answer
        return f"{type(exc).__name__}: {exc}"
    return "ran"


# ---- memory estimates: DeepSpeed's and dtlab's ---------------------------------------
class _Weight(nn.Module):
    """One weight matrix of the stand-in model: its shape, stored as one number."""

    def __init__(self, *shape: int):
        super().__init__()
        # a stride-0 view: numel() is the real count, data_ptr() its own
        self.weight = nn.Parameter(torch.zeros(()).expand(*shape), requires_grad=False)


def model_for_estimates(name: str) -> nn.Module:
    """A module with the weight shapes of preset ``name`` (``"7B"``, ``"70B"``: see
    :data:`dtlab.estimate.MODELS`), each weight its own submodule (DeepSpeed's
    largest layer is the largest module), in a few hundred bytes. Its parameter
    count is dtlab's :attr:`~dtlab.estimate.ModelPreset.n_params`."""
    spec = estimate.MODELS[name]
    if spec.n_experts != 1 or spec.bias or spec.layernorm:
        raise ValueError(f"{name}: only dense models without biases or norms here")
    h, V, f = spec.d_model, spec.vocab_size, spec.d_ff
    kv = h * (spec.n_kv_heads or spec.n_heads) // spec.n_heads
    model = nn.Module()
    model.embed = _Weight(V, h)
    if spec.learned_positions:
        model.positions = _Weight(spec.seq_len, h)
    model.layers = nn.ModuleList()
    for _ in range(spec.n_layers):
        layer = nn.Module()
        for key, shape in [("q", (h, h)), ("k", (kv, h)), ("v", (kv, h))]:
            setattr(layer, key, _Weight(*shape))
        layer.o = _Weight(h, h)
        if spec.gated_mlp:
            layer.gate = _Weight(f, h)
        layer.up, layer.down = _Weight(f, h), _Weight(h, f)
        model.layers.append(layer)
    if not spec.tied_embeddings:
        model.head = _Weight(V, h)
    count = sum(p.numel() for p in model.parameters())
    if count != spec.n_params:
        raise AssertionError(f"{name}: {count} weights, dtlab counts {spec.n_params}")
    return model


def estimates(name: str, gpus_per_node: int = 8, nodes: int = 1) -> dict:
    """Model-state bytes per GPU for preset ``name`` on ``nodes`` x
    ``gpus_per_node``, under ZeRO-2 and ZeRO-3 with and without optimizer
    offload: DeepSpeed's estimators (``additional_buffer_factor`` 1.5, its
    default, on the host side), dtlab's :func:`~dtlab.estimate.zero_states_per_rank`
    and the ZeRO paper's ``zero_memory_per_device`` (mixed-precision Adam).
    Also ``"printout"``: what DeepSpeed's ``..._all_live`` functions print for
    the stand-in model."""
    require("deepspeed")
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    model = model_for_estimates(name)
    psi, largest = stage3.model_to_params(model)  # shared weights once
    n = gpus_per_node * nodes
    rows = []
    for stage in (2, 3):
        for offload in (False, True):
            if stage == 2:
                host, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(
                    psi, gpus_per_node, nodes, cpu_offload=offload
                )
            else:
                host, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
                    psi,
                    largest,
                    gpus_per_node,
                    nodes,
                    cpu_offload=offload,
                    cpu_offload_params=False,
                    zero_init=True,
                )
            ours = estimate.zero_states_per_rank(
                psi, n, stage, "mixed", offload=offload
            )
            paper = estimate.zero_memory_per_device(psi, n, stage, "mixed")
            rows.append(
                {
                    "stage": stage,
                    "offload": offload,
                    "deepspeed_gpu": gpu,
                    "deepspeed_host_per_node": host,
                    "dtlab_gpu": ours["total"],
                    "dtlab_host_per_node": ours["host"] * gpus_per_node,
                    "paper_gpu": paper["total"] if not offload else None,
                }
            )
    printout = io.StringIO()
    with contextlib.redirect_stdout(printout):
        stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live(
            model, gpus_per_node, nodes
        )
        stage3.estimate_zero3_model_states_mem_needs_all_live(
            model, gpus_per_node, nodes
        )
    return {
        "model": name,
        "params": psi,
        "largest_layer": largest,
        "gpus": n,
        "rows": rows,
        "printout": printout.getvalue(),
    }
