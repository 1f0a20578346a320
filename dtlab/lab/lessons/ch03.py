"""Chapter 03's lesson helpers (``notebooks/03_zero.ipynb``): ZeRO's training loop
with its memory measured per phase, the live memory view, the chapter's smaller
experiments kept out of the learner's cells, the loop around a framework's model,
and the real frameworks' runs beside dtlab's ZeRO as one table.

- :data:`QUESTIONS`: the numbers the chapter asks the learner to predict.
- :func:`zero_train` (run on every rank): wrap the GPT in
  :class:`dtlab.zero.FullyShardedDataParallel` at a stage, hand its local shards
  to a plain AdamW, and let :class:`dtlab.memory.MemoryTracker` emit a memory
  event per phase (forward, backward, step); :func:`padded_psi` is Ψ as the
  units pad it; :func:`memory_explorer` is the live view of those events behind
  a stage, world-size and offload control.
- :func:`step_comm`: the training traffic of one step among a run's events.
- :func:`frozen_and_shown`, :func:`save_then_reshard` (run on every rank): what
  the optimizer steps when a parameter is frozen, and a sharded checkpoint
  saved on 4 ranks and loaded on 2.
- :func:`train_steps` (run on every rank): the loop around a framework's model
  (the job's batch slices, the collectives counted by
  :class:`dtlab.frameworks.traffic.CollectiveCounter`, the loss averaged over
  the ranks), so that the page shows only the lines that set the framework up.
- :func:`comparison_table` lines up runs of the same job (each a dict with
  ``losses``, ``memory`` and per-step ``traffic``, as :mod:`dtlab.frameworks`
  returns them): the last loss and the largest relative gap to a baseline run,
  the model-state bytes the rank holds, and the bytes each collective carried in
  one step, counted by :mod:`dtlab.frameworks.traffic` for all of them alike.
  :func:`estimates_table` prints :func:`dtlab.frameworks.deepspeed_run.estimates`.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from dtlab.estimate import GB
from dtlab.lab.predictions import Question
from dtlab.model import GPT, GPTConfig, SyntheticTokens

__all__ = [
    "QUESTIONS",
    "ADAMW",
    "GLOBAL_BATCH",
    "STEPS",
    "NOT_TRAINING",
    "padded_psi",
    "zero_train",
    "memory_explorer",
    "step_comm",
    "frozen_and_shown",
    "save_then_reshard",
    "train_steps",
    "OPS",
    "max_gap",
    "comparison_table",
    "estimates_table",
]

QUESTIONS = [
    Question(
        "zero2_state_bytes",
        "03",
        "model-state bytes (weights, gradients, AdamW's moments) rank 0 holds at the "
        "end of backward under ZeRO-2, fp32, the chapter's GPT on 4 ranks",
        "kB",
    ),
    Question(
        "zero3_wire_ratio",
        "03",
        "bytes rank 0 puts on the wire in one ZeRO-3 step, as a multiple of what it "
        "sends in one DDP (stage 0) step",
        "x",
    ),
]

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # the reference's
GLOBAL_BATCH, STEPS = 16, 4
# not training traffic: the loss all-reduce for printing, the final gather for parity
NOT_TRAINING = ("metrics", "zero/gather-full")


# ---- ZeRO's loop, measured -----------------------------------------------------------
def padded_psi(cfg: GPTConfig, n: int) -> int:
    """Ψ as dtlab's units hold it on ``n`` ranks: each unit (the root: embeddings
    and final norm; one per block) padded to a multiple of ``n``."""
    m = GPT(cfg)
    block = sum(p.numel() for p in m.blocks[0].parameters())
    root = m.n_params() - cfg.n_layers * block
    return sum(-(-k // n) * n for k in [root] + [block] * cfg.n_layers)


def zero_train(
    cfg: GPTConfig,
    stage: int,
    n: int = 4,
    steps: int = STEPS,
    compute_dtype=None,
    offload: bool = False,
    pause: float = 0.0,
) -> dict | None:
    """Train ``cfg``'s GPT with ZeRO ``stage`` on ranks ``0..n-1`` (the others sit
    out and return None), a memory event per phase. Returns ``{"losses", "params"
    (gathered), "psi" (padded), "tensors" (local shards the optimizer steps),
    "step_ms" (median)}``."""
    from dtlab import comm, telemetry
    from dtlab.memory import MemoryTracker
    from dtlab.zero import FullyShardedDataParallel

    group = (
        dist.group.WORLD
        if n == dist.get_world_size()
        else dist.new_group(list(range(n)))
    )
    if dist.get_rank() >= n:
        return None  # this rank sits the run out
    r = comm.group_rank(group)
    model = FullyShardedDataParallel(
        GPT(cfg), compute_dtype, group, stage=stage, offload=offload
    )
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)  # steps the local shards
    tracker = MemoryTracker(model, opt)  # emits a memory event per phase
    rec = telemetry.current()
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len)
    losses, times = [], []
    for step in range(steps):
        rec.step = step
        x, y = data.shard(step, GLOBAL_BATCH, r, n)  # (B/n, T) each
        t0 = time.perf_counter()
        with tracker.phase("forward"), rec.span("F"):
            _, loss = model(x, y)
        with tracker.phase("backward"), rec.span("B"):
            loss.backward()
        with tracker.phase("step"), rec.span("opt"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        total = loss.detach().clone()
        comm.all_reduce(total, group=group, tag="metrics")
        losses.append(total.item() / n)
        time.sleep(pause)  # only so that the live view is watchable
    return {
        "losses": losses,
        "params": model.gather_full_params(),
        "psi": model.padded_numel,
        "tensors": len(list(model.parameters())),  # what the optimizer steps
        "step_ms": 1e3 * statistics.median(times[1:]),
    }


def memory_explorer(cluster, cfg: GPTConfig):
    """Display the live memory view: a stage, a world size and offload to choose,
    a **train** button, each rank's bytes by category redrawn while it trains and
    the ZeRO formula beside them. Returns ``.train(stage, n, offload, steps)``
    (what the button runs), ``.live`` (the figure) and ``.controls``."""
    import ipywidgets as W
    from IPython.display import display

    from dtlab import estimate as est
    from dtlab.lab.figures.live import LiveFigure
    from dtlab.lab.figures.zero import zero_memory_figure

    stage_w = W.ToggleButtons(
        options=[0, 1, 2, 3],
        value=3,
        description="ZeRO stage",
        style={"button_width": "40px"},
    )
    world_w = W.Dropdown(options=[1, 2, 4], value=4, description="world size")
    offload_w = W.Checkbox(value=False, description="CPU offload")
    run_w = W.Button(description="train", button_style="primary")
    out_w = W.Output()
    live = LiveFigure(zero_memory_figure, min_interval=0.1, window=400)

    def train(stage, n, offload, steps=8):
        live.clear()
        live.build_kwargs["predicted"] = est.zero_states_per_rank(
            padded_psi(cfg, n), n, stage, "fp32", offload=offload
        )
        args = (cfg, stage, n, steps, None, offload, 0.05)  # 0.05 s pause per step
        result = cluster.run(zero_train, *args, on_events=live, timeout=120)
        live.flush()
        return result

    def on_click(_):
        with out_w:  # errors show under the figure
            out_w.clear_output()
            train(stage_w.value, world_w.value, offload_w.value)

    run_w.on_click(on_click)
    display(W.VBox([W.HBox([stage_w, world_w, offload_w, run_w]), live.widget, out_w]))
    controls = dict(stage=stage_w, world=world_w, offload=offload_w, run=run_w)
    return SimpleNamespace(train=train, live=live, controls=controls)


def step_comm(events, rank: int = 0, step: int = STEPS - 1) -> list[dict]:
    """The training traffic of one step on one rank: its comm events, without
    :data:`NOT_TRAINING`."""
    return [
        e
        for e in events
        if e["kind"] == "comm"
        and e["rank"] == rank
        and e["step"] == step
        and e.get("tag") not in NOT_TRAINING
    ]


# ---- the chapter's smaller experiments (run on every rank) ---------------------------
def frozen_and_shown(cfg: GPTConfig, stage: int) -> dict:
    """Two steps of ZeRO ``stage`` with weight decay 0.1 and the position embedding
    frozen: what the module shows between backward and the step (each parameter's
    local shard shape and its gradient's), whether the frozen weight moved, the
    Adam state it got, and how many local shards the optimizer steps."""
    from dtlab.zero import FullyShardedDataParallel

    r, n = dist.get_rank(), dist.get_world_size()
    gpt = GPT(cfg)
    gpt.wpe.weight.requires_grad_(False)  # frozen: position embeddings
    before = gpt.wpe.weight.detach().clone()
    model = FullyShardedDataParallel(gpt, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len)
    for step in range(2):
        x, y = data.shard(step, GLOBAL_BATCH, r, n)
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        # between backward and the step, the module shows its local shards
        shown = {
            name: (tuple(p.shape), None if p.grad is None else tuple(p.grad.shape))
            for name, p in model.module.named_parameters()
        }
        opt.step()
    return {
        "shown": shown,
        "frozen_unchanged": torch.equal(
            model.gather_full_params()["wpe.weight"], before
        ),
        "frozen_state": sum(
            len(opt.state.get(p, {})) for p in model.parameters() if not p.requires_grad
        ),
        "pieces": len(list(model.parameters())),
    }


def save_then_reshard(cfg: GPTConfig, path: str) -> bool | None:
    """Save a ZeRO-3 model and its Adam state (one step of made-up gradients) from
    every rank under ``path``, then load the same files on ranks 0 and 1 only.
    True on those two when every weight and every Adam value came back exactly
    (None on the others)."""
    from dtlab.checkpoint import gather_full_optimizer_state, load_sharded, save_sharded
    from dtlab.zero import FullyShardedDataParallel

    def build(group):
        model = FullyShardedDataParallel(GPT(cfg), None, group, stage=3)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)

    model, opt = build(None)
    for p in model.parameters():  # one step of made-up gradients gives Adam state
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    save_sharded(path, model, opt)
    before = (model.gather_full_params(), gather_full_optimizer_state(model, opt))
    pair = dist.new_group([0, 1])
    if dist.get_rank() >= 2:
        return None
    model, opt = build(pair)
    load_sharded(path, model, opt)
    after = (model.gather_full_params(), gather_full_optimizer_state(model, opt))
    return all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and all(
        torch.equal(before[1][k][s], after[1][k][s])
        for k in before[1]
        for s in before[1][k]
    )


# ---- the loop around a framework's model (run on every rank) -------------------------
def train_steps(job, step, params=None, optimizer=None) -> dict:
    """Run ``step(x, y) -> loss`` (forward, backward and optimizer step, however a
    framework spells them) for each of ``job``'s steps on this rank's slice of
    the batch, counting every collective it issues. Returns ``{"losses" (averaged
    over the ranks), "traffic" (per step), "memory" (the model state this rank
    holds, from ``params`` and ``optimizer``; empty without them), "mesh",
    "placements" (of the first parameter, when it is a DTensor)}``."""
    from dtlab.frameworks.job import (
        build_data,
        local_batch,
        mean_over_world,
        state_bytes,
    )
    from dtlab.frameworks.traffic import CollectiveCounter

    data, counter, losses = build_data(job), CollectiveCounter(), []
    for s in range(job.steps):
        x, y = local_batch(data, s, job)  # (B/N, T)
        counter.step = s
        with counter:
            loss = step(x, y)
        losses.append(mean_over_world(loss.item()))  # not counted: a report
    params = list(params or ())
    out = {
        "losses": losses,
        "traffic": [counter.per_step(s) for s in range(job.steps)],
        "memory": state_bytes(params, optimizer) if params else {},
    }
    first = params[0] if params else None
    if first is not None and hasattr(first, "placements"):
        mesh = first.device_mesh
        out["mesh"] = {"shape": tuple(mesh.shape), "names": mesh.mesh_dim_names}
        out["placements"] = [str(p) for p in first.placements]
    return out


# ---- the frameworks beside dtlab -----------------------------------------------------

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def max_gap(losses, baseline) -> float:
    """The largest relative difference between two loss curves."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, baseline))


def _payload(run: dict, step: int, op: str) -> int:
    return int(run["traffic"][step].get(op, {}).get("payload_bytes", 0))


def comparison_table(runs: dict[str, dict], baseline: str, step: int = 1) -> str:
    """One line per run: last loss, gap to ``runs[baseline]``, bytes held (params,
    grads, optimizer; ``-`` where a framework frees them before it can be asked),
    and the payload bytes of each collective in ``step``."""
    base = runs[baseline]["losses"]
    head = (
        f"{'run':<26}{'last loss':>11}{'gap':>9}{'params':>9}{'grads':>9}"
        f"{'optim':>9}" + "".join(f"{op.replace('_', '-'):>15}" for op in OPS)
    )
    lines = [head, f"{'':<55}bytes held{'':>13}payload bytes in step {step}"]
    for name, run in runs.items():
        mem = run["memory"]
        held = "".join(
            f"{mem[k]:>9,}" if k in mem else f"{'-':>9}"
            for k in ("params", "grads", "optimizer")
        )
        sent = "".join(f"{_payload(run, step, op):>15,}" for op in OPS)
        lines.append(
            f"{name:<26}{run['losses'][-1]:>11.7f}"
            f"{max_gap(run['losses'], base):>9.1e}{held}{sent}"
        )
    return "\n".join(lines)


def estimates_table(found: dict) -> str:
    """DeepSpeed's estimate of model-state GB per GPU (and per node on the host)
    beside dtlab's and the ZeRO paper's, for one model of
    :func:`~dtlab.frameworks.deepspeed_run.estimates`."""
    lines = [
        f"{found['model']}: {found['params'] / 1e9:.2f}B parameters on "
        f"{found['gpus']} GPUs (largest layer {found['largest_layer'] / 1e6:.0f}M)",
        f"{'':<18}{'GPU, DeepSpeed':>15}{'dtlab':>8}{'paper':>8}"
        f"{'host/node, DS':>15}{'dtlab':>8}",
    ]
    for row in found["rows"]:
        name = f"ZeRO-{row['stage']}" + (" + offload" if row["offload"] else "")
        paper = "-" if row["paper_gpu"] is None else f"{row['paper_gpu'] / GB:.1f}"
        lines.append(
            f"{name:<18}{row['deepspeed_gpu'] / GB:>15.1f}{row['dtlab_gpu'] / GB:>8.1f}"
            f"{paper:>8}{row['deepspeed_host_per_node'] / GB:>15.1f}"
            f"{row['dtlab_host_per_node'] / GB:>8.1f}"
        )
    return "\n".join(lines)
