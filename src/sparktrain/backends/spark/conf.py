"""What a Spark session's settings allow, read on the driver: TLS.

With ``spark.ssl.enabled=true`` a run on the executors is refused, as pyspark's
``TorchDistributor`` and spark-tensorflow-distributor refuse it: their training traffic, and
sparktrain's, is not encrypted in transit. Each front door honours its original's override conf
(:mod:`sparktrain.launchplan.front`), and ``spark.sparktrain.ignoreSsl`` works for all.
"""

from __future__ import annotations

import logging
from typing import Any

from sparktrain.ground.errors import ClusterConfigError, ConfigError
from sparktrain.launchplan.front import FrontDoor

log = logging.getLogger("sparktrain")


def conf_flag(session: Any, key: str) -> bool:
    """A true/false Spark conf (any case; unset is false); another value is refused."""
    value = str(session.conf.get(key, "false") or "false").strip().lower()
    if value not in ("true", "false"):
        raise ConfigError(f"the Spark conf {key}={value!r} must be 'true' or 'false'.")
    return value == "true"


_warned_tls: set[str] = set()


def check_encryption(session: Any, front: FrontDoor) -> None:
    """Refuse a cluster with TLS on unless one of ``front``'s overrides is ``true``.

    As pyspark and spark-tensorflow-distributor do with ``spark.ssl.enabled``; with an override
    set, one warning (per front door and process) says what travels unencrypted.

    Raises:
        ClusterConfigError: TLS is on and no override is set.
    """
    if not conf_flag(session, "spark.ssl.enabled"):
        return
    overrides = front.ignore_ssl_confs()
    what = (
        f"This cluster has TLS encryption enabled (spark.ssl.enabled=true); however, "
        f"{front.name}'s training traffic is not encrypted in transit: the collectives between "
        "ranks (gloo, NCCL), the rendezvous store and the values the ranks return travel in "
        "the clear. (sparktrain's channel between the executors and the driver is "
        "authenticated with a per-run secret, but not encrypted either.)"
    )
    if any(conf_flag(session, key) for key in overrides):
        if front.name not in _warned_tls:
            _warned_tls.add(front.name)
            log.warning("%s Running anyway: an override (%s) is set to 'true'.", what, overrides)
        return
    raise ClusterConfigError(
        f"{what} To run {front.name} anyway, set '{overrides[0]}' to 'true' in the Spark "
        "configuration; model parameters and possibly training data will then be sent between "
        "nodes unencrypted."
    )
