"""Strategies benchmark: steps per second and per-rank state bytes of every strategy.

The same model (an MLP 1024-2048-2048-10, 6.3 M parameters), data and loop on 2 ranks through
``sparktrain.prepare_model``/``prepare_optimizer``/``backward``. On this CPU machine it shows
the memory split; on a GPU machine (``--gpu``, NCCL) it gives the real speeds.

    python benchmarks/strategies.py [--steps 20] [--gpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import sparktrain

STRATEGIES = (
    ("ddp", {}),
    ("fsdp", {}),
    ("fsdp", {"reshard_after_forward": False}),
    ("zero1", {}),
    ("zero2", {}),
    ("zero3", {}),
    ("zero2_offload", {}),
)


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

    step()  # warm-up: optimizer states created, buckets built
    if gpu:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    held = st.held_bytes(model, optimizer)
    peak = torch.cuda.max_memory_allocated() if gpu else 0
    dist.destroy_process_group()
    return {"steps_per_s": steps / seconds, **held, "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpu", action="store_true", help="NCCL, one GPU per rank")
    args = parser.parse_args()
    print(
        f"cpus={os.cpu_count()} python={sys.version.split()[0]} sparktrain={sparktrain.__version__}"
    )
    rows = []
    for strategy, options in STRATEGIES:
        label = strategy + "".join(f" {k}={v}" for k, v in options.items())
        result = sparktrain.launch(
            measure, (strategy, options, args.steps, args.gpu), num_processes=2,
            use_gpu=args.gpu, log_ranks=[],
        ).value  # fmt: skip
        rows.append((label, result))
    ddp = rows[0][1]["parameters"] + rows[0][1]["optimizer"]
    where = "GPU" if args.gpu else "CPU"
    print(f"\n2 ranks, {args.steps} steps of batch 64 per rank, fp32, Adam ({where})")
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
    sparktrain.shutdown_warm()


if __name__ == "__main__":
    main()
