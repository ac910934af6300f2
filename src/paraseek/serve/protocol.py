"""The OpenAI API's request bodies as pydantic models (the fields OpenAI and vLLM accept, type-checked strictly: a
string where a number belongs is a 400, not a guess).

Unknown fields are ignored, as OpenAI ignores them. A known field is either implemented or refused: REFUSED lists
each field this server does not implement with the value that means "not used" (its default); a request that sets
one to anything else gets a 400 naming it (`refused_field`), never a 200 with another behaviour than it asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # vLLM's bounds (a torch int64)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class _Sampling(_Request):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension, as the engine samples
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's extension
    n: int = Field(1, ge=1, le=16)
    best_of: int | None = None  # only best_of == n: more candidates than returned choices is not implemented
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension (benchmarks)
    min_tokens: int = 0  # vLLM's extension
    skip_special_tokens: bool = True
    priority: int = 0  # vLLM's extension: lower values are scheduled first
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM's: keep the prompt's last N tokens
    response_format: dict[str, Any] | None = None  # text | json_object | json_schema
    # vLLM's structured-output fields (one at most; they constrain the whole output, reasoning included)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # only xgrammar (or auto)
    request_id: str | None = None  # vLLM's: the response's id
    user: str | None = None  # an end-user id; no effect here (nothing is stored)
    # Refused unless left at their defaults (REFUSED)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None
    cache_salt: str | None = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: bos as the tokenizer adds it
    prompt_embeds: Any = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any]


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow", strict=True)  # name, reasoning_content ... go to the template
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM's extension
    add_special_tokens: bool = False  # vLLM's: the template writes bos itself
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension
    include_reasoning: bool = True  # vLLM's: False drops reasoning_content
    metadata: dict[str, Any] | None = None  # only stored completions use it; nothing is stored here
    # Refused unless left at their defaults (REFUSED)
    echo: bool = False
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    store: bool | None = None
    reasoning_effort: str | None = None
    continue_final_message: bool = False
    documents: Any = None
    chat_template: str | None = None
    service_tier: str | None = None


# field -> (values that mean "not used", why it is refused otherwise)
REFUSED: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1.0, 1), "length_penalty applies to beam search, which is not supported"),
    "include_stop_str_in_output": ((False,), "include_stop_str_in_output is not supported"),
    "spaces_between_special_tokens": ((True,), "spaces_between_special_tokens=false is not supported"),
    "bad_words": ((None,), "bad_words is not supported"),
    "prompt_logprobs": ((None,), "prompt log-probabilities are not supported"),
    "logits_processors": ((None,), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": ((False,), "return_tokens_as_token_ids is not supported"),
    "return_token_ids": ((False,), "return_token_ids is not supported"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported"),
    "structural_tag": ((None,), "structural_tag is not supported; use response_format or guided_*"),
    "cache_salt": ((None,), "cache_salt is not supported"),
    "kv_transfer_params": ((None,), "KV transfer (disaggregated prefill) is not supported"),
    "vllm_xargs": ((None,), "vllm_xargs is not supported"),
    "mm_processor_kwargs": ((None,), "this server serves text models only"),
    "prompt_embeds": ((None,), "prompt_embeds is not supported"),
    "functions": ((None,), "functions is deprecated and not supported: use tools"),
    "function_call": ((None,), "function_call is deprecated and not supported: use tool_choice"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported: DeepSeek templates have no effort levels "
                         "(chat_template_kwargs passes template switches such as thinking)"),
    "continue_final_message": ((False,), "continue_final_message is not supported"),
    "documents": ((None,), "documents are not supported"),
    "chat_template": ((None,), "a per-request chat_template is not accepted; start the server with --chat-template"),
    "service_tier": ((None, "auto", "default"), "service tiers are not supported"),
}
REFUSED_IN_CHAT = {"echo": ((False,), "echo is supported for completions, not for chat")}


def refused_field(body: BaseModel) -> tuple[str, str] | None:
    """(field, message) for the first known-but-unsupported field the request sets; None if there is none."""
    for name in sorted(body.model_fields_set):
        entry = REFUSED.get(name) or (REFUSED_IN_CHAT.get(name) if isinstance(body, ChatCompletionRequest) else None)
        if entry is not None:
            neutral, why = entry
            value = getattr(body, name)
            if not any(value == v for v in neutral):
                return name, why
    return None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class TokenizeRequest(_Request):
    """vLLM's POST /tokenize: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error",
                    "server_error", "service_unavailable"]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str
