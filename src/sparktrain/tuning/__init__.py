"""Hyperparameter search over distributed trials: :func:`tune` and its search-space helpers.

``sparktrain.tune(main, {"lr": loguniform(1e-4, 1e-1)}, num_trials=8, metric="loss")`` runs
every trial as a warm distributed launch, stops weak trials early (successive halving by
default), and returns a :class:`TuneResult`. Optuna (``pip install 'sparktrain[tune]'``) does
the sampling, the scheduling and the storage that lets an interrupted search resume.
"""

from sparktrain.tuning.results import TrialRecord, TuneResult
from sparktrain.tuning.search import tune
from sparktrain.tuning.space import choice, loguniform, randint, uniform

__all__ = [
    "TrialRecord",
    "TuneResult",
    "choice",
    "loguniform",
    "randint",
    "tune",
    "uniform",
]
