"""Starting the scheduler processes: one, or this machine's tensor-parallel ranks (docs/tensor-parallel.md)."""

from __future__ import annotations

import os

from engine.config import EngineConfig
from engine.distributed.address import free_loopback_address
from engine.processes.launch import Child, spawn_child
from engine.scheduler.process import run_scheduler_process, run_scheduler_rank


def spawn_schedulers(
    config: EngineConfig, model_dir: str, endpoints: dict, parent_pid: int, env: dict[str, str]
) -> list[Child]:
    """The scheduler, or this machine's ranks, rank 0 (the one with sockets) first. Every rank's role
    is "scheduler" to its hooks; the Child's role names the rank in errors."""
    if config.tp_size == 1:
        args = (config.to_json(), model_dir, endpoints, parent_pid)
        return [spawn_child("scheduler", run_scheduler_process, args, env)]
    if config.node_rank > 0:
        raise ValueError(
            "node_rank > 0: an Engine runs on the machine of rank 0; start the other machines' "
            "ranks with `python -m engine.distributed.node` (docs/tensor-parallel.md)"
        )
    return spawn_ranks(config, model_dir, endpoints, parent_pid, env)


def spawn_ranks(
    config: EngineConfig, model_dir: str, endpoints: dict, parent_pid: int, env: dict[str, str]
) -> list[Child]:
    """This machine's tensor-parallel ranks (node_rank's share of tp_size), lowest first."""
    config_json = config.to_json()
    addr = config.dist_init_addr or free_loopback_address()
    per_node = config.tp_size // config.nnodes
    first = config.node_rank * per_node
    children = []
    traced = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    for rank in range(first, first + per_node):
        args = (config_json, model_dir, endpoints, parent_pid, rank, addr)
        # each rank's spans carry its rank (OpenTelemetry's own variable, read by the SDK)
        attrs = ",".join(a for a in (traced, f"engine.tp.rank={rank}") if a)
        child = spawn_child(
            "scheduler", run_scheduler_rank, args, {**env, "OTEL_RESOURCE_ATTRIBUTES": attrs}
        )
        if rank:
            child.role = f"scheduler rank {rank}"
        children.append(child)
    return children
