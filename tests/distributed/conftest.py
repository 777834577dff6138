import pytest

DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="session")
def default_reference():
    """The default model's single-rank greedy outputs (float32, 16 tokens) of DEFAULT_PROMPTS, computed once."""
    from rivulet import LLM, SamplingParams

    outs = LLM(dtype="float32", max_model_len=256).generate(
        DEFAULT_PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return DEFAULT_PROMPTS, [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]
