"""Engine: the user-facing object. Builds the TokenizerManager here and spawns scheduler and detokenizer."""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import threading
import weakref
from pathlib import Path

from engine import envvars, hooks
from engine.beam_search.api import DEFAULT_BEAM_MAX_NEW_TOKENS, beam_submit_args
from engine.cache_upkeep import hold_lease
from engine.config import EngineConfig
from engine.detokenizer.process import run_detokenizer_process
from engine.errors import EngineDeadError
from engine.frontend.streaming import async_collect, async_stream, stop_submitter, sync_stream
from engine.frontend.tokenizer_manager import TokenizerManager
from engine.hooks.loader import ENV, load_plugins, parse_spec
from engine.ipc.channels import Endpoints
from engine.model.embedded import is_converted
from engine.model.resolve import model_name, resolve_model_dir
from engine.processes.launch import SITECUSTOMIZE_DIR, Child, spawn_child, stop_children, wait_ready
from engine.scheduler.ranks import spawn_schedulers
from engine.tokenizer import PromptTokenizer
from engine.tracing.switch import tracing_enabled

logger = logging.getLogger(__name__)


def _child_env(plugins: str) -> dict[str, str]:
    """With plugins: ENGINE_PLUGINS for the children, and our sitecustomize first on their path."""
    if not plugins:  # none: also when the variable is set but Engine(plugins="") says otherwise
        return {ENV: ""}
    path = os.environ.get("PYTHONPATH", "")
    return {ENV: plugins, "PYTHONPATH": SITECUSTOMIZE_DIR + (os.pathsep + path if path else "")}


def _submit_args(
    prompt,
    sampling_params,
    input_ids,
    messages,
    rid,
    return_logprob,
    top_logprobs_num,
    logprob_start_len,
    trace_context,
    return_hidden_states=None,
    steering=None,
    layer_taps=None,
) -> dict:
    """generate's and async_generate's request arguments, as TokenizerManager.submit takes them."""
    return dict(
        return_hidden_states=return_hidden_states,
        steering=steering,
        layer_taps=layer_taps,
        prompt=prompt,
        sampling_params=sampling_params,
        input_ids=input_ids,
        messages=messages,
        rid=rid,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
        logprob_start_len=logprob_start_len,
        trace_context=trace_context,
    )


def _shutdown_report(tm: TokenizerManager) -> None:
    """A regular shutdown: plugins get the final stats (all processes' figures) while the children
    still answer. Nothing here may stop the shutdown itself, not even a fatal plugin error."""
    if hooks.has("engine_shutdown_report"):
        try:
            hooks.call("engine_shutdown_report", stats=tm.get_stats(timeout=10.0))
        except BaseException as exc:  # noqa: BLE001
            logger.error("engine: %s", exc)


def _user_stop_hook() -> None:
    """The user process's stop hook, last: requests cut short by the shutdown have ended by now (a
    tracing plugin flushes their spans here)."""
    if hooks.has("engine_process_stop"):
        try:
            hooks.call("engine_process_stop", role="user", pid=os.getpid())
        except BaseException as exc:  # noqa: BLE001
            logger.error("engine: %s", exc)


_live: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def live_engines() -> list["Engine"]:
    """The Engines of this process that are serving (for plugins that read their stats: metrics)."""
    return [e for e in list(_live) if e.alive]


