"""A real Jupyter kernel for the tests that need one (jupyter_client, from the test
extra): start it, run a cell, collect what the cell sent back."""

from __future__ import annotations

import os
import textwrap
import time


def start_kernel(shutdown_wait: float = 2.5):
    """A started ``KernelManager`` and a ready client. ``shutdown_wait``: seconds
    the manager waits before its SIGTERM, as JupyterLab does."""
    import jupyter_client

    km = jupyter_client.KernelManager(kernel_name="python3")
    km.shutdown_wait_time = shutdown_wait
    km.start_kernel(env={**os.environ, "PYTHONUNBUFFERED": "1"})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return km, kc


def execute_messages(kc, code: str, *, timeout: float = 240.0, errors=True) -> list:
    """Run ``code`` in the kernel; every iopub message of the cell, in order, each
    with the time it arrived (``msg["received"]``). An error in the cell raises
    ``AssertionError`` unless ``errors=False``."""
    msg_id = kc.execute(textwrap.dedent(code))
    messages, deadline = [], time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        msg["received"] = time.monotonic()
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content["execution_state"] == "idle":
            return messages
        if kind == "error" and errors:
            raise AssertionError("\n".join(content["traceback"]))
        messages.append(msg)


def execute(kc, code: str, *, timeout: float = 240.0, wait: bool = True) -> str:
    """Run ``code`` in the kernel; its stdout (raises on an error in the cell).
    ``wait=False``: send it and return at once (a cell that keeps running)."""
    if not wait:
        kc.execute(textwrap.dedent(code))
        return ""
    return "".join(
        m["content"]["text"]
        for m in execute_messages(kc, code, timeout=timeout)
        if m["msg_type"] == "stream"
    )
