"""Pipelines over fake engines (fast): stages in order around the generation, the model name a pipeline answers
to, input and output redaction (a match split across stream chunks never leaks), guards (400, refusal,
content_filter), routing, templates, stage timeouts and on_error, plugins by entry point."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine

from rivulet.config import RivuletError
from rivulet.entrypoints.openai.api_server import build_app
from rivulet.entrypoints.openai.deployment import Deployment, DeploymentSpec
from rivulet.entrypoints.openai.launch import ServerSettings
from rivulet.entrypoints.pipelines.filters import Chain, Redactor, compile_patterns

EMAIL = r"[\w.+-]+@[\w-]+\.[\w.]+"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from rivulet.engine.tokenizer import load_tokenizer
    from rivulet.models.loader import resolve_model

    return load_tokenizer(resolve_model("default"))


class Recording(FakeEngine):
    """Remembers the prompts it was given."""

    prompts: list[str]

    async def ready(self) -> Recording:
        return self

    def generate(self, prompt: Any, params: Any, request_id: str, *a: Any, **kw: Any) -> Any:
        self.prompts = getattr(self, "prompts", []) + [self.tokenizer.decode(prompt["prompt_token_ids"])]
        return super().generate(prompt, params, request_id, *a, **kw)


def app_for(tokenizer: Any, config: dict, replies: dict[str, str]) -> tuple[Any, dict[str, Recording]]:
    """The app of a deployment of fake engines, each answering its reply (ask for max_tokens=len(reply
    tokens): the fakes repeat it)."""
    engines: dict[str, Recording] = {}

    def spawn(c: Any) -> Recording:
        script = tokenizer(replies[c.model.model], add_special_tokens=False).input_ids
        engines[c.model.model] = Recording(tokenizer, script=script, step_delay=0.001, max_model_len=4096)
        engines[c.model.model].reply_len = len(script)
        return engines[c.model.model]

    deployment = Deployment(spawn=spawn)
    deployment.start(DeploymentSpec.parse(config))
    app = build_app(deployment, ServerSettings(served_model_names=["unused"]))
    asyncio.run(deployment.ready())
    return app, engines


def run(app: Any, fn: Any) -> Any:
    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            return await fn(c)
    return asyncio.run(main())


def stream_text(r: httpx.Response, kind: str = "chat") -> tuple[str, list[str | None]]:
    text, reasons = "", []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                text += (ch.get("delta", {}).get("content") or "") if kind == "chat" else ch.get("text", "")
                reasons.append(ch.get("finish_reason"))
    return text, reasons


def test_a_split_match_never_leaks_from_the_redactor() -> None:
    rx = compile_patterns([EMAIL, r"\b\d{3}-\d{4}\b"], "t")
    text = "mail ann.lee+x@mail.example.org or call 555-1234; bob@ex.io, 12-3456 stays."
    want = "mail [r] or call [r]; [r], 12-3456 stays."
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 20)))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        r = Redactor(rx, "[r]")
        sent = [r.feed(p) for p in parts]
        assert "".join(sent) + r.finish() == want
        assert not any("@" in s or "555" in s for s in sent)  # nothing of a match was ever sent
    assert Chain([Redactor(rx, "[r]")]).apply(text) == want


CHAT = {"name": "chat", "model": "m-chat"}
BIG = {"name": "big", "model": "m-big"}


def test_redaction_both_ways_and_the_pipeline_name(tokenizer: Any) -> None:
    config = {"models": [CHAT], "pipelines": [{"name": "safe-chat", "stages": [
        {"type": "redact", "patterns": [EMAIL], "replacement": "[email]", "on": ["input", "output"]},
        {"type": "generate", "model": "chat"}]}]}
    app, engines = app_for(tokenizer, config, {"m-chat": " Sure: write to carol.king@example.com today."})

    async def main(c: httpx.AsyncClient) -> None:
        n = engines["m-chat"].reply_len
        msg = {"model": "safe-chat", "messages": [{"role": "user", "content": "My mail is dan@corp.example.net"}],
               "max_tokens": n}
        r = await c.post("/v1/chat/completions", json=msg)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "safe-chat"
        assert body["choices"][0]["message"]["content"] == " Sure: write to [email] today."
        assert "dan@corp" not in engines["m-chat"].prompts[-1] and "[email]" in engines["m-chat"].prompts[-1]
        r = await c.post("/v1/chat/completions", json={**msg, "stream": True})
        text, reasons = stream_text(r)
        assert text == " Sure: write to [email] today." and reasons[-1] == "length"
        assert "carol" not in r.text and '"model":"safe-chat"' in r.text.replace(" ", "")
        r = await c.post("/v1/completions", json={"model": "safe-chat", "prompt": "x", "max_tokens": n,
                                                  "stream": True})
        assert stream_text(r, "completion")[0] == " Sure: write to [email] today."
        cards = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
        assert cards["safe-chat"]["task"] == "pipeline" and cards["safe-chat"]["parent"] == "chat"
        r = await c.post("/v1/embeddings", json={"model": "safe-chat", "input": "x"})
        assert r.status_code == 400
    run(app, main)


def test_guards_route_and_template(tokenizer: Any) -> None:
    config = {"models": [CHAT, BIG], "pipelines": [{"name": "p", "stages": [
        {"type": "guard", "words": ["password"], "on": ["input"], "action": "reject"},
        {"type": "guard", "words": ["weapon"], "on": ["input"], "action": "refuse", "message": "No."},
        {"type": "guard", "patterns": ["secret sauce"], "on": ["output"], "action": "refuse", "message": "[cut]"},
        {"type": "route", "rules": [{"pattern": "(?i)prove|theorem", "model": "big"}], "default": "chat"},
        {"type": "template", "template": "Answer briefly. {{ input }}"},
        {"type": "generate", "model": "chat"}]}]}
    app, engines = app_for(tokenizer, config, {"m-chat": " The secret sauce is love.", "m-big": " QED."})

    def ask(content: str, stream: bool = False) -> dict:
        n = engines["m-chat"].reply_len  # the big model's reply is shorter: repeated, its first copy is checked
        return {"model": "p", "messages": [{"role": "user", "content": content}], "max_tokens": n, "stream": stream}

    async def main(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json=ask("what is my PASSWORD?"))
        assert r.status_code == 400 and r.json()["error"]["code"] == "content_blocked"
        r = await c.post("/v1/chat/completions", json=ask("build a weapon"))
        assert r.json()["choices"][0]["message"]["content"] == "No."
        assert r.json()["choices"][0]["finish_reason"] == "content_filter"
        r = await c.post("/v1/chat/completions", json=ask("build a weapon", stream=True))
        assert stream_text(r) == ("No.", ["content_filter"])
        r = await c.post("/v1/chat/completions", json=ask("Prove the theorem"))
        assert r.json()["choices"][0]["message"]["content"].startswith(" QED.")
        assert engines["m-big"].prompts[-1].count("Answer briefly. Prove the theorem") == 1
        r = await c.post("/v1/chat/completions", json=ask("tell me the recipe"))
        assert r.json()["choices"][0]["message"]["content"] == " The [cut]"
        assert r.json()["choices"][0]["finish_reason"] == "content_filter"
        r = await c.post("/v1/chat/completions", json=ask("tell me the recipe", stream=True))
        text, reasons = stream_text(r)
        assert text == " The [cut]" and reasons[-1] == "content_filter" and set(reasons[:-1]) == {None}
        assert "sauce" not in r.text and r.text.rstrip().endswith("data: [DONE]")
        for _ in range(50):  # the cut stream's request was aborted in the engine
            if not engines["m-chat"].unfinished:
                break
            await asyncio.sleep(0.02)
        assert not engines["m-chat"].unfinished and engines["m-chat"].aborted
        metrics = (await c.get("/metrics")).text
        for stage, outcome in (("guard", "rejected"), ("guard", "answered"), ("route", "ok"), ("template", "ok")):
            assert f'rivulet:pipeline_stage_seconds_count{{outcome="{outcome}",pipeline="p",stage="{stage}"}}' \
                in metrics, (stage, outcome)
    run(app, main)


def test_stage_errors_and_timeouts_follow_on_error(tokenizer: Any, tmp_path: Path, monkeypatch) -> None:
    plugin_dir = tmp_path / "plugins"
    (plugin_dir / "slowplug-0.1.dist-info").mkdir(parents=True)
    (plugin_dir / "slowplug-0.1.dist-info" / "METADATA").write_text("Name: slowplug\nVersion: 0.1\n")
    (plugin_dir / "slowplug-0.1.dist-info" / "entry_points.txt").write_text(
        "[rivulet.plugins]\nslow = slowplug:Slow\nshout = slowplug:Shout\nboom = slowplug:Boom\n")
    (plugin_dir / "slowplug.py").write_text('''
import asyncio

class Slow:
    def __init__(self, options):
        self.delay = options["delay"]
    async def on_input(self, request):
        request.text = "SLOW " + request.text
        await asyncio.sleep(self.delay)

class Shout:
    def __init__(self, options):
        pass
    async def on_input(self, request):
        request.text = request.text.upper()
    def output_filter(self, request):
        class Up:
            stopped = False
            def feed(self, text): return text.upper()
            def finish(self): return ""
        return Up()

class Boom:
    def __init__(self, options):
        raise RuntimeError("bad options")
''')
    monkeypatch.syspath_prepend(str(plugin_dir))
    import importlib

    importlib.invalidate_caches()

    def config(on_error: str) -> dict:
        return {"models": [CHAT], "pipelines": [{"name": "p", "stages": [
            {"type": "plugin", "plugin": "slow", "options": {"delay": 5}, "timeout": 0.2, "on_error": on_error},
            {"type": "plugin", "plugin": "shout", "name": "shouter"},
            {"type": "generate", "model": "chat"}]}]}

    app, engines = app_for(tokenizer, config("skip"), {"m-chat": " ok then"})
    body = {"model": "p", "messages": [{"role": "user", "content": "hello"}], "max_tokens": engines["m-chat"].reply_len}

    async def skip(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " OK THEN"
        assert "HELLO" in engines["m-chat"].prompts[-1] and "SLOW" not in engines["m-chat"].prompts[-1]
    run(app, skip)
    app, engines = app_for(tokenizer, config("fail"), {"m-chat": " ok then"})

    async def fail(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 504 and "stage slow failed: timed out after 0.2 s" in r.json()["error"]["message"]
        assert not getattr(engines["m-chat"], "prompts", [])
    run(app, fail)
    bad = {"models": [CHAT], "pipelines": [{"name": "p", "stages": [{"type": "plugin", "plugin": "boom"},
                                                                     {"type": "generate", "model": "chat"}]}]}
    with pytest.raises(RivuletError, match="plugin 'boom' failed to start: RuntimeError: bad options"):
        DeploymentSpec.parse(bad)


def test_pipeline_files_are_checked(tokenizer: Any) -> None:
    def pipe(*stages: dict) -> dict:
        return {"models": [CHAT, {"name": "emb", "model": "m-emb", "task": "embed"}],
                "pipelines": [{"name": "p", "stages": list(stages)}]}
    gen = {"type": "generate", "model": "chat"}
    for config, match in [
        (pipe({"type": "redact", "patterns": [EMAIL]}), "exactly one generate"),
        (pipe(gen, gen), "exactly one generate"),
        (pipe({"type": "generate", "model": "nope"}), "does not serve"),
        (pipe({"type": "generate", "model": "emb"}), "needs a model of task generate"),
        (pipe({"type": "redact", "patterns": ["a*"]}, gen), "matches the empty string"),
        (pipe({"type": "redact", "patterns": ["("]}, gen), "bad pattern"),
        (pipe({"type": "redact", "patterns": ["a"], "on": ["sideways"]}, gen), "'on' must list"),
        (pipe({"type": "guard", "words": ["x"], "action": "shrug"}, gen), "action must be"),
        (pipe({"type": "frobnicate"}, gen), "'type' one of"),
        (pipe({"type": "template", "template": "{{ input "}, gen), "bad template"),
        (pipe({"type": "retrieve", "embed_model": "chat", "documents": "d", "index": "i"}, gen), "task embed"),
        (pipe({"type": "plugin", "plugin": "nope"}, gen), "no plugin 'nope'"),
        (pipe({"type": "redact", "patterns": ["a"], "timeout": -1}, gen), "timeout must be"),
        (pipe({"type": "redact", "patterns": ["a"], "color": "red"}, gen), "unknown key 'color'"),
    ]:
        with pytest.raises(RivuletError, match=match):
            DeploymentSpec.parse(config)
    with pytest.raises(RivuletError, match="used twice"):
        DeploymentSpec.parse({"models": [CHAT], "pipelines": [{"name": "chat", "stages": [gen]}]})
