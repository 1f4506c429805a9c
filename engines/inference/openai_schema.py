"""The OpenAI request bodies the server reads (``/v1/completions``, ``/v1/chat/completions``), and its error body.

Unknown fields are ignored, as OpenAI-compatible servers do (clients send ``user``, ``presence_penalty=0``...);
a field out of range is refused by its name. ``max_tokens``: None is the room the context leaves after the
prompt; 0 only with ``echo`` (the prompt is scored, nothing generated, as vLLM does).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = Field(1, ge=1, le=256)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # also the number of top alternatives
    echo: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str  # a data:image/...;base64, URL (the server reaches no other host)
    detail: str | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    #: text, or OpenAI's content parts: text and images (a vision-language model's)
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=0)


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)
