"""`rivulet serve --enable-lora`: adapters served as models over HTTP, from the flag and loaded at run time,
their greedy tokens equal to PEFT's model on the same adapters (tiny random llama, float32)."""

from __future__ import annotations

import httpx
import pytest

from helpers.lora import ADAPTERS, peft_tokens, write_peft_adapter
from server_helpers import ServerProcess


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    for seed, name in enumerate(("attn", "mlp"), start=1):
        write_peft_adapter(root / "base", "llama", name, root, seed, **ADAPTERS[name])
    return root


def test_served_adapters_match_peft(adapters):
    root = adapters
    prompt = list(range(20, 45))
    server = ServerProcess("--model", str(root / "base"), "--served-model-name", "base", "--enable-lora",
                           "--max-loras", "2", "--lora-modules", f"attn={root / 'attn'}")
    try:
        def tokens(model: str) -> list[int]:
            r = httpx.post(f"{server.base_url}/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        assert tokens("attn") == peft_tokens(root / "base", root / "attn", prompt)
        assert tokens("base") == peft_tokens(root / "base", None, prompt)
        r = httpx.post(f"{server.base_url}/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(root / "mlp")})
        assert r.status_code == 200, r.text
        models = {m["id"]: m.get("parent") for m in httpx.get(f"{server.base_url}/models").json()["data"]}
        assert models == {"base": None, "attn": "base", "mlp": "base"}
        assert tokens("mlp") == peft_tokens(root / "base", root / "mlp", prompt)
    finally:
        server.stop()
