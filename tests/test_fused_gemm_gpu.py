"""The fused all-gather GEMM kernel alone on one GPU: no peers, every chunk marked arrived, so a
wrong tile, a TMA descriptor the installed triton builds differently, or a layout (a linear
layer's transposed weight, rows past a chunk's end, a ragged K) fails here as a wrong number in
the early `make gpu-check` step - not as a hang among the one-GPU worlds' tests, where the same
kernel also waits on flags. Compared with fp32 torch.mm of the same bf16 operands."""
import pytest
import torch

from overlapkernels.kernels.errors import new_error_record
from overlapkernels.kernels.triton.ag_gemm import ag_gemm
from overlapkernels.kernels.triton.signals import FLAG_DTYPE, wait_budget
from overlapkernels.kernels.triton.tile_gemm import GemmConfig, tma_output

pytestmark = pytest.mark.gpu

CONFIGS = {
    "default": None,  # gemm_config's choice for the shape
    "small": GemmConfig(64, 128, 64, num_warps=4, num_stages=4),
    "tma-128x256": GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma=True),
    "tma-128x128": GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True),
    # output tiles through a per-chunk descriptor: rows past a chunk's end must be clipped, not stored
    "tma-store-128x256": GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma=True, tma_store=True),
    "store-only-128x256": GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma_store=True),
    # two programs per SM (a grid twice the SMs): bench_fused_gemm times it
    "tma-store-128x128-2/SM": GemmConfig(128, 128, 64, num_warps=4, num_stages=2, tma=True, tma_store=True,
                                         programs_per_sm=2),
}
# (world, rows per chunk, K, N): whole tiles; then rows, K and N that end mid-tile (TMA reads the
# next chunk's rows there: masked on store), with 16-byte row strides so descriptors still qualify
SHAPES = [(2, 256, 512, 512), (4, 100, 200, 136)]


def fused_gemm_case(device, dtype, world, m, k, n, config, weight_layout):
    gen = torch.Generator().manual_seed(world * 1000 + m + k + n)
    a_full = torch.randn(world * m, k, generator=gen).to(device, dtype)
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    b = w.t() if weight_layout == "linear" else w.t().contiguous()  # [K, N]: a linear's weight or row-major
    out = torch.full((world * m, n), float("nan"), dtype=dtype, device=device)
    err = new_error_record(device)
    arrived = torch.ones(world, dtype=FLAG_DTYPE, device=device)
    ag_gemm(a_full, b, out, arrived, err, rank=world - 1, world_size=world, epoch=1,
            budget=wait_budget(5.0, torch.device(device)), config=config)
    want = a_full.float() @ b.float()
    return out.float(), want, err[:4].tolist()


@pytest.mark.parametrize("weight_layout", ["row-major", "linear"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
def test_fused_gemm_alone_matches_torch(config, shape, weight_layout):
    if CONFIGS[config] is not None and CONFIGS[config].tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90 or later")
    cfg = CONFIGS[config]
    if cfg is not None and cfg.tma_store and torch.cuda.get_device_capability() >= (9, 0):  # not a silent fallback
        assert tma_output(torch.empty(shape[0] * shape[1], shape[3], dtype=torch.bfloat16, device="cuda"),
                          shape[0], cfg)[0]
    got, want, err = fused_gemm_case("cuda", torch.bfloat16, *shape, cfg, weight_layout)
    assert err == [0, 0, 0, 0]
    # bf16 output: half an ulp (2**-9 relative) of rounding, plus fp32 sums in another order; a
    # wrong tile or chunk is off by the size of the values (~sqrt(K) = 14-22)
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0.05)
