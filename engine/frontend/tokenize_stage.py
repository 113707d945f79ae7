"""The tokenize stage (user process): a call's prompts, token ids or chat messages to id lists, with the
engine_tokenize_before/after hooks around each prompt. Runs in the caller's thread, before anything is
queued, so every error here is the caller's ValueError."""

from __future__ import annotations

import time

from engine import hooks
from engine.frontend.request_checks import unicode_messages, unicode_text
from engine.hooks.types import PromptRequest


def tokenize_stage(
    tokenizer, model: str, prompt=None, input_ids=None, messages=None
) -> tuple[list[list[int]], bool, list[PromptRequest]]:
    """Returns the id lists, whether the caller passed a batch, and the PromptRequests (timed, for the
    submit hook). `model` is the engine's model name, which each request carries."""
    items, is_batch = prompt_items(prompt, input_ids, messages)
    before, after = hooks.has("engine_tokenize_before"), hooks.has("engine_tokenize_after")
    out = []
    for item in items:
        item.tokenize_start_ns = time.time_ns()
        item.model = model
        if before:
            hooks.call("engine_tokenize_before", request=item)
        if item.input_ids is None:
            if item.prompt is not None:
                item.input_ids = tokenizer.encode(item.prompt)
            else:
                item.input_ids = render_chat(tokenizer, item.messages)
        if after:
            hooks.call("engine_tokenize_after", request=item)
        item.tokenize_end_ns = time.time_ns()
        out.append(list(item.input_ids))
    return out, is_batch, items


def prompt_items(prompt, input_ids, messages) -> tuple[list[PromptRequest], bool]:
    """One PromptRequest per prompt of the call, and whether the call passed a batch."""
    given = [
        name
        for name, v in (("prompt", prompt), ("input_ids", input_ids), ("messages", messages))
        if v is not None
    ]
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of prompt, input_ids or messages (got {given or 'none'})"
        )
    if prompt is not None:
        if isinstance(prompt, str):
            return [PromptRequest(0, prompt=unicode_text(prompt, "prompt"))], False
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [
                PromptRequest(i, prompt=unicode_text(p, f"prompt[{i}]"))
                for i, p in enumerate(prompt)
            ], True
        raise ValueError("prompt must be a string or a non-empty list of strings")
    if input_ids is not None:
        if (
            isinstance(input_ids, list)
            and input_ids
            and all(isinstance(x, list) for x in input_ids)
        ):
            return [PromptRequest(i, input_ids=list(x)) for i, x in enumerate(input_ids)], True
        if isinstance(input_ids, list):
            return [PromptRequest(0, input_ids=list(input_ids))], False
        raise ValueError("input_ids must be a list of token ids or a list of such lists")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return [PromptRequest(0, messages=unicode_messages(messages, "messages"))], False
    if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
        return [
            PromptRequest(i, messages=unicode_messages(m, f"messages[{i}]"))
            for i, m in enumerate(messages)
        ], True
    raise ValueError("messages must be a list of {'role', 'content'} dicts or a list of such lists")


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The model's chat template over the messages, with the generation prompt, as token ids (the text
    transformers' apply_chat_template renders, encoded without adding special tokens again)."""
    for j, m in enumerate(messages):
        # content may be left out (a turn of tool calls)
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(
                f"each chat message needs 'role' (and most need 'content'), got {m!r:.200}"
            )
        if not isinstance(m["role"], str):
            raise ValueError(f"messages[{j}]['role'] must be a string, got {m['role']!r:.100}")
        content = m.get("content")
        if not (
            content is None
            or isinstance(content, str)
            or (isinstance(content, list) and all(isinstance(part, dict) for part in content))
        ):
            raise ValueError(
                f"messages[{j}]['content'] must be a string, a list of parts or None, got {content!r:.100}"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; pass prompt or input_ids instead"
        )
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # many templates refuse some orders or roles (raise_exception)
        raise ValueError(f"messages: the model's chat template refused them: {exc}") from exc
    except (
        TypeError,
        KeyError,
        AttributeError,
    ) as exc:  # a template meeting values it cannot render
        raise ValueError(
            f"messages: the model's chat template cannot render them ({type(exc).__name__}: {exc})"
        ) from exc
    return tokenizer.encode(text, add_special_tokens=False)
