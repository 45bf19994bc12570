"""This machine's resources as the local backend gives them to its ranks.

The CPUs and GPUs of this machine (:func:`~sparktrain.launchplan.topology.detect_local`), except
that with an active SparkSession whose driver has GPU resources (``spark.driver.resource.gpu.*``)
those are the GPUs the ranks may use, read through the driver's ``CUDA_VISIBLE_DEVICES``, as
pyspark's local mode reads them. pyspark is consulted only when it is already imported: planning a
local run never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

from sparktrain.contract import env
from sparktrain.launchplan.topology import Topology, detect_local, spark_gpus


def local_topology(use_gpu: object) -> Topology:
    """This machine's CPUs and the GPUs a local launch gives its ranks.

    With an active SparkSession whose driver has GPU resources, those are the GPUs
    (``use_gpu=True``, or ``None`` where CUDA sees GPUs), as in pyspark's local mode.
    """
    topology = detect_local(gpus=use_gpu is not False)
    driver = driver_gpus() if use_gpu is not False else None
    if driver is not None and (use_gpu is True or topology.gpus):
        topology = dataclasses.replace(topology, gpus=driver)
    return topology


def driver_gpus() -> tuple[str, ...] | None:
    """The GPUs of the active SparkSession's driver, as devices of this process.

    ``None`` when there is no classic session, or its driver has no GPU resources
    (``spark.driver.resource.gpu.*``).
    """
    if "pyspark" not in sys.modules:
        return None
    session = None
    with contextlib.suppress(Exception):
        from pyspark.sql import SparkSession

        session = SparkSession.getActiveSession()
    if session is None or type(session).__module__.startswith("pyspark.sql.connect"):
        return None
    resources = session.sparkContext.resources
    if "gpu" not in resources:
        return None
    return spark_gpus(list(resources["gpu"].addresses), env.cuda_visible_devices())
