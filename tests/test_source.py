"""dtlab.lab.source: the chapters show dtlab's own lines, numbered as in the file."""

import inspect

import pytest

from dtlab.ddp.reducer import DistributedDataParallel
from dtlab.lab.source import show, source_lines


def test_the_lines_shown_are_the_library_s_own():
    first, lines = source_lines(DistributedDataParallel._launch)
    real, start = inspect.getsourcelines(DistributedDataParallel._launch)
    assert first == start and len(lines) == len(real)
    assert lines[0].startswith("def _launch")  # dedented
    text = show(DistributedDataParallel._launch, mark=["all_reduce"])
    marked = [line for line in text.splitlines() if line[5:7] == " >"]
    assert marked and all("all_reduce" in line for line in marked)


def test_a_window_and_its_bounds():
    first, lines = source_lines(
        DistributedDataParallel._launch, start="with torch.no_grad", stop="mul_"
    )
    assert "no_grad" in lines[0] and "mul_" in lines[-1]
    with pytest.raises(ValueError, match="not in the source"):
        source_lines(DistributedDataParallel._launch, start="no such line")
    with pytest.raises(ValueError, match="show at most"):
        show(DistributedDataParallel, max_lines=10)
