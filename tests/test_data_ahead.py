"""Reading ahead: a thread decodes chunks ahead of the reader (``read_ahead``).

The batches are the same, value for value and in order, with and without the thread, in the
process and in every kind of worker; a pass resumed from a state saved while reading ahead goes
on at the right row; the thread stops however the pass ends, and an error it meets is raised to
the loop.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from sparktrain import ConfigError
from sparktrain.data import from_parquet
from test_data import ROWS, write_ids

pytest.importorskip("pyarrow")


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_ids(tmp_path / "data")


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sparktrain-data")]


def _batches(data: Path, mode: str, ahead: int | None, state: Any = None, **options: Any) -> Any:
    dataset = from_parquet(data, batch_size=16, world_size=1, read_ahead=ahead, **options)
    if state is not None:
        dataset.load_state_dict(state)
    return dataset, (
        iter(dataset) if mode == "in-process" else iter(dataset.loader(2, workers=mode))
    )


def _rows(batch: dict[str, Any]) -> tuple[list[int], list[float]]:
    return batch["id"].tolist(), batch["x"][:, 1].tolist()


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("mode", ["in-process", "processes", "threads"])
def test_reading_ahead_yields_the_same_batches_and_resumes_exactly(
    data: Path, mode: str, shuffle: bool
) -> None:
    """Windows of 200 rows span row groups of 97: each window is read in several chunks."""
    options = {"shuffle": shuffle, "shuffle_buffer": 200}
    _, plain = _batches(data, mode, 0, **options)
    whole = [_rows(b) for b in plain]
    assert sorted(i for ids, _ in whole for i in ids) == list(range(ROWS))
    assert all(x == [-float(i) for i in ids] for ids, x in whole)
    dataset, ahead = _batches(data, mode, 3, **options)
    taken = [_rows(next(ahead)) for _ in range(9)]
    ahead.close()  # what a break does: the thread stops here
    assert not _readers()
    _, rest = _batches(data, mode, 3, dataset.state_dict(), **options)
    assert taken + [_rows(b) for b in rest] == whole
    assert not _readers()


def test_the_thread_reads_ahead_only_while_the_pass_lasts(data: Path) -> None:
    dataset = from_parquet(data, batch_size=16, world_size=1, read_ahead=2, shuffle_buffer=200)
    batches = iter(dataset)
    assert not _readers()  # nothing starts before the first batch is asked for
    first = next(batches)
    assert len(_readers()) == 1
    del batches  # a loop that lets go of the pass
    assert not _readers()
    assert torch.equal(first["x"][:, 0].long(), first["id"])
    assert len(list(dataset)) == len(dataset) and not _readers()  # a pass to its end


def test_an_error_met_reading_ahead_is_raised_to_the_loop(tmp_path: Path) -> None:
    """The last file goes missing after the dataset was built: the loop gets the reader's error."""
    errors = []
    for ahead in (0, 2):
        folder = write_ids(tmp_path / f"ahead-{ahead}")
        dataset = from_parquet(folder, batch_size=16, world_size=1, shuffle=False, read_ahead=ahead)
        sorted(folder.glob("*.parquet"))[-1].unlink()
        read = []
        with pytest.raises(Exception) as raised:
            for batch in dataset:
                read += batch["id"].tolist()
        errors.append((type(raised.value), read))
        assert not _readers()
    assert errors[0] == errors[1]
    assert errors[0][0] is FileNotFoundError and 0 < len(errors[0][1]) < ROWS


def test_a_pass_reading_ahead_gives_its_thread_a_core_and_gives_it_back(data: Path) -> None:
    """torch's intra-op threads spin while they wait: where they fill every core, the rank uses
    one fewer while the thread reads, and as many as before once the pass ends or breaks."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    try:
        for ahead, during in ((2, max(1, cores - 1)), (0, cores)):
            dataset = from_parquet(data, batch_size=16, world_size=1, read_ahead=ahead)
            seen = {torch.get_num_threads() for _ in dataset}
            assert seen == {during} and torch.get_num_threads() == cores
            for _ in dataset:
                assert torch.get_num_threads() == during
                break
            assert torch.get_num_threads() == cores
            for number, _ in enumerate(dataset):  # a count set inside the loop is kept
                if number == 1:
                    torch.set_num_threads(cores + 1)
            assert torch.get_num_threads() == cores + 1
            torch.set_num_threads(cores)
    finally:
        torch.set_num_threads(before)


def test_a_pass_ended_on_another_thread_gives_the_cores_back_at_the_next(data: Path) -> None:
    """torch's thread count is per thread: a pass freed on another thread (the cyclic garbage
    collector runs wherever Python allocates, a reading thread too) cannot put the rank's back
    there; the rank's next pass does. Nothing is left running and nothing is raised."""
    before, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    unraisable: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    torch.set_num_threads(cores)
    try:
        dataset = from_parquet(data, batch_size=16, world_size=1, shuffle_buffer=200)
        batches = iter(dataset)
        next(batches)
        closer = threading.Thread(target=batches.close)
        closer.start()
        closer.join()
        for _ in range(10):  # passes dropped in a reference cycle, freed by the collector
            holder: dict[str, Any] = {"batches": iter(dataset)}
            holder["self"] = holder
            next(holder["batches"])
            del holder
            assert len(list(from_parquet(data, batch_size=16, world_size=1))) > 0
        gc.collect()
        assert len(list(dataset)) == len(dataset)  # the next pass puts the count back
        assert torch.get_num_threads() == cores and not _readers() and not unraisable
    finally:
        sys.unraisablehook = hook
        torch.set_num_threads(before)


_OPEN_AT_EXIT = """
import sys
from sparktrain.data import from_parquet
batches = iter(from_parquet(sys.argv[1], batch_size=16, world_size=1, shuffle_buffer=200))
next(batches)
if sys.argv[2] == "fail":
    raise RuntimeError("the step failed")
print("done")
"""


@pytest.mark.parametrize("end", ["exit", "fail"])
def test_a_pass_still_open_when_python_exits_ends_the_process_cleanly(data: Path, end: str) -> None:
    """A daemon thread holding a tensor while Python tears down aborts the process (SIGABRT,
    'terminate called without an active exception'): open passes are stopped first."""
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _OPEN_AT_EXIT, str(data), end],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert "terminate called" not in done.stderr
        if end == "exit":
            assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
        else:
            assert done.returncode == 1 and "RuntimeError: the step failed" in done.stderr


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None])
def test_a_bad_read_ahead_names_the_value(data: Path, bad: Any) -> None:
    with pytest.raises(ConfigError, match=f"read_ahead={bad!r} must be a whole number"):
        from_parquet(data, batch_size=16, world_size=1, read_ahead=bad)
