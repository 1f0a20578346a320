"""The ranks of a dry run: dtlab's real trainer on a fake process group, with
meta-device weights.

:func:`measure_step` is what both a dry run and a real run of the same config
execute on a rank: build :class:`dtlab.train.Trainer` (so
:func:`dtlab.parallelize.parallelize`, in its fixed order), run the step(s) with a
telemetry recorder in force, and return what dtlab's own accounting recorded: the
``memory`` event of the last step (:meth:`dtlab.parallelize.Parallelized.memory`)
and the bytes every :mod:`dtlab.comm` call recorded, by axis, op and tag. The test
runs it on real gloo ranks and on fake ones, and compares.

:func:`run_ranks` is the body of a dry-run process (one rank after another,
each through :func:`run_rank`). PyTorch's ``fake`` backend
answers every collective at once without moving data, and the meta device holds
shapes without memory; five things in this process adapt dtlab to that, and
nothing outside it (each is undone when the block ends):

- the trainer's device is ``meta`` (``dtlab.train.default_device``), and the model
  is built inside ``torch.device("meta")``, so a 405B stage costs no memory;
- the synthetic data is a stand-in of the same shape and dtype
  (:class:`MetaTokens`): the bytes do not depend on the token values, and the
  Markov chain of a 128K-token vocabulary takes seconds to draw;
- reading a meta tensor's value (``item``, ``float``, ``bool``, ``int``) gives 0
  (``tolist``: an empty list): a dry run has no loss, norm or overflow to read,
  and 0 takes the path of a finite step;
- the meta kernels of LayerNorm (forward and backward), GELU's backward and
  ``normal_`` are replaced by shape functions that return what torch's own (Python
  decompositions, a third of a 405B stage's step) return: the same shapes and
  dtypes (LayerNorm's statistics in fp32 under 16 bits, as torch's meta kernel
  and CUDA keep them);
- a meta storage's ``data_ptr()`` is its storage object's address (it is 0 for
  every meta storage): dtlab's accounting counts each storage once by its
  pointer, and two meta tensors must not look like one.
"""

from __future__ import annotations

import contextlib
import time

import torch

__all__ = [
    "measure_step",
    "MetaTokens",
    "meta_world",
    "run_rank",
    "run_ranks",
]

# the collectives of scalars (a loss, a gradient norm, an overflow flag): real
# traffic, but not the model's; the estimate leaves them out
SCALAR_TAGS = ("loss", "metrics", "grad_norm", "zero/grad-norm", "found_inf")


def measure_step(config, steps: int = 1, *, flush: bool = True) -> dict:
    """On this rank of the current world: train ``config`` for ``steps`` and return
    the last step's measurements: ``memory`` (bytes by category, dtlab.memory's
    accounting), ``traffic`` (``{(axis, op, tag): {calls, payload_bytes,
    wire_bytes}}``, every dtlab.comm call), ``coords``, ``stage`` and
    ``step_tensors`` (the tensors the optimizer keeps a step counter for).

    ``flush``: ZeRO-1 and -2 all-gather a step's updated slices at the start of the
    next forward, so a first step alone lacks that gather. Rather than run a second
    step to see it (twice the time, 40 s a rank at 128K), the gather is started now
    and counted in this step: the same bytes on the same axis as the steady state's
    (tests/test_dryrun.py holds the two equal on a real gloo world)."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.train import Trainer

    rank = dist.get_rank() if dist.is_initialized() else 0
    rec = telemetry.Recorder(rank)
    with telemetry.use(rec):
        trainer = Trainer(config)
        trainer.fit(steps)
        if flush and config.zero_stage in (1, 2):
            rec.step = steps - 1  # the gather the next forward would start
            for wrapper in trainer.parts.wrapped:
                wrapper.sync_params(wait=True)
    last = steps - 1
    events = [e for e in rec.events if e["step"] == last]
    memory = [e for e in events if e["kind"] == "memory" and e["phase"] == "step"]
    skip = ("kind", "rank", "step", "phase", "t")
    traffic: dict[tuple, dict] = {}
    for e in events:
        if e["kind"] != "comm":
            continue
        row = traffic.setdefault(
            (e["axis"], e["op"], e.get("tag")),
            {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0},
        )
        row["calls"] += 1
        row["payload_bytes"] += e["payload_bytes"]
        row["wire_bytes"] += e["wire_bytes"]
    inner = trainer.parts.optimizer.optimizer
    counters = [
        s["step"] for s in inner.state.values() if torch.is_tensor(s.get("step"))
    ]
    return {
        "rank": rank,
        "coords": dict(trainer.topo.coords),
        "memory": {k: v for k, v in memory[-1].items() if k not in skip},
        "traffic": traffic,
        "step_tensors": len(counters),
        "step_counter_bytes": sum(c.numel() * c.element_size() for c in counters),
        "steps": steps,
    }


class MetaTokens:
    """The shape of :class:`dtlab.model.SyntheticTokens` on the meta device: each
    batch is ``(x, y)``, ``(global_batch_size, seq_len)`` int64, without values."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, **_):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def batch(self, step: int, global_batch_size: int):
        shape = (global_batch_size, self.seq_len)
        return (torch.empty(shape, dtype=torch.long, device="meta") for _ in "xy")


