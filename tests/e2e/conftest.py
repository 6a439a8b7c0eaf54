import pytest

from tests.helpers.learning import learning_models


@pytest.fixture
def model_cache_env(model_cache, monkeypatch):
    """The embedded default with its full warm-up (built once per session), for the learning runs."""
    monkeypatch.setenv("MILES_CACHE", str(learning_models(model_cache)))
