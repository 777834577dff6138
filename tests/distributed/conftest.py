from types import SimpleNamespace

import pytest
from helpers.constrained import JSON_PROMPT, constrained_params

DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="session")
def default_reference():
    """The default model's single-rank outputs (float32), computed once: greedy 16 tokens of DEFAULT_PROMPTS
    (`prompts`, `tokens`, `texts`) and the tokens of JSON_PROMPT under the CITY schema (`constrained`)."""
    from rivulet import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=256)
    outs = llm.generate(DEFAULT_PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    constrained = llm.generate(JSON_PROMPT, constrained_params(), use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    return SimpleNamespace(prompts=DEFAULT_PROMPTS, tokens=[o.outputs[0].token_ids for o in outs],
                           texts=[o.outputs[0].text for o in outs], constrained=constrained)
