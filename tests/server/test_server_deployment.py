"""A real deployment: the default model (two names), a tiny random Llama folder and the MiniLM embedder, each
in its own engine process behind one ``rivulet serve --config``, driven by the openai SDK; then a model loaded
and another unloaded while requests run."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
import yaml
from server_helpers import ServerProcess

from helpers.minilm import minilm_dir
from helpers.tiny import make_tiny_model

SMALL = {"kv_cache_memory": 64 << 20, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, make_tiny_model("llama", path)


DOCS = {
    "zephyr.txt": "The Zephyr-9 rover was assembled in the town of Quillwater in 2031.\n\n"
                  "Its chief engineer was Marta Oyelaran.",
    "kettle.md": "# Tea\n\nA kettle boils water for tea. Green tea wants water below the boil.",
    "trains.txt": "Night trains run between the two capitals twice a week, leaving at nine.",
}


@pytest.fixture(scope="module")
def rag_dirs(tmp_path_factory) -> tuple[Path, Path]:
    docs = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    return docs, tmp_path_factory.mktemp("index") / "zephyr"


@pytest.fixture(scope="module")
def deployed(tiny, rag_dirs, tmp_path_factory) -> Iterator[ServerProcess]:
    config = {"models": [
        {"name": "chat", "aliases": ["smol"], "args": {**SMALL, "max_model_len": 512}},
        {"name": "tiny", "model": str(tiny[0]), "args": {**SMALL, "dtype": "float32"}},
        {"name": "minilm", "model": str(minilm_dir()), "task": "embed", "args": {"dtype": "float32"}},
    ], "pipelines": [{"name": "rag", "stages": [
        {"type": "redact", "patterns": [r"[\w.+-]+@[\w-]+\.[\w.]+"], "replacement": "[email]"},
        {"type": "retrieve", "embed_model": "minilm", "documents": str(rag_dirs[0]), "index": str(rag_dirs[1]),
         "top_k": 1, "chunk_chars": 200},
        {"type": "generate", "model": "chat"},
    ]}]}
    f = tmp_path_factory.mktemp("deploy") / "deploy.yaml"
    f.write_text(yaml.safe_dump(config))
    # ServerProcess's default engine flags would clash with --config: the file gives them
    proc = ServerProcess("--config", str(f), engine_defaults=False, startup_timeout=300)
    try:
        yield proc
    finally:
        proc.stop()


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_each_model_answers_by_name(deployed: ServerProcess, tiny) -> None:
    with openai.OpenAI(base_url=deployed.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        ids = {m.id: m for m in client.models.list().data}
        assert set(ids) == {"chat", "smol", "tiny", "minilm", "rag"}
        assert all(m.model_extra["state"] == "ready" for m in ids.values())
        assert ids["minilm"].model_extra["task"] == "embed" and ids["chat"].model_extra["task"] == "generate"
        a = client.completions.create(model="chat", prompt="The capital of France is", max_tokens=6, temperature=0)
        b = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=6, temperature=0)
        assert a.choices[0].text == b.choices[0].text and a.model == "chat" and b.model == "smol"
        chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4)
        assert chat.choices[0].message.content
        prompt = [5, 17, 33, 2, 9]
        t = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        assert t.choices[0].model_extra["token_ids"] == greedy_reference(tiny[1], prompt, 8)
        from sentence_transformers import SentenceTransformer

        texts = ["retrieval needs embeddings", "a second passage"]
        ref = SentenceTransformer(str(minilm_dir()), device="cpu").encode(texts)
        got = np.array([d.embedding for d in client.embeddings.create(model="minilm", input=texts).data])
        assert ((got * ref).sum(-1) / np.linalg.norm(ref, axis=-1)).min() > 0.99999
        with pytest.raises(openai.BadRequestError, match="does not support the Embeddings API"):
            client.embeddings.create(model="chat", input="x")
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=1)
    m = deployed.metrics()
    for name in ("chat", "tiny", "minilm"):
        assert m[f'rivulet:request_success_total{{finished_reason="stop",model_name="{name}"}}'] + \
            m[f'rivulet:request_success_total{{finished_reason="length",model_name="{name}"}}'] >= 1


def test_a_rag_pipeline_puts_the_retrieved_passage_into_the_prompt(deployed: ServerProcess, rag_dirs) -> None:
    with openai.OpenAI(base_url=deployed.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        question = "Which town was the Zephyr-9 rover assembled in? Reply to me at ann@example.com"
        res = client.chat.completions.create(model="rag", messages=[{"role": "user", "content": question}],
                                             max_tokens=24, temperature=0, extra_body={"return_token_ids": True})
        assert res.model == "rag"
        prompt = httpx.post(f"{deployed.url}/detokenize", json={"model": "chat", "tokens": res.model_extra[
            "prompt_token_ids"]}, timeout=30).json()["prompt"]
        assert "The Zephyr-9 rover was assembled in the town of Quillwater" in prompt  # the passage, retrieved
        assert "kettle" not in prompt and "ann@example.com" not in prompt and "[email]" in prompt
        assert "Quillwater" in res.choices[0].message.content  # only the documents know it
        models = {m.id: m.model_extra for m in client.models.list().data}
        assert models["rag"]["task"] == "pipeline" and models["rag"]["state"] == "ready"
    assert (rag_dirs[1] / "index.faiss").is_file() and (rag_dirs[1] / "passages.json").is_file()


def test_load_and_unload_while_requests_run(deployed: ServerProcess, tiny) -> None:
    http = httpx.Client(base_url=deployed.url, timeout=300)

    def chat_stream(i: int) -> str:
        r = http.post("/v1/completions", json={"model": "chat", "prompt": f"Count to {i}:", "max_tokens": 24,
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def slow_tiny() -> httpx.Response:  # long enough for a /metrics scrape to see it running on a busy machine
        return http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 200,
                                                  "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(chat_stream, i) for i in range(4)]
        load = pool.submit(http.post, "/v1/models/load",
                           json={"name": "tiny2", "model": str(tiny[0]), "args": {**SMALL, "dtype": "float32"}})
        r = load.result()
        assert r.status_code == 200 and r.json()["state"] == "ready", r.text
        running = pool.submit(slow_tiny)
        deployed_wait_for_running(http, "tiny")
        unload = pool.submit(http.delete, "/v1/models/tiny")
        r = running.result()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200  # finished, not cut
        assert unload.result().json() == {"id": "tiny", "object": "model", "deleted": True}
        assert all(s.result() for s in streams)
    r = http.post("/v1/completions", json={"model": "tiny2", "prompt": [5, 17, 33, 2, 9], "max_tokens": 8,
                                           "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == greedy_reference(tiny[1], [5, 17, 33, 2, 9], 8)
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 1}).status_code == 404
    assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {"chat", "smol", "tiny2", "minilm", "rag"}


def deployed_wait_for_running(http: httpx.Client, model: str) -> None:
    """Until `model`'s engine reports a running request (the metrics scrape asks every engine)."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        line = next((l for l in text.splitlines()
                     if l.startswith(f'rivulet:num_requests_running{{model_name="{model}"}}')), "")
        if line and float(line.rsplit(" ", 1)[1]) > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"no request of {model} ran")
