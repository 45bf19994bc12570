"""Track a 2-rank training in MLflow: one run, rank 0 logs, the model logged unwrapped.

    python examples/track_mlflow.py        # then: mlflow ui --backend-store-uri sqlite:///mlflow.db

With no MLFLOW_TRACKING_URI set, the run goes to ./mlflow.db. The training code calls
sparktrain.log_* on every rank without any ``if rank == 0``. At the end, this script prints what
was logged.
"""

from __future__ import annotations

import mlflow
import torch
import torch.distributed as dist
from torch import nn

import sparktrain
from sparktrain import TorchDistributor


def train(epochs: int) -> float:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = sparktrain.prepare_model(
        nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
        ),
        "ddp",
    )
    optimizer = sparktrain.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 784, generator=g)
    y = (x @ torch.randn(784, 10, generator=g)).argmax(1)
    loader = sparktrain.prepare_data_loader(
        torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True
        )
    )
    sparktrain.log_params({"lr": 1e-3, "epochs": epochs}, batch_size_per_rank=64)
    for epoch in range(epochs):
        for bx, by in loader:
            loss = nn.functional.cross_entropy(model(bx), by)
            optimizer.zero_grad()
            sparktrain.backward(loss, optimizer)
            optimizer.step()
        sparktrain.log_metrics({"loss": loss.item()}, step=epoch)
        print(f"epoch {epoch} loss {loss.item():.4f}")
    sparktrain.log_model(model, "model")
    return loss.item()


if __name__ == "__main__":
    TorchDistributor(2, True, False, mlflow=True).run(train, 3)
    client = mlflow.tracking.MlflowClient("sqlite:///mlflow.db")
    run = client.search_runs(["0"], order_by=["attributes.start_time DESC"], max_results=1)[0]
    print(f"\nrun {run.info.run_name} ({run.info.run_id}): {run.info.status}")
    print("params: ", dict(sorted(run.data.params.items())))
    print(
        "metrics:",
        {
            k: [round(m.value, 4) for m in client.get_metric_history(run.info.run_id, k)]
            for k in sorted(run.data.metrics)
        },
    )
    print(
        "tags:   ", {k: v for k, v in sorted(run.data.tags.items()) if k.startswith("sparktrain.")}
    )
    models = mlflow.search_logged_models(experiment_ids=["0"], output_format="list")
    print("models: ", [(m.name, m.source_run_id == run.info.run_id) for m in models][:1])
