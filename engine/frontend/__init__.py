"""The user process's side of the engine: `Engine` (engine.py) and the tokenizer manager that turns
each call into requests for the scheduler and the detokenizer's text back into results.

engine.py: Engine, its child processes and its lifetime.
tokenizer_manager.py: composes the parts below and runs the tokenize stage.
submission.py: a call's checked requests, registered and sent to the scheduler.
layer_checks.py: a call's hidden states, steering and taps, checked.
request_table.py: the running requests by rid, their n > 1 groups, and the lock over them.
scheduler_channel.py: the socket to the scheduler.
receiver.py: the thread that receives text and answers from the detokenizer.
output_dispatch.py: each received output to its request; every request failed when the engine dies.
aborts.py: aborts, now or deferred.
scheduler_queries.py: get_stats and flush_cache, asked of the scheduler.
tokenize_stage.py: a call's prompts, token ids or chat messages to id lists.
request_checks.py: what a call's inputs and the received messages must satisfy.
request_state.py: what is known about one request while it runs, and its result dict.
streaming.py: streaming and asyncio front ends over the tokenizer manager.
"""
