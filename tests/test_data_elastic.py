"""sparktrain.data: resuming an epoch at another world size (an elastic run shrank or grew).

One process plays every rank (``rank=``/``world_size=``): every old rank hands out the same
number of batches, rank 0's ``state_dict()`` is loaded into every new rank, and the new ranks
read to the end of the epoch. The ids read across all legs are then the epoch's rows exactly
once (rows that divide evenly), at least once with only padding repeated (``uneven="pad"``), or
at most once with the rows carried over as documented (``uneven="drop"``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparktrain import ConfigError
from sparktrain.data import StreamingDataset, from_parquet, remainder

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_ids(folder: Path, rows: int, files: int = 3, group: int = 97) -> Path:
    """Parquet files of ``rows`` rows with an ``id`` column, in row groups of ``group``."""
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for number in range(files):
        ids = np.arange(bounds[number], bounds[number + 1])
        table = pa.table({"id": ids, "x": ids.astype(np.float32)})
        pq.write_table(table, folder / f"part-{number}.parquet", row_group_size=group)
    return folder


@pytest.fixture(scope="module")
def even(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ids(tmp_path_factory.mktemp("even"), 1200)


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ids(tmp_path_factory.mktemp("odd"), 1001, files=2, group=89)


@dataclass(frozen=True)
class Leg:
    """``world`` ranks with ``workers`` DataLoader workers each hand out ``batches`` (all: None)."""

    world: int
    workers: int = 0
    batches: int | None = None
    loader_batch: int | None = None  # a DataLoader that batches single rows


@dataclass
class Run:
    """What an elastic epoch read: every id, and per leg the rows left before it and its size."""

    reads: list[int]
    left: list[int]  # rows no earlier leg had read (set semantics), at each leg's start
    worlds: list[int]
    datasets: list[StreamingDataset]  # the last leg's ranks


def _pass(dataset: StreamingDataset, leg: Leg) -> tuple[list[int], dict[str, Any]]:
    """The ids one rank hands out in ``leg`` (to the epoch's end when ``batches`` is None)."""
    options = {} if leg.loader_batch is None else {"batch_size": leg.loader_batch}
    plain = leg.workers == 0 and leg.loader_batch is None
    source = dataset if plain else dataset.loader(num_workers=leg.workers, **options)
    ids: list[int] = []
    iterator = iter(source)
    count = 0
    while leg.batches is None or count < leg.batches:
        try:
            batch = next(iterator)
        except StopIteration:
            assert leg.batches is None, f"the pass ended after {count} batches"
            break
        ids.extend(batch["id"].reshape(-1).tolist())
        count += 1
    state = dataset.state_dict()
    del iterator
    return ids, state


def run(path: Path, legs: list[Leg], **options: Any) -> Run:
    """Read one epoch in ``legs``, each new leg's ranks loading the last leg's rank 0 state."""
    options.setdefault("batch_size", 16)
    reads: list[int] = []
    left: list[int] = []
    state: dict[str, Any] | None = None
    datasets: list[StreamingDataset] = []
    rows = 0
    for leg in legs:
        datasets = [
            from_parquet(path, rank=r, world_size=leg.world, **options) for r in range(leg.world)
        ]
        rows = datasets[0].source.rows
        left.append(rows - len(set(reads)))
        states = []
        for dataset in datasets:
            if state is not None:
                dataset.load_state_dict(state)
            ids, saved = _pass(dataset, leg)
            reads.extend(ids)
            states.append(saved)
        assert all(s == states[0] for s in states), "every rank saves the same state"
        state = states[0]
    return Run(reads, left, [leg.world for leg in legs], datasets)


def assert_exactly_once(result: Run, rows: int) -> None:
    for world, count in zip(result.worlds, result.left, strict=True):
        assert count % world == 0, "the test's numbers must divide evenly at every leg"
    assert sorted(result.reads) == list(range(rows))


def assert_padded(result: Run, rows: int) -> None:
    """Every row at least once; repeats no more than the legs' padding positions."""
    counts = Counter(result.reads)
    assert set(counts) == set(range(rows))
    padding = sum(-(-m // w) * w - m for m, w in zip(result.left, result.worlds, strict=True))
    assert len(result.reads) - rows <= padding


def assert_next_epoch_whole(result: Run, path: Path, **options: Any) -> None:
    """The pass after the resumed one is the new size's ordinary next epoch."""
    options.setdefault("batch_size", 16)
    world = len(result.datasets)
    seen = []
    for rank, dataset in enumerate(result.datasets):
        assert dataset.epoch == 1 and dataset.state_dict()["legs"] == []
        ids = [i for batch in dataset for i in batch["id"].reshape(-1).tolist()]
        fresh = from_parquet(path, rank=rank, world_size=world, **options)
        fresh.set_epoch(1)
        assert ids == [i for batch in fresh for i in batch["id"].reshape(-1).tolist()]
        seen.extend(ids)
    rows = result.datasets[0].source.rows
    if rows % world == 0:
        assert sorted(seen) == list(range(rows))
    elif options.get("uneven") == "drop":
        assert len(set(seen)) == len(seen) == rows - rows % world
    else:
        assert set(seen) == set(range(rows))


# -- every row exactly once (the counts divide evenly) -------------------------------------------

EVEN = [  # (legs, options): 1200 rows, batches of 16 unless said
    ([Leg(4, 0, 3), Leg(3)], {}),
    ([Leg(4, 0, 3), Leg(3)], {"shuffle": False}),
    ([Leg(4, 2, 3), Leg(3, 3)], {"shuffle_buffer": 50}),
    ([Leg(1, 0, 7), Leg(2, 2)], {"shuffle_buffer": 100}),
    ([Leg(4, 0, 3), Leg(3, 2, 4), Leg(2)], {"shuffle_buffer": 40}),
    ([Leg(2, 2, 5), Leg(1, 0, 9), Leg(2, 3)], {"shuffle_buffer": 64}),
    ([Leg(2, 0, 5), Leg(1, 2, 9), Leg(2, 0)], {"shuffle": False, "shuffle_buffer": 64}),
    ([Leg(4, 0, 3), Leg(3, 0, 2), Leg(3, 0, 1), Leg(2)], {"shuffle_buffer": 30}),  # 3 -> 3
    ([Leg(4, 0, 3), Leg(3, 2, 3), Leg(3, 2, 2), Leg(2, 3)], {"shuffle_buffer": 20}),
    ([Leg(4, 0, 30), Leg(3)], {"batch_size": None, "shuffle_buffer": 70}),
    ([Leg(2, 2, 6, 10), Leg(3, 0, None, 7)], {"batch_size": None, "shuffle_buffer": 45}),
    ([Leg(3, 0, 4), Leg(2, 0, 0), Leg(4)], {"batch_size": 25}),  # a leg that read nothing
]


@pytest.mark.parametrize(("legs", "options"), EVEN)
def test_every_row_exactly_once(even: Path, legs: list[Leg], options: dict[str, Any]) -> None:
    result = run(even, legs, **options)
    assert_exactly_once(result, 1200)
    assert_next_epoch_whole(result, even, **options)


def test_the_remainder_is_what_the_old_ranks_did_not_read(even: Path) -> None:
    """Without the shuffle, positions are ids: rank 0's state alone gives every rank's reads."""
    head = run(even, [Leg(4, 2, 5)], shuffle=False, shuffle_buffer=64, batch_size=8)
    state = head.datasets[1].state_dict()
    plan = remainder.Plan(1200, 0, 0, False, 64, 8, False, "pad")
    old = remainder.Leg(state["world_size"], state["workers"], state["consumed"])
    left = remainder.remaining(plan, [old]).positions()
    assert sorted(set(range(1200)) - set(head.reads)) == left.tolist()
    shuffled = run(even, [Leg(3, 2, 5)], shuffle_buffer=64, batch_size=8)
    state = shuffled.datasets[0].state_dict()
    plan = remainder.Plan(1200, 0, 0, True, 64, 8, False, "pad")
    old = remainder.Leg(state["world_size"], state["workers"], state["consumed"])
    assert len(remainder.remaining(plan, [old])) == 1200 - len(shuffled.reads)


# -- uneven counts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("legs", "options"),
    [
        ([Leg(4, 0, 3), Leg(3)], {}),
        ([Leg(4, 2, 5), Leg(3, 0, 2), Leg(2, 2)], {"shuffle_buffer": 50}),
        ([Leg(2, 0, 4), Leg(1, 2, 3), Leg(2)], {"shuffle": False}),
        ([Leg(3, 0, 20), Leg(4)], {"shuffle_buffer": 60}),  # the padding was being read
        ([Leg(3, 0, 40), Leg(2, 3, None, 6)], {"batch_size": None}),
    ],
)
def test_pad_reads_every_row_and_repeats_only_padding(
    odd: Path, legs: list[Leg], options: dict[str, Any]
) -> None:
    result = run(odd, legs, **options)
    assert_padded(result, 1001)
    assert_next_epoch_whole(result, odd, **options)


def test_drop_carries_the_dropped_rows_to_the_next_world_size(odd: Path) -> None:
    # 4 ranks of 250 rows leave row 1000 out; after 2 batches of 16 a rank, 873 rows are left,
    # which 3 ranks share evenly: the carried row is read, every row exactly once.
    result = run(odd, [Leg(4, 0, 2), Leg(3)], uneven="drop", shuffle=False)
    assert result.left == [1001, 873]
    assert sorted(result.reads) == list(range(1001))
    # 2 ranks read 2 x 2 x 16 rows; 937 are left, 3 ranks take 312 each and leave out the last
    # one of the rest (the highest unread id without the shuffle).
    result = run(odd, [Leg(2, 2, 2), Leg(3, 2)], uneven="drop", shuffle=False)
    counts = Counter(result.reads)
    assert max(counts.values()) == 1 and sorted(set(range(1001)) - set(counts)) == [1000]
    shuffled = run(odd, [Leg(3, 0, 3), Leg(2, 2, 4), Leg(4)], uneven="drop", shuffle_buffer=40)
    counts = Counter(shuffled.reads)
    assert max(counts.values()) == 1
    assert 1001 - len(counts) == shuffled.left[-1] % 4
    assert_next_epoch_whole(shuffled, odd, uneven="drop", shuffle_buffer=40)


def test_drop_last_carries_short_batches_and_reads_no_row_twice(odd: Path) -> None:
    result = run(odd, [Leg(2, 2, 3), Leg(3, 2)], drop_last=True, batch_size=32, uneven="drop")
    assert max(Counter(result.reads).values()) == 1
    # 809 rows left: 3 ranks take 269 (2 left out), 134 and 135 a worker: 4 batches of 32 each
    assert 1001 - len(result.reads) == 2 + 3 * (134 - 128 + 135 - 128)


def test_a_finished_leg_ends_the_epoch(odd: Path) -> None:
    whole = from_parquet(odd, batch_size=16, rank=0, world_size=3, uneven="drop")
    result = run(odd, [Leg(3, 0, len(whole)), Leg(2)], uneven="drop")
    assert len(result.reads) == 1001 - 1001 % 3  # the new size read nothing: the epoch was over
    assert all(dataset.epoch == 1 for dataset in result.datasets)
    assert_next_epoch_whole(result, odd, uneven="drop")


# -- compatibility and errors ---------------------------------------------------------------------


def test_same_world_size_and_old_states_resume_as_before(even: Path) -> None:
    straight = run(even, [Leg(2, 2)], shuffle_buffer=64)
    resumed = run(even, [Leg(2, 2, 7), Leg(2, 2)], shuffle_buffer=64)
    assert sorted(resumed.reads) == sorted(straight.reads)
    reader = from_parquet(even, batch_size=16, rank=0, world_size=2, shuffle_buffer=64)
    _, state = _pass(reader, Leg(2, 0, 5))
    old = {k: v for k, v in state.items() if k not in remainder_keys()}  # an older checkpoint
    again = from_parquet(even, batch_size=16, rank=0, world_size=2, shuffle_buffer=64)
    again.load_state_dict(old)
    with pytest.raises(ConfigError, match="num_workers=0; resume with the same, not 2"):
        list(again.loader(num_workers=2))
    elastic = run_from(even, old, Leg(4, 2), shuffle_buffer=64)
    assert len(elastic) + 2 * 5 * 16 == 1200  # an old state also resumes at another size


def remainder_keys() -> set[str]:
    return {"legs", "shuffle", "shuffle_buffer", "uneven", "drop_last"}


def run_from(path: Path, state: dict[str, Any], leg: Leg, **options: Any) -> list[int]:
    ids: list[int] = []
    for rank in range(leg.world):
        dataset = from_parquet(path, batch_size=16, rank=rank, world_size=leg.world, **options)
        dataset.load_state_dict(state)
        ids.extend(_pass(dataset, leg)[0])
    return ids


def test_states_of_another_dataset_are_refused(even: Path, odd: Path) -> None:
    reader = from_parquet(even, batch_size=16, rank=0, world_size=2)
    _, state = _pass(reader, Leg(2, 0, 3))
    cases: list[tuple[StreamingDataset, str]] = [
        (from_parquet(odd, batch_size=16, world_size=3), "rows was 1200, now 1001"),
        (from_parquet(even, batch_size=16, world_size=3, seed=5), "seed was 0, now 5"),
        (from_parquet(even, batch_size=8, world_size=3), "batch_size was 16, now 8"),
        (from_parquet(even, batch_size=16, world_size=3, shuffle_buffer=9), "shuffle_buffer"),
        (from_parquet(even, batch_size=16, world_size=3, uneven="drop"), "uneven was 'pad'"),
    ]
    for dataset, message in cases:
        with pytest.raises(ConfigError, match=message):
            dataset.load_state_dict(state)
    target = from_parquet(even, batch_size=16, world_size=3)
    with pytest.raises(ConfigError, match="handed out 999 batches, but it had only 38"):
        target.load_state_dict({**state, "consumed": 999})
    with pytest.raises(ConfigError, match=r"leg .* is malformed"):
        target.load_state_dict({**state, "legs": [{"world_size": 2}]})
    with pytest.raises(ConfigError, match="needs world_size >= 1"):
        target.load_state_dict({**state, "legs": [{**state, "world_size": 0}]})
    target.load_state_dict(state)  # the refusals left it alone; this one fits
    assert target.state_dict()["legs"] == [
        {"world_size": 2, "workers": 0, "consumed": 3, "loader_batch": None}
    ]


def test_runs_arithmetic() -> None:
    runs = remainder.Runs([0, 10, 20], [5, 12, 23])
    assert runs.take(3, 8).positions().tolist() == [3, 4, 10, 11, 20]
    assert runs.take(8, 12).positions().tolist() == [21, 22, 0, 1]  # wraps: padding
    assert runs.at(np.array([0, 5, 9, 10])).tolist() == [0, 10, 22, 0]
    minus = runs.minus(remainder.Runs([1, 4, 11, 4, 30], [2, 11, 12, 6, 31]))
    assert minus.pairs() == [(0, 1), (2, 4), (20, 23)]
    assert remainder.Runs.span(0, 10).minus(remainder.Runs([3], [4])).pairs() == [(0, 3), (4, 10)]
    assert len(remainder.Runs([], [])) == 0 and remainder.Runs([], []).take(0, 0).pairs() == []
