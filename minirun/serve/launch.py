"""Start the engine replicas on Ray Serve (replicas.py), on a local Ray instance or a running cluster,
and serve until SIGINT or SIGTERM (`minirun serve --replicas N [--address ADDR]`).

Every machine of a cluster needs minirun (with its `ray` extra) in the same Python environment and
the model at the same path: each replica loads it where it runs.
"""
from __future__ import annotations

import logging
import re
import signal
import sys
import threading

from ..errors import MiniRunError
from . import affinity
from .app import MAX_BODY
from .replicas import EngineFront, EngineReplica, Ingress

APP = "minirun"
ROUTERS = ("document", "ray-default")
ROUTER_CLASS = "minirun.serve.router:DocumentRouter"
STATS_PERIOD_S = 0.5     # how often a replica reports what its cache holds


def import_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise MiniRunError("--replicas runs on Ray Serve: install it with pip install 'minirun[ray]'") from None
    return ray, serve


def build_app(model, options: dict, replicas: int, max_queue: int, model_name: str, api_key: str | None,
              router: str = "document", max_body: int = MAX_BODY):
    """The Serve application: Ingress over `replicas` EngineReplicas (options: the engine options,
    as load_engine takes them, with `parallel`: each replica's slots)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from ..cli.common import engine_settings
    routing = {}
    if router == "document":
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS, request_routing_stats_period_s=STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0)
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    engines = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=replicas, max_ongoing_requests=options.get("parallel", 1) + max_queue,
        graceful_shutdown_timeout_s=5, health_check_period_s=2, max_constructor_retry_count=replicas,
        ray_actor_options={"num_cpus": options.get("threads") or 1}, logging_config=quiet, **routing)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress").options(
        num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0}, logging_config=quiet)
    return ingress.bind(engines.bind(model, options, max_queue, affinity.BLOCK), model, engine_settings(**options),
                        model_name, api_key, replicas, max_queue, max_body)


def why_not_started(e: Exception, name: str) -> str:
    """One line from Serve's deployment failure: the replica's own error where its status holds it."""
    from ray import serve
    try:
        text = "\n".join(d.message for d in serve.status().applications[name].deployments.values()) + f"\n{e}"
    except (KeyError, AttributeError):
        text = str(e)
    found = re.findall(r"MiniRunError: (.+)", text)
    if found:
        return found[-1].strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def start(model, options: dict, replicas: int, *, host: str = "127.0.0.1", port: int = 8080,
          address: str | None = None, max_queue: int = 16, model_name: str | None = None,
          api_key: str | None = None, router: str = "document", name: str = APP, max_body: int = MAX_BODY) -> str:
    """Start Ray (address None: a local instance), Serve's HTTP proxy on host:port and the app;
    return its URL once every replica has loaded the model. A failure is a one-line MiniRunError.
    name: the Serve application's (another name runs beside it on the same proxy)."""
    if replicas < 1:
        raise MiniRunError(f"--replicas must be at least 1, got {replicas}")
    if router not in ROUTERS:
        raise MiniRunError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")
    from ..cli.common import engine_settings
    front = EngineFront(model, engine_settings(**options))      # (a wrong model path: here, in one line)
    ray, serve = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 configure_logging=True, log_to_driver=False)
    need = replicas * (options.get("threads") or 1)
    have = ray.cluster_resources().get("CPU", 0)
    if need > have:
        raise MiniRunError(f"{replicas} replicas x {options.get('threads') or 1} threads need {need} CPUs; the Ray "
                           f"cluster has {have:g} (fewer --replicas or --threads, or more machines: ray start)")
    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    app = build_app(model, options, replicas, max_queue, model_name or front.path.name, api_key, router, max_body)
    try:
        serve.run(app, name=name, route_prefix="/" if name == APP else f"/{name}")
    except RuntimeError as e:
        why = why_not_started(e, name)
        serve.delete(name)
        raise MiniRunError(f"the replicas did not start: {why}") from None
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def stop(joined: bool) -> None:
    """Take the app down: on a cluster that was joined, only this app; else Serve and Ray too."""
    ray, serve = import_ray()
    if not ray.is_initialized():
        return
    if joined:
        serve.delete(APP)
    else:
        serve.shutdown()
        ray.shutdown()


def run(model, options: dict, replicas: int, address: str | None = None, **kw) -> None:
    """Start (start()), then serve until SIGINT or SIGTERM, then stop."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        url = start(model, options, replicas, address=address, **kw)
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        print(f"minirun serve: {replicas} replicas on {where}, router {kw.get('router', 'document')}, on "
              f"{url}/v1 (Ctrl-C stops)", file=sys.stderr)
        done.wait()
    finally:
        stop(joined=address is not None)
    print("minirun serve: stopped", file=sys.stderr)
