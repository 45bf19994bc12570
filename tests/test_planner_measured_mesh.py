"""The planner's mesh figures against the tensors 4 CPU ranks really hold after one step.

One launch of 4 gloo ranks trains the small Llama-shaped ``nn.Sequential`` of
``examples/train_mesh.py`` (embedding, 4 blocks, head) for one step under five meshes of
``prepare_model(..., "fsdp", tp=, pp=)``, in fp32 with Adam. Each rank sums the bytes of its
parameters, gradients and optimizer states (local shards of DTensors, its own stage only), and
the planner's figure for that rank's stage must be within 5 %. Layer widths divide every degree,
so every shard has the same size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from sparktrain import launch
from sparktrain.planner import plan

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import train_mesh

WIDTH, HEADS, VOCAB, LAYERS, SEQ, BATCH = 256, 4, 512, 4, 16, 8
MESHES = ((2, 1), (1, 2), (2, 2), (4, 1), (1, 4))  # (tp, pp) on 4 ranks
TOLERANCE = 0.05


def build_model() -> nn.Sequential:
    return train_mesh.build_model(WIDTH, HEADS, LAYERS, VOCAB)


_loss = train_mesh.loss_fn


def measure_meshes() -> dict[tuple[int, int], tuple[int, int]]:
    """Run on every rank: per mesh, (this rank's stage, bytes of params + grads + states)."""
    import torch.distributed as dist

    import sparktrain
    from sparktrain.strategies.memory import local_bytes
    from sparktrain.strategies.mesh import current, data_share

    dist.init_process_group("gloo")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    held = {}
    for tp, pp in MESHES:
        model = sparktrain.prepare_model(build_model(), "fsdp", tp=tp, pp=pp)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        replicas, index = data_share() or (1, 0)
        x, y = tokens[:, :-1].chunk(replicas)[index], tokens[:, 1:].chunk(replicas)[index]
        sparktrain.forward_backward(model, x, y, _loss)
        opt.step()
        params = list(model.parameters())
        total = sum(local_bytes(p) for p in params) + sum(local_bytes(p.grad) for p in params)
        total += sum(local_bytes(v) for s in opt.state.values() for v in s.values())
        found = current()
        assert found is not None
        held[(tp, pp)] = (int(found[0].get_local_rank("pp")), total)
    return held


def predicted(tp: int, pp: int) -> tuple[int, ...]:
    """The planner's model states per GPU for each stage of the mesh."""
    model = build_model()
    result = plan(
        params=sum(p.numel() for p in model.parameters()),
        layers=LAYERS,
        hidden=WIDTH,
        vocab=VOCAB,
        seq_len=SEQ,
        micro_batch=BATCH,
        gpus_per_node=4,
        gpu_memory="1GB",
        precision="fp32",
        optimizer="adam",
    )
    return result.mesh(tp, pp).stage_states


@pytest.fixture(scope="module")
def measured() -> dict[int, dict[tuple[int, int], tuple[int, int]]]:
    result = launch(measure_meshes, num_processes=4, use_gpu=False, return_all=True)
    values: dict[int, dict[tuple[int, int], tuple[int, int]]] = result.return_values
    return values


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES, ids=[f"tp{t}-pp{p}" for t, p in MESHES])
def test_mesh_prediction_within_5_percent(
    measured: dict[int, dict[tuple[int, int], tuple[int, int]]], mesh: tuple[int, int]
) -> None:
    stages = predicted(*mesh)
    for rank in range(4):
        stage, got = measured[rank][mesh]
        want = stages[stage]
        print(f"tp={mesh[0]} pp={mesh[1]} rank {rank} stage {stage}: {want:,} vs {got:,}")
        assert abs(got - want) <= TOLERANCE * want, (rank, stage, got, want)


@pytest.mark.slow
def test_the_meshes_really_split_the_model(
    measured: dict[int, dict[tuple[int, int], tuple[int, int]]],
) -> None:
    """Guards the check itself: every rank holds about a quarter of the whole model's bytes."""
    whole = 16 * sum(p.numel() for p in build_model().parameters())  # fp32 p + g + 2 Adam
    for rank in range(4):
        for mesh in MESHES:
            assert measured[rank][mesh][1] < 0.35 * whole, (rank, mesh)
