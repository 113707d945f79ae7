"""Built-in plugins, registered under the entry-point group `engine.plugins` (pyproject.toml):

skipdetok        the detokenizer skips decoding: callers get output_ids and empty text
stagetimer       time per stage in each process, summed, at shutdown and in get_stats()
no_repeat_ngram  registers a custom logit processor through a hook (the worked example)
noop             every hook implemented, doing nothing (a template, and the cost benchmark)
"""
