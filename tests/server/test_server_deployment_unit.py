"""Deployments over fake engines (fast): the file format, routing by name and alias, the models' states,
load and unload at run time (an unload lets requests in flight finish), the memory check, the API key."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine

from rivulet.config import RivuletError
from rivulet.entrypoints.openai.api_server import build_app
from rivulet.entrypoints.openai.deployment import Deployment, DeploymentSpec, ModelSpec
from rivulet.entrypoints.openai.launch import ServerSettings


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from rivulet.engine.tokenizer import load_tokenizer
    from rivulet.models.loader import resolve_model

    return load_tokenizer(resolve_model("default"))


class SlowReady(FakeEngine):
    """A fake whose model takes `load_s` to load."""

    def __init__(self, *a: Any, load_s: float = 0.0, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.load_s = load_s

    async def ready(self) -> SlowReady:
        await asyncio.sleep(self.load_s)
        return self


LOAD_S = {"s": 0.0}  # how long the next fake engine takes to load


def make_app(tokenizer: Any, specs: list[ModelSpec], scripts: dict[str, list[int]],
             **settings: Any) -> tuple[Any, dict[str, FakeEngine]]:
    engines: dict[str, FakeEngine] = {}
    LOAD_S["s"] = 0.0

    def spawn(config: Any) -> FakeEngine:
        name = config.model.model
        engines[name] = SlowReady(tokenizer, script=scripts[name], step_delay=0.02, load_s=LOAD_S["s"])
        return engines[name]

    deployment = Deployment(spawn=spawn)
    deployment.start(DeploymentSpec(specs))
    app = build_app(deployment, ServerSettings(served_model_names=["unused"], **settings))
    return app, engines


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)


def test_the_file_format_is_checked_before_anything_starts(tmp_path) -> None:
    ok = DeploymentSpec.parse({"models": [{"name": "chat", "aliases": ["smol"], "args": {"max_num_seqs": 8}},
                                          {"name": "emb", "model": "x", "task": "embed"}]})
    assert [m.names for m in ok.models] == [["chat", "smol"], ["emb"]]
    assert ok.models[0].engine_config().scheduler.max_num_seqs == 8
    assert ok.models[1].engine_config().model.task == "embed"
    for bad, match in [({"models": []}, "non-empty list"),
                       ({"models": [{"name": "a"}, {"name": "b", "aliases": ["a"]}]}, "used twice"),
                       ({"models": [{"name": "a", "args": {"max_num_seq": 8}}]}, "unknown engine argument"),
                       ({"models": [{"name": "a", "modle": "x"}]}, "unknown key 'modle'"),
                       ({"models": [{"name": "a", "task": "rerank"}]}, "task must be"),
                       ({"models": [{"name": "a", "args": {"model": "x"}}]}, "as a key of the model"),
                       ({"models": [{"name": "a"}], "pipelines": {}}, "'pipelines' must be a list"),
                       ({"model": []}, "unknown key 'model'")]:
        with pytest.raises(RivuletError, match=match):
            DeploymentSpec.parse(bad)
    f = tmp_path / "d.yaml"
    f.write_text("models:\n  - name: chat\n    args: {dtype: bfloat16}\n")
    assert DeploymentSpec.load(str(f)).models[0].engine_config().model.dtype == "bfloat16"
    f.write_text("models:\n  - {name: chat}\npipelines:\n  - name: p\n    stages:\n"
                 "      - {type: redact, patterns: [x], on: [output]}\n      - {type: generate, model: chat}\n")
    assert DeploymentSpec.load(str(f)).pipelines[0].stages[0].on == {"output"}  # `on` is a key, not YAML 1.1's True
    f.write_text("models: [\n")
    with pytest.raises(RivuletError, match="not valid YAML"):
        DeploymentSpec.load(str(f))


def test_requests_go_to_the_model_they_name(tokenizer: Any) -> None:
    specs = [ModelSpec("a", "model-a", ("a2",)), ModelSpec("b", "model-b")]
    app, engines = make_app(tokenizer, specs, {"model-a": [504], "model-b": [3575]})

    async def main() -> None:
        await app.state.deployment.ready()
        async with client(app) as c:
            for name, token in (("a", 504), ("a2", 504), ("b", 3575), (None, 504)):
                body = {"prompt": "hi", "max_tokens": 2, **({"model": name} if name else {})}
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == tokenizer.decode([token, token])
                assert r.json()["model"] == (name or "a")
            r = await c.post("/v1/completions", json={"model": "c", "prompt": "hi"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            cards = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m["root"], m["state"]) for m in cards] == [
                ("a", "model-a", "ready"), ("a2", "model-a", "ready"), ("b", "model-b", "ready")]
            metrics = (await c.get("/metrics")).text
            assert metrics.count("# TYPE rivulet:prompt_tokens_total counter") == 1
            assert 'rivulet:prompt_tokens_total{model_name="a"}' in metrics
            assert 'rivulet:prompt_tokens_total{model_name="b"}' in metrics
    asyncio.run(main())


def test_load_and_unload_while_requests_run(tokenizer: Any) -> None:
    app, engines = make_app(tokenizer, [ModelSpec("a", "model-a")], {"model-a": [504], "default": [3575]})
    deployment: Deployment = app.state.deployment

    async def main() -> None:
        await deployment.ready()
        async with client(app) as c:
            LOAD_S["s"] = 0.3  # the next model loads for a while
            load = asyncio.create_task(c.post("/v1/models/load", json={"name": "b", "model": "default"}))
            while "b" not in deployment.models:
                await asyncio.sleep(0.01)
            card = next(m for m in (await c.get("/v1/models")).json()["data"] if m["id"] == "b")
            assert card["state"] == "loading"
            r = await c.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
            r = await load
            assert r.status_code == 200 and r.json()["state"] == "ready"
            r = await c.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == tokenizer.decode([3575])
            r = await c.post("/v1/models/load", json={"name": "b"})
            assert r.status_code == 400 and "already served" in r.json()["error"]["message"]
            # unload b while a 20-token request runs on it: the request finishes, new ones get 404
            running = asyncio.create_task(c.post("/v1/completions", json={"model": "b", "prompt": "x",
                                                                          "max_tokens": 20}))
            while not engines["default"].unfinished:
                await asyncio.sleep(0.01)
            unload = asyncio.create_task(c.delete("/v1/models/b"))
            await asyncio.sleep(0.05)
            r = await c.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 404
            done = await running
            assert done.status_code == 200 and len(done.json()["choices"][0]["text"]) > 0
            r = await unload
            assert r.status_code == 200 and r.json() == {"id": "b", "object": "model", "deleted": True}
            assert engines["default"].dead  # its engine was stopped
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["a"]
            assert (await c.delete("/v1/models/b")).status_code == 404
            r = await c.delete("/v1/models/a")
            assert r.status_code == 400 and "last model" in r.json()["error"]["message"]
            r = await c.post("/v1/models/load", json={"name": "c", "args": {"kv_cache_memory": 1 << 50}})
            assert r.status_code == 400 and "GiB of memory is available" in r.json()["error"]["message"]
            r = await c.post("/v1/models/load", json={"name": "c", "modle": "x"})
            assert r.status_code == 400
    asyncio.run(main())


def test_loading_and_unloading_need_the_api_key(tokenizer: Any) -> None:
    app, _ = make_app(tokenizer, [ModelSpec("a", "model-a")], {"model-a": [504]}, api_key="k")

    async def main() -> None:
        await app.state.deployment.ready()
        async with client(app) as c:
            assert (await c.post("/v1/models/load", json={"name": "b"})).status_code == 401
            assert (await c.delete("/v1/models/a")).status_code == 401
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer k"})).status_code == 200
    asyncio.run(main())


def test_a_single_engine_server_refuses_runtime_loads(tokenizer: Any) -> None:
    app = build_app(FakeEngine(tokenizer, script=[504]), ServerSettings(served_model_names=["fake"]))

    async def main() -> None:
        async with client(app) as c:
            r = await c.post("/v1/models/load", json={"name": "b"})
            assert r.status_code == 400 and "--config" in r.json()["error"]["message"]
            assert (await c.get("/v1/models")).json()["data"][0]["state"] == "ready"
    asyncio.run(main())


def test_the_example_deployment_reads(tmp_path) -> None:
    from helpers.minilm import minilm_dir

    example = Path(__file__).resolve().parents[2] / "examples" / "rag" / "deploy.yaml"
    f = tmp_path / "deploy.yaml"
    f.write_text(example.read_text().replace("MINILM", str(minilm_dir())))
    spec = DeploymentSpec.load(str(f))
    assert [m.name for m in spec.models] == ["chat", "minilm"]
    assert [s.kind for s in spec.pipelines[0].stages] == ["guard", "redact", "retrieve", "generate"]
    assert spec.pipelines[0].stages[1].on == {"input", "output"}
