"""The user process's side of the engine: `Engine` (engine.py) and the tokenizer manager that turns
each call into requests for the scheduler and the detokenizer's text back into results.

engine.py: Engine, its child processes and its lifetime.
tokenizer_manager.py: requests out to the scheduler, text in from the detokenizer, one state per rid.
tokenize_stage.py: a call's prompts, token ids or chat messages to id lists.
request_checks.py: what a call's inputs and the received messages must satisfy.
request_state.py: what is known about one request while it runs, and its result dict.
streaming.py: streaming and asyncio front ends over the tokenizer manager.
"""
