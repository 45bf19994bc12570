"""The one module that reads or writes environment variables of the rank contract.

Each rank gets the torch contract (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and the torchelastic
variables that make frameworks (Lightning, Accelerate, DeepSpeed) treat the process as an
already-launched rank. ``TORCHELASTIC_USE_AGENT_STORE=True`` tells ``init_process_group`` to join
the store that sparktrain hosts on a port it already holds, so two runs never race for a port.
CPU ranks also get ``ACCELERATE_USE_CPU=true``, so that Accelerate (and with it the Hugging Face
``Trainer``) runs them as one gloo job: without it, Accelerate trains each rank alone on a machine
without CUDA, and puts the ranks on GPUs where the run asked for CPU.
Nothing else in sparktrain passes values through environment variables, and nothing else in
sparktrain reads these: a rank asks the functions at the end of this module
(:func:`contract_rank`, :func:`contract_int`, ...), which also give the values outside a launch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Variables owned by the contract: removed from the caller's environment before a rank's are set.
CONTRACT_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "ACCELERATE_USE_CPU",
    "SPARKTRAIN_TARGET_WORLD_SIZE",
    "SPARKTRAIN_GROW_FILE",
    "SPARKTRAIN_CHECKPOINT_MEMORY",
)


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """Everything one rank needs to find its peers.

    Attributes:
        rank: Global rank, 0 .. world_size - 1.
        local_rank: Rank on this node; indexes ``visible_devices`` on GPU runs.
        world_size: Number of ranks in the run.
        local_world_size: Number of ranks on this node.
        node_rank: Index of this node.
        nodes: Number of nodes.
        master_addr: Host of the rendezvous store.
        master_port: Port of the rendezvous store.
        run_id: Identifier of the run (``TORCHELASTIC_RUN_ID``).
        visible_devices: GPU addresses this node's ranks own, or ``None`` on CPU.
        threads: Intra-op threads for the rank (``OMP_NUM_THREADS`` unless the user set it).
        restart: How many times the group was restarted before this attempt.
        max_restarts: How many restarts the run allows.
        target_world_size: In an elastic run, the size it was launched at (``None``: not
            elastic).
        grow_file: In an elastic run, the file whose presence asks the ranks to stop at their
            next checkpoint so that the run grows back.
        memory: The node's checkpoint memory folder, or ``None`` where the node has none.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nodes: int
    master_addr: str
    master_port: int
    run_id: str
    visible_devices: tuple[str, ...] | None
    threads: int
    restart: int = 0
    max_restarts: int = 0
    target_world_size: int | None = None
    grow_file: str | None = None
    memory: str | None = None

    def variables(self) -> dict[str, str]:
        """The variables to set in the rank, as strings."""
        out = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "NODE_RANK": str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nodes),
            "ROLE_RANK": str(self.rank),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(self.restart),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "PYTHONUNBUFFERED": "1",
        }
        if self.target_world_size is not None:
            out["SPARKTRAIN_TARGET_WORLD_SIZE"] = str(self.target_world_size)
        if self.grow_file is not None:
            out["SPARKTRAIN_GROW_FILE"] = self.grow_file
        if self.memory is not None:
            out[CHECKPOINT_MEMORY] = self.memory
        if self.visible_devices is not None:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible_devices)
        else:
            out["ACCELERATE_USE_CPU"] = "true"
        return out


def rank_environ(base: Mapping[str, str], rank_env: RankEnv) -> dict[str, str]:
    """The full environment of one rank: the caller's, less a stale contract, plus the rank's."""
    env = {k: v for k, v in base.items() if k not in CONTRACT_VARS}
    env.update(rank_env.variables())
    env.setdefault("OMP_NUM_THREADS", str(rank_env.threads))
    return env


def caller_environ() -> dict[str, str]:
    """A snapshot of the caller's environment, to be the base of every rank's."""
    return dict(os.environ)


def cuda_visible_devices() -> tuple[str, ...] | None:
    """The caller's ``CUDA_VISIBLE_DEVICES`` as a tuple, or ``None`` when it is not set."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return tuple(p.strip() for p in raw.split(",") if p.strip() and p.strip() != "-1")


def user_set_threads(env: Mapping[str, str]) -> bool:
    """Whether the user chose the thread count (``OMP_NUM_THREADS``) themselves."""
    return "OMP_NUM_THREADS" in env


def restart_count() -> int:
    """Inside a rank: how many times the group was restarted before this attempt (0 at first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0")


def target_world_size() -> int | None:
    """Inside a rank of an elastic run: the size it was launched at; ``None`` when not elastic."""
    raw = os.environ.get("SPARKTRAIN_TARGET_WORLD_SIZE")
    return int(raw) if raw else None


def grow_file() -> str | None:
    """Inside a rank of an elastic run: the file that asks for a stop to grow back, or ``None``."""
    return os.environ.get("SPARKTRAIN_GROW_FILE") or None


#: The node's checkpoint memory: a folder in host memory that outlives the node's attempts.
CHECKPOINT_MEMORY = "SPARKTRAIN_CHECKPOINT_MEMORY"


def checkpoint_memory() -> str | None:
    """Inside a rank: its node's checkpoint memory folder, or ``None`` where the node has none."""
    return os.environ.get(CHECKPOINT_MEMORY) or None


#: In place: the store the driver hosts for the ranks' generations (``host:port``).
IN_PLACE_STORE = "SPARKTRAIN_IN_PLACE_STORE"


#: In place: set for the ranks of a node that joins a running group (they ask in, then heal).
IN_PLACE_JOIN = "SPARKTRAIN_IN_PLACE_JOIN"


def in_place_joining() -> bool:
    """Inside a rank of an in-place run: whether it joins a running group."""
    return os.environ.get(IN_PLACE_JOIN) == "1"


def in_place_store() -> tuple[str, int, str] | None:
    """Inside a rank of an in-place run: the driver's store, or ``None``.

    Returns:
        Its ``host`` and ``port``, and the secret prefix of every key the run uses.
    """
    raw = os.environ.get(IN_PLACE_STORE)
    if not raw:
        return None
    secret, _, address = raw.rpartition("@")
    host, _, port = address.rpartition(":")
    return host, int(port), secret


def contract_rank() -> int:
    """Inside a rank: its global rank from the contract (``RANK``), 0 outside any launch."""
    return int(os.environ.get("RANK", "0") or "0")


def contract_world_size() -> int:
    """Inside a rank: the number of ranks from the contract (``WORLD_SIZE``), 1 outside."""
    return int(os.environ.get("WORLD_SIZE", "1") or "1")


def contract_int(name: str, default: int) -> int:
    """Inside a rank: the contract's integer ``name`` (``LOCAL_RANK``, ...), else ``default``."""
    return int(os.environ.get(name, "") or default)


def launched() -> bool:
    """Inside a process: whether a launcher gave it the contract (``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def contract_master_addr(default: str) -> str:
    """Inside a rank: the host of the run's store (``MASTER_ADDR``), else ``default``."""
    return os.environ.get("MASTER_ADDR", default)


def contract_store_address() -> tuple[str, int]:
    """Inside a rank: where the run's store listens (``MASTER_ADDR``, ``MASTER_PORT``)."""
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
