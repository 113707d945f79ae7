"""The request bodies the OpenAI API and SGLang's /generate take, as pydantic models (FastAPI
validates them; a wrong type is a 400 naming the field). Unknown fields are refused rather than
silently ignored, so a client never believes a parameter took effect when it did not; vLLM's and
SGLang's fields that change nothing here are taken, with a warning in the log (IGNORED_FIELDS).

Types are strict: a number is a JSON number (an integer where a float is asked, as JSON does not
tell them apart), never a string or a bool. null in any known field means its default, as OpenAI
types them "X or null" and clients send null for what they leave out."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.serve.errors import OpenAIError

Number = StrictFloat  # an int or a float; "0" and true are refused (pydantic's lax float would take them)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """Drop the known fields sent as null, so they take their defaults; an unknown field stays
        (refused, even as null)."""
        if not isinstance(data, dict):
            return data
        known = {*cls.model_fields, *(f.alias for f in cls.model_fields.values() if f.alias)}
        return {k: v for k, v in data.items() if v is not None or k not in known}


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # OpenAI pads its chunks against side channels; taken, nothing to pad
    include_obfuscation: StrictBool = False
    # vLLM's: every chunk carries its choice's usage so far
    continuous_usage_stats: StrictBool = False


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: one constraint, as the engine's json_schema, regex or ebnf."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: StrictBool | None = None


class HiddenStatesOptions(_Body):
    """return_hidden_states as an object: which layers, tokens and point (the engine checks the values)."""

    layers: list[StrictInt] | StrictInt | None = None
    tokens: str | None = None
    point: str | None = None


class Steering(_Body):
    """One steering entry: scale * vector added to the residual stream after layer."""

    layer: StrictInt
    vector: list[Number] | str  # the model's hidden size of numbers, or a name a plugin registered
    scale: Number | None = None


class _LayerFields(_Body):
    """Per-request hidden states, steering and plugin taps (docs/interpretability.md), as the
    engine's keywords of the same names; every route takes them."""

    return_hidden_states: StrictBool | HiddenStatesOptions | None = None
    steering: list[Steering] | None = None
    layer_taps: list[str] | None = None

    def layer_kwargs(self) -> dict[str, Any]:
        """The engine's keywords for the fields given, as sent (nulls left out); none when none
        asks for anything, so such a request is submitted as before."""
        out: dict[str, Any] = {}
        hidden = self.return_hidden_states
        if isinstance(hidden, HiddenStatesOptions):
            out["return_hidden_states"] = hidden.model_dump(exclude_unset=True)
        elif hidden:
            out["return_hidden_states"] = True
        if self.steering is not None:
            out["steering"] = [s.model_dump(exclude_unset=True) for s in self.steering]
        if self.layer_taps is not None:
            out["layer_taps"] = list(self.layer_taps)
        return out


class _EngineExtras(_LayerFields):
    """The engine's own sampling parameters, as extra body fields (the `extra_body` of the openai
    client), named as SGLang and vLLM name them."""

    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None
    # beam search (engine/serve/beams.py): n results of a search of beam_width beams
    regex: str | None = None  # structured output (docs/structured_output.md), as SGLang takes them
    ebnf: str | None = None
    use_beam_search: StrictBool = False
    beam_width: StrictInt | None = None
    length_penalty: Number | None = None
    early_stopping: StrictBool | Literal["never"] | None = None
    # vLLM's and SGLang's names for what the engine does (engine/serve/translate.py maps them)
    include_stop_str_in_output: StrictBool = False  # vLLM: the matched stop string ends the text
    no_stop_trim: StrictBool = False  # SGLang: the same
    json_schema: dict[str, Any] | str | None = None  # SGLang: a JSON Schema (as JSON text there)
    # vLLM's structured output before structured_outputs
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's and SGLang's request fields beyond OpenAI's and those above; docs/server.md gives each one's reason.
# Taken and ignored, with a warning in the log: on their servers they say where or how a request runs
# (routing, priority, ids, multimodal settings, what only their other routes read), never what it answers.
IGNORED_FIELDS = frozenset(
    {
        "priority",
        "request_id",
        "rid",
        "session_id",
        "custom_labels",
        "kv_transfer_params",
        "ec_transfer_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "stream_interval",
        "guided_decoding_backend",
        "mm_processor_kwargs",
        "media_io_kwargs",
        "images_config",
        "max_dynamic_patch",
        "min_dynamic_patch",
        "use_audio_in_video",
        "ngram_corpus_id",
        "include_reasoning",
        "separate_reasoning",
        "stream_reasoning",
        "return_mm_kwargs",
        "return_token_offsets",
        "routed_experts_prompt_start",
        "routed_experts_start_len",
        "truncation_side",
    }
)
# Refused with a 400 naming the field unless null or a value that asks for nothing (listed): this server
# cannot do what they ask, and ignoring them would change the answer the client gets.
REFUSED_FIELDS: dict[str, tuple] = {
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "logprob_token_ids": (),
    "logits_processors": (),
    "vllm_xargs": (),
    "lora_path": (),
    "cache_salt": (),
    "extra_key": (),
    "watermarking": (False,),
    "repetition_detection": (),
    "thinking_token_budget": (-1,),
    "stop_regex": (),
    "session_params": (),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "prompt_embeds": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "return_routed_experts": (False,),
    "return_cached_tokens_details": (False,),
}
REFUSED_CHAT: dict[str, tuple] = {
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": ([],),
    "input_ids": (),
    "task": (),
    "return_prompt_token_ids": (False,),
    "return_meta_info": (False,),
    "return_prompt_text": (False,),
}
# what the engine does for each route
REFUSED_COMPLETIONS: dict[str, tuple] = {"add_special_tokens": (True,)}


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # type-strict: 0 is not false


