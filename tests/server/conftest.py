"""Fixtures for the server tests: one real ``rivulet serve`` shared by the read-only tests of this
folder (destructive tests start their own), and clients for it."""

from __future__ import annotations

from typing import Iterator

import httpx
import openai
import pytest

from server_helpers import ServerProcess


@pytest.fixture(scope="package")
def server() -> Iterator[ServerProcess]:
    """The default model on a free loopback port (context 512, room for the 200-stream load test)."""
    proc = ServerProcess("--max-model-len", "512", "--max-num-seqs", "64", "--served-model-name", "smol")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="package")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="package")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
