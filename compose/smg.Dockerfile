# Shepherd Model Gateway (PyPI `smg`): OpenAI-compatible HTTP, cache-aware routing over the engines'
# smg gRPC protocol (services/smg). The version is the one tests/services/smg/test_router.py runs against
# (pyproject's `test` extra); tests/deploy/test_compose.py checks that they agree.
FROM python:3.12-slim

RUN pip install --no-cache-dir "smg==1.13.0"
ENTRYPOINT ["smg"]
