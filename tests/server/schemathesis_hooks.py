"""Schemathesis hooks for the fuzz test (loaded through SCHEMATHESIS_HOOKS): keep generation requests
small so a CPU engine answers each within seconds, and drop the generated ``model`` name (a random
one is a 404 before anything else is looked at, which would hide the rest of the request). Every
other generated value, valid or not, reaches the server as generated."""

from __future__ import annotations

from typing import Any

import schemathesis

LIMITS = {"n": 2, "max_tokens": 2, "max_completion_tokens": 2, "min_tokens": 2}


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    body.pop("model", None)
    for key, limit in LIMITS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            body[key] = limit
    if "max_tokens" in body and body["max_tokens"] is None:
        body["max_tokens"] = 2  # null means the rest of the context
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2  # chat's default is the rest of the context
