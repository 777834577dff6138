"""The command line: output on the default model, and one clear line (no traceback) for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from rivulet.entrypoints.cli import main


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "rivulet.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_generate_prints_the_greedy_continuation():
    r = _run(["generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
              "--dtype", "float32", "--json"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"].startswith(" Paris") and len(out["token_ids"]) == 8
    assert "Traceback" not in r.stderr


def test_prompt_longer_than_the_context_is_one_line():
    r = _run(["generate", "--prompt", "word " * 300, "--max-model-len", "128"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("rivulet: error: this model's maximum context length is 128")


def _error_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()  # drop what fixtures printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("rivulet: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == errors[0]  # the error is the last word
    return errors[0]


def test_missing_model(capsys, tmp_path):
    assert "model not found" in _error_line(capsys, ["generate", "--prompt", "hi", "--model", str(tmp_path / "nope")])
    assert "neither a config.json nor a .gguf" in _error_line(capsys, ["generate", "--prompt", "hi", "--model",
                                                                       str(tmp_path)])


def test_missing_weights(capsys, tmp_path, tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    assert "no *.safetensors weights" in _error_line(capsys, ["generate", "--prompt", "hi", "--model", str(tmp_path)])


def test_unknown_architecture(capsys, tmp_path, tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    line = _error_line(capsys, ["generate", "--prompt", "hi", "--model", str(tmp_path)])
    assert "unsupported architecture 'GPTBigCodeForCausalLM'" in line and "LlamaForCausalLM" in line


def test_unsupported_gguf_type(capsys, tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, gguf.GGML_QUANT_SIZES[QT.IQ3_S][1]), np.uint8), raw_dtype=QT.IQ3_S)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    line = _error_line(capsys, ["generate", "--prompt", "hi", "--model", str(tmp_path / "m.gguf")])
    assert "unsupported GGUF tensor type" in line and "IQ3_S" in line


def test_text_prompt_for_a_model_without_tokenizer(capsys, tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    assert "no tokenizer" in _error_line(capsys, ["generate", "--prompt", "hi", "--model", str(path)])


def test_no_prompt(capsys):
    assert "no prompt given" in _error_line(capsys, ["generate"])


@pytest.mark.parametrize("flag, reason", [
    (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--dtype", "float16"], "dtype float16 is not supported on cpu; use one of: float32, bfloat16"),
])
def test_bad_sampling_or_dtype(capsys, flag, reason):
    assert _error_line(capsys, ["generate", "--prompt", "hi", *flag]) == f"rivulet: error: {reason}"


def test_chat_streams_a_reply_and_exits_on_eof():
    r = subprocess.run([sys.executable, "-m", "rivulet.entrypoints.cli", "chat", "--temperature", "0",
                        "--max-tokens", "12"], input="What is the capital of France?\n", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "KV cache:" in r.stderr  # the cache size is reported at start-up


def test_generate_from_a_jsonl_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text('"The capital of France is"\n{"prompt": "def add(a, b):"}\n\n')
    r = _run(["generate", "--prompts-file", str(f), "--max-tokens", "6", "--temperature", "0", "--json",
              "--dtype", "float32"])
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    prompts = ["The capital of France is", "def add(a, b):"]
    assert [row["prompt"] for row in rows] == prompts
    # each line is the engine's greedy answer to its own prompt (not a batch-mate's, not truncated)
    from rivulet import LLM, SamplingParams

    llm = LLM(dtype="float32")
    want = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    llm.shutdown()
    assert [row["token_ids"] for row in rows] == [o.outputs[0].token_ids for o in want]
    assert [row["text"] for row in rows] == [o.outputs[0].text for o in want]
    assert [row["finish_reason"] for row in rows] == [o.outputs[0].finish_reason for o in want]
