"""``POST /v1/embeddings`` on a real server with all-MiniLM-L6-v2, through the openai SDK (which asks
for base64 by default) and raw HTTP, against sentence-transformers."""

from __future__ import annotations

import base64
import concurrent.futures
import struct
from typing import Iterator

import httpx
import numpy as np
import openai
import pytest
from server_helpers import ServerProcess, assert_error_body

from helpers.minilm import minilm_dir

TEXTS = ["A paged KV cache holds keys and values in blocks.", "The weather is lovely today.", "hi"]


@pytest.fixture(scope="module")
def embed_server() -> Iterator[ServerProcess]:
    proc = ServerProcess(str(minilm_dir()), "--task", "embed", "--served-model-name", "minilm")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu").encode(TEXTS)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_openai_sdk_embeddings_match_sentence_transformers(embed_server: ServerProcess, reference: np.ndarray) -> None:
    with openai.OpenAI(base_url=embed_server.base_url, api_key="unused", max_retries=0) as client:
        res = client.embeddings.create(model="minilm", input=TEXTS)  # the SDK sends encoding_format=base64
        got = np.array([d.embedding for d in res.data])
        assert [d.index for d in res.data] == [0, 1, 2] and got.shape == (3, 384)
        assert cosine(got, reference).min() > 0.99999
        assert res.model == "minilm" and res.usage.prompt_tokens == res.usage.total_tokens > 10
        one = client.embeddings.create(model="minilm", input=TEXTS[1], encoding_format="float")
        assert cosine(np.array(one.data[0].embedding), reference[1]) > 0.99999
        with pytest.raises(openai.BadRequestError, match="does not support 'dimensions'"):
            client.embeddings.create(model="minilm", input="x", dimensions=8)
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="nope", input="x")


def test_embeddings_over_http(embed_server: ServerProcess, reference: np.ndarray) -> None:
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        r = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        raw = base64.b64decode(body["data"][0]["embedding"])
        vec = np.array(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert cosine(vec, reference[0]) > 0.99999
        ids = http.post("/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
        for payload in (ids, [ids, ids]):  # token ids, one list or several
            r = http.post("/v1/embeddings", json={"input": payload})
            assert all(cosine(np.array(d["embedding"]), reference[0]) > 0.99999 for d in r.json()["data"])
        long = {"input": "word " * 300}
        assert "maximum input length is 256" in assert_error_body(http.post("/v1/embeddings", json=long), 400)["message"]
        r = http.post("/v1/embeddings", json={**long, "truncate_prompt_tokens": 256})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
        for bad in ({"input": []}, {"input": "x", "encoding_format": "int8"}, {"input": [-1]}, {"input": 5},
                    {"input": "x", "truncate_prompt_tokens": 0}):
            assert_error_body(http.post("/v1/embeddings", json=bad), 400)
        err = assert_error_body(http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}), 400)
        assert "serves embeddings" in err["message"]
        assert http.get("/health", params={"generate": 1}).status_code == 200


def test_concurrent_embedding_requests_are_batched(embed_server: ServerProcess, reference: np.ndarray) -> None:
    def one(i: int) -> list[float]:
        r = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": TEXTS[i % 3]}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(48)))
    for i, vec in enumerate(got):
        assert cosine(np.array(vec), reference[i % 3]) > 0.99999
    metrics = embed_server.metrics()
    assert metrics['rivulet:request_success_total{finished_reason="stop",model_name="minilm"}'] >= 48
