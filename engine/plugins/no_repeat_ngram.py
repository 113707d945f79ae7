"""no_repeat_ngram: the worked example of a plugin that provides a custom logit processor.

The plugin's one hook, engine_logit_processors, runs when the plugin loads, in every process: the
user process learns the name (so requests can be validated) and the scheduler the class (so it can
run it). A request then selects it by name:

    ENGINE_PLUGINS=no_repeat_ngram python run.py
    engine.generate(prompt, {"custom_logit_processor": "no_repeat_ngram", "custom_params": {"n": 3}})

The processor bans any token that would complete an n-gram already present in the request's
prompt-free output (transformers' no_repeat_ngram_size, applied to generated tokens).
"""

from __future__ import annotations

from engine.hooks import hookimpl
from engine.sampling.processors import CustomLogitProcessor, ProcessorBatch


class NoRepeatNGram(CustomLogitProcessor):
    def validate_params(self, params: dict, vocab_size: int) -> None:
        n = params.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
            raise ValueError(f"custom_params['n'] must be an integer in [1, 16], got {n!r}")

    def __call__(self, logits, batch: ProcessorBatch):
        for row, (params, out) in enumerate(zip(batch.params, batch.output_ids)):
            n = params["n"]
            if len(out) < n - 1:
                continue
            prefix = tuple(out[len(out) - n + 1 :]) if n > 1 else ()
            banned = {
                out[i + n - 1]
                for i in range(len(out) - n + 1)
                if tuple(out[i : i + n - 1]) == prefix
            }
            if banned:
                logits[row, sorted(banned)] = float("-inf")
        return logits


@hookimpl
def engine_logit_processors() -> dict:
    return {"no_repeat_ngram": NoRepeatNGram}
