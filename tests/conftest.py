import os
import pathlib
import sys
import time

# Inductor's caches per checkout, not the machine-wide /tmp/torchinductor_<user>: a cache hit
# skips lowering, so a graph compiled by another run on this machine (`make demo`, an older
# checkout) hid that inductor refuses to lower it under CI=true (stop 25: aten.addmm_). A clean
# clone now compiles every graph of the suite at least once. Spawned ranks inherit it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "torchinductor"))

# DeepSpeed's JIT-built ops per venv, not the machine-wide ~/.cache/torch_extensions: two venvs
# (another torch, a fresh clone) sharing it rebuild each other's ops, and a build killed midway
# leaves a lock that hangs every later DeepSpeed init of every venv.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(pathlib.Path(sys.prefix) / "torch_extensions"))

import pytest

from rankpool import RankPool

STALE_LOCK_S = 600


def pytest_configure(config):
    """Build DeepSpeed's CPU shared-memory comm op once, here, before any rank starts.

    Otherwise the first two ranks build it concurrently under torch's file lock; a rank killed
    while holding that lock (a scenario that fails during start-up) leaves it behind and every later
    DeepSpeed init waits on it forever. A lock older than 10 minutes is such a leftover."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from torch.utils.cpp_extension import _get_build_directory

    lock = pathlib.Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    from deepspeed.comm.torch import build_shm_op
    build_shm_op()


@pytest.fixture(scope="session")
def ranks():
    """Two gloo ranks with DeepSpeed initialised, shared by every test of the session."""
    pool = RankPool()
    yield pool
    pool.close()