class _Resources:
    """Everything that must be released at shutdown, kept apart from Engine so a finalizer can own it."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.endpoints: Endpoints | None = None
        self.tokenizer_manager: TokenizerManager | None = None
        self.lock = threading.Lock()
        self.closed = False
        self.started = False  # every process is ready and serving
        # a fork of this process (os.fork) inherits the finalizer but owns nothing
        self.pid = os.getpid()
        # a converted model's lease, held while this engine runs (engine/cache_upkeep.py)
        self.lease = None

    def kill_children(self, reason: str) -> None:
        """Called by the tokenizer manager when a child died: the rest must not linger."""
        stop_children(self.children, timeout=2.0)
        if self.endpoints is not None:
            self.endpoints.remove()

    def close(self) -> None:
        if os.getpid() != self.pid:
            return
        with self.lock:
            if self.closed:
                return
            self.closed = True
        tm = self.tokenizer_manager
        regular = tm is not None and tm.dead is None and self.started
        if regular:
            _shutdown_report(tm)
        if tm is not None:
            tm.close()
            stop_submitter(tm)
        stop_children(self.children)
        if self.endpoints is not None:
            self.endpoints.remove()
        if self.lease is not None:
            self.lease.close()
        if regular:
            _user_stop_hook()


class _Closer(multiprocessing.util.Finalize):
    """The engine's close: run by shutdown(), at exit as one of multiprocessing's exit finalizers (before
    it SIGTERMs and joins daemonic children, which ignore SIGTERM: the join would wait for good; in the
    main process and in a multiprocessing worker alike, which runs no atexit handler), or when the engine
    is collected. Collected, it runs in a thread of its own: the collector runs in whichever thread
    allocates, maybe one holding the tokenizer manager's lock, which the close takes."""

    def __call__(self, wr=None, **kwargs):
        if wr is not None:  # the weak reference's callback: the collector
            threading.Thread(target=super().__call__, name="engine-close").start()
            return None
        return super().__call__(**kwargs)


