"""The OpenAI-compatible HTTP server (``rivulet serve``).

FastAPI + uvicorn in the API-server process; the engine runs in its own process behind
``rivulet.engine.async_llm.AsyncLLM``. Modules:

- ``protocol``: request and response models (pydantic), request -> ``SamplingParams``
- ``errors``: the OpenAI error body and the exception handlers that produce it
- ``engine_client``: the engine interface the handlers rely on
- ``serving_base``: what the endpoints share (model names, admission, prompts, streaming helpers)
- ``serving_completion`` / ``serving_chat`` / ``serving_tokenization``: the endpoints
- ``logprobs``: engine logprobs -> the OpenAI logprobs objects
- ``metrics``: Prometheus metrics, one registry per app
- ``api_server``: the app, its gate middleware (auth, draining), and the process (signals, drain)
"""
