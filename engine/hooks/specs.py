"""The hook specifications: the contract between the engine and its plugins.

Every hook says the process it runs in, when and how often it is called, its arguments, and what an
implementation may change. Arguments are passed by keyword; an implementation may accept any subset
of them (pluggy's rule). Requests are seen as `Req` objects in the scheduler (engine/scheduler/request.py:
rid, input_ids, output_ids, sampling, ...); treat them as read-only unless the hook says otherwise.

A hook that raises (anything: SystemExit too; only KeyboardInterrupt in the user process's main thread passes)
fails only the requests it was called for (the error names the plugin and the hook); with
ENGINE_PLUGIN_ERRORS=raise, it stops the process instead (for development).

Hooks marked `firstresult` stop at the first non-None result (pluggy's rule); the others return
every implementation's non-None result. Wrappers (`@hookimpl(wrapper=True)`, or the older
`hookwrapper=True`) run around the plain implementations of any hook but the per-plugin services
`engine_stats` and `engine_logit_processors` (docs/plugins.md, "Wrappers").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # for the reader and type checkers only: importing them here would load torch
    import torch

    from engine.hooks.types import PromptRequest, StepRecord
    from engine.ipc.messages import BatchTextOut
    from engine.sampling_params import SamplingParams
    from engine.scheduler.request import Req
    from engine.model.forward_batch import ForwardBatch

hookspec = pluggy.HookspecMarker("engine")


class EngineSpecs:
    # ------------------------------------------------------------------ process lifecycle (every process)

    @hookspec
    def engine_process_start(self, role: str, pid: int) -> None:
        """A process of the engine starts. Runs in every process ("user", "scheduler", "detokenizer"):
        a child once, before it builds anything; the user process, which may hold several engines,
        once per Engine, when it is created (guard what must happen once per process). Changes
        nothing."""

    @hookspec
    def engine_process_ready(self, role: str, pid: int, info: dict) -> None:
        """The process is built and about to serve: a child once; the user process once per Engine,
        when that engine serves. `info` (the scheduler's: pool size, dtype, ...; in the user process
        that engine's server_info, with "model") is read-only."""

    @hookspec
    def engine_process_stop(self, role: str, pid: int) -> None:
        """The process is about to stop on a regular shutdown (not after a crash or SIGKILL): a child
        once; the user process once per Engine, when that engine shuts down, last (after its
        children stopped and every request ended). In a child it runs in the thread that watches the
        parent, while the serving thread may still be in another hook: lock what both touch."""

    # ------------------------------------------------------------------ tokenize (user process)

    @hookspec
    def engine_tokenize_before(self, request: PromptRequest) -> None:
        """Before a prompt is tokenized. User process, once per prompt of a generate call.
        `request` (engine.hooks.types.PromptRequest): index, prompt (str or None), messages (a chat or
        None), input_ids (given ids or None). May rewrite prompt, messages or input_ids."""

    @hookspec
    def engine_tokenize_after(self, request: PromptRequest) -> None:
        """After tokenization, before validation. User process, once per prompt. May rewrite
        request.input_ids (the ids that will be sent)."""

    @hookspec
    def engine_request_submitted(
        self,
        rid: str,
        request: PromptRequest,
        sampling: SamplingParams,
        trace_context: dict[str, str],
        seq: int,
    ) -> None:
        """A request is about to be sent to the scheduler. User process, in the caller's thread (an
        async call's: the engine's submit thread, in the caller's contextvars), once per request
        (n > 1: once per copy, one after another), after every request of the call was validated. `request` is its
        PromptRequest (with tokenize_start_ns/tokenize_end_ns), `sampling` its SamplingParams.
        `trace_context` is the dict of W3C trace headers (strings) that travels with the request to the
        scheduler and detokenizer, holding what the caller passed; a plugin may replace its entries
        (the tracing plugin puts its root span there). If it raises, nothing of the call is sent.
        `seq`: the request's submission number, unique in this process: with it a plugin tells apart
        two requests given one rid by two engines in one process (engine_request_done gets it too)."""

    @hookspec
    def engine_request_done(
        self, rid: str, meta_info: dict[str, Any], error: str | None, seq: int
    ) -> None:
        """A request ended in the user process: its last output arrived (any finish reason, streams
        and aborts included; `meta_info` as in the result), or the engine stopped first, or its call
        failed after engine_request_submitted saw it and nothing was sent (`error` says why;
        meta_info holds what was known). Once per request engine_request_submitted saw: in the
        receiver thread, before the caller wakes (the failing or shutting-down thread otherwise).
        Changes nothing; errors are logged, not raised."""

    # ------------------------------------------------------------------ schedule (scheduler)

    @hookspec
    def engine_schedule(self, waiting: list[Req], running: int) -> None:
        """Before the scheduler picks requests for a prefill step, in the order it will try them.
        Scheduler, each time it plans a prefill while requests wait, the step has budget left and one
        of them could be admitted (a free slot, a pool the running requests do not reserve whole):
        about once per step, not while nothing can start. `waiting` is a list of Req the
        hook may reorder or remove items from (a removed request is held back this time, not
        dropped; adding or duplicating requests is an error); `running` is the number of decoding
        requests."""

    @hookspec
    def engine_request_arrived(self, req: Req) -> None:
        """A request reached the scheduler and joins the waiting queue (it passed the arrival
        checks). Scheduler, once per request, as it is read from the socket; every request later
        seen by engine_request_finished was seen here first. Changes nothing; if it raises, that
        request fails alone, before it waits."""

    @hookspec
    def engine_request_admitted(self, req: Req, cached_tokens: int) -> None:
        """A request got memory and a slot and will be prefilled. Scheduler, once per admission (again
        after a retraction). Changes nothing."""

    @hookspec
    def engine_request_finished(self, req: Req, finish_reason: dict[str, Any]) -> None:
        """A request finished (stop, length or abort) in the scheduler. Once per request. Changes
        nothing; an error here is reported but cannot fail the request any more. `req` carries its
        wall-clock times (arrived_ns: sent by the user process, received_ns, admitted_ns,
        first_token_ns; 0 where it never got there),
        admissions (more than one: retracted) and trace_context."""

    # ------------------------------------------------------------------ forward (scheduler)

    @hookspec
    def engine_forward_before(self, batch: ForwardBatch, rids: list[str]) -> None:
        """Before the model's forward pass. Scheduler, once per step. `batch` is the ForwardBatch
        (engine/model/forward_batch.py: mode, input_ids, positions, ...); `rids` the requests in the step.
        Read-only."""

    @hookspec
    def engine_forward_after(
        self, batch: ForwardBatch, rids: list[str], logits: torch.Tensor
    ) -> None:
        """After the forward pass. Scheduler, once per step. `logits` [rows, vocab] float32, in this
        order: one row per ordinary request that samples this step; then the beam searches' rows (a
        prefill: one per search whose prompt completes; a decode: one per live beam); then, in a
        prefill, the rows for prompt logprobs. `rids`: a prefill's are every request in the step,
        once each (a prompt chunk that samples nothing yet has no row); a decode's follow the rows,
        so a beam search's rid comes once per live beam. Read-only (change logits in
        engine_process_logits)."""

    # ------------------------------------------------------------------ sample (scheduler)

    @hookspec
    def engine_process_logits(
        self, logits: torch.Tensor, rids: list[str], reqs: list[Req], beams: list[int | None]
    ) -> None:
        """The batched logits before sampling, one row per request (`rids`, `reqs` in row order).
        Scheduler, once per step that samples. May change `logits` in place: the place for logit
        processors that need the whole batch. Runs after the engine's own processing (bias,
        penalties, custom processors) and before greedy/temperature sampling or beam selection.
        Beam searches' rows come last: one row per live beam (its rid and Req repeated, `beams[i]`
        its beam index 0..K-1; None for an ordinary request's row). Their values are processed
        log-probabilities, not logits: beam selection ranks beams by cumulative log-probability, as
        transformers does (docs/beam_search.md)."""

    @hookspec
    def engine_beam_step(
        self,
        rid: str,
        step: int,
        parents: list[int],
        tokens: list[int],
        scores: list[float],
        finished: int,
    ) -> None:
        """A beam search chose its next beams. Scheduler, once per search per selection (the first
        from the prompt's logits, then one per decode step). Live beam i continues beam `parents[i]`
        of the previous step (all 0 at the first) with token `tokens[i]`; `scores[i]` is its
        cumulative log-probability; `step` counts the tokens each beam now has; `finished` is how
        many finished hypotheses the search holds. Read-only. If it raises, that search fails alone."""

    @hookspec
    def engine_sample_after(
        self, rids: list[str], next_ids: torch.Tensor, logprobs: torch.Tensor | None
    ) -> None:
        """After sampling. Scheduler, once per step that samples. `next_ids` [rows] int64; `logprobs`
        [rows] float32 under the model's distribution, or None when no request asked for them.
        Read-only."""

    @hookspec
    def engine_step_end(self, step: StepRecord) -> None:
        """A step ran (or failed). Scheduler, once per step, after its output was sent. `step` is an
        engine.hooks.types.StepRecord: mode, the requests served, tokens computed, and the wall-clock
        start of each stage (schedule, forward, sample, process results) and end. Read-only. Its
        requests carry arrived_ns / admitted_ns / first_token_ns and their trace_context."""

    # ------------------------------------------------------------------ detokenize (detokenizer)

    @hookspec(firstresult=True)
    def engine_detokenize(
        self, rids: list[str], token_ids: list[int], finished: list[bool]
    ) -> list[str] | None:
        """Replace the decoding of one batch of outputs. Detokenizer, once per scheduler step.
        `token_ids[i]` is request i's new token (-1: none). Return one text delta per request to use
        instead of the engine's incremental decoder, or None to decode as usual. firstresult: stops at
        the first non-None result (a wrapper sees that one result, or None). Stop strings are still
        matched on what is returned."""

    @hookspec
    def engine_detokenize_after(self, rids: list[str], texts: list[str]) -> None:
        """After decoding one batch. Detokenizer, once per scheduler step. May change `texts` (a list of
        text deltas, one per request) in place."""

    @hookspec
    def engine_detokenize_output(self, output: BatchTextOut) -> None:
        """One batch's text, as it leaves for the user process (stop strings applied: `finished` is
        final). Detokenizer, once per scheduler step. `output` is the BatchTextOut (rids,
        text_deltas, token_ids, finished, meta, headers: a request's first output carries its
        RequestHeader, with its trace_context). Read-only."""

    # ------------------------------------------------------------------ output (user process)

    @hookspec
    def engine_output(self, result: dict[str, Any], seq: int) -> None:
        """A finished result in the user process, before generate returns it (not for stream chunks).
        Once per request. May change the dict in place. If it raises, that result comes back with
        finish_reason abort and the error; the call's other results are untouched. `seq`: the
        request's submission number, as engine_request_submitted and engine_request_done gave it (two
        engines in one process may both run a caller-given rid)."""

    # ------------------------------------------------------------------ plugin services

    @hookspec
    def engine_logit_processors(self) -> dict[str, type] | None:
        """Custom logit processors this plugin provides: {name: CustomLogitProcessor subclass}.
        Called once per engine process (user, scheduler, detokenizer) when the plugin is loaded,
        with current_role() already right; per plugin, so it cannot be wrapped. A package that
        only provides processors can use the entry-point group `engine.logit_processors` instead,
        which needs no ENGINE_PLUGINS (docs/plugins.md)."""

    @hookspec(firstresult=True)
    def engine_grammar_backend(
        self, tokenizer: Any, vocab_size: int, stop_ids: list[int]
    ) -> Any | None:
        """Provide the grammar backend for structured output (json_schema, regex, ebnf) instead of
        the built-in xgrammar one. Scheduler, once, when the first constrained request arrives (in
        the compile worker thread); if it raises it is not called again, and its error fails every
        constrained request. Return an object with compile(kind, text), matcher(compiled),
        new_bitmask(rows), fill_masks(matchers, bitmask, rows) and apply_masks(logits, bitmask,
        rows), whose matchers have accept_token, is_terminated and fork
        (engine/grammar/backend.py), or None to leave it to the next plugin / xgrammar.
        firstresult: stops at the first non-None result."""

    @hookspec
    def engine_layer_taps(self, num_layers: int) -> list[Any] | None:
        """The layer taps this plugin provides on a model of `num_layers` decoder layers: a list of
        engine.taps.LayerTap (name, layers, points, fn, writes, every_request). Called in every
        process (the user process checks the names requests give in layer_taps); the scheduler
        calls each tap's `fn` with a TapRows during the forward pass, once per step per (layer,
        point), for the requests that asked (docs/interpretability.md). A tap's error fails only
        its rows' requests. Per plugin, so it cannot be wrapped."""

    @hookspec
    def engine_steering_vectors(self) -> dict[str, Any] | None:
        """Named steering vectors this plugin provides: {name: vector of hidden_size floats (a list
        or a 1-D tensor)}; requests name them in steering[i].vector. Called in every process when a
        request names one. Per plugin, so it cannot be wrapped."""

    @hookspec
    def engine_stats(self, role: str) -> dict[str, Any] | None:
        """Figures for engine.get_stats()["plugins"][role][plugin name]. Called in every process
        whenever stats are asked for; per plugin (keyed by its name), so it cannot be wrapped. If
        it raises, {"error": message} stands in its place; the other plugins' figures stay."""

    @hookspec
    def engine_shutdown_report(self, stats: dict[str, Any]) -> None:
        """User process, once, when the engine shuts down regularly, with the final get_stats()
        (children's plugin figures included)."""
