"""Size bounds of the task factories that read or build data: each refuses, naming the factory, the
option or file and the bound, before reading or building anything."""

from __future__ import annotations

import pytest

from rlvr import procmem
from rlvr.tasks import TaskError, limits
from rlvr.tasks.dataset import read_rows
from rlvr.tasks.mathverify import BUILTIN_PROBLEMS, math_task
from rlvr.tasks.rgym import rgym_task


def test_a_data_file_larger_than_the_machine_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """1,000 bytes need about 4 x 1,000 once read (FILE_BYTES_FACTOR): refused with 3,000 available,
    read with 5,000."""
    f = tmp_path / "d.jsonl"
    f.write_text(('{"prompt": "ab", "answer": "ba"}\n' * 40)[:999] + "\n")
    assert f.stat().st_size == 1000 and limits.FILE_BYTES_FACTOR == 4
    with pytest.raises(ValueError, match="data file.*d.jsonl.*use a smaller file"):
        limits.check_file("data file", f, available=3000)
    limits.check_file("data file", f, available=5000)
    monkeypatch.setattr(procmem, "available_bytes", lambda: 3000)
    with pytest.raises(TaskError, match="d.jsonl.*the machine has"):
        read_rows(f)


def test_the_built_in_math_problems_are_counted_before_they_are_drawn():
    """a/b op c/d over 1..9 and three operations: 9^4 x 3 distinct prompts; asking for more is refused
    at once (it drew 50 x (train + heldout) times before saying so)."""
    assert BUILTIN_PROBLEMS == 19_683
    with pytest.raises(TaskError, match="train \\+ heldout = 1,000,000,200 asks for more than the 19,683"):
        math_task(train=10**9)
    assert len(math_task(train=20, heldout=5).train) == 20


@pytest.mark.parametrize("option", ["size", "heldout"])
def test_a_reasoning_gym_task_of_a_billion_entries_is_refused_before_the_dataset_is_made(option):
    with pytest.raises(ValueError, match=f"rgym_task: option {option} = 1,000,000,000 exceeds the limit"):
        rgym_task("leg_counting", **{option: 10**9})
