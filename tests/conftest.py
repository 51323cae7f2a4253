"""Shared test set-up: the Triton interpreter on CPU, seeds, the gpu marker, rank pools."""
import os
import signal

import torch

# Before any kernel module is imported: @triton.jit decides at definition time whether it
# builds an interpreted function.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from overlapkernels.comm.rank_pool import RankPool, preload_in_ranks  # noqa: E402

# What torch.compile imports at a rank's first compile (aot_eager), once in the forkserver instead
# of in every rank of every pool: ~10 s of CI's two cores (tests/test_gpt_gloo.py's compiled case:
# 18 s -> 14 s). What these modules read from the environment at import is then fixed when the
# first pool starts, as torch's own is.
preload_in_ranks("torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compiler_bisector",
                 "torch._inductor.pattern_matcher")

POOL_MAX_GROUPS = 96  # ~4-6 respawns of the 4-rank pool a session (a few seconds each), none mid-test


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# A time limit's SIGTERM (`make gpu-check` runs each step under `timeout`) stops pytest as Ctrl-C
# does: it still prints its summary and writes the junit XML of the tests that ran.
signal.signal(signal.SIGTERM, _interrupt)


def pytest_configure(config):
    # also here, not only in pytest.ini: `pytest -c other.ini` or `--strict-markers` from elsewhere
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with `make gpu-check`); skipped without one")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make gpu-check)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(n)``: the session's gloo pool of n CPU ranks, spawned on first use."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            # respawned when its ranks hold many process groups (see RankPool's max_groups)
            pools[world_size] = RankPool(world_size, timeout=120.0, max_groups=POOL_MAX_GROUPS)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo world of one in the pytest process (ops with group=None, layers on a 1-rank group),
    torn down after the module; launcher variables are set aside meanwhile."""
    env = {k: os.environ.pop(k, None) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    created = not dist.is_initialized()
    try:
        if created:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.get_world_size() == 1
        yield
    finally:
        if created:
            dist.destroy_process_group()
        os.environ.update({k: v for k, v in env.items() if v is not None})


@pytest.fixture
def use_lib(monkeypatch):
    """``use_lib(path)``: the CUDA library loader reads ``path`` next (OVERLAPKERNELS_CUDA_LIB), as
    if nothing were loaded yet; forgotten after the test."""
    from overlapkernels.kernels import cuda as cuda_lib

    def use(path):
        monkeypatch.setenv("OVERLAPKERNELS_CUDA_LIB", str(path))
        monkeypatch.setattr(cuda_lib, "_lib", None)
    yield use
    cuda_lib._lib = None
