"""Notebook magics for the live cluster: target ranks by rank, run every cell on
the ranks, move variables, see every rank's status.

Taught in chapter 01. :func:`dtlab.lab.start` loads them into the notebook (or
``%load_ext dtlab.lab.kernel.magics``); they act on the cluster ``start`` returned last.

- ``%%rank 0,2`` (also ``%%rank 1-3``, ``%%rank all``): the cell runs on those
  ranks (by rank, not ipyparallel engine id); each rank's output streams into an
  area of its own under the cell (:mod:`dtlab.lab.kernel.output`), and the cell ends as
  ``cluster.run`` does: an error names its rank, a hung rank is named and
  interrupted, the Stop button stops the ranks (:mod:`dtlab.lab.kernel.waiting`).
- ``%ranks on`` / ``%ranks off``: every following cell runs on all ranks, as if it
  began with ``%%rank all`` (a cell that starts with ``%%local`` still runs in the
  notebook, one with ``%%rank ...`` on its own ranks).
- ``%push x y``: the notebook's ``x`` and ``y`` to every rank; ``%pull x``: each
  rank's ``x`` into the notebook's ``x``, a list in rank order (also
  ``cluster.push(x=...)`` / ``cluster.pull("x")``).
- ``%status``: every rank's pid, host, device, memory, current or last operation
  and heartbeat (:mod:`dtlab.lab.kernel.status`).
"""

from __future__ import annotations

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from dtlab.lab.kernel import replacing, teardown, waiting
from dtlab.lab.kernel.output import RankOutput

_MODE = {"on": False}  # %ranks on: every cell goes to the ranks


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """``"0,2"``, ``"1-3"``, ``"all"`` (or nothing) -> sorted ranks; a rank outside
    the world is a ``ValueError`` that says which ranks exist."""
    spec = spec.strip()
    if spec in ("", "all", "*"):
        return list(range(world_size))
    ranks: set[int] = set()
    for part in spec.replace(" ", ",").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if last else lo
        except ValueError:
            raise ValueError(
                f"%%rank {spec}: write ranks as 0,2 or 1-3 or all, got {part!r}"
            ) from None
        ranks.update(range(lo, hi + 1))
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad or not ranks:
        raise ValueError(
            f"%%rank {spec}: ranks {bad or '(none)'} are not in this world of "
            f"{world_size} (ranks 0..{world_size - 1})"
        )
    return sorted(ranks)


def current_cluster():
    """The cluster :func:`dtlab.lab.start` made last in this kernel."""
    clusters = [c for c in teardown.live() if c.running]
    active = [c for c in clusters if c.px_active] or clusters
    if not active:
        raise RuntimeError("no cluster is running: cluster = dtlab.lab.start(...)")
    return active[-1]


def run_cell(cluster, code: str, ranks: list[int]):
    """Run ``code`` on ``ranks``' engines as a cell, their output in an area each;
    returns the replies in rank order."""
    cluster.check_running()
    replacing.require_registered(cluster, ranks)
    if cluster.needs_reset:
        cluster.reset()
    pending = {
        r: cluster.client[cluster.rank_to_engine[r]].execute(
            code, silent=False, block=False
        )
        for r in ranks
    }
    try:
        return waiting.wait_for_ranks(
            cluster,
            [pending[r] for r in ranks],
            ranks=ranks,
            timeout=cluster.call_timeout,
            what="the cell",
            output=RankOutput(pending, results=True),
        )
    except BaseException:
        cluster.needs_reset = True
        raise


@magics_class
class RankMagics(Magics):
    """``%%rank``, ``%ranks``, ``%%local``, ``%push``, ``%pull``, ``%status``."""

    @cell_magic
    def rank(self, line, cell):
        """Run the cell on the ranks given: ``%%rank 0,2``, ``%%rank 1-3``,
        ``%%rank all``."""
        cluster = current_cluster()
        ranks = parse_ranks(line, cluster.world_size)
        try:
            run_cell(cluster, cell, ranks)
        except Exception as exc:  # noqa: BLE001 - the ranks' error, not ours
            # the message names the rank and carries its traceback: the frames
            # of this magic and of the waiting loop would only bury it
            raise exc.with_traceback(None) from None

    @cell_magic
    def local(self, line, cell):
        """Run the cell in the notebook even when ``%ranks on``."""
        mode, _MODE["on"] = _MODE["on"], False  # not sent to the ranks again
        try:
            self.shell.run_cell(cell, store_history=False)
        finally:
            _MODE["on"] = mode

    @line_magic
    def ranks(self, line):
        """``%ranks on``: every cell runs on all ranks; ``%ranks off``: back."""
        word = line.strip().lower()
        if word not in ("on", "off"):
            raise ValueError("write %ranks on (every cell on the ranks) or %ranks off")
        current_cluster()  # there is one to send cells to
        _MODE["on"] = word == "on"
        transforms = self.shell.input_transformers_cleanup
        if _MODE["on"] and to_ranks not in transforms:
            transforms.insert(0, to_ranks)
        elif not _MODE["on"] and to_ranks in transforms:
            transforms.remove(to_ranks)
        print(
            "every cell now runs on the ranks (%ranks off to stop; %%local for one "
            "cell here)"
            if _MODE["on"]
            else "cells run in the notebook again"
        )

    @line_magic
    def push(self, line):
        """``%push x y``: the notebook's variables to every rank."""
        names = line.split()
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing or not names:
            raise ValueError(f"%push: no notebook variable named {missing or '...'}")
        current_cluster().push({n: self.shell.user_ns[n] for n in names})

    @line_magic
    def pull(self, line):
        """``%pull x``: each rank's ``x``, a list in rank order, into the
        notebook's ``x``."""
        cluster = current_cluster()
        for name in line.split():
            self.shell.user_ns[name] = cluster.pull(name)

    @line_magic
    def status(self, line):
        """Every rank's pid, host, device, memory, operation and heartbeat."""
        from IPython.display import display

        display(current_cluster().status())


def to_ranks(lines: list[str]) -> list[str]:
    """Input transformer of ``%ranks on``: a cell becomes ``%%rank all``, unless it
    is a ``%ranks``, ``%%local`` or ``%%rank`` cell."""
    first = next((x.strip() for x in lines if x.strip()), "")
    if not _MODE["on"] or first.startswith(("%ranks", "%%local", "%%rank")):
        return lines
    return ["%%rank all\n", *lines]


def load_ipython_extension(ipython) -> None:
    """``%load_ext dtlab.lab.kernel.magics`` (done by :func:`dtlab.lab.start`)."""
    ipython.register_magics(RankMagics)
