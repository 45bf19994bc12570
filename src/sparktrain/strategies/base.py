"""The strategy base: one object per ``prepare_model`` name, with that strategy's steps.

Runs inside a rank. Modelled on Lightning Fabric's ``Strategy``: the steps are resolve (only
``auto`` changes anything), whether a weightless skeleton is needed, the tracking parameters,
the module, the optimizer, backward and the full state dict. The defaults are plain PyTorch's
(the optimizer as given, ``loss.backward()``, torch's full state dict through
``get_model_state_dict``), so DDP overrides nothing but its module step, and a model wrapped
outside ``prepare_model`` (a DDP or FSDP module of the user's own) takes the same defaults.

The ``tp`` x ``pp`` layout is one step of the base for every strategy, so that
:mod:`sparktrain.strategies.composed` keeps deciding which strategies compose with it and its
refusal reads the same for all of them.

Each object also says which row of the planner (:mod:`sparktrain.planner.strategies`, the ZeRO
paper's names) prices it, and which rows ``auto`` runs with it: the one place where the two
vocabularies meet (:mod:`sparktrain.strategies.registry` collects them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from sparktrain.contract.env import contract_int
from sparktrain.ground.errors import ConfigError
from sparktrain.planner.strategies import Strategy as PlannerRow
from sparktrain.strategies.options import PrepareOptions


def device() -> Any:
    """This rank's device: ``cuda:LOCAL_RANK`` when the rank owns GPUs, else the CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", contract_int("LOCAL_RANK", 0))
    return torch.device("cpu")


def world() -> Any:
    """``torch.distributed``, once its process group exists (else the error saying so)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "prepare_model needs the process group: call "
            "torch.distributed.init_process_group(...) first, inside the training function."
        )
    return dist


#: The attribute naming the strategy object that made a prepared model (or ZeRO optimizer).
ATTRIBUTE = "_sparktrain_strategy"


def mark(prepared: Any, strategy: Strategy) -> None:
    """Record on ``prepared`` the object that made it (not a registered submodule)."""
    object.__setattr__(prepared, ATTRIBUTE, strategy)


def made_by(prepared: Any) -> Strategy | None:
    """The strategy object :func:`mark` recorded on ``prepared``, if any."""
    found = getattr(prepared, ATTRIBUTE, None)
    return found if isinstance(found, Strategy) else None


class Strategy(ABC):
    """One ``prepare_model`` strategy and its steps.

    Attributes:
        name: The word ``prepare_model`` takes.
        auto_runs: The planner rows ``auto`` runs with this strategy, each with the
            :class:`~sparktrain.strategies.options.Sharding` fields it sets (empty: none).
    """

    name: str
    auto_runs: ClassVar[Mapping[PlannerRow, Mapping[str, bool]]] = {}

    def resolve(self, model: Any, options: PrepareOptions) -> tuple[Strategy, PrepareOptions]:
        """The strategy that will run, and its options: this one, unchanged (``auto`` chooses)."""
        return self, options

    @abstractmethod
    def priced_as(self, options: PrepareOptions) -> PlannerRow | None:
        """The planner row whose memory this strategy takes with ``options`` (``None``: varies)."""

    def needs_skeleton(self, options: PrepareOptions) -> bool:
        """Whether :func:`~sparktrain.strategies.plain_module` must rebuild the model.

        A split model (``tp``/``pp``) holds pieces, so yes; a whole module can be unwrapped.
        """
        return options.parallel.composed

    def settings(self, options: PrepareOptions) -> dict[str, Any]:
        """The parameters logged to the tracking run."""
        return {"strategy": self.name, **options.parallel.settings()}

    def prepare(self, model: Any, options: PrepareOptions, where: Any) -> Any:
        """The module step: split over the ``tp`` x ``pp`` layout, else :meth:`prepare_module`."""
        layout = options.parallel
        if not layout.composed:
            return self.prepare_module(model, options, where)
        from sparktrain.strategies.composed import prepare_parallel

        return prepare_parallel(
            model,
            self.name,
            where,
            tp=layout.tp,
            pp=layout.pp,
            plan=layout.plan,
            pipelining=layout.pipelining,
            shard=self.part_sharder(options),
        )

    @abstractmethod
    def prepare_module(self, model: Any, options: PrepareOptions, where: Any) -> Any:
        """Move the whole ``model`` to ``where`` and wrap it."""

    def part_sharder(self, options: PrepareOptions) -> Callable[..., Any] | None:
        """``fn(part, where, mesh)`` sharding a piece of a split model (``None``: not sharded)."""
        return None

    def prepare_optimizer(self, model: Any, optimizer: Any) -> Any:
        """The optimizer to step: ``optimizer`` itself."""
        return optimizer

    def backward(self, loss: Any, optimizer: Any) -> None:
        """``loss.backward()``."""
        loss.backward()

    def full_state_dict(self, model: Any) -> dict[str, Any]:
        """The whole, unwrapped state dict on every rank, on the CPU (a collective if sharded)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.nn.parallel import DistributedDataParallel

        from sparktrain.strategies.pipeline import PipelineModel, gather_state

        if isinstance(model, PipelineModel):  # each stage whole, then every stage
            return dict(gather_state(model, self.full_state_dict))
        if isinstance(model, DistributedDataParallel):
            model = model.module
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        state: dict[str, Any] = dict(get_model_state_dict(model, options=options))
        return {k: v.detach().cpu() if hasattr(v, "detach") else v for k, v in state.items()}
