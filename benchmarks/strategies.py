"""Strategies benchmark: steps per second and per-rank state bytes of every strategy.

The same model (an MLP 1024-2048-2048-10, 6.3 M parameters), data and loop on 2 ranks through
``sparktrain.prepare_model``/``prepare_optimizer``/``backward``. On this CPU machine it shows
the memory split; on a GPU machine (``--gpu``, NCCL) it gives the real speeds.

    python benchmarks/strategies.py [--steps 20] [--gpu] [--mesh]

``--mesh`` adds the mesh rows: the Llama-shaped ``nn.Sequential`` of ``examples/train_mesh.py``
on 4 ranks under ``prepare_model(..., "fsdp", tp=, pp=)`` (1F1B, 4 micro-batches), with the
planner's predicted model states per rank beside the measured ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import sparktrain
from sparktrain.strategies.memory import local_bytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
MESHES = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4))  # (tp, pp) on 4 ranks

STRATEGIES = (
    ("ddp", {}),
    ("fsdp", {}),
    ("fsdp", {"reshard_after_forward": False}),
    ("zero1", {}),
    ("zero2", {}),
    ("zero3", {}),
    ("zero2_offload", {}),
)


def _timed(step: Callable[[], None], steps: int, gpu: bool) -> float:
    """Seconds for ``steps`` calls of ``step`` after one warm-up (optimizer states, buckets)."""
    import torch

    step()
    if gpu:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(strategy: str, options: dict, steps: int, gpu: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    import sparktrain.strategies as st

    dist.init_process_group("nccl" if gpu else "gloo")
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    )
    model = st.prepare_model(mlp, strategy, **options)
    optimizer = st.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4), model)
    where = st.device()
    x = torch.randn(64, 1024, device=where)
    y = torch.randint(0, 10, (64,), device=where)

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        st.backward(loss, optimizer)
        optimizer.step()

    seconds = _timed(step, steps, gpu)
    held = st.held_bytes(model, optimizer)
    peak = torch.cuda.max_memory_allocated() if gpu else 0
    dist.destroy_process_group()
    return {"steps_per_s": steps / seconds, **held, "peak": peak}


def measure_mesh(tp: int, pp: int, steps: int, gpu: bool) -> dict:
    """One rank of a (pp, dp, tp) mesh: steps/s and the bytes it holds."""
    import torch
    import torch.distributed as dist
    import train_mesh

    import sparktrain.strategies as st

    dist.init_process_group("nccl" if gpu else "gloo")
    model = st.prepare_model(train_mesh.build_model(), "fsdp", tp=tp, pp=pp, microbatches=4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    where = st.device()
    tokens = torch.randint(0, 512, (16, 129), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].to(where), tokens[:, 1:].to(where)

    def step() -> None:
        optimizer.zero_grad()
        st.forward_backward(model, x, y, train_mesh.loss_fn)
        optimizer.step()

    seconds = _timed(step, steps, gpu)
    held = st.held_bytes(model, optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    held["grads"] = sum(local_bytes(g) for g in grads)
    found = st.mesh.current()
    stage = int(found[0].get_local_rank("pp")) if found else 0
    dist.destroy_process_group()
    return {"steps_per_s": steps / seconds, "stage": stage, **held}


def mesh_rows(steps: int, gpu: bool) -> None:
    """The mesh table: measured bytes per rank against the planner's, and steps/s."""
    import train_mesh

    model = train_mesh.build_model()
    planned = sparktrain.plan(
        params=sum(p.numel() for p in model.parameters()), layers=4, hidden=256, vocab=512,
        seq_len=128, micro_batch=4, gpus_per_node=4, gpu_memory="80GB", precision="fp32",
    )  # fmt: skip
    print(f"\n4 ranks, {steps} steps of 16 x 128 tokens per data-parallel group, fp32, Adam")
    print("| mesh | steps/s | states, rank 0 (MB) | planner (MB) | largest rank (MB) | planner |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for tp, pp in MESHES:
        ranks = sparktrain.launch(
            measure_mesh, (tp, pp, steps, gpu), num_processes=4, use_gpu=gpu, log_ranks=[],
            return_all=True,
        ).return_values  # fmt: skip
        mesh = planned.mesh(tp, pp)
        held = {r: v["parameters"] + v["grads"] + v["optimizer"] for r, v in ranks.items()}
        top = max(held, key=held.__getitem__)
        print(
            f"| {mesh.name} | {ranks[0]['steps_per_s']:.2f} | {held[0] / 1e6:.2f} | "
            f"{mesh.stage_states[ranks[0]['stage']] / 1e6:.2f} | {held[top] / 1e6:.2f} | "
            f"{mesh.stage_states[ranks[top]['stage']] / 1e6:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpu", action="store_true", help="NCCL, one GPU per rank")
    parser.add_argument("--mesh", action="store_true", help="add the tp x pp x FSDP rows")
    parser.add_argument("--processes", type=int, default=2, help="ranks (one GPU each)")
    args = parser.parse_args()
    import importlib.util

    deepspeed = importlib.util.find_spec("deepspeed") is not None
    print(
        f"cpus={os.cpu_count()} python={sys.version.split()[0]} sparktrain={sparktrain.__version__}"
    )
    rows = []
    for strategy, options in STRATEGIES:
        if strategy.startswith("zero") and not deepspeed:
            print(f"{strategy}: skipped, DeepSpeed is not installed")
            continue
        label = strategy + "".join(f" {k}={v}" for k, v in options.items())
        result = sparktrain.launch(
            measure, (strategy, options, args.steps, args.gpu), num_processes=args.processes,
            use_gpu=args.gpu, log_ranks=[],
        ).value  # fmt: skip
        rows.append((label, result))
    ddp = rows[0][1]["parameters"] + rows[0][1]["optimizer"]
    where = "GPU" if args.gpu else "CPU"
    print(
        f"\n{args.processes} ranks, {args.steps} steps of batch 64 per rank, fp32, Adam ({where})"
    )
    print(
        "| strategy | steps/s | parameters (MB/rank) | optimizer states (MB/rank) | vs ddp "
        "| peak GPU (MB) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, r in rows:
        total = r["parameters"] + r["optimizer"]
        print(
            f"| {label} | {r['steps_per_s']:.1f} | {r['parameters'] / 1e6:.1f} | "
            f"{r['optimizer'] / 1e6:.1f} | {total / ddp:.2f} | {r['peak'] / 1e6:.0f} |"
        )
    if args.mesh:
        mesh_rows(args.steps, args.gpu)
    sparktrain.shutdown_warm()


if __name__ == "__main__":
    main()