class Engine:
    """engine = Engine(); engine.generate("prompt", {"max_new_tokens": 32})["text"]

    Keyword options are the fields of EngineConfig. Scripts that create an Engine must guard their
    top level with `if __name__ == "__main__":` (children are spawned, which re-imports the main module).
    """

    def __init__(self, model_path: str | None = None, **kwargs) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        envvars.check_switches()  # the children read them: a misspelt value stops here, named
        plugins = self.config.plugins if self.config.plugins is not None else envvars.read(ENV)
        if tracing_enabled() and "tracing" not in parse_spec(plugins):
            # ENGINE_TRACING=1: the tracing plugin, everywhere
            plugins = ",".join(parse_spec(plugins) + ["tracing"])
        load_plugins(plugins)  # an unknown name stops here, listing the available plugins
        if hooks.has("engine_process_start"):
            hooks.call("engine_process_start", role="user", pid=os.getpid())
        res = self._resources = _Resources()
        self._finalizer = _Closer(self, res.close, exitpriority=100)
        child_env = _child_env(plugins)
        try:
            announce = print if self.config.show_progress else None
            self.model_dir = resolve_model_dir(self.config.model_path, announce)
            # a newer conversion's upkeep leaves the folder while we run
            if is_converted(Path(self.model_dir)):
                res.lease = hold_lease(Path(self.model_dir))
            res.endpoints = Endpoints.create()
            ends, parent = res.endpoints.to_dict(), os.getpid()
            res.children.extend(  # one scheduler, or a process per tensor-parallel rank
                spawn_schedulers(self.config, self.model_dir, ends, parent, child_env)
            )
            # While the scheduler loads the model: the tokenizer and the sockets (ZeroMQ connects once
            # the other side binds). The detokenizer starts after them so that its start-up does not
            # compete for the CPU with the scheduler's, the longest.
            tokenizer = PromptTokenizer(self.model_dir)
            res.tokenizer_manager = TokenizerManager(tokenizer, res.endpoints)
            res.children.append(
                spawn_child(
                    "detokenizer",
                    run_detokenizer_process,
                    (self.model_dir, ends, parent),
                    child_env,
                )
            )
            if self.config.preload_tokenizer:  # this process would only wait for the scheduler
                tokenizer.hf
            with _LoadProgress(self.config.show_progress) as bar:
                wait_ready(res.children, self.config.startup_timeout, bar.update)
        except BaseException:
            self._finalizer()
            raise
        self.server_info = dict(
            res.children[0].info,
            model=model_name(self.config.model_path),
            max_sequences_per_call=self.config.max_sequences_per_call,
            max_hidden_state_bytes=self.config.max_hidden_state_bytes,
        )
        self._prompt_tokenizer = tokenizer
        sentinels = {c.process.sentinel: c.role for c in res.children}
        res.tokenizer_manager.start(sentinels, self.server_info, on_dead=res.kill_children)
        res.started = True
        _live.add(self)
        if hooks.has("engine_process_ready"):
            try:
                hooks.call(
                    "engine_process_ready",
                    role="user",
                    pid=os.getpid(),
                    info=dict(self.server_info),
                )
            except BaseException:  # the caller gets no engine: none may be left running
                _live.discard(self)
                self._finalizer()
                raise

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        messages=None,
        rid=None,
        progress=False,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        trace_context=None,
        return_hidden_states=None,
        steering=None,
        layer_taps=None,
    ):
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts, in order).

        Exactly one of prompt (str or list of str), input_ids (list of ids or list of lists) or messages
        (a chat: list of {"role", "content"}, or a list of chats) is given. sampling_params is a dict or
        a list of dicts, one per prompt (docs/sampling.md). With n > 1 a list comes back, n results per
        prompt, prompt by prompt. stream=True returns an iterator of chunks instead (docs/api.md).
        return_logprob adds the logprobs of the output tokens to meta_info, top_logprobs_num the most
        likely alternatives, logprob_start_len >= 0 the prompt's from that position on.
        trace_context (a W3C traceparent string or a dict of trace headers) makes the request's spans
        part of the caller's trace when tracing is on (docs/tracing.md).
        return_hidden_states, steering and layer_taps read and steer the model's layers for these
        requests alone (docs/interpretability.md); hidden states come back in
        meta_info["hidden_states"].
        Raises ValueError before anything is queued if any input is bad.
        """
        tm = self._tm()
        submit = _submit_args(
            prompt,
            sampling_params,
            input_ids,
            messages,
            rid,
            return_logprob,
            top_logprobs_num,
            logprob_start_len,
            trace_context,
            return_hidden_states,
            steering,
            layer_taps,
        )
        if stream:
            return sync_stream(tm, submit)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(desc="generating", unit="req", total=0)
            submit["on_finish"] = lambda state: bar.update(1)
        try:
            states, is_batch = tm.submit(**submit)
            if bar is not None:
                bar.total = len(states)
                bar.refresh()
            results = tm.wait(states)
        finally:
            if bar is not None:
                bar.close()
        return results if is_batch else results[0]

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        messages=None,
        rid=None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        trace_context=None,
        return_hidden_states=None,
        steering=None,
        layer_taps=None,
    ):
        """generate() for asyncio: `await engine.async_generate(...)` gives the result(s);
        `async for chunk in await engine.async_generate(..., stream=True)` streams. Cancelling the
        awaiting task aborts the requests."""
        tm = self._tm()
        submit = _submit_args(
            prompt,
            sampling_params,
            input_ids,
            messages,
            rid,
            return_logprob,
            top_logprobs_num,
            logprob_start_len,
            trace_context,
            return_hidden_states,
            steering,
            layer_taps,
        )
        if stream:
            return await async_stream(tm, submit)
        return await async_collect(tm, submit)

    def beam_search(
        self,
        prompt=None,
        beam_width: int = 4,
        max_new_tokens: int = DEFAULT_BEAM_MAX_NEW_TOKENS,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_return_sequences: int = 1,
        input_ids=None,
        messages=None,
        rid=None,
        trace_context=None,
        return_hidden_states=None,
        steering=None,
        layer_taps=None,
        **sampling,
    ):
        """Beam search in the scheduler (docs/beam_search.md): for one prompt a dict, for a batch a list.

        Each result: {"hypotheses": the num_return_sequences best, best first, each {"text",
        "output_ids", "logprob" (cumulative), "score" (logprob / length ** length_penalty),
        "finish_reason"}, "meta_info": {..., "beam_width", "steps"}}. Rules as transformers'
        generate(num_beams=beam_width, early_stopping=..., length_penalty=...). Keyword sampling
        parameters that suit beams (logit_bias, repetition/frequency/presence_penalty,
        min_new_tokens, stop_token_ids, ignore_eos, custom_logit_processor, custom_params, ...) apply
        to every beam; the others (temperature > 0, top_p, n, seed, stop, stream, ...) raise
        ValueError naming them, before anything is queued. return_hidden_states (with "generated"
        or "all", meta_info["hidden_states"]["generated"] holds one tensor per hypothesis), steering
        (every beam) and layer_taps as in generate.
        """
        tm = self._tm()
        submit = beam_submit_args(
            prompt,
            input_ids,
            messages,
            rid,
            trace_context,
            beam_width,
            max_new_tokens,
            length_penalty,
            early_stopping,
            num_return_sequences,
            sampling,
        )
        submit.update(
            return_hidden_states=return_hidden_states, steering=steering, layer_taps=layer_taps
        )
        states, is_batch = tm.submit(**submit)
        results = tm.wait(states)
        return results if is_batch else results[0]

    async def async_beam_search(
        self,
        prompt=None,
        beam_width: int = 4,
        max_new_tokens: int = DEFAULT_BEAM_MAX_NEW_TOKENS,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_return_sequences: int = 1,
        input_ids=None,
        messages=None,
        rid=None,
        trace_context=None,
        return_hidden_states=None,
        steering=None,
        layer_taps=None,
        **sampling,
    ):
        """beam_search() for asyncio; cancelling the awaiting task aborts the searches."""
        tm = self._tm()
        submit = beam_submit_args(
            prompt,
            input_ids,
            messages,
            rid,
            trace_context,
            beam_width,
            max_new_tokens,
            length_penalty,
            early_stopping,
            num_return_sequences,
            sampling,
        )
        submit.update(
            return_hidden_states=return_hidden_states, steering=steering, layer_taps=layer_taps
        )
        return await async_collect(tm, submit)

    def abort(self, rid: str | list[str]) -> None:
        """Stop running or queued requests by id: their memory is freed and they finish with reason abort.
        Ids that are unknown or already finished are ignored."""
        self._tm().abort([rid] if isinstance(rid, str) else list(rid))

    def get_stats(self) -> dict:
        """Scheduler counters: KV pool use (max_total_tokens, free_tokens), slots, queue lengths, totals,
        prefix cache (cache_tokens, cache_hit_tokens, cache_evicted_tokens, ...). docs/memory.md lists them."""
        return self._tm().get_stats()

    def flush_cache(self) -> int:
        """Drop every prefix-cache entry no running request holds. Returns the pool tokens freed."""
        return self._tm().flush_cache()["flushed_tokens"]

    @property
    def alive(self) -> bool:
        """True while the engine serves: not shut down, its receiver running, both children alive."""
        res = self._resources
        tm = res.tokenizer_manager
        return (
            not res.closed
            and res.started
            and tm is not None
            and tm.dead is None
            and all(c.process.is_alive() for c in res.children)
        )

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer of the model. Loaded on first use: the engine itself encodes text
        without it (engine/tokenizer.py), so Engine() does not pay for importing transformers and torch."""
        return self._prompt_tokenizer.hf

    @property
    def pids(self) -> dict[str, int]:
        """Process ids by role: user, scheduler, detokenizer."""
        out = {"user": os.getpid()}
        out.update({c.role: c.pid for c in self._resources.children})
        return out

    @property
    def runtime_dir(self) -> str | None:
        return self._resources.endpoints.runtime_dir if self._resources.endpoints else None

    def shutdown(self) -> None:
        """Stop both children and remove the runtime directory. Safe to call twice."""
        self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _tm(self) -> TokenizerManager:
        tm = self._resources.tokenizer_manager
        if self._resources.closed or tm is None:
            raise EngineDeadError("the engine was shut down")
        if tm.dead is not None:
            raise EngineDeadError(tm.dead)
        return tm


class _LoadProgress:
    """A tqdm bar fed by the scheduler's weight-loading progress messages."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None

    def __enter__(self) -> "_LoadProgress":
        return self

    def update(self, role: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="loading weights", unit="tensor")
        self.bar.n = done
        self.bar.refresh()

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
