"""The router: one OpenAI-compatible endpoint in front of many engine replicas.

``workers.py`` (health, load, circuit breakers) → ``policies.py`` (which worker; ``prefix_tree.py``
for cache-aware routing) → ``proxy.py`` (retries before the first byte, ``failover.py`` resumes a
stream after it) → ``app.py`` (the HTTP endpoints and ``rivulet router``). It talks HTTP only and
knows nothing of models or the engine.
"""
