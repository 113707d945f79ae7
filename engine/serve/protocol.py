"""The request bodies the OpenAI API and SGLang's /generate take, as pydantic models (FastAPI
validates them; a wrong type is a 400 naming the field). Unknown fields are refused rather than
silently ignored, so a client never believes a parameter took effect when it did not.

Types are strict: a number is a JSON number (an integer where a float is asked, as JSON does not
tell them apart), never a string or a bool. null in any known field means its default, as OpenAI
types them "X or null" and clients send null for what they leave out."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationInfo, field_validator,
                      model_validator)  # fmt: skip

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
    include_obfuscation: StrictBool = False  # OpenAI pads its chunks against side channels; taken, nothing to pad


class _EngineExtras(_Body):
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


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_EngineExtras):
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
    name: str | None = None  # accepted, as OpenAI does, and not shown to the model (chat templates have no place for it)
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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


Prompt = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: StrictInt | None = None
    echo: Literal[False] = False
    suffix: str | None = None  # only "" (no fill-in-the-middle): translate.sampling_params says so
    best_of: StrictInt | None = None  # only n (no choosing among more samples): likewise


class GenerateRequest(_Body):
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


FIELD_NAMES = frozenset(_field_names(_Body))  # what a validation error's location may name (the rest are pydantic's tags)
