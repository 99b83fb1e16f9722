"""OpenAI-compatible request bodies (pydantic) and the error type every endpoint answers with.

Only what the engine can honour is accepted: a field we cannot serve (``n > 1``, ``logprobs``,
``echo``, ``best_of``) is a 400 that names it, never a silently different answer. Fields outside
the OpenAI schema that vLLM users send (``top_k``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``cache_salt``) mean what they mean in vLLM. Unknown fields are ignored, as the
OpenAI and vLLM servers do.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "ValidationError",
           "error_body", "validation_message"]


class APIError(Exception):
    """An error the client caused (or a server condition it should see), with its HTTP status.

    ``type``/``code`` follow OpenAI's error object: ``invalid_request_error`` for 400/404/413,
    ``authentication_error`` for 401, ``server_error`` for 5xx.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type, code, param)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None
               ) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_message(e: ValidationError) -> str:
    """Pydantic's errors as one line: ``max_tokens: Input should be greater than or equal to 1``."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)           # vLLM's -1 for "off" is accepted as 0 below
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    user: str | None = None

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, v: Any) -> Any:
        return 0 if v == -1 else v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string when given")
        return v

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _unsupported(name: str, v: Any, off: Any) -> Any:
    if v not in (None, off):
        raise ValueError(f"{name} is not supported by this server")
    return v


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of either
    (one choice per prompt)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)     # null: OpenAI's default, 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        return _unsupported("echo", v, False)

    @field_validator("logprobs", "best_of", "suffix")
    @classmethod
    def _none_only(cls, v: Any, info) -> Any:
        return _unsupported(info.field_name, v, 1 if info.field_name == "best_of" else None)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice (a bare string or token list is one prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        """The message's text; a content list may hold only ``{"type": "text"}`` parts."""
        c = self.content
        if c is None or isinstance(c, str):
            return c or ""
        out = []
        for part in c:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got "
                                 f"{part.get('type')!r}")
            out.append(part["text"])
        return "".join(out)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``) defaults to
    what fits in ``max_seq_len`` after the prompt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        return _unsupported("logprobs", v, False)

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: Any) -> Any:
        return _unsupported("top_logprobs", v, None)

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v:
            raise ValueError("tools are not supported by this server")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
