"""`rivulet bench` bad input: one `rivulet: error: ...` line, exit 2, no traceback."""

from __future__ import annotations

import json
import sys

import pytest

from rivulet.entrypoints.cli import main


def _error_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("rivulet: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == errors[0]
    return errors[0]


SERVE = ["bench", "serve", "--disable-tqdm"]


@pytest.mark.parametrize("args,fragment", [
    ([], "give --request-rate R or --max-concurrency C"),
    (["--max-concurrency", "4", "--slo", "ttft=fast"], "bad --slo"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--request-rate", "-2"], "--request-rate must be > 0"),
    (["--sweep", "1,x"], "bad --sweep"),
    (["--sweep", "1.5,2"], "bad --sweep"),
    (["--sweep", "1,4", "--max-concurrency", "2"], "replaces --max-concurrency"),
    (["--max-concurrency", "2", "--endpoint", "chat", "--prompt-format", "ids"], "--endpoint chat needs"),
    (["--max-concurrency", "2", "--extra-body", "[1]"], "bad --extra-body"),
    (["--max-concurrency", "2", "--base-url", "localhost:1"], "bad --base-url"),
    (["--max-concurrency", "2", "--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
    (["--max-concurrency", "2", "--timeout", "0"], "--timeout must be > 0"),
    # checked before the run (which once ran to its end, then failed to write)
    (["--max-concurrency", "2", "--result-json", "/proc/no/such/r.json"], "--result-json /proc/no/such/r.json: cannot"),
    (["--max-concurrency", "2", "--result-json", "/"], "not a writable file path"),
])
def test_serve_bad_input(capsys, args, fragment):
    assert fragment in _error_line(capsys, SERVE + args)


def test_serve_unknown_tokenizer_and_bad_model(capsys, fake):
    line = _error_line(capsys, SERVE + ["--base-url", fake.url, "--max-concurrency", "1"])
    assert "cannot find a tokenizer for 'fake'" in line and "--tokenizer" in line
    fake.state.fail_every = 1
    line = _error_line(capsys, SERVE + ["--base-url", fake.url, "--max-concurrency", "1", "--tokenizer", "default",
                                        "--num-prompts", "2", "--input-len", "4", "--output-len", "2"])
    assert "the warm-up request failed: HTTP 500: boom" in line


def test_serve_against_the_fake_server_writes_json(capsys, fake, tmp_path):
    fake.state.ttft, fake.state.tpot = 0.05, 0.01
    out = tmp_path / "r.json"
    assert main(SERVE + ["--base-url", fake.url, "--tokenizer", "default", "--num-prompts", "6", "--input-len", "16",
                         "--output-len", "4", "--request-rate", "inf", "--max-concurrency", "3", "--slo", "ttft=500",
                         "--result-json", str(out), "--label", "fake-system", "--temperature", "0.7",
                         "--top-p", "0.9", "--top-k", "50"]) == 0
    data = json.loads(out.read_text())
    assert data["label"] == "fake-system" and data["model"] == "fake" and len(data["points"]) == 1
    p = data["points"][0]
    assert p["completed"] == 6 and p["max_concurrency"] == 3 and p["request_rate"] is None and p["good_requests"] == 6
    assert fake.state.max_in_flight == 3 and len(fake.state.bodies) == 7  # 1 warm-up
    body = fake.state.bodies[-1]  # vLLM's client flags, sent as the API's fields; min_p not given, not sent
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 50) and "min_p" not in body
    assert "Successful requests:" in capsys.readouterr().out


def test_plot_errors(capsys, tmp_path, monkeypatch):
    assert "cannot read result JSON" in _error_line(capsys, ["bench", "plot", str(tmp_path / "nope.json"), "-o",
                                                             str(tmp_path / "x.png")])
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert "not a `rivulet bench serve` result" in _error_line(capsys, ["bench", "plot", str(bad), "-o", "x.png"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    line = _error_line(capsys, SERVE + ["--max-concurrency", "1", "--plot", str(tmp_path / "x.png")])
    assert line == "rivulet: error: plotting needs matplotlib: pip install 'rivulet[bench]'"


def test_offline_bad_input(capsys):
    assert "unknown backend 'vllm'" in _error_line(capsys, ["bench", "throughput", "--backend", "vllm"])
    assert "--output-len >= 2" in _error_line(capsys, ["bench", "latency", "--output-len", "1"])


def test_sweep_with_prompts_per_concurrency(capsys, fake, tmp_path):
    fake.state.ttft, fake.state.tpot = 0.02, 0.01
    out = tmp_path / "s.json"
    assert main(SERVE + ["--base-url", fake.url, "--tokenizer", "default", "--input-len", "8", "--output-len", "3",
                         "--sweep", "1,3", "--prompts-per-concurrency", "2", "--num-warmups", "0",
                         "--result-json", str(out)]) == 0
    pts = json.loads(out.read_text())["points"]
    assert [(p["max_concurrency"], p["num_prompts"], p["completed"]) for p in pts] == [(1, 2, 2), (3, 6, 6)]
    assert fake.state.max_in_flight == 3
    assert "needs a positive K" in _error_line(capsys, SERVE + ["--max-concurrency", "2",
                                                                "--prompts-per-concurrency", "2"])
