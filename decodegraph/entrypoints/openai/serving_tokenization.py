"""vLLM's tokenizer endpoints: POST /tokenize (a prompt or chat messages), POST
/detokenize, and GET /tokenizer_info (behind --enable-tokenizer-info-endpoint, as in
vLLM, since it shows the tokenizer's whole configuration)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Field, Tag

from decodegraph.engine.async_llm import AsyncLLM
from decodegraph.entrypoints.openai.protocol import ChatMessage, OpenAIBaseModel
from decodegraph.entrypoints.openai.serving_chat import OpenAIServingChat
from decodegraph.entrypoints.openai.serving_engine import OpenAIError


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    # The rendered template carries its own special tokens (vLLM's default).
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


def _tokenize_kind(body: Any) -> str:
    return "chat" if isinstance(body, dict) and "messages" in body else "completion"


# POST /tokenize's body: chat messages or a prompt, told apart by "messages" (so that
# only one model validates it, and logs the fields it ignores).
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("completion")]
    | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_tokenize_kind),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class OpenAIServingTokenization(OpenAIServingChat):
    """Handler of /tokenize, /detokenize and /tokenizer_info (chat rendering shared with
    /v1/chat/completions)."""

    def __init__(
        self, async_llm: AsyncLLM, served_model_names: list[str], chat_template: str | None = None
    ) -> None:
        super().__init__(async_llm, served_model_names, chat_template)
        self.vocab_size: int = async_llm.engine.vocab_size

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise OpenAIError(
                "model: this server has no tokenizer (skip_tokenizer_init is set)", 400, "model"
            )
        return self.tokenizer

    def create_tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        self.check_model(request.model)
        tokenizer = self._require_tokenizer()
        if isinstance(request, TokenizeChatRequest):
            text = self._render(request)  # type: ignore[arg-type]
        else:
            text = request.prompt
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        tokenizer = self._require_tokenizer()
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(
                f"tokens: token id(s) {bad[:8]} are out of vocabulary [0, {self.vocab_size})",
                400,
                "tokens",
            )
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    def get_tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's class and its JSON-able configuration, with the chat template
        the server renders with."""
        tokenizer = self._require_tokenizer()
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
        for key, value in getattr(tokenizer, "init_kwargs", {}).items():
            value = getattr(value, "content", value)  # AddedToken -> its text
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            info[key] = value
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if template:
            info["chat_template"] = template
        return info
