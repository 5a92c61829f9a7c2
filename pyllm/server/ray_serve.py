"""The OpenAI routes of app.py served by several replicas behind Ray Serve's HTTP proxy (``pyllm serve --replicas N``).

Each replica is a Ray actor process that loads the model itself and serves create_app's ASGI app; Ray's proxy
spreads the requests over them. On one machine the replicas share the GGUF's pages (it is mapped, not read), so
N replicas cost N KV caches and N sets of threads, not N copies of the weights. Every response names the process
that answered in the ``x-pyllm-replica`` header, so a client (and the tests) can see the load being spread.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass

from ..errors import PyllmError

REPLICA_HEADER = "x-pyllm-replica"


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads and serves: pyllm.load's arguments and create_app's."""

    path: str
    model_name: str
    device: str = "cpu"
    n_ctx: int = 4096
    kv_cache: str = "f16"
    n_threads: int = 1
    kernels: str = "fast"  # the CPU kernels, as pyllm.load's kernels=
    api_key: str | None = None
    max_body: int = 8 * 2**20
    client_timeout: float = 30  # the body's deadline; the head's is the Ray proxy's own
    parallel: int = 1
    plain_template: bool = False
    cors_origins: tuple[str, ...] = ()
    host: str = "127.0.0.1"  # the proxy's address: on loopback, only Host headers naming this machine are answered
    allow_hosts: tuple[str, ...] = ()
    max_request_memory: int | None = None  # bytes, per replica
    lora: tuple[tuple[str, float], ...] = ()  # LoRA adapters (path, scale), as pyllm.load's lora=
    gpu_layers: int | None = None  # layers on the GPU, as pyllm.load's gpu_layers=


def require_ray():
    """ray and ray.serve, or one error naming the extra that provides them."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise PyllmError(f"pyllm serve --replicas needs Ray Serve ({e.name} is missing): "
                         f"pip install \"pyllm[ray]\"") from None
    return ray, serve


def with_replica_header(app, replica: str):
    """``app`` answering every HTTP response with REPLICA_HEADER: ``replica``."""
    value = replica.encode()

    async def replica_app(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), value)]}
            await send(message)

        return await app(scope, receive, send_named)

    return replica_app


def build_replica_app(spec: ReplicaSpec):
    """One replica's ASGI app: the model loaded in this process, served by create_app."""
    import pyllm

    from .app import create_app, prepare_for_requests

    llm = pyllm.load(spec.path, device=spec.device, n_ctx=spec.n_ctx, kv_cache=spec.kv_cache,
                     n_threads=spec.n_threads, kernels=spec.kernels, quiet=True, lora=list(spec.lora),
                     gpu_layers=spec.gpu_layers)
    if spec.plain_template:
        llm.use_fallback_template()
    prepare_for_requests(llm)  # Ray routes to a replica once this returns: not while it compiles
    app = create_app(llm, spec.model_name, api_key=spec.api_key, max_body=spec.max_body, parallel=spec.parallel,
                     cors_origins=tuple(spec.cors_origins), client_timeout=spec.client_timeout, host=spec.host,
                     allow_hosts=tuple(spec.allow_hosts), max_request_memory=spec.max_request_memory)
    return with_replica_header(app, f"{socket.gethostname()}:{os.getpid()}")


def application(spec: ReplicaSpec, replicas: int):
    """The Ray Serve application: ``replicas`` copies of the pyllm app, each reserving ``spec.n_threads`` CPUs."""
    _, serve = require_ray()
    fields = asdict(spec)

    def build():  # a plain function: Ray ships it to each replica and calls it there
        return build_replica_app(ReplicaSpec(**fields))

    ingress = serve.ingress(build)()
    deployment = serve.deployment(ingress, name="pyllm", num_replicas=replicas,
                                  ray_actor_options={"num_cpus": spec.n_threads},
                                  max_ongoing_requests=max(8, 4 * spec.parallel))
    return deployment.bind()


def serve_replicas(spec: ReplicaSpec, replicas: int, host: str, port: int, stop) -> None:
    """Start a local Ray instance, deploy ``replicas`` replicas on ``host:port``, and block until ``stop()`` (an
    Event's wait, or anything that returns when the server should end) returns; then shut Ray down.

    Ctrl-C or SIGTERM at any point, while the replicas are still starting too, ends it the same way: Ray is shut
    down and this returns normally."""
    import logging
    import signal
    import sys
    import threading

    ray, serve = require_ray()
    cpus = max(os.cpu_count() or 1, replicas * spec.n_threads)
    # Serve's controller kills an HTTP proxy that has not started within 5 s, and serve.start then raises
    # ActorDiedError; on a loaded machine (2 busy cores) starting the proxy's process takes longer. 60 s is what
    # serve.start itself waits for it. The controller reads the setting in its own process, which inherits this
    # environment from the Ray instance started below; a value the user set is kept.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    # address="local": a Ray instance of its own, as documented, even where RAY_ADDRESS is set or `ray start`
    # left a cluster address in Ray's shared temp dir; ray.init would otherwise connect there, refuse num_cpus
    # with a traceback, and serve.shutdown would then stop that cluster's Serve applications.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             configure_logging=False, object_store_memory=128 * 2**20)
    # Installed after ray.init, whose core worker replaces the SIGTERM handler with one that aborts the process
    # (exit -6, Ray left running). The proxy answers as soon as one replica runs, so a SIGTERM can come while
    # serve.run still waits for the others: raising here stops that wait as Ctrl-C does.
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
        try:
            serve.run(application(spec, replicas), name="pyllm", route_prefix="/")
        except Exception as e:  # a replica that could not load the model: say why, once
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            raise PyllmError(f"the Ray Serve replicas did not start: {lines[-1] if lines else type(e).__name__}") \
                from None
        print(f"pyllm serve: {spec.model_name} on http://{host}:{port}/v1 ({replicas} Ray Serve replicas, "
              f"{spec.n_threads} threads each, context {spec.n_ctx}, KV {spec.kv_cache})", file=sys.stderr,
              flush=True)
        stop()
    except KeyboardInterrupt:
        pass
    finally:
        if on_main_thread:  # a second signal must not cut the shutdown short and leave Ray's processes behind
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("pyllm serve: stopping the replicas", file=sys.stderr, flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