class _Sampling(_EngineExtras):
    """What both OpenAI routes take. Extra fields are kept only to be sorted here: vLLM's and SGLang's
    ignored or refused ones (above), any other a 400."""

    model_config = ConfigDict(extra="allow")
    refused_fields: ClassVar[dict[str, tuple]] = REFUSED_FIELDS

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @model_validator(mode="after")
    def _other_servers_fields(self):
        """Sort the extra fields: vLLM's and SGLang's ignored ones pass, refused ones only at a value that
        asks for nothing, any other is refused. An OpenAIError, not a ValueError: pydantic would name no
        field for a check of the whole body."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED_FIELDS:
                continue
            if name not in self.refused_fields:
                raise OpenAIError(400, f"unsupported parameter: {name}", param=name)
            allowed = self.refused_fields[name]
            if value is not None and not any(_same(value, ok) for ok in allowed):
                leave = " or ".join(["leave it out", *(json.dumps(ok) for ok in allowed)])
                raise OpenAIError(
                    400,
                    f"{name} is not supported by this server, and ignoring it would change the answer "
                    f"({leave})",
                    param=name,
                )
        return self

    def ignored_fields(self) -> list[str]:
        """vLLM's and SGLang's fields this body gave that change nothing here (null ones aside)."""
        return sorted(
            k for k, v in (self.model_extra or {}).items() if k in IGNORED_FIELDS and v is not None
        )


class TextPart(_Body):
    type: Literal["text"]
    text: str


class RefusalPart(_Body):
    """An assistant's refusal as OpenAI's responses carry it: the assistant's text all the same."""

    type: Literal["refusal"]
    refusal: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | RefusalPart] | None = None
    # accepted, as OpenAI does, and not shown to the model (chat templates have no place for it)
    name: str | None = None
    # what OpenAI puts in an assistant message (a history replayed from its responses holds them):
    # a refusal is the assistant's text, annotations (citations) say nothing to the model, and the
    # rest must be null or empty, as this server has no tools nor audio
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None

    @field_validator("content", "refusal")
    @classmethod
    def _refusals_are_the_assistants(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "refusal":
            refuses = value is not None
        else:
            refuses = isinstance(value, list) and any(isinstance(p, RefusalPart) for p in value)
        if refuses and info.data.get("role") != "assistant":
            raise ValueError("a refusal belongs in an assistant message only")
        return value

    @field_validator("tool_calls", "function_call", "audio")
    @classmethod
    def _no_tools_nor_audio(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            what = "audio" if info.field_name == "audio" else "tool calls"
            raise ValueError(f"{what} are not supported by this server (send null or leave it out)")
        return value


class ChatCompletionRequest(_Sampling):
    refused_fields: ClassVar[dict[str, tuple]] = {**REFUSED_FIELDS, **REFUSED_CHAT}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


Prompt = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    refused_fields: ClassVar[dict[str, tuple]] = {**REFUSED_FIELDS, **REFUSED_COMPLETIONS}

    prompt: Prompt
    logprobs: StrictInt | None = None
    echo: Literal[False] = False
    suffix: str | None = None  # only "" (no fill-in-the-middle): translate.sampling_params says so
    best_of: StrictInt | None = None  # only n (no choosing among more samples): likewise


class GenerateRequest(_LayerFields):
    """SGLang's native /generate: text or input_ids, sampling_params as the engine takes them."""

    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: StrictBool = False
    rid: str | list[str] | None = None
    return_logprob: StrictBool = False
    top_logprobs_num: StrictInt = 0
    logprob_start_len: StrictInt = -1


def _field_names(cls: type[BaseModel]) -> set[str]:
    names = {*cls.model_fields, *(f.alias for f in cls.model_fields.values() if f.alias)}
    for sub in cls.__subclasses__():
        names |= _field_names(sub)
    return names


# what a validation error's location may name (the rest are pydantic's tags)
FIELD_NAMES = frozenset(_field_names(_Body))
