"""Entry point of the spawned detokenizer process. It never imports torch."""

from __future__ import annotations

from engine.processes.child import run_child


def run_detokenizer_process(model_dir: str, endpoints: dict, parent_pid: int, conn) -> None:
    def build(progress):
        from engine.detokenizer.manager import DetokenizerManager

        return DetokenizerManager(model_dir, endpoints)

    run_child("detokenizer", conn, parent_pid, build, endpoints["runtime_dir"])
