"""``sparktrain.tune``: hyperparameter search where every trial is a distributed launch.

Optuna does the searching (its samplers, its pruners as schedulers, its storage for resuming);
sparktrain runs the trials. Each trial is one :func:`sparktrain.launch` of ``main(config)`` on
any backend, warm-started like every launch, so a trial starts in a fraction of a second. Rank
0's ``sparktrain.report(step=..., **{metric: value})`` calls reach the driver through the
launch's monitor, become Optuna intermediate values, and when the scheduler prunes the trial the
monitor stops every rank of it. Trials run in worker threads (``max_concurrent_trials``); the
calling thread waits, so Ctrl-C stops every running trial, records them as interrupted, and
re-raises: calling ``tune`` again with the same ``storage`` retries them and runs the rest.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Literal

from sparktrain.backends.base import Backend
from sparktrain.backends.registry import BackendName
from sparktrain.driver.launch import PreparedLaunch, prepare
from sparktrain.driver.monitor import Monitor
from sparktrain.ground.errors import (
    ClusterError,
    ConfigError,
    HangError,
    TrainingFailedError,
    TrainingTimeoutError,
)
from sparktrain.launchplan.option_docs import documents_options
from sparktrain.launchplan.options import RunOptions, run_options
from sparktrain.tuning import study as studies
from sparktrain.tuning.results import TuneResult
from sparktrain.tuning.space import to_optuna
from sparktrain.tuning.tracking import SearchRun

_TRIAL_ERRORS = (TrainingFailedError, HangError, TrainingTimeoutError, ClusterError)
#: A trial whose ranks print and report nothing for this long is stopped as hung, so that one
#: stuck trial cannot stall the whole search; the search goes on with the next trial.
TRIAL_HANG_TIMEOUT = 600.0


@documents_options
def tune(
    main: Callable[[dict[str, Any]], Any],
    search_space: Mapping[str, Any],
    *,
    num_trials: int,
    metric: str,
    mode: Literal["min", "max"] = "min",
    max_concurrent_trials: int = 1,
    num_processes_per_trial: int = 1,
    scheduler: Any = "asha",
    sampler: Any = None,
    backend: BackendName | Backend = "local",
    use_gpu: bool | None = None,
    ray_address: str | None = None,
    storage: str | None = None,
    study_name: str = "sparktrain-tune",
    seed: int | None = None,
    mlflow: bool | None = None,
    log_ranks: Collection[int] | None = (),
    hang_timeout: float | None = TRIAL_HANG_TIMEOUT,
    options: RunOptions | None = None,
    **option_args: Any,
) -> TuneResult:
    """Search ``search_space`` for the configuration of ``main`` with the best ``metric``.

    Args:
        main: The training function; every rank of a trial calls ``main(config)``. Rank 0
            reports with ``sparktrain.report(step=epoch, **{metric: value})``; its last reported
            value (or a number or dict returned by rank 0) is the trial's result.
        search_space: Name to range (``sparktrain.tuning.loguniform(1e-4, 1e-1)``,
            ``uniform``, ``randint``, ``choice``, a list, an Optuna distribution) or constant.
        num_trials: Trials to finish in the study (a resumed study counts earlier ones).
        metric: The reported metric to optimise.
        mode: ``"min"`` or ``"max"``.
        max_concurrent_trials: Trials run at once.
        num_processes_per_trial: Ranks per trial.
        scheduler: Early stopping: ``"asha"`` (successive halving, the default),
            ``"hyperband"``, ``"median"`` (median stopping), ``None``, or an Optuna pruner.
        sampler: An Optuna sampler (default: TPE, seeded with ``seed``).
        backend: Where trials run: ``"local"``, ``"spark"`` or ``"ray"``.
        use_gpu: As for :func:`sparktrain.launch` (``None``: GPUs where there are some).
        ray_address: With ``backend="ray"``: the cluster to join.
        storage: An Optuna storage (``"sqlite:///tune.db"``, or a path ending in ``.db``) to
            keep the study, so that an interrupted search resumes; ``None`` keeps it in memory.
        study_name: The study's name in ``storage``.
        seed: Seed of the default sampler.
        mlflow: Track the search as an MLflow run with one child run per trial (``None``: when
            the caller has an active run).
        log_ranks: Ranks whose lines are shown (default: none; errors are still reported).
        hang_timeout: Seconds without a line or a report from any rank of a trial after which
            the trial is stopped as hung (and recorded failed, with where each rank waited);
            600 by default, so that one stuck trial cannot stall the search. ``None`` turns the
            watch off.
        options: A :class:`~sparktrain.launchplan.options.RunOptions` for every trial.
        **option_args: Run options of every trial by name (:class:`~sparktrain.RunOptions`;
            ``on_report`` is not taken: tune reads every trial's reports itself, its scheduler
            stops weak trials):

            {run_options}

    Returns:
        A :class:`TuneResult`: every trial, ``best_config``, ``best_value``, ``table()``.

    Raises:
        ConfigError: Bad input; nothing was started.
        KeyboardInterrupt: Ctrl-C; running trials were stopped and marked interrupted.
    """
    _check(num_trials, metric, mode, max_concurrent_trials, num_processes_per_trial, option_args)
    prepared = prepare(
        num_processes_per_trial,
        use_gpu=use_gpu,
        backend=backend,
        ray_address=ray_address,
        options=run_options(options, log_ranks=log_ranks, hang_timeout=hang_timeout, **option_args),
        name="num_processes_per_trial",
    )
    searched, constants = to_optuna(search_space)
    study = studies.open_study(
        storage, study_name, mode=mode, sampler=sampler, scheduler=scheduler, seed=seed
    )
    remaining = studies.prepare_resume(study, num_trials)
    tracking = SearchRun.begin(
        mlflow, study_name, num_trials=num_trials, metric=metric, mode=mode, scheduler=scheduler
    )
    search = _Search(
        main=main, study=study, searched=searched, constants=constants, metric=metric,
        tracking=tracking, prepared=prepared,
    )  # fmt: skip
    try:
        search.run(remaining, max_concurrent_trials)
    except BaseException as error:
        if tracking:
            tracking.end(None, error)
        raise
    result = TuneResult(metric, mode, tuple(studies.records(study)))
    if tracking:
        tracking.end(result, None)
    return result


def _check(  # noqa: PLR0917 - one private caller: tune()
    num_trials: int,
    metric: str,
    mode: str,
    concurrent: int,
    procs: int,
    option_args: Mapping[str, Any],
) -> None:
    for name, value in (("num_trials", num_trials), ("max_concurrent_trials", concurrent),
                        ("num_processes_per_trial", procs)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"metric={metric!r} must name a reported metric, e.g. 'loss'")
    if mode not in ("min", "max"):
        raise ConfigError(f"mode={mode!r} must be 'min' or 'max'")
    if "on_report" in option_args:
        raise ConfigError(
            "tune reads every trial's reports itself (its scheduler stops weak trials), so it "
            "takes no on_report=; report with sparktrain.report(step=..., **{metric: value})."
        )


class _Search:
    """The running search: asks Optuna for trials, launches them, tells Optuna the outcome."""

    def __init__(
        self,
        *,
        main: Callable[[dict[str, Any]], Any],
        study: Any,
        searched: dict[str, Any],
        constants: dict[str, Any],
        metric: str,
        tracking: SearchRun | None,
        prepared: PreparedLaunch,
    ) -> None:
        self.main, self.study, self.searched, self.constants = main, study, searched, constants
        self.metric, self.tracking, self.prepared = metric, tracking, prepared
        self.aborting = threading.Event()
        self.monitors: set[Monitor] = set()
        self.lock = threading.Lock()

    def run(self, count: int, concurrent: int) -> None:
        """Run ``count`` trials, ``concurrent`` at a time; Ctrl-C stops them all."""
        with ThreadPoolExecutor(concurrent, thread_name_prefix="sparktrain-trial") as pool:
            pending: set[Future[None]] = set()
            started = 0
            try:
                while started < count or pending:
                    while started < count and len(pending) < concurrent:
                        pending.add(pool.submit(self.trial))
                        started += 1
                    done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()  # a bug or a ConfigError: stop the search
            except BaseException:
                self.aborting.set()
                with self.lock:
                    for monitor in self.monitors:
                        monitor.request_stop()
                wait(pending)
                raise

    def trial(self) -> None:
        """Run one trial to its end and tell Optuna how it went."""
        if self.aborting.is_set():
            return
        trial = self.study.ask(self.searched)
        config = {**self.constants, **trial.params}
        state = _TrialState()

        def on_report(rank: int, record: dict[str, Any]) -> bool:
            value = (record.get("metrics") or {}).get(self.metric)
            if rank != 0 or not isinstance(value, (int, float)):
                return self.aborting.is_set() or state.pruned
            if state.pruned:  # reports still in flight while the ranks stop: the verdict stands
                return True
            state.reports += 1
            step = record.get("step")
            state.step = step if isinstance(step, int) else state.reports
            state.value = float(value)
            trial.report(state.value, state.step)
            if self.aborting.is_set():
                return True
            state.pruned = trial.should_prune()
            return state.pruned

        monitor = Monitor(progress=False, on_report=on_report)
        with self.lock:
            self.monitors.add(monitor)
        started = time.monotonic()
        try:
            outcome = self._launch(trial.number, config, monitor, state)
        finally:
            with self.lock:
                self.monitors.discard(monitor)
        record = studies.conclude(
            self.study, trial, config, outcome, state=state, metric=self.metric,
            duration=time.monotonic() - started, interrupted=self.aborting.is_set(),
        )  # fmt: skip
        if self.tracking:
            self.tracking.trial_done(record, state.run_id)
        detail = f"{self.metric}={record.value:.4g}" if record.value is not None else record.error
        print(
            f"sparktrain.tune: trial {record.number} {record.state}"
            + (f" at step {record.step}" if record.state == "pruned" else "")
            + f" ({detail}) {trial.params}",
            file=sys.stderr,
            flush=True,
        )

    def _launch(
        self, number: int, config: dict[str, Any], monitor: Monitor, state: _TrialState
    ) -> Any:
        """The trial's :class:`RunResult`, or the error that ended it."""
        try:
            if self.tracking is None:
                return self.prepared.run(self.main, (config,), monitor=monitor)
            tracked = dataclasses.replace(
                self.prepared, options=run_options(self.prepared.options, mlflow=True)
            )
            with self.tracking.child(number, config) as child:
                try:
                    return tracked.run(self.main, (config,), monitor=monitor)
                finally:
                    state.run_id = child.run_id
        except ConfigError:
            raise
        except _TRIAL_ERRORS as error:
            return error


class _TrialState:
    """What the reports of one trial said so far."""

    def __init__(self) -> None:
        self.reports = 0
        self.step: int | None = None
        self.value: float | None = None
        self.pruned = False
        self.run_id: str | None = None
