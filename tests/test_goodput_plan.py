"""The goodput benchmark's pure parts (``benchmarks/goodput_plan.py``, ``goodput.py``): the
seeded schedule, what the ranks' logs count as trained, and the goodput figure."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import goodput  # noqa: E402
import goodput_plan as plan  # noqa: E402


def test_the_schedule_is_the_seeds_and_never_takes_the_first_node() -> None:
    first = plan.schedule(1, 600, 60, 20, 0.25)
    assert first == plan.schedule(1, 600, 60, 20, 0.25) != plan.schedule(2, 600, 60, 20, 0.25)
    assert all(0 < f.at < 600 for f in first) and [f.at for f in first] == sorted(
        f.at for f in first
    )
    assert {f.kind for f in plan.schedule(1, 6000, 60, 20, 0.25)} == {"kill", "notice"}
    assert {plan.choose(p / 10, [0, 1, 2, 3]) for p in range(10)} == {1, 2, 3}
    assert plan.choose(0.5, [0]) is None


def _write(folder: Path, name: str, lines: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("".join(f"{line}\n" for line in lines))


def test_in_place_counts_a_step_in_the_generation_it_committed_in(tmp_path: Path) -> None:
    # Step 2 ran in generation 1 (rows 5, 6) and was not committed; it ran again in
    # generation 2 (rows 7, 8) and committed there: only 7, 8 count, one step dropped.
    _write(tmp_path, "rank0-1.txt", [
        "P 1 1 10.0 1 2", "C 1 1 10.1 2", "P 2 1 10.2 5 6", "P 2 2 11.0 7 8", "C 2 2 11.1 1",
    ])  # fmt: skip
    _write(tmp_path, "rank1-2.txt", ["P 1 1 10.0 3 4", "C 1 1 10.2 2"])
    trained = plan.read_in_place(tmp_path)
    assert sorted(trained.rows) == [1, 2, 3, 4, 7, 8] and trained.dropped == 1
    assert trained.commits[(1, 1)] == (10.1, 2)  # the earliest rank's commit


def test_in_place_a_restarts_commit_replaces_the_earlier_attempts(tmp_path: Path) -> None:
    # Attempt 0 committed steps 1-3; its restart (generations from 1_000_000) resumed from the
    # checkpoint of step 2 and trained step 3 again on other rows: the lineage is the restart's.
    _write(tmp_path, "rank0-1.txt", [
        "P 1 0 1.0 1 2", "C 1 0 1.1 1", "P 2 0 1.2 3 4", "C 2 0 1.3 1", "P 3 0 1.4 5 6",
        "C 3 0 1.5 1",
    ])  # fmt: skip
    _write(tmp_path, "rank0-2.txt", ["P 3 1000000 9.0 5 6", "C 3 1000000 9.1 1"])
    trained = plan.read_in_place(tmp_path)
    assert sorted(trained.rows) == [1, 2, 3, 4, 5, 6] and trained.steps == 3
    assert trained.dropped == 1  # attempt 0's step 3, trained again


def test_torchfts_steps_not_committed_count_as_dropped(tmp_path: Path) -> None:
    # torchft's side logs a step at its commit, and "D" for a step tried and not committed.
    _write(tmp_path, "group0-1.txt", ["D 1 0 1.0", "P 1 0 2.0 1 2", "C 1 0 2.0 2", "D 2 0 3.0"])
    _write(tmp_path, "group1-2.txt", ["D 1 0 1.0", "P 1 0 2.0 3 4", "C 1 0 2.0 2"])
    trained = plan.read_in_place(tmp_path)
    assert sorted(trained.rows) == [1, 2, 3, 4] and trained.steps == 1 and trained.dropped == 2


def test_a_restart_counts_each_attempt_up_to_the_next_resume(tmp_path: Path) -> None:
    # Attempt 1700 (a generation named by the clock, as torchrun's side does) trained steps
    # 1-3; attempt 1800 resumed from step 2's checkpoint: step 3's rows were trained again.
    _write(tmp_path, "attempt1700-rank0-1.txt", [
        "R 0", "C 1 1700 1.0 2 1 2", "C 2 1700 2.0 2 3 4", "C 3 1700 3.0 2 5 6",
    ])  # fmt: skip
    _write(tmp_path, "attempt1800-rank0-2.txt", ["R 2", "C 3 1800 9.0 1 5 6", "C 4 1800 10.0 1 7"])
    trained = plan.read_restarts(tmp_path)
    assert sorted(trained.rows) == [1, 2, 3, 4, 5, 6, 7] and trained.duplicated() == 0
    assert trained.missing(8) == 1 and trained.resumes == 1
    assert trained.step_seconds(2) == 1.0 and trained.step_seconds(4) is None


def test_repeats_inside_one_generation_up_to_its_world_are_padding_and_others_duplicates(
    tmp_path: Path,
) -> None:
    # Generation 2 at 3 ranks read the epoch's rest of 7 rows padded to 9: rows 1 and 2 twice.
    # Row 5 trained in generation 1 and again in generation 2 is a duplicate all the same.
    _write(tmp_path, "rank0-1.txt", [
        "P 1 1 1.0 5 6", "C 1 1 1.1 3", "P 2 2 2.0 1 2 3", "C 2 2 2.1 3",
    ])  # fmt: skip
    _write(tmp_path, "rank1-2.txt", ["P 2 2 2.0 4 5 7"])
    _write(tmp_path, "rank2-3.txt", ["P 2 2 2.0 8 1 2"])
    trained = plan.read_in_place(tmp_path)
    assert trained.padded() == 2 and trained.duplicated() == 1 and trained.missing(9) == 1
    # the same repeats spread over two generations are no padding
    trained = plan.Trained()
    trained.commit(1, 1, 1.0, 3)
    trained.commit(2, 2, 2.0, 3)
    trained.train(1, [1, 2])
    trained.train(2, [1, 2])
    assert trained.padded() == 0 and trained.duplicated() == 2


def test_goodput_counts_committed_steps_and_at_full_size_the_rows() -> None:
    trained = plan.Trained()
    for step in range(10):  # 10 steps at 4 ranks of 4 rows, 10 at 2 ranks
        trained.train(1, list(range(16 * step, 16 * step + 16)))
        trained.train(2, list(range(1000 + 8 * step, 1000 + 8 * step + 8)))
    assert plan.goodput(trained, 100.0, 0.5) == 20 * 0.5 / 100.0
    assert plan.full_size(trained, 4, 4, 100.0, 0.5) == 240 / 16 * 0.5 / 100.0
    assert plan.goodput(trained, 100.0, None) is None


def test_every_world_size_divides_the_epoch_and_a_side_never_at_full_size_borrows() -> None:
    for minutes in (0.1, 0.5, 1, 10):
        rows = goodput._rows(minutes, 0.1)
        assert rows > 0 and all(rows % (world * goodput.BATCH) == 0 for world in (1, 2, 3, 4))
    restart = {"side": goodput.SIDES["restart"], "rows": 160, "wall": 100.0, "step": 0.5}
    torchrun = {"side": goodput.SIDES["torchrun"], "rows": 80, "steps": 8, "wall": 100.0,
                "step": None}  # fmt: skip
    goodput.borrow_step([restart, torchrun])
    assert torchrun["step"] == 0.5 and torchrun["goodput"] == 8 * 0.5 / 100.0
    assert torchrun["full_size"] == 80 / 16 * 0.5 / 100.0
    assert torchrun["step_from"] == restart["side"]


def test_where_the_time_went_adds_up_to_the_wall_and_names_each_gaps_cause(tmp_path: Path) -> None:
    # Launch at 100; steps of 1 s commit at 110-113, a loss at 113.5 (next commit 115), steps
    # at 116, a 6 s gap at 122 while a returning node starts (118-121.5), a 5 s gap with no
    # cause at 127; the launch returns at 130.
    times = [110, 111, 112, 113, 115, 116, 122, 123, 128]
    _write(tmp_path, "rank0-1.txt",
           [line for n, at in enumerate(times, 1) for line in (f"P {n} 1 {at - 0.5} {n}",
                                                              f"C {n} 1 {at} 4")])  # fmt: skip
    trained = plan.read_in_place(tmp_path)
    losses, starts = plan.node_starts(
        100.0, [{"at": 13.5, "kind": "kill", "node": 2}, {"at": 30.0, "kind": "none up"}],
        [["lost", 4, 3, True, 113.6], ["grew", 3, 4, True, 121.5]], 4.5, 2.0,
    )  # fmt: skip
    assert losses == [113.5] and starts == [(118.0, 121.5)]
    parts = plan.spent(trained, 100.0, 30.0, 1.0, losses, starts)
    assert parts == {"start": 10.0, "at_loss": 1.0, "starting": 5.0, "stalls": 4.0,
                     "slow": 0.0, "end": 2.0}  # fmt: skip
    assert sum(parts.values()) + trained.steps * 1.0 == 30.0 + 1.0  # less one step
    # a notice's node goes ``lead`` later, so it is back that much later; no grew: no start-up
    assert plan.node_starts(0.0, [{"at": 1.0, "kind": "notice", "node": 1}], [], 5.0, 2.0) == (
        [1.0],
        [],
    )
