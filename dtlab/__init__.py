"""dtlab: distributed training of LLMs, implemented from scratch, run live.

Core modules use only torch (``torch.distributed``); the notebook layer lives in
:mod:`dtlab.lab`.
"""

__version__ = "0.1.0"
