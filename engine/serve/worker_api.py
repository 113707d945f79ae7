"""The routes a gateway or an orchestrator asks of a worker: health, what it serves, its load, and
the prefix-cache flush. Named and shaped as SGLang's server answers them, since the SGLang model
gateway (`smg`, docs/scale-out.md) registers, probes and balances workers through exactly these.

At registration the gateway reads `/v1/models` (an `owned_by` it does not know, here "engine"), then
takes a worker that answers `/server_info` and not vLLM's `/version` for an SGLang one; it then reads
`/server_info` and `/model_info` for labels, probes `/health` every interval, polls `/v1/loads`
for the load-aware policies, fans `POST /flush_cache` out to every worker, and proxies its own
`/health_generate`, `/get_server_info` and `/get_model_info` to one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from datetime import datetime, timezone

from fastapi import FastAPI
from starlette.responses import JSONResponse

from engine.serve import errors

log = logging.getLogger("engine.serve")

HEALTH_GENERATE_TIMEOUT = 20.0  # seconds one token may take before /health_generate answers 503


def engine_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("engine")
    except PackageNotFoundError:
        return "unknown"


def server_info(engine, served_model_name: str) -> dict:
    """engine.server_info plus the fields SGLang's /server_info carries that the gateway reads as
    labels (model_path, tp_size, dp_size, version). No `model_id` key: the gateway takes `model` as
    its alias, and both would be a duplicate field to its parser."""
    return {
        **engine.server_info,
        "served_model_name": served_model_name,
        "model_path": getattr(engine, "model_dir", None),
        "tp_size": getattr(engine.config, "tp_size", 1),
        "dp_size": 1,
        "is_embedding": False,
        "version": engine_version(),
        "pids": engine.pids,
    }


def model_info(engine) -> dict:
    """SGLang's /model_info: what the model is, read from its Hugging Face config."""
    model_dir = getattr(engine, "model_dir", None)
    config: dict = {}
    if model_dir:
        try:
            with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = {}
    return {
        "model_path": model_dir,
        "tokenizer_path": model_dir,
        "is_generation": True,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }


def loads(stats: dict) -> dict:
    """SGLang's /v1/loads answer (the gateway's WorkerLoadResponse) from engine.get_stats(). Used
    tokens are the pool's less what is free and what the prefix cache could evict, as SGLang counts
    them: the load a new request would meet."""
    total = int(stats.get("max_total_tokens", 0))
    used = max(
        0, total - int(stats.get("free_tokens", 0)) - int(stats.get("cache_evictable_tokens", 0))
    )
    prompt = int(stats.get("prompt_tokens", 0))
    running, waiting = int(stats.get("running", 0)), int(stats.get("waiting", 0))
    usage = used / total if total else 0.0
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "dp_rank_count": 1,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "num_total_reqs": running + waiting,
                "num_used_tokens": used,
                "max_total_num_tokens": total,
                "token_usage": usage,
                "cache_hit_rate": stats.get("prompt_cache_hit_tokens", 0) / prompt
                if prompt
                else 0.0,
                "utilization": usage,
                "max_running_requests": int(stats.get("max_running_requests", 0)),
            }
        ],
    }


def install(app: FastAPI, engine, served_model_name: str) -> None:
    """Add the worker routes to the server's app."""

    @app.get("/health")
    async def health():
        """200 while the engine's three processes are alive and its receiver runs; a dead scheduler
        or detokenizer gives 503 (and the server then exits 1: engine/serve/cli.py)."""
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return errors.response(503, "the engine is not running")

    @app.get("/health_generate")
    async def health_generate():
        """One token generated end to end: 200 when it came back in time, 503 otherwise. Stronger
        than /health (a hung scheduler fails it), and it costs a step: for slow probes only."""
        if not engine.alive:
            return errors.response(503, "the engine is not running")
        try:
            await asyncio.wait_for(
                engine.async_generate(
                    input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}
                ),
                HEALTH_GENERATE_TIMEOUT,
            )
        except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
            return errors.response(503, f"the engine did not generate: {type(exc).__name__}")
        return JSONResponse({"status": "ok"})

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(engine, served_model_name)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return await asyncio.to_thread(model_info, engine)

    @app.get("/v1/loads")
    async def get_loads():
        """The load the gateway's load-aware policies read (it asks with ?include=...; every
        section this engine has is always sent)."""
        return loads(await asyncio.to_thread(engine.get_stats))

    @app.post("/flush_cache")
    async def flush_cache():
        """Empty the prefix cache (the gateway's POST /flush_cache reaches every worker)."""
        freed = await asyncio.to_thread(engine.flush_cache)
        return {"flushed_tokens": freed}
