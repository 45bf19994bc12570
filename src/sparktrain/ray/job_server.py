"""Ray on Spark's job server: on loopback where Spark is one machine, and only for the token holder.

``setup_ray_cluster`` starts a plain-HTTP server in the driver (Ray's ``SparkJobServer``) through
which Ray's autoscaler starts and ends worker nodes as Spark jobs (``/create_node`` takes ``ray
start`` options, ``/terminate_node`` cancels a job, ...). Ray binds it to the driver's address
and checks nothing. For one cluster, :class:`JobServerGuard` changes three things, all in this
process and undone by :meth:`JobServerGuard.close`:

- **Where it listens**: ``127.0.0.1`` when Spark's master is ``local``, ``local[...]`` or
  ``local-cluster[...]`` (:func:`single_host`: every executor, now and later, runs on this
  machine); else the driver's address, as Ray chooses, since executors elsewhere must reach it.
- **Who it answers**: every request, whatever its method or path, must carry ``Authorization:
  Bearer <token>`` (a fresh 256-bit token per cluster, compared in constant time); any other is
  refused with 401 before its body is read.
- **Its three clients send the token**, each to the server's real address:

  - the autoscaler (Ray's ``monitor.py``, a child of the head node, which learns the server's
    URL from the provider section of its autoscaling config): the config names
    :class:`AuthenticatedSparkNodeProvider` as an ``external`` provider, with the server's URL
    and the path of the token's file (mode 0600); the token itself is in no config or variable;
  - the Spark tasks that start worker nodes (``/check_node_id_availability``,
    ``/notify_task_launched``) and the driver's wait for the workers
    (``/query_last_worker_err``): Ray's ``cluster_init`` module calls ``requests.post``, and its
    ``requests`` is replaced by :func:`token_requests` while the cluster lives; the task's
    function is pickled with it, by value (sparktrain need not be installed on executors).
"""

from __future__ import annotations

import hmac
import logging
import shutil
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
from ray.autoscaler._private.spark import node_provider
from ray.autoscaler._private.spark.node_provider import SparkNodeProvider

log = logging.getLogger("sparktrain")

LOOPBACK = "127.0.0.1"
#: The provider config's keys that :class:`AuthenticatedSparkNodeProvider` reads.
URL_KEY = "sparktrain_job_server_url"
TOKEN_FILE_KEY = "sparktrain_job_server_token_file"
_PROVIDER = f"{__name__}.AuthenticatedSparkNodeProvider"
_BEARER = "Bearer "


