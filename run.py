"""The main job: start the engine on the embedded SmolLM2-135M-Instruct and show some generations."""

from __future__ import annotations

import time

from engine import Engine

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about autumn leaves.",
    "Explain what a CPU cache is in two sentences.",
    "What is 17 multiplied by 3?",
    "Suggest a name for a friendly robot.",
]


def main() -> None:
    with Engine(show_progress=True) as engine:
        info = engine.server_info
        print(
            f"engine ready: {info['architecture']} {info['dtype']} on {info['device']}, "
            f"KV pool {info['max_total_tokens']} tokens, pids {engine.pids}\n"
        )

        # The seed example: one chat turn, greedy (an instruct model answers chats; a bare question it may end at once).
        out = engine.generate(
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            sampling_params={"max_new_tokens": 64, "temperature": 0},
        )
        print(f"[chat] What is the capital of France?\n{out['text']!r}\n{out['meta_info']}\n")

        # A plain prompt is continued as text, here sampled.
        prompt = "The three primary colors are"
        out = engine.generate(
            prompt, sampling_params={"max_new_tokens": 32, "temperature": 0.7, "seed": 0}
        )
        print(f"[prompt] {prompt}{out['text']}\n")

        # A batch of chat requests, continuously batched, with a progress bar.
        chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
        start = time.perf_counter()
        outs = engine.generate(
            messages=chats, sampling_params={"max_new_tokens": 96, "temperature": 0}, progress=True
        )
        wall = time.perf_counter() - start
        for question, o in zip(QUESTIONS, outs):
            print(
                f"\n[chat] {question}\n{o['text'].strip()}\n  ({o['meta_info']['completion_tokens']} tokens, "
                f"finish {o['meta_info']['finish_reason']})"
            )
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        print(f"\n{len(outs)} chats, {tokens} tokens in {wall:.2f}s ({tokens / wall:.1f} tokens/s)")


if __name__ == "__main__":
    main()
