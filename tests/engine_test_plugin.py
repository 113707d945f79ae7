"""A plugin for the tests: records every hook call (with process role and pid) to the file named by
ENGINE_TEST_PROBE, and changes behaviour for marked requests:

- a prompt starting "REWRITE:" is replaced by the text after the colon (tokenize_before);
- requests whose rid starts "hold-" are held back for HOLD_STEPS scheduling turns (engine_schedule);
- requests whose rid starts "ban-" never get token BANNED (engine_process_logits), and those whose
  rid starts "force-" always get it, whatever else (a grammar) allowed;
- a request whose rid starts "boom-" makes engine_request_admitted raise, "exit-" raise SystemExit;
- a request whose rid starts "noarrive-" makes engine_request_arrived raise;
- a prompt containing "EXPLODE" makes engine_tokenize_before raise;
- a batch with a rid starting "badtexts-" gets one text too many from engine_detokenize;
- a result whose rid starts "badoutput-" makes engine_output raise;
- a beam search whose rid starts "boomstep-" makes engine_beam_step raise;
- it provides the custom logit processor "explode_after", which raises once a row has generated
  custom_params["after"] tokens (SystemExit where custom_params["exit"] is true).
"""

from __future__ import annotations

import json
import sys
import os
import time

from engine import hooks
from engine.hooks import hookimpl
from engine.sampling.processors import CustomLogitProcessor

HOLD_STEPS = 3
BANNED = 13
_held: dict[str, int] = {}


def _record(hook: str, **info) -> None:
    path = os.environ.get("ENGINE_TEST_PROBE")
    if path:
        with open(path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "hook": hook,
                        "role": hooks.current_role(),
                        "pid": os.getpid(),
                        "t": time.time(),
                        **info,
                    }
                )
                + "\n"
            )


@hookimpl
def engine_process_start(role, pid):
    _record("engine_process_start", arg_role=role, arg_pid=pid)


@hookimpl
def engine_process_ready(role, pid, info):
    _record("engine_process_ready", arg_role=role, info_keys=sorted(info))


@hookimpl
def engine_process_stop(role, pid):
    _record("engine_process_stop", arg_role=role)


@hookimpl
def engine_tokenize_before(request):
    if request.prompt is not None and "EXPLODE" in request.prompt:
        raise RuntimeError("exploded on purpose")
    if request.prompt is not None and request.prompt.startswith("REWRITE:"):
        request.prompt = request.prompt[len("REWRITE:") :]
    _record("engine_tokenize_before", index=request.index, prompt=request.prompt)


@hookimpl
def engine_tokenize_after(request):
    _record("engine_tokenize_after", index=request.index, n_ids=len(request.input_ids))


@hookimpl
def engine_schedule(waiting, running):
    for req in list(waiting):
        if req.rid.startswith("hold-") and _held.get(req.rid, 0) < HOLD_STEPS:
            _held[req.rid] = _held.get(req.rid, 0) + 1
            waiting.remove(req)
    _record("engine_schedule", rids=[r.rid for r in waiting], running=running)


@hookimpl
def engine_request_arrived(req):
    if req.rid.startswith("noarrive-"):
        raise RuntimeError("arrival refused on purpose")
    _record("engine_request_arrived", rid=req.rid, arrived_ns=req.arrived_ns)


@hookimpl
def engine_request_admitted(req, cached_tokens):
    if req.rid.startswith("boom-"):
        raise ValueError("admission refused on purpose")
    if req.rid.startswith("exit-"):
        raise SystemExit("admission exits on purpose")
    _record("engine_request_admitted", rid=req.rid, cached_tokens=cached_tokens)


@hookimpl
def engine_request_finished(req, finish_reason):
    _record("engine_request_finished", rid=req.rid, finish_reason=finish_reason)


@hookimpl
def engine_forward_before(batch, rids):
    _record(
        "engine_forward_before",
        rids=list(rids),
        mode=batch.mode.value,
        tokens=int(batch.input_ids.numel()),
    )


@hookimpl
def engine_forward_after(batch, rids, logits):
    _record("engine_forward_after", rids=list(rids), logits_shape=list(logits.shape))


