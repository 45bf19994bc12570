"""The planner's meshes: tensor x pipeline x FSDP memory per GPU, the choice and its reasons."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sparktrain import ConfigError, plan
from sparktrain.cli import main

SEVENTY_B: dict[str, Any] = {
    "params": "70B",
    "layers": 80,
    "hidden": 8192,
    "seq_len": 4096,
    "micro_batch": 1,
}


def test_seventy_b_on_eight_nodes_needs_tensor_parallelism() -> None:
    result = plan(**SEVENTY_B, gpus_per_node=8, nodes=8, gpu_memory="80GB")
    fsdp = result.mesh(1, 1)
    assert fsdp.dp == 64 and not fsdp.fits
    # Korthikanti: 34*s*b*h per layer without tensor parallelism, (10 + 24/t) with it.
    assert fsdp.activations == 80 * 34 * 4096 * 8192
    assert result.mesh(tp=8).activations == 80 * (10 + 3) * 4096 * 8192
    assert result.mesh(1, 1).states == pytest.approx(16 * 70e9 / 64, rel=1e-6)
    chosen = result.recommended_mesh
    assert chosen is not None and (chosen.tp, chosen.pp) == (4, 1)
    assert "FSDP alone (tp=1 pp=1 dp=64) needs" in result.mesh_reasons[0]
    assert "tp=4 pp=1 dp=16" in str(result) and "Recommended mesh" in str(result)


def test_pipeline_bubble_and_stages() -> None:
    result = plan(**SEVENTY_B, gpus_per_node=8, nodes=8, gpu_memory="80GB", microbatches=8)
    mesh = result.mesh(tp=8, pp=4)
    assert mesh.stage_layers == (20, 20, 20, 20) and mesh.dp == 2
    assert mesh.bubble == pytest.approx(3 / 11)
    # 1F1B: the first stage holds pp micro-batches of its 20 layers: as many as one of 80.
    assert mesh.activations == 80 * 13 * 4096 * 8192
    gpipe_like = plan(
        **SEVENTY_B,
        gpus_per_node=8,
        nodes=8,
        gpu_memory="80GB",
        microbatches=2,
    ).mesh(tp=8, pp=4)
    assert gpipe_like.activations == 2 * 20 * 13 * 4096 * 8192  # fewer in flight than stages


def test_thirteen_b_fits_under_fsdp_alone() -> None:
    result = plan(
        params="13B", layers=40, hidden=5120, seq_len=4096, micro_batch=1,
        gpus_per_node=8, gpu_memory="80GB",
    )  # fmt: skip
    assert result.recommended_mesh is result.mesh(1, 1)
    assert "FSDP alone (tp=1 pp=1 dp=8) fits" in result.mesh_reasons[0]


def test_no_mesh_fits_says_what_to_change() -> None:
    result = plan(**SEVENTY_B, gpus_per_node=8, nodes=1, gpu_memory="24GB")
    assert result.recommended_mesh is None
    assert "no mesh fits" in result.mesh_reasons[0]
    assert "activation checkpointing" in result.mesh_reasons[0]


def test_meshes_respect_the_layout() -> None:
    result = plan(**SEVENTY_B, gpus_per_node=4, nodes=2, gpu_memory="80GB")
    assert all(4 % e.tp == 0 and e.tp * e.pp * e.dp == 8 for e in result.meshes)
    with pytest.raises(ConfigError, match=r"no mesh tp=8 pp=1 in this plan"):
        result.mesh(tp=8)
    small = plan(params="1B", layers=2, hidden=2048, seq_len=512, micro_batch=1,
                 gpus_per_node=4, gpu_memory="80GB")  # fmt: skip
    assert max(e.pp for e in small.meshes) == 2  # never more stages than layers


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": "7B", "layers": 32}, "needs seq_len and micro_batch as well"),
        ({}, "plan\\(\\) needs the model once"),
        (
            {
                "params": "7B",
                "microbatches": 0,
                "seq_len": 8,
                "micro_batch": 1,
                "hidden": 8,
                "layers": 2,
            },
            "microbatches=0 must be a positive int",
        ),
    ],
)
def test_bad_shapes_name_the_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(gpus_per_node=8, gpu_memory="80GB", **kwargs)


def test_cli_prints_and_exports_the_meshes(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--params", "70B", "--layers", "80", "--hidden-size", "8192", "--seq-len",
            "4096", "--batch-size", "1", "--gpus-per-node", "8", "--nodes", "8",
            "--gpu-memory", "80GB"]  # fmt: skip
    assert main(args) == 0
    assert "Recommended mesh: tp=4 pp=1 dp=16" in capsys.readouterr().out
    assert main([*args, "--json", "--microbatches", "16"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended_mesh"] == "tp=4 pp=1 dp=16"
    row = next(m for m in data["meshes"] if (m["tp"], m["pp"]) == (8, 2))
    assert row["microbatches"] == 16 and row["bubble"] == pytest.approx(1 / 17, abs=1e-4)
