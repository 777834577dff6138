"""``POST /v1/embeddings``: each input becomes one engine request of a model started with ``--task embed``;
they are batched by the engine's scheduler like any prompt, and answered together."""

from __future__ import annotations

import base64
import struct
import uuid

from starlette.requests import Request
from starlette.responses import Response

from rivulet.engine.outputs import PoolingRequestOutput
from rivulet.entrypoints.openai.errors import JSONBody, OpenAIError
from rivulet.entrypoints.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from rivulet.entrypoints.openai.aio import ClientDisconnected, until_disconnected
from rivulet.entrypoints.openai.serving_base import ServerContext
from rivulet.pooling_params import PoolingParams

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, body: EmbeddingRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.model_name(body.model)
        if ctx.engine.model_info.task != "embed":
            raise OpenAIError(400, f"The model `{model}` does not support the Embeddings API: it generates text "
                                   "(an embedding model is served with --task embed)", param="model")
        info = ctx.engine.model_info
        if body.dimensions is not None and not info.matryoshka:
            raise OpenAIError(400, "this model does not support 'dimensions' (it is not a Matryoshka model: a shorter "
                                   "vector would be a poor embedding)", param="dimensions")
        inputs = body.inputs()
        if not inputs:
            raise OpenAIError(400, "input is empty", param="input")
        if len(inputs) > MAX_INPUTS:
            raise OpenAIError(400, f"input has {len(inputs)} entries; at most {MAX_INPUTS} per request", param="input")
        try:
            params = PoolingParams(body.dimensions, body.normalize, body.truncate_prompt_tokens)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="truncate_prompt_tokens") from None
        group = ctx.open_group(len(inputs))
        try:
            request_id = f"embd-{uuid.uuid4().hex}"
            for i, x in enumerate(inputs):
                if isinstance(x, str) and body.truncate_prompt_tokens is None:
                    text, ids = await ctx.tokenize_off_loop(x, body.add_special_tokens)
                    x = {"prompt": text, "prompt_token_ids": ids}
                elif isinstance(x, str) and not body.add_special_tokens:
                    raise OpenAIError(400, "truncate_prompt_tokens with add_special_tokens false is not supported",
                                      param="add_special_tokens")
                group.add(x, params, f"{request_id}-{i}", body.priority)
            finals: list[PoolingRequestOutput] = await until_disconnected(  # type: ignore[assignment]
                raw.receive, group.collect(), group.deadline)
            return JSONBody(self._response(body, model, request_id, finals).model_dump())
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            await group.aclose()

    @staticmethod
    def _response(body: EmbeddingRequest, model: str, request_id: str,
                  finals: list[PoolingRequestOutput]) -> EmbeddingResponse:
        data = []
        for i, out in enumerate(finals):
            assert out.outputs is not None  # errors were raised by collect()
            vec = out.outputs.embedding
            if body.encoding_format == "base64":
                packed = struct.pack(f"<{len(vec)}f", *vec)  # as OpenAI's: little-endian float32
                data.append(EmbeddingData(index=i, embedding=base64.b64encode(packed).decode()))
            else:
                data.append(EmbeddingData(index=i, embedding=vec))
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        return EmbeddingResponse(id=request_id, model=model, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
