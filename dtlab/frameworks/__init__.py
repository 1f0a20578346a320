"""From dtlab to the real thing: the same training job under the frameworks an
interviewer names, run beside dtlab's own version of it.

Taught in the "from dtlab to the real thing" sections of chapters 02 (torch DDP,
``torch.multiprocessing.spawn``, ``torchrun``), 03 (FSDP2 and HSDP, DeepSpeed ZeRO),
06 (``torch.autocast`` and ``GradScaler``) and 07 (HF accelerate, and the
translation table). Every module trains dtlab's job, :mod:`dtlab.frameworks.job`
(:class:`dtlab.model.GPT` on :class:`dtlab.model.SyntheticTokens`, the same seed,
batch and AdamW as a :class:`dtlab.train.TrainConfig`), with one framework, and
returns the losses to compare with :class:`dtlab.train.Trainer`'s:

- :mod:`~dtlab.frameworks.torch_ddp`: ``torch.nn.parallel.DistributedDataParallel``
  on the engines, and the same job as a script under ``mp.spawn`` and ``torchrun``;
- :mod:`~dtlab.frameworks.fsdp2`: ``fully_shard`` with ``MixedPrecisionPolicy`` and
  ``reshard_after_forward``, and HSDP on a 2D device mesh;
- :mod:`~dtlab.frameworks.autocast`: the ``autocast`` + ``GradScaler`` loop next to
  :mod:`dtlab.amp`'s policy and loss scaler;
- :mod:`~dtlab.frameworks.accelerate_run`: ``Accelerator().prepare`` and
  ``accelerate launch``;
- :mod:`~dtlab.frameworks.deepspeed_run`: DeepSpeed ZeRO-1/2/3 and ZeRO-Offload
  from a JSON config, and DeepSpeed's memory estimators beside dtlab's;
- :mod:`~dtlab.frameworks.translate`: one ``TrainConfig`` as a DeepSpeed JSON, an
  accelerate config and FSDP2 arguments, each loaded by its own library;
- :mod:`~dtlab.frameworks.traffic`: the bytes any of them sends, counted on
  torch.distributed's own collectives.

The core never imports this package. torch's own frameworks need nothing more;
DeepSpeed and accelerate come with the ``frameworks`` extra
(``pip install -e '.[frameworks]'``, pinned in ``constraints.txt``): a module
imports them only when one of its functions runs, so importing any module here
works without them.
"""

from __future__ import annotations

import importlib
import importlib.util

__all__ = ["require", "missing", "deepspeed_on_gloo"]

EXTRA = "frameworks"  # the pyproject extra that installs deepspeed and accelerate


def missing(package: str) -> str | None:
    """Why ``package`` cannot be imported here (``None`` if it can): what a test
    prints when it skips, and what :func:`require` raises."""
    if importlib.util.find_spec(package) is None:  # without importing it (seconds)
        return (
            f"{package} is not installed: pip install -c constraints.txt "
            f"-e '.[{EXTRA}]'"
        )
    return None


def require(package: str):
    """Import ``package`` (``"deepspeed"``, ``"accelerate"``) or raise an
    ``ImportError`` that says which extra installs it."""
    reason = missing(package)
    if reason is not None:
        raise ImportError(reason)
    return importlib.import_module(package)


def deepspeed_on_gloo():
    """Import DeepSpeed for a CPU world on gloo, without its shared-memory
    all-reduce: the first ``deepspeed.init_distributed`` on a CPU compiles that C++
    op (``ShareMemCommBuilder``) with ninja, 30-60 s in a fresh environment, and
    only DeepSpeed's *inference* all-reduce uses it. dtlab's comparisons train, and
    every collective must go through torch.distributed (gloo), where dtlab counts
    the bytes; so the op is marked incompatible before the backend is made."""
    deepspeed = require("deepspeed")
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
    return deepspeed