@hookimpl
def engine_process_logits(logits, rids, reqs, beams):
    for row, rid in enumerate(rids):
        if rid.startswith("ban-"):
            logits[row, BANNED] = float("-inf")
        elif rid.startswith("force-"):
            logits[row] = float("-inf")
            logits[row, BANNED] = 0.0
    _record(
        "engine_process_logits",
        rids=list(rids),
        shape=list(logits.shape),
        reqs=[r.rid for r in reqs],
        beams=list(beams),
    )


@hookimpl
def engine_beam_step(rid, step, parents, tokens, scores, finished):
    if rid.startswith("boomstep-"):
        raise RuntimeError("beam step refused on purpose")
    _record(
        "engine_beam_step",
        rid=rid,
        step=step,
        parents=parents,
        tokens=tokens,
        scores=scores,
        finished=finished,
    )


class ExplodeAfter(CustomLogitProcessor):
    def validate_params(self, params: dict, vocab_size: int) -> None:
        if not isinstance(params.get("after"), int):
            raise ValueError("custom_params['after'] must be an integer")

    def __call__(self, logits, batch):
        for n, p in zip(batch.out_lens, batch.params):
            if int(n) >= p["after"]:  # custom_params["exit"]: as a plugin's sys.exit() would
                raise (
                    SystemExit("exited on purpose")
                    if p.get("exit")
                    else RuntimeError("exploded on purpose")
                )
        return logits


@hookimpl
def engine_grammar_backend(tokenizer, vocab_size, stop_ids):
    """xgrammar, wrapped so the tests see that the plugin's backend is the one compiling."""
    from engine.grammar.backend import XGrammarBackend

    class Recording(XGrammarBackend):
        name = "recording"

        def compile(self, kind, text):
            _record("grammar_compile", kind=kind)
            return super().compile(kind, text)

    _record("engine_grammar_backend", vocab_size=vocab_size, stop_ids=list(stop_ids))
    return Recording(tokenizer, vocab_size, stop_ids)


@hookimpl
def engine_logit_processors():
    return {"explode_after": ExplodeAfter}


@hookimpl
def engine_sample_after(rids, next_ids, logprobs):
    _record("engine_sample_after", rids=list(rids), next_ids=next_ids.tolist())


@hookimpl
def engine_detokenize(rids, token_ids, finished):
    _record(
        "engine_detokenize", rids=list(rids), token_ids=list(token_ids), finished=list(finished)
    )
    if any(r.startswith("badtexts-") for r in rids):
        return ["x"] * (len(rids) + 1)  # one text too many: the engine must refuse it
    return None


@hookimpl
def engine_detokenize_after(rids, texts):
    _record("engine_detokenize_after", rids=list(rids), texts=list(texts))


@hookimpl
def engine_output(result):
    if result["meta_info"]["id"].startswith("badoutput-"):
        raise KeyError("output refused on purpose")
    result["meta_info"]["seen_by_test_plugin"] = True
    _record("engine_output", rid=result["meta_info"]["id"])


@hookimpl
def engine_request_submitted(rid, request, sampling, trace_context):
    _record(
        "engine_request_submitted",
        rid=rid,
        index=request.index,
        max_new=sampling.max_new_tokens,
        trace_context=dict(trace_context),
        tokenize_ns=[request.tokenize_start_ns, request.tokenize_end_ns],
    )


@hookimpl
def engine_request_done(rid, meta_info, error):
    _record(
        "engine_request_done",
        rid=rid,
        completion_tokens=meta_info["completion_tokens"],
        finish_reason=meta_info["finish_reason"],
        error=error,
    )


@hookimpl
def engine_step_end(step):
    times = [
        step.schedule_start_ns,
        step.forward_start_ns,
        step.sample_start_ns,
        step.results_start_ns,
        step.end_ns,
    ]
    _record(
        "engine_step_end",
        mode=step.mode,
        rids=[r.rid for r in step.reqs],
        tokens=step.tokens,
        times=times,
        error=step.error,
        first_token_ns=[r.first_token_ns for r in step.reqs],
    )


@hookimpl
def engine_detokenize_output(output):
    _record(
        "engine_detokenize_output",
        rids=list(output.rids),
        texts=list(output.text_deltas),
        finished=[None if f is None else f.type for f in output.finished],
    )


plugin = sys.modules[__name__]  # ENGINE_PLUGINS=engine_test_plugin:plugin registers this module
