"""What ``sparktrain.report()`` costs a training loop.

Two ranks train the seeds' MLP (784-512-256-10, DDP, gloo, batch 64) in one launch and alternate
blocks of steps without and with a ``report(step=..., total=..., loss=...)`` call after every
step, so both variants share the processes, the caches and the machine's moods. Rank 0 returns
each block's steps per second; the table shows medians and their ratio (target: >= 0.99). It
also times a bare flood of reports (calls per second one rank can make) and counts what the
driver received.

    python benchmarks/report_overhead.py [--blocks 7] [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from _common import fmt, load_average, log, version_of

import sparktrain


def train(blocks: int, steps: int, flood: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                      nn.Linear(256, 10))
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    total = 2 * blocks * steps

    def block(report: bool, done: int) -> float:
        started = time.perf_counter()
        for i in range(steps):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            value = loss.item()  # both variants read the loss; only the report differs
            if report:
                sparktrain.report(step=done + i + 1, total=total, loss=value)
        return steps / (time.perf_counter() - started)

    block(False, 0)  # warm-up
    without: list[float] = []
    with_report: list[float] = []
    done = 0
    for _ in range(blocks):
        without.append(block(False, done))
        done += steps
        with_report.append(block(True, done))
        done += steps
    started = time.perf_counter()
    for i in range(flood):
        sparktrain.report(step=i + 1, loss=0.5)
    calls_per_s = flood / (time.perf_counter() - started)
    return {"without": without, "with": with_report, "calls_per_s": calls_per_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--flood", type=int, default=200_000)
    args = parser.parse_args()
    log(f"torch {version_of('torch')}, load {load_average()}")
    received = [0]

    def count(rank: int, record: dict[str, Any]) -> None:
        received[0] += 1

    result = sparktrain.launch(
        train,
        (args.blocks, args.steps, args.flood),
        num_processes=2,
        use_gpu=False,
        on_report=count,
    ).value
    without = statistics.median(result["without"])
    with_report = statistics.median(result["with"])
    print("| loop | steps/s (median of blocks) |")
    print("|---|---|")
    print(f"| without report | {without:.1f} |")
    print(f"| report every step | {with_report:.1f} |")
    print()
    print(f"ratio with/without: {fmt(with_report / without)} (target >= 0.99)")
    print(
        f"bare report() calls per second in one rank: {result['calls_per_s']:,.0f} "
        f"(target: 10,000 without slowing training); records the driver received: "
        f"{received[0]:,} of {2 * (args.blocks * args.steps + args.flood):,} calls (coalesced)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
