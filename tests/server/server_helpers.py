"""A real ``rivulet serve`` subprocess on a free loopback port, and small HTTP helpers for the tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

# Small engines: a 256 MiB KV cache loads quickly and makes block usage visible.
DEFAULT_ARGS = ("--dtype", "float32", "--kv-cache-memory", str(256 << 20), "--disable-uvicorn-access-log")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m rivulet.entrypoints.cli serve`` with its output in a log file."""

    def __init__(self, *args: str, startup_timeout: float = 180.0, engine_defaults: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="rivulet-serve-", suffix=".log", delete=False)
        # PASSIVE: idle OpenMP threads sleep instead of spinning, so the server, its engine and the test
        # client share 2 cores without starving each other
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONWARNINGS": "ignore",
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "rivulet.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port",
               str(self.port), *(DEFAULT_ARGS if engine_defaults else DEFAULT_ARGS[-1:]), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rivulet serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"rivulet serve did not become healthy in {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def engine_pid(self) -> int:
        """The engine process: the server's child running ``rivulet.engine.core_proc``."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"rivulet.engine.core_proc" in cmdline:
                return int(entry.name)
        raise RuntimeError("no engine process found")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {"name{labels}": value} (and the bare name for the first sample of each)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            out.setdefault(key.split("{", 1)[0], float(value))
        return out

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def sse_events(lines: list[str]) -> list[Any]:
    """The ``data:`` payloads of an SSE body: parsed JSON, or the string ``[DONE]``."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def assert_error_body(response: httpx.Response, status: int) -> dict[str, Any]:
    """The response is ``status`` with an OpenAI error body; returns ``body["error"]``."""
    assert response.status_code == status, (response.status_code, response.text)
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err
