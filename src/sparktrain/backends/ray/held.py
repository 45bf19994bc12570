"""What outlives a Ray attempt on the driver: our placement groups' resources, silent hosts.

The backend owns one :class:`Held` and lends it to each attempt's nodes: a placement group's
resources count as the run's capacity while its attempt runs (:meth:`Held.total`), and a node
that went silent is left out of layouts and placements for :data:`AVOID_SECONDS` (Ray itself
declares an unreachable node dead only after its health checks fail, tens of seconds later).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

#: How long a node that went silent is left out of layouts and placements.
AVOID_SECONDS = 120.0


class Held:
    """The placement groups' resources and the silent hosts, shared by a backend's attempts."""

    def __init__(self, ray: Any) -> None:
        """Keep what ``ray``'s attempts hold; nothing yet."""
        self.ray = ray
        self._lock = threading.Lock()
        self._groups: dict[int, dict[str, float]] = {}  # each running attempt's group, by key
        self._silent: dict[str, float] = {}  # host -> when it went silent

    def hold(self, key: int, resources: Mapping[str, float]) -> None:
        """An attempt's placement group (``key``) holds ``resources`` now."""
        with self._lock:
            self._groups[key] = dict(resources)

    def release(self, key: int) -> None:
        """The attempt ``key`` let its placement group go."""
        with self._lock:
            self._groups.pop(key, None)

    def total(self, kind: str) -> float:
        """The ``kind`` (``"CPU"``, ``"GPU"``) every running attempt's group holds."""
        with self._lock:
            return sum(group.get(kind, 0.0) for group in self._groups.values())

    def avoid(self, hosts: Collection[str]) -> None:
        """Leave the nodes on ``hosts`` out for a while: they went silent (cut off, frozen).

        Ray still counts such a node alive, with its resources free, until its health checks
        have failed; a new placement there would wait for a node that cannot answer.
        """
        with self._lock:
            self._silent.update(dict.fromkeys(hosts, time.monotonic()))

    def avoided(self) -> dict[str, str]:
        """The silent hosts still left out, with their Ray node ids (alive in Ray's view)."""
        with self._lock:
            now = time.monotonic()
            self._silent = {h: t for h, t in self._silent.items() if now - t < AVOID_SECONDS}
            silent = set(self._silent)
        if not silent:
            return {}
        return {
            str(n["NodeManagerAddress"]): str(n["NodeID"])
            for n in self.ray.nodes()
            if n.get("Alive") and str(n["NodeManagerAddress"]) in silent
        }
