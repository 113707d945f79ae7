"""Entry points of the spawned scheduler processes: the one scheduler, or one tensor-parallel rank."""

from __future__ import annotations

import gc

import msgspec

from engine.processes.child import run_child


def run_scheduler_process(
    config_json: bytes, model_dir: str, endpoints: dict, parent_pid: int, conn
) -> None:
    run_scheduler_rank(config_json, model_dir, endpoints, parent_pid, 0, None, conn)


def run_scheduler_rank(
    config_json: bytes,
    model_dir: str,
    endpoints: dict,
    parent_pid: int,
    rank: int,
    dist_init_addr: str | None,
    conn,
) -> None:
    """Tensor-parallel rank `rank` of the ranks meeting at dist_init_addr (rank 0 alone has sockets)."""

    def build(progress):
        from engine.config import EngineConfig
        from engine.scheduler.scheduler import Scheduler

        # torch's import leaves many objects that live as long as the process: frozen, the full
        # collections that building the model's modules sets off skip them
        gc.freeze()
        config = EngineConfig.from_json(config_json)
        return Scheduler(config, model_dir, endpoints, progress, rank, dist_init_addr)

    # rank 0 is engine::scheduler, the others engine::tp-rank<N>: `engine profile` tells them apart;
    # rank 0 says how many ranks this machine runs, so discovery waits for all of them
    fields = msgspec.json.decode(config_json)
    per_node = fields["tp_size"] // fields["nnodes"]
    title = f"engine::tp-rank{rank}" if rank else None
    if not rank and per_node > 1:
        title = f"engine::scheduler ranks={per_node}"
    run_child("scheduler", conn, parent_pid, build, endpoints.get("runtime_dir"), title)
