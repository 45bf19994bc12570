"""The Optuna side of a search: the study, resuming it, and recording each trial's outcome."""

from __future__ import annotations

import os
from typing import Any

from sparktrain.driver.results import RunResult
from sparktrain.ground.errors import ConfigError
from sparktrain.tuning.results import TrialRecord, TrialState
from sparktrain.tuning.space import optuna_module

#: Trial attributes sparktrain keeps in the study (Optuna user attributes).
CONFIG, ERROR, DURATION, INTERRUPTED, RETRIED = (
    "sparktrain.config", "sparktrain.error", "sparktrain.duration",
    "sparktrain.interrupted", "sparktrain.retried",
)  # fmt: skip


def _pruner(optuna: Any, scheduler: Any) -> Any:
    if isinstance(scheduler, optuna.pruners.BasePruner):
        return scheduler
    if scheduler is None or scheduler == "none":
        return optuna.pruners.NopPruner()
    if scheduler == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    if scheduler == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, reduction_factor=3)
    if scheduler == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
    raise ConfigError(
        f"scheduler={scheduler!r} is not one of 'asha', 'hyperband', 'median', None, "
        "or an optuna.pruners.BasePruner"
    )


def _storage_url(storage: str | None) -> str | None:
    if storage is None or "://" in storage:
        return storage
    if storage.endswith(".db"):
        return f"sqlite:///{os.path.abspath(storage)}"
    raise ConfigError(
        f"storage={storage!r} is neither a database URL (sqlite:///tune.db) nor a .db path"
    )


def open_study(
    storage: str | None, name: str, *, mode: str, sampler: Any, scheduler: Any, seed: int | None
) -> Any:
    """Create the study, or load it from ``storage`` when it exists (resuming)."""
    optuna = optuna_module()
    if sampler is not None and not isinstance(sampler, optuna.samplers.BaseSampler):
        raise ConfigError(f"sampler={sampler!r} must be an optuna.samplers.BaseSampler")
    study = optuna.create_study(
        study_name=name,
        storage=_storage_url(storage),
        load_if_exists=True,
        direction="minimize" if mode == "min" else "maximize",
        sampler=sampler,
        pruner=_pruner(optuna, scheduler),
    )
    if sampler is None:  # a resumed study continues the seed's sequence, not its start again
        done = len(study.get_trials(deepcopy=False))
        study.sampler = optuna.samplers.TPESampler(seed=None if seed is None else seed + done)
    wanted = "minimize" if mode == "min" else "maximize"
    if study.direction.name.lower() != wanted:
        raise ConfigError(
            f"study {name!r} in {storage} was created with mode "
            f"{'min' if wanted == 'maximize' else 'max'}; pass that mode or a new study_name"
        )
    return study


def prepare_resume(study: Any, num_trials: int) -> int:
    """Queue the trials an interrupted session left for retrying; return how many to run."""
    from optuna.trial import TrialState as OptunaState

    retried = set(study.user_attrs.get(RETRIED, []))
    for trial in study.get_trials(deepcopy=False):
        if trial.state == OptunaState.RUNNING:  # its process died: retry it
            study._storage.set_trial_user_attr(trial._trial_id, INTERRUPTED, True)
            study._storage.set_trial_state_values(trial._trial_id, state=OptunaState.FAIL)
            interrupted = True
        else:
            interrupted = bool(trial.user_attrs.get(INTERRUPTED))
        if interrupted and trial.number not in retried:
            study.enqueue_trial(trial.params, skip_if_exists=False)
            retried.add(trial.number)
    study.set_user_attr(RETRIED, sorted(retried))
    finished = sum(1 for t in records(study) if t.state != "interrupted")
    return max(0, num_trials - finished)


def conclude(
    study: Any,
    trial: Any,
    config: dict[str, Any],
    outcome: RunResult | BaseException,
    *,
    state: Any,
    metric: str,
    duration: float,
    interrupted: bool,
) -> TrialRecord:
    """Tell Optuna how ``trial`` ended and return its record."""
    from optuna.trial import TrialState as OptunaState

    trial.set_user_attr(CONFIG, {k: _plain(v) for k, v in config.items()})
    trial.set_user_attr(DURATION, duration)
    error = None
    if isinstance(outcome, BaseException):
        error = str(outcome).splitlines()[0][:500]
        kind: TrialState = "failed"
    elif interrupted and (outcome.stopped or state.value is None):
        kind = "interrupted"
        trial.set_user_attr(INTERRUPTED, True)
    elif state.pruned and outcome.stopped and 0 not in outcome.return_values:
        kind = "pruned"  # (a trial pruned at its last report that returned anyway is complete)
    else:
        final = _final_value(outcome.value, metric, state.value)
        if final is None:
            error = (
                f"the trial reported no {metric!r}: call sparktrain.report({metric}=...) on "
                f"rank 0, or return the value"
            )
            kind = "failed"
        else:
            state.value, kind = final, "complete"
    if error:
        trial.set_user_attr(ERROR, error)
    optuna_state = {"complete": OptunaState.COMPLETE, "pruned": OptunaState.PRUNED}.get(
        kind, OptunaState.FAIL
    )
    try:
        study.tell(trial, state.value if kind == "complete" else None, state=optuna_state)
    except RuntimeError as exc:  # a sampler that ran out (GridSampler) asks optimize() to stop;
        if "Study.stop" not in str(exc):  # the trial is stored all the same
            raise
    return TrialRecord(trial.number, config, kind, state.value, state.step, duration, error)


def _final_value(returned: Any, metric: str, reported: float | None) -> float | None:
    if isinstance(returned, (int, float)) and not isinstance(returned, bool):
        return float(returned)
    if isinstance(returned, dict) and isinstance(returned.get(metric), (int, float)):
        return float(returned[metric])
    return reported


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def records(study: Any) -> list[TrialRecord]:
    """Every finished trial of the study as a :class:`TrialRecord`."""
    from optuna.trial import TrialState as OptunaState

    out = []
    for t in study.get_trials(deepcopy=False):
        if t.state in (OptunaState.RUNNING, OptunaState.WAITING):
            continue
        attrs = t.user_attrs
        if attrs.get(INTERRUPTED):
            kind: TrialState = "interrupted"
        else:
            kind = {OptunaState.COMPLETE: "complete", OptunaState.PRUNED: "pruned"}.get(
                t.state, "failed"
            )  # type: ignore[assignment]
        value = t.value if t.state == OptunaState.COMPLETE else None
        if value is None and t.intermediate_values:
            value = t.intermediate_values[t.last_step]
        out.append(
            TrialRecord(
                number=t.number,
                config=attrs.get(CONFIG, dict(t.params)),
                state=kind,
                value=value,
                step=t.last_step,
                duration=attrs.get(DURATION),
                error=attrs.get(ERROR),
            )
        )
    return out
