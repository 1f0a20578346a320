"""How a function travels to the engines: pickled by cloudpickle, by name or by
value.

Taught in chapter 01 (the function you pass to ``cluster.run`` is sent to every
engine).
"""

from __future__ import annotations


def ship_by_value(fn) -> None:
    """Functions travel to the engines pickled. cloudpickle sends a function of an
    importable module by *name*; that fails on an engine when the module is a
    script or a test file the engine cannot import. Such modules (anything outside
    site-packages and not dtlab itself) are sent by value instead."""
    import sys

    import cloudpickle

    name = getattr(fn, "__module__", None) or "__main__"
    module = sys.modules.get(name)
    if name == "__main__" or module is None or name.split(".")[0] == "dtlab":
        return
    path = getattr(module, "__file__", None) or ""
    if "site-packages" in path or "dist-packages" in path or not path:
        return
    if path.startswith(sys.base_prefix) and "/lib/python" in path:  # stdlib
        return
    try:
        cloudpickle.register_pickle_by_value(module)
    except ValueError:  # already registered
        pass
