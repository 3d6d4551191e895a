"""Imported first by the serve tests: they skip where the serve extra and the HTTP clients are missing (the GPU
machine has none of them)."""

import pytest

for _m in ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai"):
    pytest.importorskip(_m, reason="the serve stack is not installed: pip install -e '.[test]'")
