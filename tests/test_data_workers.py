"""DataLoader workers without copies, and the data layer's other ends.

Every worker mode (our processes, our threads, torch's own workers) yields the same batches in
the same order as the in-process reader, resumes exactly (through ``ds.loader`` and through
torchdata's ``StatefulDataLoader``), never overwrites a batch the loop still holds, and stops
its workers however the pass ends. Also: dates and timestamps, hive partition folders, Arrow
IPC files and a format of the test's own, one saved state for every rank, a plain DataLoader's
uncounted workers refused, and a 64 MB ``/dev/shm``.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain import ConfigError
from sparktrain.data import StreamingDataset, from_arrow, from_parquet
from sparktrain.data.sources import from_files
from sparktrain.data.workers import WorkerError
from test_data import ROWS, write_ids

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

MODES = ["processes", "threads", "torch"]


def ids(batches: Any) -> list[list[int]]:
    return [batch["id"].tolist() for batch in batches]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_ids(tmp_path / "data")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_mode_yields_what_torch_workers_yield(data: Path, mode: str, workers: int) -> None:
    """The same batches in the same order (the workers' turns), every row once a rank."""
    expected = ids(from_parquet(data, batch_size=32, world_size=1).loader(workers, workers="torch"))
    got = ids(from_parquet(data, batch_size=32, world_size=1).loader(workers, workers=mode))
    assert got == expected
    in_process = ids(from_parquet(data, batch_size=32, world_size=1))
    flat = sorted(i for batch in got for i in batch)
    assert flat == sorted(i for batch in in_process for i in batch) == list(range(ROWS))


def test_torch_workers_hand_over_each_batch_alone(data: Path) -> None:
    """A shuffled batch is a view of its window's buffer; through torch's worker queue (which
    moves a tensor's whole storage to /dev/shm) each arrives holding its own rows only."""
    loader = from_parquet(data, batch_size=32, world_size=1).loader(2, workers="torch")
    got = list(loader)
    assert sorted(i for b in got for i in b["id"].tolist()) == list(range(ROWS))
    for batch in got:
        for value in batch.values():
            assert value.untyped_storage().nbytes() == value.nbytes


@pytest.mark.parametrize("mode", MODES)
def test_a_dataset_of_rows_is_batched_in_the_workers(data: Path, mode: str) -> None:
    loader = from_parquet(data, batch_size=None, world_size=1).loader(
        2, workers=mode, batch_size=10, drop_last=True
    )
    batches = list(loader)
    assert {len(b["id"]) for b in batches} == {10} and len(batches) == len(loader)
    assert len({i for b in batches for i in b["id"].tolist()}) == 10 * len(batches)


@pytest.mark.parametrize("mode", ["processes", "threads"])
def test_resume_mid_epoch_through_the_loader(data: Path, mode: str) -> None:
    whole = ids(from_parquet(data, batch_size=16, world_size=1).loader(2, workers=mode))
    first = from_parquet(data, batch_size=16, world_size=1)
    taken = []
    for batch in first.loader(2, workers=mode):
        taken.append(batch["id"].tolist())
        if len(taken) == 7:
            break  # the workers are stopped here
    state = first.state_dict()
    second = from_parquet(data, batch_size=16, world_size=1)
    second.load_state_dict(state)
    assert taken + ids(second.loader(2, workers=mode)) == whole


def test_a_batch_the_loop_keeps_is_never_overwritten(data: Path) -> None:
    """Batches are views of reused memory, lent back only when nothing uses them."""
    loader = from_parquet(data, batch_size=8, world_size=1).loader(2, prefetch_factor=1)
    kept, seen = [], []
    for number, batch in enumerate(loader):
        if number % 3 == 0:
            kept.append((batch["id"].clone(), batch["id"], batch["x"][:, 0]))  # views too
        seen.append(batch["id"].tolist())
    for copy, held, view in kept:
        assert torch.equal(copy, held) and torch.equal(view.long(), copy)
    assert sorted(i for b in seen for i in b) == list(range(ROWS))


def _fails_at_third(batch: dict[str, Any]) -> dict[str, Any]:
    if int(batch["id"][0]) >= 64:
        raise ValueError(f"a bad row near id {int(batch['id'][0])}")
    return batch


@pytest.mark.parametrize("mode", ["processes", "threads"])
def test_an_error_in_a_worker_is_raised_with_its_traceback(data: Path, mode: str) -> None:
    dataset = from_parquet(
        data, batch_size=32, world_size=1, shuffle=False, transform=_fails_at_third
    )
    with pytest.raises(ValueError, match="a bad row near id") as raised:
        list(dataset.loader(1, workers=mode))
    if mode == "processes":
        assert isinstance(raised.value.__cause__, WorkerError)
        assert "_fails_at_third" in str(raised.value.__cause__)


def _stalls(batch: dict[str, Any]) -> dict[str, Any]:
    if int(batch["id"][0]) >= 64:
        Path(os.environ["STALL_PIDS"], str(os.getpid())).touch()
        import time

        time.sleep(1000)
    return batch


def test_a_worker_killed_from_outside_is_named_not_waited_for(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALL_PIDS", str(tmp_path))
    dataset = from_parquet(data, batch_size=32, world_size=1, shuffle=False, transform=_stalls)
    batches = iter(dataset.loader(1))
    next(batches)
    next(batches)
    while not list(tmp_path.glob("[0-9]*")):
        pass
    os.kill(int(next(tmp_path.glob("[0-9]*")).name), signal.SIGKILL)
    with pytest.raises(WorkerError, match="killed by SIGKILL"):
        list(batches)


def test_a_plain_dataloader_is_read_but_its_state_refused(data: Path) -> None:
    dataset = from_parquet(data, batch_size=32, world_size=1)
    rows = sum(
        len(b["id"]) for b in torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    )
    assert rows == ROWS
    with pytest.raises(ConfigError, match=r"ds\.loader\(num_workers=k\)"):
        dataset.state_dict()
    list(dataset.loader(2))  # a counted pass: its state is exact again
    assert dataset.state_dict()["epoch"] == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(data: Path, workers: int) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader_of = stateful.StatefulDataLoader

    def loader(dataset: StreamingDataset) -> Any:
        return loader_of(dataset, batch_size=None, num_workers=workers, snapshot_every_n_steps=1)

    whole = ids(loader(from_parquet(data, batch_size=16, world_size=1)))
    first = loader(from_parquet(data, batch_size=16, world_size=1))
    taken = []
    for batch in first:
        taken.append(batch["id"].tolist())
        if len(taken) == 9:
            break
    state = first.state_dict()
    second = loader(from_parquet(data, batch_size=16, world_size=1))
    second.load_state_dict(state)
    assert taken + ids(second) == whole  # the epoch exactly once, in the same order


def test_one_state_resumes_every_rank_and_a_list_of_them_too(data: Path) -> None:
    ranks = [from_parquet(data, batch_size=16, rank=r, world_size=2) for r in range(2)]
    for dataset in ranks:
        for number, _ in enumerate(dataset):
            if number == 4:
                break
    states = [d.state_dict() for d in ranks]
    assert states[0] == states[1]
    for rank in range(3):  # a larger world: what rank 1 of 3 would load
        grown = from_parquet(data, batch_size=16, rank=rank, world_size=3)
        grown.load_state_dict(states)  # the all-gathered list, as docs once showed it
        grown_too = from_parquet(data, batch_size=16, rank=rank, world_size=3)
        grown_too.load_state_dict(states[0])
        assert ids(grown) == ids(grown_too)
    states[1] = {**states[1], "consumed": 9}
    with pytest.raises(ConfigError, match=r"ranks \[1\] differ"):
        ranks[0].load_state_dict(states)


def test_dates_and_timestamps_are_int64(tmp_path: Path) -> None:
    table = pa.table(
        {
            "day": pa.array([dt.date(1970, 1, 2), dt.date(2026, 11, 26)]),
            "at": pa.array([0, 1_500], type=pa.timestamp("ms", tz="UTC")),
            "took": pa.array([dt.timedelta(seconds=2), dt.timedelta(0)]),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    batch = next(
        iter(from_parquet(tmp_path / "t.parquet", batch_size=2, shuffle=False, world_size=1))
    )
    assert {k: v.dtype for k, v in batch.items()} == dict.fromkeys(batch, torch.int64)
    assert batch["day"].tolist() == [1, 20783]  # days since 1970-01-01
    assert batch["at"].tolist() == [0, 1_500_000_000]  # nanoseconds since 1970-01-01 UTC
    assert batch["took"].tolist() == [2_000_000_000, 0]


def _same(batch: Any) -> Any:
    return batch


def test_hive_partition_folders_are_columns(tmp_path: Path) -> None:
    for year, region in [(2025, "eu"), (2026, "eu"), (2026, "us west")]:
        folder = tmp_path / "t" / f"year={year}" / f"region={region.replace(' ', '%20')}"
        folder.mkdir(parents=True)
        pq.write_table(pa.table({"id": np.arange(3) + year * 10}), folder / "part-0.parquet")
    dataset = from_parquet(  # a string column reaches the transform as it is
        tmp_path / "t", batch_size=100, shuffle=False, world_size=1, transform=_same
    )
    assert str(dataset.source.schema.field("year").type) == "int64"
    (batch,) = list(dataset.loader(workers="processes", num_workers=1))
    rows = sorted(zip(batch["id"].tolist(), batch["year"].tolist(), batch["region"], strict=True))
    assert rows[0] == (20250, 2025, "eu") and rows[-1] == (20262, 2026, "us west")
    assert len(rows) == 9
    null = tmp_path / "t" / "year=__HIVE_DEFAULT_PARTITION__" / "region=eu"
    null.mkdir(parents=True)
    pq.write_table(pa.table({"id": np.arange(3)}), null / "part-0.parquet")
    with pytest.raises(ConfigError, match="null partition value"):
        from_parquet(tmp_path / "t", batch_size=100, world_size=1)


def test_arrow_ipc_files_and_a_format_of_ones_own(tmp_path: Path, data: Path) -> None:
    (tmp_path / "ipc").mkdir()
    table = pq.read_table(data).sort_by("id")
    with pa.ipc.new_file(tmp_path / "ipc" / "all.arrow", table.schema) as out:
        for start in range(0, table.num_rows, 100):
            out.write_batch(table.slice(start, 100).to_batches()[0])
    arrow = ids(from_arrow(tmp_path / "ipc", batch_size=32, world_size=1))
    parquet = ids(from_parquet(data, batch_size=32, world_size=1))
    assert sorted(i for b in arrow for i in b) == sorted(i for b in parquet for i in b)

    class Lines:  # one id a line; a file is one unit
        name = "lines"

        def units(self, fs: Any, file: str) -> tuple[Any, list[int]]:
            return pa.schema([("id", pa.int64())]), [len(Path(file).read_text().split())]

        def read(
            self, fs: Any, file: str, unit: int, columns: Sequence[str], chunk: int
        ) -> Iterator[Any]:
            values = [int(v) for v in Path(file).read_text().split()]
            for start in range(0, len(values), chunk):
                yield pa.record_batch([pa.array(values[start : start + chunk])], names=["id"])

    (tmp_path / "lines").mkdir()
    for n in range(3):
        (tmp_path / "lines" / f"{n}.txt").write_text(
            "\n".join(map(str, range(n * 50, n * 50 + 50)))
        )
    files = sorted(str(p) for p in (tmp_path / "lines").iterdir())
    import pyarrow.fs as pafs

    source = from_files("lines", pafs.LocalFileSystem(), files, kind=Lines())
    mine = ids(StreamingDataset(source, batch_size=20, world_size=1).loader(2))
    assert sorted(i for b in mine for i in b) == list(range(150))


SMALL_SHM = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from sparktrain import ConfigError
from sparktrain.data import from_parquet
data = sys.argv[2]
started = time.monotonic()
rows = sum(len(b["id"]) for b in from_parquet(data, batch_size=16384, world_size=1).loader(2))
print("processes", rows, round(time.monotonic() - started, 1))
started = time.monotonic()
try:
    list(from_parquet(data, batch_size=16384, world_size=1).loader(2, workers="torch"))
    print("torch finished", round(time.monotonic() - started, 1))
except ConfigError as error:
    print("torch refused", round(time.monotonic() - started, 1), str(error).replace("\n", " "))
"""


@pytest.mark.slow
def test_a_64_mb_dev_shm_with_batches_larger_than_it(tmp_path: Path) -> None:
    """Docker's default: our workers need no /dev/shm; torch's are refused before they hang."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small /dev/shm in a namespace")
    folder = tmp_path / "wide"
    folder.mkdir()
    features = np.random.default_rng(0).random((40_000, 784), dtype=np.float32)
    table = pa.table(
        {
            "id": np.arange(40_000),
            "x": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), 784),
        }
    )
    pq.write_table(table, folder / "part-0.parquet", row_group_size=10_000)
    script = tmp_path / "small.py"
    script.write_text(SMALL_SHM)
    command = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
        f"{sys.executable} {script} {Path(__file__).parent} {folder}"
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line)
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines["processes"].split()[0] == "40000"  # finished: slots are not /dev/shm files
    refused = lines["torch"].split()
    assert refused[0] == "refused" and float(refused[1]) < 10, lines["torch"]
    said = lines["torch"]
    assert "/dev/shm, which has 64 MB free" in said and "a batch is 49 MB" in said


def test_bad_loader_options_name_the_fix(data: Path) -> None:
    dataset = from_parquet(data, batch_size=32, world_size=1)
    with pytest.raises(
        ConfigError, match="workers='nope' must be one of processes, threads, torch"
    ):
        dataset.loader(2, workers="nope")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="workers='torch' to use them"):
        dataset.loader(2, timeout=5)
    with pytest.raises(ConfigError, match="num_workers=-1"):
        dataset.loader(-1)
