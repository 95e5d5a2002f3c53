"""``monokernel serve --replicas N``: N copies of the engine behind Ray Serve.

One engine runs one sequence at a time on a kernel backend without slots, a batch with them;
past what one GPU serves, the answer is more engines.
Ray Serve (``pip install 'monokernel[ray]'``) is the distributed engine: its HTTP proxy takes
the requests and routes each to a replica (power of two choices on their open requests), its
controller restarts a replica that dies, and the same cluster may span many machines (a
KubeRay ``RayService``, or ``ray start`` on each node: see the README).

Each replica is the whole single-machine server: ``create_app`` (app.py) over its own ``LLM``,
mounted with ``serve.ingress``, so the routes, streaming, errors, limits, API key, metrics and
request log are the same code; its ``x-monokernel-replica`` header names the replica
(``<ray replica id>@<host>:<pid>``). A replica asks Ray for one GPU when the backend is a GPU
one, else one CPU. Each replica's /metrics counts its own requests (a scrape through the proxy
reaches one replica; Prometheus scrapes replicas directly, or sums what it gets).

The command (the "driver") starts a local Ray instance unless ``--ray-address`` names a
cluster, deploys, prints the address, and on SIGTERM or Ctrl-C deletes the application (and
shuts down the Ray instance it started), then says "server stopped" and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from ..backend_args import backend_options
from ..errors import MonokernelError

APP_NAME = "monokernel"


class RayExtraMissing(MonokernelError):
    """Ray Serve is not installed."""


def _slots(options: dict) -> int:
    """The sequences a kernel engine runs at once: its slots option (the LLM checks it)."""
    slots = options.get("slots", 1)
    return slots if isinstance(slots, int) and slots >= 1 else 1

def require_ray():
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise RayExtraMissing(f"`monokernel serve --replicas` needs Ray Serve ({e.name} is not "
                              "installed): pip install 'monokernel[ray]'") from None
    return ray, serve


def uses_gpu(backend: str, cluster_gpus: float) -> bool:
    return backend.startswith("cuda") or (backend == "auto" and cluster_gpus > 0)


def deployment(args: argparse.Namespace, options: dict, gpu: bool):
    """The Ray Serve application: ``args.replicas`` copies of create_app(**options)."""
    from ray import serve
    from ray.serve.schema import LoggingConfig

    model, backend, max_seq_len = args.model, args.backend, args.max_seq_len
    engine_options = backend_options(args)
    log_level = args.log_level

    def build_app():
        # runs in each replica's process: load the model there, not in the driver
        import socket

        from ray import serve as ray_serve

        from monokernel.llm import LLM
        from monokernel.serve.app import create_app
        from monokernel.serve.observe import setup_request_log

        setup_request_log(log_level)
        replica_id = ray_serve.get_replica_context().replica_id.unique_id
        llm = LLM(model, backend=backend, max_seq_len=max_seq_len, progress=False,
                  max_num_seqs=options["max_num_seqs"], **engine_options)
        # Ray's proxy honours the client's x-request-id (or makes one), hands it on to the
        # replica and echoes it itself
        return create_app(llm, replica=f"{replica_id}@{socket.gethostname()}:{os.getpid()}",
                          echo_request_id=False, **options)

    resources = {"num_gpus": 1} if gpu else {"num_cpus": 1}
    ingress = serve.ingress(build_app)()
    return serve.deployment(
        ingress, name=APP_NAME, num_replicas=args.replicas,
        # a replica takes as many requests as its own queue holds (+ the running ones: one
        # on a kernel backend without slots, which runs one sequence at a time, else up to
        # its slots): it answers 503 queue_full past that, as one server does
        max_ongoing_requests=args.max_queue + (
            min(args.max_num_seqs, _slots(engine_options)) if gpu else args.max_num_seqs),
        graceful_shutdown_timeout_s=args.drain_timeout,
        ray_actor_options=resources,
        # the request log (observe.py) replaces Ray's access lines
        logging_config=LoggingConfig(log_level=args.log_level.upper(),
                                     enable_access_log=False),
    ).bind()


def serve_replicas(args: argparse.Namespace, options: dict) -> int:
    """Deploy, wait for SIGTERM or SIGINT, take it all down. ``args``: the serve command's
    flags; ``options``: create_app's keyword arguments."""
    local = args.ray_address is None
    if local:
        # A local instance is one node: Ray's single-node mode keeps every Ray process on
        # 127.0.0.1 (otherwise its agents bind to the machine's address and its processes talk
        # through it). The switch is read when ray is imported, so it is set before; its name
        # comes from the platforms where that mode is Ray's default.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray, serve = require_ray()
    if args.model is not None and not Path(args.model).exists():
        raise MonokernelError(f"--model {args.model}: no such file or folder")
    if local:
        # every replica of a CPU backend asks for one CPU: a small machine still runs N
        ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas), include_dashboard=False,
                 log_to_driver=True)
    else:
        ray.init(address=args.ray_address, log_to_driver=True)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT,
                                                                        signal.SIGTERM)}
    try:
        gpu = uses_gpu(args.backend, ray.cluster_resources().get("GPU", 0))
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(deployment(args, options, gpu), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica's constructor failed (Ray logged its error)
            raise MonokernelError(f"the replicas did not start: {e} (the replica's own error "
                                  "is in Ray's log lines above)") from None
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"monokernel: serving {args.replicas} replica{'s' if args.replicas > 1 else ''} "
              f"({args.backend}{', 1 GPU each' if gpu else ''}) on Ray Serve at "
              f"http://{host}:{args.port}/v1", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        print("monokernel: stopping the replicas", file=sys.stderr, flush=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    print("monokernel: server stopped", file=sys.stderr, flush=True)
    return 0
