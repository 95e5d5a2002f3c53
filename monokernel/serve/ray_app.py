"""The replicas as a Ray Serve application builder, for a Serve config file or a KubeRay
``RayService`` (``import_path: monokernel.serve.ray_app:build``): ``args`` are the flags of
``monokernel serve``, by their long names with underscores, e.g.

    args: {replicas: 4, backend: cuda, max_queue: 64, default_max_tokens: 256}

The API key comes from ``MONOKERNEL_API_KEY`` on the cluster (never put it in a manifest).
"""

from __future__ import annotations

from typing import Any

from ..errors import MonokernelError


def build(args: dict[str, Any]):
    """A Ray Serve Application of ``args["replicas"]`` replicas (default 1)."""
    import ray

    from ..cli import build_parser
    from .cli import app_options, check_serve_args
    from .replicas import deployment, require_ray, uses_gpu

    require_ray()
    flags = dict(args or {})
    flags.setdefault("replicas", 1)
    ns = build_parser().parse_args(["serve"])
    unknown = sorted(set(flags) - set(vars(ns)) - {"func", "cmd"})
    if unknown or "api_key" in flags:
        raise MonokernelError(f"unknown argument(s) of monokernel serve: {unknown}" if unknown
                              else "give the API key through MONOKERNEL_API_KEY, not in args")
    for k, v in flags.items():
        setattr(ns, k, v)
    check_serve_args(ns)
    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    return deployment(ns, app_options(ns), uses_gpu(ns.backend, gpus))
