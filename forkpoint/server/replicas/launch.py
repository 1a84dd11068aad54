"""Starting and stopping a replica cluster: Ray (a local instance, or a cluster joined by
address), Serve, the metrics board and the engine replicas; and `forkpoint serve
--data-parallel-size N`, which puts the OpenAI endpoint in front of them.

    with ReplicaCluster(engine_kwargs, ReplicaOptions(num_replicas=2)) as cluster:
        app = cluster.app(ServerConfig())          # FastAPI app for uvicorn
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any, Self

try:
    import ray
    from ray import serve
except ImportError as err:  # an optional dependency: say how to get it
    raise ImportError("replicas (--data-parallel-size, --ray-address) need Ray Serve: "
                      "pip install 'forkpoint[serve]'") from err
from transformers import PreTrainedTokenizerBase

from forkpoint.cache.sizing import default_host_tier_bytes, physical_memory_bytes
from forkpoint.inputs.hub import resolve_model_dir
from forkpoint.inputs.tokenizer import load_tokenizer
from forkpoint.server.config import ServerConfig
from forkpoint.server.replicas.cluster import ClusterWorker
from forkpoint.server.replicas.deployment import (
    ReplicaBoard,
    ReplicaInfo,
    ReplicaOptions,
    deploy_replicas,
)
from forkpoint.server.replicas.ingress import build_cluster_app

logger = logging.getLogger("forkpoint.distributed")


def host_tier_share(engine_kwargs: dict[str, Any], num_replicas: int, num_gpus: float) -> dict[str, Any]:
    """`engine_kwargs` with each GPU replica's share of the host tier: the default tier of this machine
    (cache/sizing.py: a quarter of its memory) split over the replicas, which would each size the whole
    default for themselves (N quarters of one machine's memory, pinned). A `checkpoint_host_bytes` the
    user gave, and CPU replicas (no host tier by default), are left as they are. Replicas on other
    machines (`--ray-address`) get the share of this one's memory."""
    if engine_kwargs.get("checkpoint_host_bytes") is not None or not num_gpus:
        return engine_kwargs
    tier = default_host_tier_bytes(physical_memory_bytes(), True, int(engine_kwargs.get("tensor_parallel_size") or 1))
    return {**engine_kwargs, "checkpoint_host_bytes": tier // max(num_replicas, 1)}


class ReplicaCluster:
    """The replicas of one Serve application, and what was started for them.

    Ray: joined at `ray_address` when given; else the running Ray of this process if there is one
    (tests start it once per module), else a local instance started here with `ray_init_kwargs`.
    `close()` deletes the application and the board, and shuts down Ray and Serve only when it
    started them. Blocks in the constructor until every replica has loaded its model.
    """

    def __init__(self, engine_kwargs: dict[str, Any], options: ReplicaOptions, *, ray_address: str | None = None,
                 ray_init_kwargs: dict[str, Any] | None = None) -> None:
        device = str(engine_kwargs.get("device", "auto"))
        if device.startswith("cuda:"):
            raise ValueError(f"--device {device}: each replica gets its own GPU from Ray; pass --device cuda or auto")
        self._started_ray = False
        if ray_address is not None or not ray.is_initialized():
            ray.init(address=ray_address, **({} if ray_address else (ray_init_kwargs or {})))
            self._started_ray = ray_address is None
        if options.num_gpus is None:
            options = dataclasses.replace(options, num_gpus=_gpus_per_replica(device))
        self.options = options
        engine_kwargs = host_tier_share(engine_kwargs, options.num_replicas, options.num_gpus)
        self._started_serve = not _serve_running()
        if self._started_serve:
            start_serve()
        self.board = ReplicaBoard.remote()
        try:
            self.handle = deploy_replicas(engine_kwargs, options, self.board)
            self.info: ReplicaInfo = self.handle.info.remote().result()
        except BaseException:
            self.close()
            raise
        tokenizer = engine_kwargs.get("tokenizer")  # a directory or a Hub name, as the replicas resolved it
        self._tokenizer_path = self.info.model_path if tokenizer is None else resolve_model_dir(
            tokenizer, revision=engine_kwargs.get("tokenizer_revision"),
            download_dir=engine_kwargs.get("download_dir"), weights=False, what="tokenizer")

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The engines' tokenizer, with their marker registered under the same id."""
        marker = self.info.checkpoint_token if self.info.checkpoint_token_id is not None else None
        loaded = load_tokenizer(Path(self._tokenizer_path), checkpoint_token=marker)
        if loaded.checkpoint_token_id != self.info.checkpoint_token_id:
            raise ValueError(f"the tokenizer at {self._tokenizer_path} gives the marker id "
                             f"{loaded.checkpoint_token_id}, the replicas {self.info.checkpoint_token_id}: "
                             "they must load the same tokenizer")
        return loaded.tokenizer

    def worker(self, **kwargs: Any) -> ClusterWorker:
        return ClusterWorker(self.handle, self.board, poll_s=self.options.stats_period_s, **kwargs)

    def app(self, config: ServerConfig, **kwargs: Any):
        """The OpenAI-compatible app over these replicas (`kwargs` go to `build_cluster_app`)."""
        return build_cluster_app(self.worker(), self.info, self.tokenizer(), config, **kwargs)

    def close(self) -> None:
        try:
            if serve_app_running(self.options.app_name):
                serve.delete(self.options.app_name)
            ray.kill(self.board)
        finally:
            if self._started_serve and self._started_ray:
                serve.shutdown()
            if self._started_ray:
                ray.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_serve() -> None:
    """Serve without its HTTP proxy (the ingress is forkpoint's own app), quiet logs."""
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING", "enable_access_log": False})


def _serve_running() -> bool:
    try:
        serve.status()
    except Exception:  # no controller yet: Serve raises several kinds
        return False
    return True


def serve_app_running(name: str) -> bool:
    try:
        return name in serve.status().applications
    except Exception:  # Serve is gone: nothing to delete
        return False


def serve_replicas(args: argparse.Namespace, config: ServerConfig, engine_kwargs: dict[str, Any],
                   http: dict[str, Any]) -> int:
    """`forkpoint serve --data-parallel-size N [--ray-address ADDR]`: the replicas, then uvicorn with the
    keyword arguments `http` (server/http_args.py `uvicorn_options`)."""
    import uvicorn

    options = ReplicaOptions(num_replicas=args.data_parallel_size)
    init = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": False}
    with ReplicaCluster(engine_kwargs, options, ray_address=args.ray_address, ray_init_kwargs=init) as cluster:
        logger.info("%d replicas ready (%s)", options.num_replicas, "a GPU each" if cluster.options.num_gpus else "CPU")
        uvicorn.run(cluster.app(config), **http)
    return 0


def _gpus_per_replica(device: str) -> float:
    """One GPU per replica for --device cuda, and for auto when the cluster has GPUs."""
    if device == "cpu":
        return 0
    if device == "cuda":
        return 1
    return 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
