import pytest


@pytest.fixture
def model_cache_env(model_cache, monkeypatch):
    """The embedded default with its full warm-up (built once per session), for the learning runs."""
    monkeypatch.setenv("MILES_CACHE", str(model_cache / "full-warm-up"))