def single_host(master: str) -> bool:
    """Whether Spark master ``master`` runs every executor on this machine, for its whole life."""
    name = master.strip().lower()
    return name == "local" or name.startswith(("local[", "local-cluster["))


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header holds ``Bearer <token>`` (constant-time comparison)."""
    given = header[len(_BEARER) :] if header and header.startswith(_BEARER) else ""
    return hmac.compare_digest(given.encode("latin-1", "replace"), token.encode())


def netloc(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def token_requests(token: str, hosts: set[str], port: int, target: str) -> Any:
    """A stand-in for the ``requests`` module whose ``post`` to the job server carries ``token``.

    A URL at ``port`` on one of ``hosts`` goes to ``target`` (the server's ``host:port``) with
    the token; any other call is ``requests``' own. The class is local, so that pickling an
    instance (in a Spark task's function) carries it by value.
    """

    class JobServerRequests:
        def __getattr__(self, name: str) -> Any:
            """The rest of ``requests`` (``requests.exceptions``, ...), as it is."""
            if name.startswith("__"):
                raise AttributeError(name)
            return getattr(requests, name)

        def post(self, url: str, *args: Any, **kwargs: Any) -> Any:
            """``requests.post``; to the job server, at its address and with the token."""
            parts = urlsplit(url)
            if parts.port == port and parts.hostname in hosts:
                url = urlunsplit(parts._replace(netloc=target))
                kwargs["headers"] = {
                    **(kwargs.get("headers") or {}),
                    "Authorization": _BEARER + token,
                }
            return requests.post(url, *args, **kwargs)

    return JobServerRequests()


def _refusing(base: Any, token: str) -> Any:
    """Ray's request handler class, refusing (401) every request without the token."""

    class TokenRequestHandler(base):  # type: ignore[misc]
        def parse_request(self) -> bool:
            """Parse the request line and headers; ``False`` (answered) unless authorized."""
            if not super().parse_request():
                return False  # malformed: answered already, nothing dispatched
            if authorized(self.headers.get("Authorization"), token):
                return True
            self.send_response(HTTPStatus.UNAUTHORIZED)
            self.send_header("WWW-Authenticate", 'Bearer realm="ray-on-spark-job-server"')
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            return False

        def log_message(self, format: str, *args: Any) -> None:
            """To sparktrain's log, at debug level, not to standard error."""
            log.debug("Ray on Spark job server: " + format, *args)

    return TokenRequestHandler


@dataclass(eq=False)
class JobServerGuard:
    """The changes to Ray on Spark for one cluster (see the module docstring).

    Attributes:
        token: The token every request to the job server must carry.
        token_path: Its file (mode 0600, in a folder of mode 0700), read by the autoscaler.
        loopback: Whether the server listens on ``127.0.0.1`` rather than the driver's address.
        server: Ray's ``SparkJobServer``, once started.
    """

    token: str = field(repr=False)
    token_path: str
    loopback: bool
    server: Any = field(default=None, repr=False)
    _setup: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)
    _lasting: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)

    @classmethod
    def install(cls, *, loopback: bool) -> JobServerGuard:
        """A fresh token, and Ray's job server start and autoscaling config changed to use it.

        Call before ``setup_ray_cluster``; :meth:`end_setup` after it, :meth:`close` at the
        cluster's shutdown.
        """
        from ray.autoscaler._private.spark import spark_job_server
        from ray.util.spark import cluster_init

        from sparktrain.ray.tokens import write_token

        guard = cls(*write_token(), loopback=loopback)
        guard._patch(guard._setup, spark_job_server, "_start_spark_job_server", guard._start)
        base = cluster_init.AutoscalingCluster

        class AutoscalingCluster(base):  # type: ignore[misc, valid-type]
            def _generate_config(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
                return guard.provider_config(super()._generate_config(*args, **kwargs))

        guard._patch(guard._setup, cluster_init, "AutoscalingCluster", AutoscalingCluster)
        return guard

    @staticmethod
    def _patch(undo: list[tuple[Any, str, Any]], owner: Any, name: str, value: Any) -> None:
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _start(self, host: str, port: int, spark: Any, ray_node_custom_env: Any) -> Any:
        """Ray's ``_start_spark_job_server``, on loopback if so and with the token required."""
        from ray.autoscaler._private.spark.spark_job_server import SparkJobServer
        from ray.util.spark import cluster_init

        server = SparkJobServer(
            (LOOPBACK if self.loopback else host, port), spark, ray_node_custom_env
        )
        server.RequestHandlerClass = _refusing(server.RequestHandlerClass, self.token)
        bound = str(server.server_address[0])
        client = token_requests(self.token, {host, bound}, port, netloc(bound, port))
        self._patch(self._lasting, cluster_init, "requests", client)
        self.server = server
        threading.Thread(target=server.serve_forever, name="ray-job-server", daemon=True).start()
        return server

    def provider_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Ray's autoscaling config, with :class:`AuthenticatedSparkNodeProvider` as provider."""
        provider = config["provider"]
        if provider.get("type") != "spark":
            raise RuntimeError(f"unexpected Ray on Spark autoscaler provider: {provider!r}")
        host = LOOPBACK if self.loopback else str(provider["ray_head_ip"])
        url = f"http://{netloc(host, int(provider['spark_job_server_port']))}"
        provider.update(
            {"type": "external", "module": _PROVIDER, URL_KEY: url, TOKEN_FILE_KEY: self.token_path}
        )
        return config

    def end_setup(self) -> None:
        """Undo the start-up changes (the server is started, the config written)."""
        _undo(self._setup)

    def close(self) -> None:
        """Undo everything, close the server's socket (Ray leaves it open), delete the token."""
        _undo(self._setup)
        _undo(self._lasting)
        if self.server is not None:
            import socketserver

            socketserver.BaseServer.shutdown(self.server)  # at once when Ray stopped it already
            self.server.server_close()
            self.server = None
        shutil.rmtree(Path(self.token_path).parent, ignore_errors=True)


def _undo(changes: list[tuple[Any, str, Any]]) -> None:
    while changes:
        owner, name, value = changes.pop()
        setattr(owner, name, value)


class AuthenticatedSparkNodeProvider(SparkNodeProvider):  # type: ignore[misc]
    """Ray's Spark node provider (in the autoscaler), sending the token to the server's real URL.

    Ray's provider posts to ``http://<head node address>:<port>`` with ``requests.post``; here
    the URL and the token's file come from the provider config, and that module's ``requests``
    (this process holds one cluster's provider) becomes :func:`token_requests`.
    """

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        url = urlsplit(str(provider_config[URL_KEY]))
        token = Path(provider_config[TOKEN_FILE_KEY]).read_text().strip()
        host, port = url.hostname or LOOPBACK, url.port or 80
        node_provider.requests = token_requests(token, {host}, port, netloc(host, port))
        super().__init__(provider_config, cluster_name)

    @property
    def spark_job_server_url(self) -> str:
        """The job server's URL, from the provider config."""
        return str(self.provider_config[URL_KEY])

    @spark_job_server_url.setter
    def spark_job_server_url(self, _ray_url: str) -> None:
        """Ray's own URL (the head node's address) is ignored: the server may be on loopback."""
