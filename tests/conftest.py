import pytest

from rankpool import RankPool


@pytest.fixture(scope="session")
def ranks():
    """Two gloo ranks with DeepSpeed initialised, shared by every test of the session."""
    pool = RankPool()
    yield pool
    pool.close()
