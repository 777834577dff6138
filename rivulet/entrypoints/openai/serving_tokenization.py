"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes); they never reach the engine."""

from __future__ import annotations

from rivulet.entrypoints.openai.errors import OpenAIError
from rivulet.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                                 TokenizeResponse)
from rivulet.entrypoints.openai.serving_base import ServerContext
from rivulet.entrypoints.openai.serving_chat import render_chat


class TokenizationHandler:
    """Tokenize a prompt or a conversation; detokenize ids."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def _tokenizer(self) -> object:
        tok = self.ctx.engine.tokenizer
        if tok is None:
            raise OpenAIError(400, "this model has no tokenizer")
        return tok

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of ``prompt`` (special tokens added by default) or of ``messages`` rendered with the
        chat template (none added by default, the template has them)."""
        self.ctx.model_name(body.model)
        tok = self._tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise OpenAIError(400, "messages is empty", param="messages")
            text, ids = render_chat(tok, body.messages, body.add_generation_prompt, body.continue_final_message,
                                    body.chat_template_kwargs, body.tools,
                                    body.chat_template or self.ctx.settings.chat_template)
            if body.add_special_tokens:
                ids = list(tok(text, add_special_tokens=True).input_ids)  # type: ignore[operator]
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            _, ids = self.ctx.tokenize(body.prompt or "", add_special_tokens=add)
        strs = None
        if body.return_token_strs:
            pieces = tok.convert_ids_to_tokens(ids)  # type: ignore[attr-defined]
            strs = [s if isinstance(s, str) else "" for s in pieces]
        return TokenizeResponse(count=len(ids), max_model_len=self.ctx.engine.model_info.max_model_len, tokens=ids,
                                token_strs=strs)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """Text of token ids; 400 for ids outside the vocabulary."""
        self.ctx.model_name(body.model)
        self._tokenizer()
        vocab = self.ctx.engine.model_info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self.ctx.decode(list(body.tokens)))
