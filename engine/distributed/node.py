"""python -m engine.distributed.node: one machine's tensor-parallel ranks for an engine whose rank 0
(with the tokenizer manager and the detokenizer) runs on another machine, the first of `--nnodes`.

    python -m engine.distributed.node --tp 4 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000

Every other setting comes from rank 0 at the rendezvous. Exits when a rank dies (status 1, the
others stopped) or on SIGTERM or Ctrl-C (status 0).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing.connection
import os
import signal
import sys

from engine.config import EngineConfig
from engine.model.resolve import resolve_model_dir
from engine.processes.launch import stop_children, wait_ready
from engine.scheduler.ranks import spawn_ranks

logger = logging.getLogger("engine.distributed.node")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.distributed.node", description=__doc__)
    p.add_argument("--tp-size", "--tp", type=int, required=True, help="ranks in all")
    p.add_argument("--nnodes", type=int, required=True, help="machines the ranks span")
    p.add_argument("--node-rank", type=int, required=True, help="this machine's place (> 0)")
    p.add_argument("--dist-init-addr", required=True, help="rank 0's host:port")
    p.add_argument("--model-path", default=None, help="the model here (default: the embedded one)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    config = EngineConfig.from_kwargs(
        tp_size=args.tp_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        model_path=args.model_path,
    )
    if config.node_rank == 0:
        print("node rank 0 is the engine itself (Engine or engine serve)", file=sys.stderr)
        return 2
    model_dir = resolve_model_dir(config.model_path, None)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    children = spawn_ranks(config, model_dir, {}, os.getpid(), {})
    try:
        wait_ready(children, config.startup_timeout)
        logger.info("ranks %s ready", ", ".join(str(c.pid) for c in children))
        done = multiprocessing.connection.wait([c.process.sentinel for c in children])
        gone = [c.role for c in children if c.process.sentinel in done]
        logger.error("%s exited: this machine's ranks stop", ", ".join(gone))
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_children(children)


if __name__ == "__main__":
    sys.exit(main())
