"""What the scheduler's stages work on: each part owned by one object, the stages given this rather
than the Scheduler (so no stage imports the scheduler that calls it)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.beam_search.batch import BeamBatch
from engine.config import EngineConfig
from engine.grammar.stage import Grammars
from engine.memory import ReqToTokenPool
from engine.memory.manager import KVManager
from engine.sampling.processors import ProcessorSet
from engine.scheduler.batch import RunningBatch
from engine.scheduler.outbox import Outbox
from engine.scheduler.plan import SchedulePlan
from engine.scheduler.waiting import WaitingQueue
from engine.taps.registry import TapRegistry

if TYPE_CHECKING:
    from engine.scheduler.model_runner import ModelRunner


@dataclass
class SchedulerState:
    config: EngineConfig
    device: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    context_len: int
    max_total_tokens: int
    req_to_token: ReqToTokenPool  # request slots and each one's row of pool locations
    kv: KVManager  # the pool, the prefix cache, what each request holds
    waiting: WaitingQueue  # arrivals and retracted requests, in queue order
    running: RunningBatch  # the decoding requests and their per-row tensors
    beams: BeamBatch  # live beam searches
    grammars: Grammars  # structured output: compiles and matchers
    plan: SchedulePlan  # chunked prefill, the admission estimate, this turn's admissions
    outbox: Outbox  # messages to the detokenizer
    taps: TapRegistry  # the plugins' layer taps and steering vectors
    processors: ProcessorSet = field(default_factory=ProcessorSet)
    counters: collections.Counter = field(default_factory=collections.Counter)
    busy_seconds: collections.Counter = field(default_factory=collections.Counter)  # per stage

    @classmethod
    def build(
        cls, config: EngineConfig, runner: ModelRunner, model_dir: str, outbox: Outbox
    ) -> SchedulerState:
        """Empty owners for the runner's model, pool and request slots."""
        mc, device, slots = runner.model_config, runner.device, runner.req_to_token
        return cls(
            config=config,
            device=device,
            vocab_size=mc.vocab_size,
            eos_ids=mc.eos_token_ids,
            context_len=runner.context_len,
            max_total_tokens=runner.max_total_tokens,
            req_to_token=slots,
            kv=KVManager(runner.kv_pool, slots, config.enable_prefix_cache, device),
            waiting=WaitingQueue(),
            running=RunningBatch.empty(mc.vocab_size, device),
            beams=BeamBatch(mc.vocab_size, device, slots.table),
            grammars=Grammars(model_dir, mc.vocab_size, list(mc.eos_token_ids)),
            plan=SchedulePlan(config.init_new_token_ratio),
            outbox=outbox,
            taps=TapRegistry(mc.num_layers, mc.hidden_size, device, runner.dtype, runner.model),
        )

    def idle(self) -> bool:
        return not (self.waiting or len(self.running) or self.plan.chunked or self.beams)

    def live_rids(self) -> dict[str, int]:
        """rid -> seq of every request the scheduler holds, wherever it is."""
        live = {r.rid: r.seq for r in self.waiting}
        live.update((r.rid, r.seq) for r in self.running.reqs)
        live.update((g.req.rid, g.req.seq) for g in self.beams.groups)
        if self.plan.chunked is not None:
            live[self.plan.chunked.rid] = self.plan.chunked.seq
        return live
