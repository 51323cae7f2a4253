"""One GPU: symm and fused compiled for real, in bf16 vs torch, with N ranks as threads sharing
the GPU (a stream each) and as 2 processes sharing it. Run by `make gpu-check`.

Autograd runs only in the process world: torch's autograd engine runs every CUDA backward node on
one thread per device, shared by all calling threads, so thread-world ranks' backward passes
would run one after another and deadlock at their first collective."""
import pytest
import torch

import overlapkernels as ok
from overlapkernels.comm.thread_world import ThreadWorld
from overlapkernels.kernels.triton.tile_gemm import GemmConfig
from test_cuda_lib import needs_cuda_library
from test_ops_tp_peer import _autograd_checks, _forward_cases_on_rank
from test_ops_tp_peer_tiles import check_tma_calls_with_straggler

pytestmark = pytest.mark.gpu
METHODS = ["symm", "fused"]
# a hang should cost seconds of a short GPU lease, not minutes (device waits give up at half this)
GPU_TIMEOUT_S = 30


@pytest.fixture(scope="module", autouse=True)
def cuda_ready():
    """The CUDA context (every module loaded: gpu_check.sh sets CUDA_MODULE_LOADING=EAGER) and
    cuBLAS made once, before the first world's ranks start their GPU_TIMEOUT_S clock."""
    if torch.cuda.is_available():
        x = torch.ones(8, 8, device="cuda")
        (x @ x).sum().item()
    yield


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_exact_bf16_with_straggler(world, method):
    assert ThreadWorld(world, device="cuda", timeout=GPU_TIMEOUT_S).run(
        _forward_cases_on_rank, method, torch.bfloat16, world - 1) == [True] * world


def _bf16_random_on_rank(ctx, method, m, k, n):
    r, w = ctx.rank, ctx.world_size
    gen = torch.Generator().manual_seed(1234)
    shards = [torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16) for _ in range(w)]
    b = torch.randn(k, n, generator=gen).to("cuda", torch.bfloat16)
    out = ok.all_gather_matmul(shards[r], b, ctx, method=method)
    want = (torch.cat(shards).float() @ b.float())
    torch.testing.assert_close(out.float(), want, atol=1e-1, rtol=1e-2)
    a_all = [torch.randn(w * m, k, generator=gen).to("cuda", torch.bfloat16) for _ in range(w)]
    out2 = ok.matmul_reduce_scatter(a_all[r], b, ctx, method=method)
    partials = [(x.float() @ b.float()).chunk(w)[r] for x in a_all]
    want2 = sum(partials)
    # each rank's partial travels rounded to bf16 (at most half an ulp: 2**-8 relative) and the fp32
    # sum is rounded once more; twice that bound per element (fp32 accumulation order differs from
    # this reference's), plus a little. Not atol/rtol on the output: partials reach ~100 where the
    # sum is near 0, and their rounding (0.8 here) is what the method does, not an error.
    bound = 2.0 ** -7 * (sum(p.abs() for p in partials) + want2.abs()) + 1e-2
    # and what the method computes, rounding for rounding: bf16 partials added in fp32 in a fixed
    # order. Equal but where a GEMM's own accumulation order tips a partial's rounding (rare).
    bf16 = torch.bfloat16
    rounded = sum(p.to(bf16).float() for p in partials).to(bf16).float()

    def judged(result):
        within, differ = bool(((result - want2).abs() <= bound).all()), float((result != rounded).float().mean())
        return within and differ < 0.01, f"rank {r}: within the bound {within}, {differ:.2%} differ from rounded"

    fine, why = judged(out2.float())
    assert fine, why
    # planted: a lost partial, and partials added in bf16 (within the bound, but rounded differently)
    lost = sum(p.to(bf16).float() for p in partials[1:]).to(bf16).float()
    in_bf16 = partials[0].to(bf16)
    for p in partials[1:]:
        in_bf16 = in_bf16 + p.to(bf16)
    return not judged(lost)[0] and not judged(in_bf16.float())[0]


@pytest.mark.parametrize("method", METHODS)
def test_bf16_random_close_to_fp32_reference(method):
    """cuBLAS may add split-K pieces in bf16 (torch allows it by default): then symm's partials carry
    more than one rounding each and the bounds above, one rounding per partial, would not hold. The
    methods' own summation is what is under test, so cuBLAS adds in fp32 here, as fused's GEMM does."""
    matmul = torch.backends.cuda.matmul
    allowed, matmul.allow_bf16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction, False
    try:
        assert ThreadWorld(4, device="cuda", timeout=GPU_TIMEOUT_S).run(_bf16_random_on_rank, method, 256, 512,
                                                                         384) == [True] * 4
    finally:
        matmul.allow_bf16_reduced_precision_reduction = allowed


