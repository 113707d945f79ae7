"""noop: every hook implemented, doing nothing. A template for plugin authors, and what the
benchmark loads to measure the cost of the hook call sites themselves."""

from __future__ import annotations

from engine.hooks import hookimpl


@hookimpl
def engine_process_start(role, pid):
    return None


@hookimpl
def engine_process_ready(role, pid, info):
    return None


@hookimpl
def engine_process_stop(role, pid):
    return None


@hookimpl
def engine_tokenize_before(request):
    return None


@hookimpl
def engine_tokenize_after(request):
    return None


@hookimpl
def engine_schedule(waiting, running):
    return None


@hookimpl
def engine_request_arrived(req):
    return None


@hookimpl
def engine_request_admitted(req, cached_tokens):
    return None


@hookimpl
def engine_request_finished(req, finish_reason):
    return None


@hookimpl
def engine_forward_before(batch, rids):
    return None


@hookimpl
def engine_forward_after(batch, rids, logits):
    return None


@hookimpl
def engine_process_logits(logits, rids, reqs):
    return None


@hookimpl
def engine_sample_after(rids, next_ids, logprobs):
    return None


@hookimpl
def engine_beam_step(rid, step, parents, tokens, scores, finished):
    return None


@hookimpl
def engine_detokenize(rids, token_ids, finished):
    return None


@hookimpl
def engine_detokenize_after(rids, texts):
    return None


@hookimpl
def engine_output(result, seq):
    return None


@hookimpl
def engine_request_submitted(rid, request, sampling, trace_context, seq):
    return None


@hookimpl
def engine_request_done(rid, meta_info, error, seq):
    return None


@hookimpl
def engine_step_end(step):
    return None


@hookimpl
def engine_detokenize_output(output):
    return None


@hookimpl
def engine_stats(role):
    return None


@hookimpl
def engine_shutdown_report(stats):
    return None


@hookimpl
def engine_logit_processors():
    return None


@hookimpl
def engine_layer_taps(num_layers):
    return None


@hookimpl
def engine_steering_vectors():
    return None


@hookimpl
def engine_grammar_backend(tokenizer, vocab_size, stop_ids):
    return None
