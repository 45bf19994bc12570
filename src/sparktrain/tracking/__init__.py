"""MLflow tracking of distributed runs: one run per launch, rank 0 logs, models unwrapped.

The driver creates the run once (nested under the caller's active run, if any) and logs the
launch; inside the ranks, :func:`log_params`, :func:`log_metrics` and :func:`log_model` do their
work on rank 0 and nothing elsewhere, so training code has no ``if rank == 0``. MLflow is the
``mlflow`` extra and is imported only when tracking is on.
"""

from sparktrain.tracking.rank import log_metrics, log_model, log_params

__all__ = ["log_metrics", "log_model", "log_params"]