def _process_world_on_rank(method, peer_memory, calls=None):
    """Two processes sharing cuda:0 (gloo for control), buffers from torch symmetric memory or
    from CUDA IPC (csrc/ipc.cu)."""
    import os

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    os.environ["OVERLAPKERNELS_PEER_MEMORY"] = peer_memory
    os.environ["OVERLAPKERNELS_PEER_TIMEOUT"] = str(GPU_TIMEOUT_S / 2)
    try:
        return (calls or _process_world_calls)(method, peer_memory)
    finally:  # the pool's processes serve later tests
        del os.environ["OVERLAPKERNELS_PEER_MEMORY"], os.environ["OVERLAPKERNELS_PEER_TIMEOUT"]


def _process_world_calls(method, peer_memory):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    r, w = dist.get_rank(), dist.get_world_size()
    for call in range(2):
        gen = torch.Generator().manual_seed(call)
        shards = [torch.randint(0, 2, (64, 96), generator=gen).to("cuda", torch.bfloat16) for _ in range(w)]
        b = torch.randint(0, 2, (96, 40), generator=gen).to("cuda", torch.bfloat16)
        out = ok.all_gather_matmul(shards[r], b, method=method)
        assert torch.equal(out, (torch.cat(shards).float() @ b.float()).to(torch.bfloat16)), call
        a_all = [torch.randint(0, 2, (w * 32, 96), generator=gen).to("cuda", torch.bfloat16) for _ in range(w)]
        out2 = ok.matmul_reduce_scatter(a_all[r], b, method=method)
        want = sum(x.float() @ b.float() for x in a_all).chunk(w)[r].to(torch.bfloat16)
        assert torch.equal(out2, want), call
    _autograd_checks(None, r, w, torch.device("cuda", 0), method)  # fp32, dgrad/wgrad through the dual ops
    torch.cuda.synchronize()
    from overlapkernels.comm.process_world import process_peer_world

    assert process_peer_world(dist.group.WORLD, torch.device("cuda", 0)).peer_memory == peer_memory
    return True


@pytest.mark.parametrize("peer_memory", ["symm_mem", pytest.param("ipc", marks=needs_cuda_library)])
@pytest.mark.parametrize("method", METHODS)
def test_process_world_two_processes_one_gpu(rank_pool, method, peer_memory):
    assert rank_pool(2).run(_process_world_on_rank, method, peer_memory) == [True, True]


def _tma_calls(method, peer_memory):
    """The fused GEMMs' TMA configs, bf16 0/1 inputs (exact): 192 rows a chunk (the last 128-row
    tile reads 64 rows of the next chunk, masked on store), K 200 (ragged for 64-wide K blocks: the
    descriptor reads 0 past it, partials below 256 stay exact in bf16), both weight layouts."""
    import torch.distributed as dist

    from overlapkernels.kernels.triton.tile_gemm import forced_gemm_config, tma_operands

    torch.cuda.set_device(0)
    r, w = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)

    def ints(*shape):
        return torch.randint(0, 2, shape, generator=gen).to("cuda", torch.bfloat16)

    shards, a_all = [ints(192, 200) for _ in range(w)], [ints(w * 192, 200) for _ in range(w)]
    exact = []
    for cfg in TMA_CONFIGS:
        for b in (ints(200, 296), ints(296, 200).t()):
            assert tma_operands(a_all[r], b, cfg)[0], (cfg, b.stride())
            with forced_gemm_config(cfg):
                out = ok.all_gather_matmul(shards[r], b, method=method)
                out2 = ok.matmul_reduce_scatter(a_all[r], b, method=method)
            exact.append(torch.equal(out, (torch.cat(shards).float() @ b.float()).to(torch.bfloat16))
                         and torch.equal(out2, sum(x.float() @ b.float() for x in a_all).chunk(w)[r].to(torch.bfloat16)))
    torch.cuda.synchronize()
    return exact


# (the first stores the all-gather GEMM's output through descriptors too)
TMA_CONFIGS = [GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma=True, tma_store=True),
               GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True)]


def test_fused_tma_configs_two_processes_one_gpu(rank_pool):
    """The TMA configs bench_fused_gemm times, for real (sm_90+): descriptor loads after the
    chunk's flag and a proxy fence, descriptor stores per chunk. Not a default yet; this is what a
    default switch would rest on."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90 or later")
    assert rank_pool(2).run(_process_world_on_rank, "fused", "symm_mem", _tma_calls) == [[True] * 4] * 2


@pytest.mark.parametrize("world", [2, 4])
def test_fused_tma_configs_thread_world_with_straggler(monkeypatch, world):
    """The same TMA configs with ranks as threads sharing the GPU (one context: the warm-up's
    barriers matter), a straggler, three calls, ragged rows/K/N (test_ops_tp_peer_tiles.py)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90 or later")
    check_tma_calls_with_straggler(monkeypatch, world, TMA_CONFIGS, device="cuda", timeout=GPU_TIMEOUT_S)
