"""``DeepspeedTorchDistributor``, call-compatible with pyspark's.

``DeepspeedTorchDistributor(numGpus=1, nnodes=1, localMode=True, useGpu=None,
deepspeedConfig=None)`` runs ``numGpus * nnodes`` ranks like :class:`TorchDistributor`.
The configuration (a dict or a JSON file) is read and checked before anything starts, then
travels inside the entrypoint, so it reaches every rank on every backend:

- function mode: ``sparktrain.deepspeed_config()`` returns it inside the rank, and the ZeRO
  strategies of ``prepare_model`` merge it into their own;
- script mode: as with pyspark, the script gets ``--deepspeed --deepspeed_config PATH``; here
  PATH is a private file that each rank writes before running the script and removes after
  (pyspark leaves its temporary file behind, and puts the flags in ``sys.argv`` of functions,
  where nothing reads them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

from typing_extensions import Unpack

from sparktrain.backends.base import Backend
from sparktrain.backends.registry import BackendName, backend_class, for_local_mode
from sparktrain.compat.rank.deepspeed import run_script_with_config, run_with_config
from sparktrain.compat.torch_distributor import TorchDistributor
from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan.front import DEEPSPEED_DISTRIBUTOR, FrontDoor
from sparktrain.launchplan.options import RunOptions, RunOptionsArgs


def load_config(config: object) -> dict[str, Any]:
    """The DeepSpeed configuration as a dict, from a dict, a JSON file's path, or ``None``."""
    if config is None:
        return {}
    if isinstance(config, dict):
        try:
            json.dumps(config)
        except TypeError as exc:
            raise ConfigError(f"deepspeedConfig cannot be written as JSON: {exc}") from None
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"deepspeedConfig={os.fspath(config)!r} is not an existing file; pass the path "
                "of a DeepSpeed JSON configuration, or the configuration as a dict."
            )
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"deepspeedConfig file {path} is not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"deepspeedConfig file {path} holds {type(loaded).__name__}, not an object"
            )
        return loaded
    raise ConfigError(
        f"deepspeedConfig={config!r} ({type(config).__name__}) must be a dict, a path to a JSON "
        "file, or None."
    )


def _count(name: str, value: object) -> int:
    """A positive count; ``True`` is 1, as pyspark's ``numGpus * nnodes`` makes it."""
    if value is True:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive int")
    return value


class DeepspeedTorchDistributor(TorchDistributor):
    """Run DeepSpeed training on ``numGpus * nnodes`` ranks (pyspark's signature)."""

    count_name: ClassVar[str] = "numGpus * nnodes"
    front_door: ClassVar[FrontDoor] = DEEPSPEED_DISTRIBUTOR

    def __init__(
        self,
        numGpus: int = 1,
        nnodes: int = 1,
        localMode: bool = True,
        useGpu: bool | None = None,
        deepspeedConfig: dict[str, Any] | str | os.PathLike[str] | None = None,
        *,
        backend: BackendName | Backend | None = None,
        ray_address: str | None = None,
        options: RunOptions | None = None,
        **option_args: Unpack[RunOptionsArgs],
    ) -> None:
        """Check the configuration and the layout; nothing starts yet.

        Args:
            numGpus: Ranks per node (GPUs per node on GPU).
            nnodes: Nodes; more than one needs ``localMode=False`` (Spark) or ``backend="ray"``.
            localMode: ``True``: every rank on this machine; ``False``: on Spark executors.
            useGpu: ``True``, ``False`` or ``None`` (GPUs when available).
            deepspeedConfig: A dict, the path of a JSON file, or ``None``.
            backend: Where the ranks run (``None``: follows ``localMode``); see
                :class:`TorchDistributor`.
            ray_address: With ``backend="ray"``: the cluster to join.
            options: A :class:`~sparktrain.launchplan.options.RunOptions` to start from.
            **option_args: Run options by name (:class:`~sparktrain.RunOptions`):

                {run_options}
        """
        numGpus, nnodes = _count("numGpus", numGpus), _count("nnodes", nnodes)
        spans = backend_class(for_local_mode(localMode, backend)).multi_node
        if nnodes > 1 and localMode and not spans:
            raise ConfigError(
                f"nnodes={nnodes} with localMode=True: local mode runs on this machine only; "
                "pass localMode=False to spread the ranks over Spark executors, or nnodes=1."
            )
        self.deepspeed_config = load_config(deepspeedConfig)
        self.numGpus = numGpus
        self.nnodes = nnodes
        super().__init__(
            numGpus * nnodes,
            localMode,
            useGpu,
            backend=backend,
            ray_address=ray_address,
            options=options,
            **option_args,
        )
        self.input_params = {"deepspeed_config": deepspeedConfig, **self.input_params}

    def run(self, main: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``main`` (a function or a script) on every rank; return rank 0's value."""
        if isinstance(main, (str, os.PathLike)):
            if kwargs:
                raise ConfigError(
                    f"keyword arguments {sorted(kwargs)} cannot be passed to a script; pass "
                    "them as command-line arguments."
                )
            script = Path(main).expanduser()
            if not script.is_file():
                raise ConfigError(f"main={os.fspath(main)!r} is not an existing file")
            strings = [str(a) for a in args]
            return super().run(
                run_script_with_config, self.deepspeed_config, str(script.resolve()), strings
            )
        if not callable(main):
            raise ConfigError(f"main={main!r} is neither a callable nor a path to a script")
        return super().run(run_with_config, self.deepspeed_config, main, *args, **kwargs)
