"""Entry point of the spawned scheduler process."""

from __future__ import annotations

import gc

from engine.processes.child import run_child


def run_scheduler_process(
    config_json: bytes, model_dir: str, endpoints: dict, parent_pid: int, conn
) -> None:
    def build(progress):
        from engine.config import EngineConfig
        from engine.scheduler.scheduler import Scheduler

        # torch's import leaves many objects that live as long as the process: frozen, the full
        # collections that building the model's modules sets off skip them
        gc.freeze()
        return Scheduler(EngineConfig.from_json(config_json), model_dir, endpoints, progress)

    run_child("scheduler", conn, parent_pid, build, endpoints["runtime_dir"])
