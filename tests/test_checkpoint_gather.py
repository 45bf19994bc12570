"""The plan of a restart's fetch: which node sends which kept checkpoint file to which.

The fetch itself runs in real ranks on a ``LocalCluster`` of 3 nodes (test_checkpoint_memory.py,
a restart after a lost node): here, the pure plan every rank computes from the same postings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparktrain.rank.checkpoints import gather

GB = 1 << 30


def _said(node: str, held: dict[str, dict[str, int]], free: int = 10 * GB) -> dict[str, Any]:
    return {"node": node, "free": free, "held": {"store": held}}


def test_each_lacking_node_gets_each_file_from_a_holder_once_per_node() -> None:
    # 3 nodes of 2 ranks; node b held node a's files too (its neighbour); node a was lost
    a_files = {"part-00000.bin": 100, "part-00001.bin": 100}
    b_files = {"part-00002.bin": 100, "part-00003.bin": 100}
    postings = [
        _said("b", {"00000003-t": {**a_files, **b_files}}),
        _said("b", {"00000003-t": {**a_files, **b_files}}),
        _said("c", {"00000003-t": {"part-00004.bin": 100}}),
        _said("c", {"00000003-t": {"part-00004.bin": 100}}),
    ]
    moves = gather.plan(postings)
    # node c (lowest rank 2) takes what only b holds, from b's lowest rank; b takes c's part
    assert {(m.sender, m.receiver, m.name) for m in moves} == {
        (0, 2, "part-00000.bin"),
        (0, 2, "part-00001.bin"),
        (0, 2, "part-00002.bin"),
        (0, 2, "part-00003.bin"),
        (2, 0, "part-00004.bin"),
    }
    assert all(m.folder == "00000003-t" and m.store == "store" and m.size == 100 for m in moves)


def test_nothing_moves_when_every_node_holds_every_file() -> None:
    held = {"00000003-t": {"skeleton.pt": 10, "part-00000.bin": 100}}
    assert gather.plan([_said("a", held), _said("b", held)]) == []


def test_the_newest_checkpoint_is_fetched_and_holders_take_turns() -> None:
    newest = {"a.bin": 1, "b.bin": 1, "c.bin": 1, "d.bin": 1}
    postings = [
        _said("x", {"00000009-new": newest}),
        _said("y", {"00000009-new": newest}),
        _said("z", {"00000004-old": {"a.bin": 1}}),  # an older one is no source
    ]
    moves = gather.plan(postings)
    assert {m.receiver for m in moves} == {2}
    assert {m.folder for m in moves} == {"00000009-new"}
    assert sorted(m.name for m in moves) == sorted(newest)
    assert sorted(m.sender for m in moves) == [0, 0, 1, 1]  # the two holders share the sending


def test_a_node_takes_only_what_its_memory_has_room_for() -> None:
    postings = [
        _said("x", {"00000002-t": {"big.bin": 3 * GB, "small.bin": GB}}),
        _said("y", {}, free=2 * GB),
    ]
    moves = gather.plan(postings)
    assert [(m.name, m.receiver) for m in moves] == [("small.bin", 1)]


def test_a_node_posts_whole_files_only(tmp_path: Path) -> None:
    kept = tmp_path / "store" / "00000005-t"
    kept.mkdir(parents=True)
    (kept / ".metadata").write_bytes(b"m" * 7)
    (kept / "part-00000.bin").write_bytes(b"p" * 11)
    (kept / ".part-00001.bin.partial").write_bytes(b"cut")
    said = gather.posting(str(tmp_path))
    assert said["node"] == str(tmp_path) and said["free"] > 0
    assert said["held"] == {"store": {"00000005-t": {".metadata": 7, "part-00000.bin": 11}}}


@pytest.mark.parametrize(
    ("restarts", "world", "local", "expected"),
    [(0, 4, 2, False), (1, 2, 2, False), (1, 4, 2, True)],
    ids=["first-attempt", "one-node", "restart-on-2-nodes"],
)
def test_only_a_restart_on_several_nodes_with_memory_fetches(
    monkeypatch: pytest.MonkeyPatch, restarts: int, world: int, local: int, expected: bool
) -> None:
    monkeypatch.setenv("SPARKTRAIN_CHECKPOINT_MEMORY", "/nowhere")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restarts))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    assert gather.needed() is expected
    monkeypatch.delenv("SPARKTRAIN_CHECKPOINT_MEMORY")
    assert gather.needed() is False


def test_a_rank_joining_in_place_does_not_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """A joiner starts long after its attempt's ranks gathered; it heals from live peers."""
    monkeypatch.setenv("SPARKTRAIN_CHECKPOINT_MEMORY", "/nowhere")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert gather.needed()
    monkeypatch.setenv("SPARKTRAIN_IN_PLACE_JOIN", "1")
    assert not gather.needed()


def test_the_ranks_stop_waiting_for_a_lost_ranks_posting() -> None:
    """Rank 1 was lost before it posted (an in-place run goes on without it): the others give
    up the gather at once instead of waiting for its posting until the store's timeout."""
    import torch.distributed as dist

    board = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    board.set("held/0", "{}")
    with pytest.raises(RuntimeError, match="lost before it posted"):
        gather._postings(board, 2, 600, lambda: True)
    with pytest.raises(TimeoutError, match="posted what its node holds in 0 s"):
        gather._postings(board, 2, 0.1, lambda: False)
    board.set("held/1", '{"x": 1}')
    assert gather._postings(board, 2, 600, lambda: True) == [{}, {"x": 1}]
