"""The OpenAI-compatible request and response bodies (msgspec Structs).

Requests reject unknown fields, so a misspelt parameter is a 400 naming it rather than
a silently ignored setting; fields OpenAI clients commonly send that change nothing here
(`user`, `n` = 1, zero penalties, `parallel_tool_calls`, `stream_options`) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The generation fields both endpoints take."""

    model: str | None = None
    # None (or left out): the server's default (`qnpipe serve --temperature/--top-p/--top-k/--min-p`)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension, as vLLM's and mlx_lm.server's
    min_p: float | None = None  # an extension, as vLLM's and mlx_lm.server's
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False  # an extension (as vLLM's): run to max_tokens past EOS (benchmarks)
    # Taken so that the answer is the server's own "not supported" (qnpipe.server.jobs), not the decoder's.
    logprobs: Any = None
    top_logprobs: Any = None
    response_format: Any = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Message]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int]
    echo: bool = False


# -- responses


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class OutToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class OutMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[OutToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: OutMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class StreamToolCall(msgspec.Struct):
    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[StreamToolCall] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "qnpipe"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail
