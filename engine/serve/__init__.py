"""`engine serve`: the three-process engine behind an OpenAI-compatible HTTP API (FastAPI on
uvicorn). The HTTP layer only translates; validation, sampling and everything else stays in the
engine, so the served and the offline engine behave the same (docs/server.md)."""