def _zero_on_meta(original, zero):
    def read(self, *args, **kwargs):
        if self.device.type == "meta":
            return zero
        return original(self, *args, **kwargs)

    return read


def _storage_address(original):
    def data_ptr(self):
        if self.device.type == "meta":
            return self._cdata  # the storage's own address: one per storage
        return original(self)

    return data_ptr


def _stat_dtype(x):
    half = (torch.float16, torch.bfloat16)
    return torch.float32 if x.dtype in half else x.dtype


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    n = len(normalized_shape)
    stats = (*x.shape[: x.dim() - n], *([1] * n))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dtype = _stat_dtype(x)
    return out, x.new_empty(stats, dtype=dtype), x.new_empty(stats, dtype=dtype)


def _layer_norm_backward(grad, x, shape, mean, rstd, weight, bias, mask):
    def like(t, wanted):
        if not wanted or t is None:
            return None
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    return like(x, mask[0]), like(weight, mask[1]), like(bias, mask[2])


def _gelu_backward(grad, x, approximate="none"):
    dtype = torch.promote_types(grad.dtype, x.dtype)
    return torch.empty_like(grad, dtype=dtype, memory_format=torch.contiguous_format)


def _normal(self, mean=0.0, std=1.0, generator=None):
    return self


@contextlib.contextmanager
def _fast_meta_kernels():
    import warnings

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a registered kernel"
        lib.impl("native_layer_norm", _layer_norm, "Meta")
        lib.impl("native_layer_norm_backward", _layer_norm_backward, "Meta")
        lib.impl("gelu_backward", _gelu_backward, "Meta")
        lib.impl("normal_", _normal, "Meta")
    try:
        yield
    finally:
        lib._destroy()  # torch's own kernels again


@contextlib.contextmanager
def meta_world():
    """The five adaptations of the module docstring, for the ``with`` body."""
    import dtlab.train as train_mod

    storage = torch.UntypedStorage
    patches = [
        (torch.Tensor, "item", _zero_on_meta(torch.Tensor.item, 0.0)),
        (torch.Tensor, "__float__", _zero_on_meta(torch.Tensor.__float__, 0.0)),
        (torch.Tensor, "__int__", _zero_on_meta(torch.Tensor.__int__, 0)),
        (torch.Tensor, "__bool__", _zero_on_meta(torch.Tensor.__bool__, False)),
        (torch.Tensor, "tolist", _zero_on_meta(torch.Tensor.tolist, [])),
        (storage, "data_ptr", _storage_address(storage.data_ptr)),
        (train_mod, "default_device", lambda: torch.device("meta")),
        (train_mod, "SyntheticTokens", MetaTokens),
    ]  # fmt: skip
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    original_init = train_mod.Trainer.__init__

    def init_on_meta(self, *args, **kwargs):
        with torch.device("meta"):  # the model's parameters: shapes, no memory
            original_init(self, *args, **kwargs)

    train_mod.Trainer.__init__ = init_on_meta
    try:
        with _fast_meta_kernels():
            yield
    finally:
        train_mod.Trainer.__init__ = original_init
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def run_rank(config, world_size: int, rank: int, results) -> bool:
    """Dry-run one ``rank``: join a fake world of ``world_size`` ranks as it,
    :func:`measure_step` under :func:`meta_world`, leave the world again; put
    ``("ok", rank, measurement)`` or ``("error", rank, (message, traceback))`` on
    ``results``; return whether it went well."""
    import traceback

    t0 = time.perf_counter()
    try:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group(
            "fake", rank=rank, world_size=world_size, store=FakeStore()
        )
        try:
            with meta_world():
                out = measure_step(config)
        finally:
            dist.destroy_process_group()
        out["seconds"] = time.perf_counter() - t0
        results.put(("ok", rank, out))
        return True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        message = f"{type(exc).__name__}: {exc}"
        results.put(("error", rank, (message, traceback.format_exc())))
        return False


def run_ranks(config, world_size: int, ranks, results) -> None:
    """The body of one dry-run process: :func:`run_rank` for each of ``ranks`` in
    turn (a fake world is left and joined again as the next rank: one start-up,
    torch's import, for all of them). Stops at the first error."""
    torch.set_num_threads(1)
    for rank in ranks:
        if not run_rank(config, world_size, rank, results):
            return
