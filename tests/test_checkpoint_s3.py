"""Checkpoints on an object store: a real S3 endpoint on loopback (moto's server), through s3fs.

Every rank writes its part under the save's token, the manifest is written last and is the
publication, a writer killed mid-write leaves the previous checkpoint loadable, ``keep=`` prunes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from tests.conftest import free_port
from tests.test_checkpoint_async import KILLED_MID_WRITE

from sparktrain import checkpoint, launch

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A bucket on a real S3 endpoint on loopback; the fsspec options that reach it."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket="ckpt")
    try:
        yield options  # type: ignore[misc]
    finally:
        server.stop()


def _objects(options: dict, prefix: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    return sorted(p.split(f"{prefix}/", 1)[1] for p in fs.find(f"ckpt/{prefix}"))


def _train_and_save(url: str, options: dict, steps: int) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    state = {"a": torch.randn(400, 1024), "b": torch.randn(300, 1024), "step": 0}
    for step in range(1, steps + 1):
        state["a"].add_(1.0)
        state["step"] = step
        checkpoint.save(state, url, step=step, keep=2, storage_options=options)
    checkpoint.wait()
    found = checkpoint.load_latest(url, storage_options=options)
    assert found is not None
    return [found.step, found.state["step"], float(found.state["a"].sum() - state["a"].sum())]


def test_two_ranks_write_their_parts_to_s3_and_keep_prunes(s3: dict) -> None:
    url = "s3://ckpt/run1"
    run = launch(_train_and_save, (url, s3, 4), num_processes=2, use_gpu=False, return_all=True)
    assert run.return_values == {0: [4, 4, 0.0], 1: [4, 4, 0.0]}
    objects = _objects(s3, "run1")
    assert [o for o in objects if o.endswith("COMPLETE")] == [
        "step-00000003/COMPLETE",
        "step-00000004/COMPLETE",
    ]  # keep=2: steps 1 and 2 are gone, manifest and files
    latest = [
        o.split("/", 2)[2] for o in objects if o.startswith("step-00000004/") and o.count("/") == 2
    ]
    assert sorted(latest) == ["part-00000.bin", "part-00001.bin", "skeleton.pt"]
    assert len({o.split("/")[1] for o in objects if o.startswith("step-00000004/")}) == 2  # token
    assert checkpoint.latest_step(url, storage_options=s3) == 4


def test_a_step_saved_again_replaces_the_published_one_whole(s3: dict) -> None:
    url = "s3://ckpt/again"
    checkpoint.save({"w": torch.zeros(3)}, url, step=5, storage_options=s3, blocking=True)
    checkpoint.save({"w": torch.ones(3)}, url, step=5, storage_options=s3, blocking=True)
    found = checkpoint.load_latest(url, storage_options=s3)
    assert found is not None and torch.equal(found.state["w"], torch.ones(3))

    def tokens() -> set[str]:
        return {o.split("/")[1] for o in _objects(s3, "again") if o.startswith("step-00000005/")}

    assert len(tokens()) == 3  # the manifest and two tries: the published one is the second
    checkpoint.save({"w": torch.ones(3)}, url, step=6, storage_options=s3, blocking=True)
    assert len(tokens()) == 2  # the next save removed the first try's files


def _sharded_to_s3(url: str, options: dict, in_memory: bool) -> dict:
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    state = {"w": torch.arange(1000.0) + dist.get_rank() * 0, "n": torch.tensor(3)}
    checkpoint.save(state, url, step=1, sharded=True, storage_options=options, in_memory=in_memory)
    checkpoint.wait(in_memory=True)
    into = {"w": torch.zeros(1000), "n": torch.tensor(0)}
    found = checkpoint.load_latest(url, into=into, storage_options=options)
    node = os.environ["SPARKTRAIN_CHECKPOINT_MEMORY"]
    return {
        "equal": found is not None
        and torch.equal(into["w"], torch.arange(1000.0))
        and int(into["n"]) == 3,
        "read": None if found is None else found.read,
        "in memory": sorted(name for _root, _dirs, names in os.walk(node) for name in names),
        "writing": [
            name for _root, dirs, _names in os.walk(node) for name in dirs if "wri" in name
        ],
    }


@pytest.mark.parametrize("in_memory", [True, False], ids=["kept", "storage-only"])
def test_a_sharded_checkpoint_goes_to_s3_through_dcp(s3: dict, in_memory: bool) -> None:
    url = f"s3://ckpt/dcp-{in_memory}"
    run = launch(_sharded_to_s3, (url, s3, in_memory), num_processes=2, use_gpu=False)
    assert run.value["equal"] is True
    objects = [o.split("/") for o in _objects(s3, f"dcp-{in_memory}")]
    (_token,) = {o[1] for o in objects if len(o) == 3}  # step-00000001/<token>/<file>: one
    stored = sorted(o[2] for o in objects if len(o) == 3)
    assert stored == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # storage has it whole
    assert run.value["writing"] == []  # what was written first was moved into place
    if in_memory:  # written to the node's memory first, uploaded, kept: the load reads memory
        assert run.value["in memory"] == stored
        assert set(run.value["read"]) == {"memory"}
    else:
        assert run.value["in memory"] == [] and "memory" not in run.value["read"]


def _one_node_without_room(url: str, options: dict) -> dict:
    """2 nodes; rank 1's node has no room in memory: every rank writes to S3 alone, twice."""
    import torch.distributed as dist

    from sparktrain.rank.checkpoints import memory

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        memory.HEADROOM_BYTES = 1 << 62  # no memory folder has that much to spare
    reads, equal = [], True
    for step in (1, 2):
        state = {"w": torch.arange(1000.0) * step}
        checkpoint.save(state, url, step=step, sharded=True, storage_options=options, replicas=1)
        checkpoint.wait(in_memory=True)  # the neighbour exchange is over on every rank
        into = {"w": torch.zeros(1000)}
        found = checkpoint.load_latest(url, into=into, storage_options=options)
        equal = (
            equal
            and found is not None
            and found.step == step
            and torch.equal(into["w"], state["w"])
        )
        reads.append(None if found is None else found.read)
    return {"equal": equal, "reads": reads}


def test_ranks_write_to_memory_first_all_or_none(s3: dict) -> None:
    from sparktrain import LocalCluster

    url = "s3://ckpt/no-room"
    run = launch(
        _one_node_without_room, (url, s3), num_processes=2, backend=LocalCluster(nodes=2),
        timeout=120, return_all=True,
    )  # fmt: skip
    for value in run.return_values.values():
        assert value["equal"] is True
        assert all("memory" not in read for read in value["reads"])  # storage, on both nodes
    objects = [o.split("/") for o in _objects(s3, "no-room")]
    assert sorted(o[2] for o in objects if len(o) == 3 and o[0].endswith("2")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp",
    ]  # fmt: skip


def test_a_writer_killed_mid_write_on_s3_leaves_a_whole_checkpoint(s3: dict) -> None:
    import json

    done = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, "s3://ckpt/killed", "15", json.dumps(s3), "2.5"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = eval(done.stdout.strip().splitlines()[-1])
    assert seen["none"] + seen["published"] == 15 and seen["published"] > 0


def test_doctor_writes_reads_and_removes_a_probe_on_s3(s3: dict) -> None:
    from sparktrain.doctor.storage import here_check

    good = here_check("s3://ckpt/doctor", s3)
    assert good.verdict == "ok", good.found
    assert _objects(s3, "doctor") == []  # the probe is removed
    bad = here_check("s3://no-such-bucket/run", s3)
    assert bad.verdict == "error" and "cannot write checkpoints to s3://no-such-bucket" in bad.found
