"""The fused GEMMs' tiles and warm-up in the thread world (Triton interpreter): rectangular tiles
with ragged edges, every tile config gemm_config hands out on GPUs, the rules that pick one per GPU
(a pure function of the call), matmul_reduce_scatter when the tile count changes between calls, and
the GPU warm-up launches (scratch buffers only; barriers only in a shared context). Every result is
compared bitwise (0/1 inputs). The algorithms, autograd and timeouts: test_ops_tp_peer.py."""
import time

import pytest
import torch

import overlapkernels as ok
from overlapkernels.comm.thread_world import ThreadWorld
from overlapkernels.kernels.triton import tile_gemm as TG
from overlapkernels.kernels.triton.tile_gemm import INTERPRETER_GEMM, GemmConfig, forced_gemm_config, gemm_config
from test_ops_tp_peer import METHODS, STRAGGLER_DELAY_S, _ints


def _tile_shapes_on_rank(ctx, k, method="fused", m=40, n=48):
    r, w = ctx.rank, ctx.world_size
    shards = [_ints((m, k), torch.float32, q) for q in range(w)]
    b = _ints((k, n), torch.float32, 50)
    out = ok.all_gather_matmul(shards[r], b, ctx, method=method)
    assert torch.equal(out, torch.cat(shards) @ b)
    a_all = [_ints((w * m, k), torch.float32, 60 + q) for q in range(w)]
    out = ok.matmul_reduce_scatter(a_all[r], b, ctx, method=method)
    assert torch.equal(out, sum(x @ b for x in a_all).chunk(w)[r])
    return True


@pytest.mark.parametrize("k", [32, 40])  # K a multiple of BLOCK_K (unmasked loads) or not
def test_fused_rectangular_tiles_with_remainders(k):
    """The CUDA configs use BLOCK_M != BLOCK_N and drop the K mask when K divides: run those code
    paths in the interpreter with small tiles, 40 rows x 48 columns per chunk -> 3 x 2 tiles, each
    with a ragged edge, so a wrong tile index or mask shows up as a wrong value."""
    with forced_gemm_config(GemmConfig(16, 32, 16)):
        assert ThreadWorld(2, timeout=60).run(_tile_shapes_on_rank, k) == [True, True]


def _fp16_sums_on_rank(ctx):
    """fp16 with one nonzero product per K block: 2048, then 1, then 1. Accumulated in fp32 the sum is
    2050, exact in fp16; accumulated in fp16 each +1 rounds away (2049 is not an fp16)."""
    w = ctx.world_size
    b = torch.zeros(48, 16, dtype=torch.float16)
    b[0], b[16], b[32] = 2048, 1, 1
    out = ok.all_gather_matmul(torch.ones(16, 48, dtype=torch.float16), b, ctx, method="fused")
    out2 = ok.matmul_reduce_scatter(torch.ones(w * 16, 48, dtype=torch.float16), b, ctx, method="fused")
    return out.unique().tolist(), out2.unique().tolist()


@pytest.mark.parametrize("tma", [False, True])
def test_fused_gemm_tiles_accumulate_in_fp32(tma):
    with forced_gemm_config(GemmConfig(16, 16, 16, tma=tma)):
        assert ThreadWorld(2, timeout=60).run(_fp16_sums_on_rank) == [([2050.0], [4100.0])] * 2


GPU_GEMM_CONFIGS = {name: getattr(TG, name) for name in ("CUDA_GEMM_16BIT", "CUDA_GEMM_16BIT_SMALL", "CUDA_GEMM_FP32",
                                                             "SMALL_SMEM_GEMM", "SMALL_SMEM_GEMM_SMALL")}


@pytest.mark.parametrize("name", list(GPU_GEMM_CONFIGS))
def test_fused_ops_with_every_gpu_tile_config(name):
    """The exact tiles gemm_config hands out on GPUs (128x256x64, ...), which the interpreter's
    default never uses: chunks of BLOCK_M + 7 rows x BLOCK_N + 9 columns (2 x 2 ragged tiles each),
    K a multiple of BLOCK_K (the unmasked loop the 16-bit GPU configs require) and not."""
    cfg = GPU_GEMM_CONFIGS[name]
    with forced_gemm_config(cfg):
        for k in (cfg.block_k, cfg.block_k + 8):
            assert ThreadWorld(2, timeout=60).run(_tile_shapes_on_rank, k, "fused", cfg.block_m + 7,
                                                  cfg.block_n + 9) == [True, True], k


def test_gemm_config_is_a_pure_function_of_the_call():
    """gemm_rs owners wait for a tile count every rank derives on its own: same inputs, same config."""
    cfg = gemm_config(torch.device("cpu"), torch.float16, 7, 5, 33)
    assert cfg == INTERPRETER_GEMM and cfg.tiles(7, 5) == 1 and cfg.tiles(65, 129) == 2 * 3
    assert cfg.meta(64)["EVEN_K"] and not cfg.meta(33)["EVEN_K"]
    with forced_gemm_config(GemmConfig(16, 32, 16)) as forced:
        assert gemm_config(torch.device("cpu"), torch.float16, 7, 5, 33) is forced
    assert gemm_config(torch.device("cpu"), torch.float16, 7, 5, 33) == INTERPRETER_GEMM


def test_two_programs_per_sm_config():
    """``programs_per_sm=2`` only doubles the persistent grid on GPUs (test_process_world_gloo checks
    the count): the kernels run it as any config, named apart in reports; other counts are refused."""
    cfg = GemmConfig(16, 32, 16, tma=True, tma_store=True, programs_per_sm=2)
    assert str(cfg) == "16x32x16 w4 s3 tma tma-store 2/SM" and str(GemmConfig(16, 32, 16)) == "16x32x16 w4 s3"
    with pytest.raises(ValueError, match=r"GemmConfig programs_per_sm=3: expected 1 or 2"):
        GemmConfig(16, 32, 16, programs_per_sm=3)
    with forced_gemm_config(GemmConfig(16, 32, 16, programs_per_sm=2)):
        assert ThreadWorld(2, timeout=60).run(_tile_shapes_on_rank, 40) == [True, True]


def _rs_tile_counts_change_on_rank(ctx):
    r, w = ctx.rank, ctx.world_size
    b = _ints((32, 48), torch.float32, 70)
    for call, cfg in enumerate([GemmConfig(64, 64, 32), GemmConfig(16, 16, 16), GemmConfig(32, 16, 16)]):
        with_cfg = [_ints((w * 40, 32), torch.float32, 80 + 10 * call + q) for q in range(w)]
        ctx.barrier()  # every rank is past its previous call before the config changes under it
        if r == 0:
            _FORCED.append(cfg)
        ctx.barrier()
        out = ok.matmul_reduce_scatter(with_cfg[r], b, ctx, method="fused")
        assert torch.equal(out, sum(x @ b for x in with_cfg).chunk(w)[r]), call
    return True


_FORCED: list = []


def test_fused_reduce_scatter_when_the_tile_count_changes_between_calls(monkeypatch):
    """Same (m, n) workspace, three tile configs (1, 9 and 6 tiles per chunk): the owner must wait
    for the counts actually sent so far. Waiting for epoch * tiles (the old target) times out on
    the second call or reads partial sums on the third."""
    import overlapkernels.ops._peer_methods as pm

    monkeypatch.setattr(pm, "gemm_config", lambda *args: _FORCED[-1])
    _FORCED.clear()
    assert ThreadWorld(2, timeout=20).run(_rs_tile_counts_change_on_rank) == [True, True]


def _warmup_launches_on_rank(ctx, method):
    from overlapkernels.kernels.triton.signals import wait_budget
    from overlapkernels.ops import _kernel_warmup as warmup

    budget = wait_budget(5.0, ctx.device)
    a, bs = _ints((7, 32), torch.float32, ctx.rank), [_ints((32, 48), torch.float32, 1), _ints((32, 5), torch.float32, 2)]
    warmup.all_gather_matmul(ctx, method, a, bs, budget)
    a2 = _ints((2 * 7, 32), torch.float32, 3)
    warmup.reduce_scatter(ctx, method, a2, bs[0], 7, 48, budget, GemmConfig(16, 16, 16))
    warmup.reduce_scatter(ctx, "symm", a2, None, 7, 32, budget)
    # warm-up writes only scratch buffers: the real ops still give exact results afterwards
    return _tile_shapes_on_rank(ctx, 32, method)


@pytest.mark.parametrize("method", METHODS)
def test_gpu_warmup_launches_touch_only_scratch(method):
    """On GPUs the first call of each op signature launches every kernel on scratch buffers before
    any rank spins (kernel loading may need a context-wide sync). Those launches run here, in the
    interpreter, so a broken warm-up is caught without a GPU."""
    assert ThreadWorld(2, timeout=60).run(_warmup_launches_on_rank, method) == [True, True]


class _FakeCudaWorld:
    device = torch.device("cuda", 0)

    def __init__(self, shares_context):
        self.shares_context, self.barriers, self._spaces = shares_context, 0, {}

    def workspace(self, key, make):
        return self._spaces.setdefault(key, make(self))

    def barrier(self):
        self.barriers += 1


@pytest.mark.parametrize("shares_context, barriers", [(True, 2), (False, 0)])
def test_warmup_meets_at_barriers_only_in_a_shared_context(monkeypatch, shares_context, barriers):
    """Processes of their own warm up alone: a rank-local signature part (TF32, alignment) that
    differed between ranks would otherwise pair barriers wrongly. One context (threads) must meet."""
    from overlapkernels.ops import _kernel_warmup as warmup

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    world, launches = _FakeCudaWorld(shares_context), []
    for key in ("a", "a", "b"):
        warmup.warm(world, key, lambda k=key: launches.append(k))
    assert launches == ["a", "b"] and world.barriers == 2 * barriers


@pytest.mark.parametrize("smem_kb, dtype, rows, n, k, want", [
    (227, torch.bfloat16, 4096, 8192, 1024, "CUDA_GEMM_16BIT"),        # H100/H200, a large chunk
    (227, torch.bfloat16, 4096, 8192, 1376, "CUDA_GEMM_16BIT_SMALL"),  # ragged K: the big tile spills
    (227, torch.bfloat16, 32, 8192, 1024, "CUDA_GEMM_16BIT_SMALL"),    # few rows per chunk
    (227, torch.bfloat16, 64, 8192, 1024, "CUDA_GEMM_16BIT_SMALL"),    # the edge: 64 rows is still few
    (227, torch.bfloat16, 65, 8192, 1024, "CUDA_GEMM_16BIT"),
    (227, torch.float32, 4096, 8192, 1024, "CUDA_GEMM_FP32"),
    (163, torch.float16, 4096, 8192, 1024, "CUDA_GEMM_16BIT"),         # A100
    (99, torch.bfloat16, 4096, 8192, 1024, "SMALL_SMEM_GEMM"),         # ~100 KB parts
    (99, torch.float32, 4096, 8192, 1024, "SMALL_SMEM_GEMM_SMALL")])
def test_gemm_config_rules_per_gpu(monkeypatch, smem_kb, dtype, rows, n, k, want):
    from overlapkernels.kernels.triton import tile_gemm

    monkeypatch.setattr(tile_gemm, "shared_memory_per_block", lambda device: smem_kb << 10)
    assert tile_gemm.gemm_config(torch.device("cuda", 0), dtype, rows, n, k) is getattr(tile_gemm, want)


def _tma_tiles_on_rank(ctx, k, weight_layout, m=40, n=48):
    """fp16 (the TMA path is 16-bit only), 0/1 inputs: exact. ``weight_layout``: b as [K, N] rows or
    as a linear layer's weight [N, K] transposed (the K-major descriptor)."""
    r, w = ctx.rank, ctx.world_size
    dt = torch.float16
    b = _ints((k, n), dt, 50) if weight_layout == "rows" else _ints((n, k), dt, 50).t()
    shards = [_ints((m, k), dt, q) for q in range(w)]
    out = ok.all_gather_matmul(shards[r], b, ctx, method="fused")
    a_all = [_ints((w * m, k), dt, 60 + q) for q in range(w)]
    out2 = ok.matmul_reduce_scatter(a_all[r], b, ctx, method="fused")
    return (torch.equal(out, (torch.cat(shards).float() @ b.float()).to(dt))
            and torch.equal(out2, sum(x.float() @ b.float() for x in a_all).chunk(w)[r].to(dt)))


def spy_tma_operands(monkeypatch) -> dict:
    """Records, per GEMM ("ag", "rs"), whether each launch took the TMA loads."""
    from overlapkernels.kernels.triton import ag_gemm as AG, gemm_rs as RS

    used = {"ag": [], "rs": []}
    for name, module in (("ag", AG), ("rs", RS)):
        def spy(a, b, config, real=TG.tma_operands, seen=used[name]):
            picked = real(a, b, config)
            seen.append(picked[0])
            return picked
        monkeypatch.setattr(module, "tma_operands", spy)
    return used


@pytest.mark.parametrize("weight_layout", ["rows", "weight.t()"])
@pytest.mark.parametrize("k, tma_used", [(32, True), (40, True), (36, False)])
def test_fused_tma_loads(monkeypatch, weight_layout, k, tma_used):
    """A TMA config reads A and B through tensor descriptors: tiles addressed by their chunk's first
    row, chunks of 40 rows in 16-row tiles (the last tile's rows past the chunk read the next chunk's,
    masked on store), K ragged for 16-wide K blocks at 40 (the descriptor reads 0 past the edge).
    K = 36 fp16 is 72 bytes a row, not the 16-byte multiple a tensor map needs: the pointer loads."""
    used = spy_tma_operands(monkeypatch)
    with forced_gemm_config(GemmConfig(16, 32, 16, tma=True)):
        assert ThreadWorld(2, timeout=60).run(_tma_tiles_on_rank, k, weight_layout) == [True, True]
    assert set(used["ag"] + used["rs"]) == {tma_used}, used


def tma_calls_with_straggler_on_rank(ctx, cfg, straggler, calls=3):
    """One TMA config, 0/1 inputs (exact; bf16 on a GPU, fp16 in the interpreter, which has no bf16):
    BLOCK_M + 7 rows a chunk (a chunk's second tile reads BLOCK_M - 7 rows of the next, maybe still
    arriving, chunk: masked on store), K = 72 (ragged for 16/64-wide K blocks; 144 bytes a row, a
    tensor map's 16-byte multiple), N = BLOCK_N + 8 (a ragged last column tile), both weight layouts,
    ``calls`` calls (epochs, released slots), a straggler whose chunk arrives late: the descriptor loads
    must wait for its flag. One ``(call, layout, ag exact, rs exact)`` per call and layout."""
    r, w, dev = ctx.rank, ctx.world_size, ctx.device
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16
    m, k, n = cfg.block_m + 7, 72, cfg.block_n + 8
    exact = []
    for call in range(calls):
        if r == straggler:
            time.sleep(STRAGGLER_DELAY_S)
        for layout, b in (("rows", _ints((k, n), dt, 50 + call, dev)),
                          ("weight.t()", _ints((n, k), dt, 60 + call, dev).t())):
            shards = [_ints((m, k), dt, 10 * call + q, dev) for q in range(w)]
            a_all = [_ints((w * m, k), dt, 100 + 10 * call + q, dev) for q in range(w)]
            out = ok.all_gather_matmul(shards[r], b, ctx, method="fused")
            out2 = ok.matmul_reduce_scatter(a_all[r], b, ctx, method="fused")
            exact.append((call, layout, torch.equal(out, (torch.cat(shards).float() @ b.float()).to(dt)),
                          torch.equal(out2, sum(x.float() @ b.float() for x in a_all).chunk(w)[r].to(dt))))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return exact


def check_tma_calls_with_straggler(monkeypatch, world, configs, device="cpu", timeout=60, calls=3):
    used = spy_tma_operands(monkeypatch)
    for cfg in configs:
        with forced_gemm_config(cfg):  # process-wide: every rank thread sees it
            results = ThreadWorld(world, device=device, timeout=timeout).run(tma_calls_with_straggler_on_rank,
                                                                             cfg, world - 1, calls)
        wrong = [(r, row) for r, rows in enumerate(results) for row in rows if not all(row[2:])]
        assert not wrong and len(results[0]) == 2 * calls, (cfg, wrong, results)
    assert used["ag"] and used["rs"] and all(used["ag"] + used["rs"]), used


def test_fused_tma_loads_and_stores_three_ranks_straggler_two_calls(monkeypatch):
    """TMA loads and the all-gather GEMM's TMA stores under a straggler, exact. (Rows a chunk's last
    tile loads past the chunk come from the next chunk, so storing them there would write that
    chunk's own results - visible only if they land before it arrived, a race this cannot force:
    test_tma_stores_clip_each_tile_at_its_chunk_end[pointer] is the guard for the clipping.) Three
    ranks and two calls: what the interpreter can afford; the GPU test runs 2 and 4 ranks, 3 calls."""
    check_tma_calls_with_straggler(monkeypatch, 3, [GemmConfig(16, 32, 16, tma=True, tma_store=True)], calls=2)


@pytest.mark.parametrize("loads", ["pointer", "tma"])
def test_tma_stores_clip_each_tile_at_its_chunk_end(loads):
    """ag_gemm with TMA stores on every rank of 2, all chunks arrived: chunks of 7 rows in 16-row
    tiles, so every tile's rows 7-15 fall past its chunk. Stored through a [W*m, N] descriptor they
    would land in the next chunk or past the output (NaN-poisoned, padded with NaN rows that must
    stay NaN). With pointer loads those rows are zeros: the unclipped store fails here. With TMA
    loads they are the next chunk's true results (its rows were loaded), so only the padding can
    show it: the [pointer] case is the guard. N = 40: a ragged last column tile too."""
    from overlapkernels.kernels.errors import new_error_record
    from overlapkernels.kernels.triton.ag_gemm import ag_gemm
    from overlapkernels.kernels.triton.signals import FLAG_DTYPE, polls

    w, m, k, n = 2, 7, 32, 40
    cfg = GemmConfig(16, 32, 16, tma=loads == "tma", tma_store=True)
    a, b = _ints((w * m, k), torch.float16, 1), _ints((k, n), torch.float16, 2)
    for rank in range(w):  # tiles start at the rank's own chunk: each rank stores the chunks in another order
        padded = torch.full((w * m + 16, n), float("nan"), dtype=torch.float16)
        out = padded[:w * m]
        assert TG.tma_output(out, w, cfg)[0]
        ag_gemm(a, b, out, torch.ones(w, dtype=FLAG_DTYPE), new_error_record("cpu"), rank=rank, world_size=w, epoch=1,
                budget=polls(1000), config=cfg)
        assert torch.equal(out, (a.float() @ b.float()).half()), rank
        assert padded[w * m:].isnan().all(), rank


def test_tma_output_qualifies_only_an_aligned_16bit_output():
    cfg = GemmConfig(16, 32, 16, tma_store=True)
    out = torch.zeros(2 * 7, 40, dtype=torch.float16)
    used, desc = TG.tma_output(out, 2, cfg)
    assert used and list(desc.shape) == [2, 7, 40] and list(desc.strides) == [7 * 40, 40, 1]
    assert desc.block_shape == [1, 16, 32]
    padded = torch.zeros(2 * 7, 48, dtype=torch.float16)[:, :40]  # rows 48 apart: the chunk stride counts them
    used, desc = TG.tma_output(padded, 2, cfg)
    assert used and list(desc.shape) == [2, 7, 40] and list(desc.strides) == [7 * 48, 48, 1]
    for why, (t, c) in {"config without tma_store": (out, GemmConfig(16, 32, 16, tma=True)),
                        "fp32": (out.float(), cfg), "empty": (out[:0], cfg),
                        "row stride of 36 bytes": (torch.zeros(14, 18, dtype=torch.float16), cfg),
                        "column-major": (torch.zeros(40, 14, dtype=torch.float16).t(), cfg)}.items():
        assert TG.tma_output(t, 2, c) == (False, None), why


def test_tma_operands_qualify_only_aligned_16bit_2d_operands():
    cfg, plain = GemmConfig(16, 32, 16, tma=True), GemmConfig(16, 32, 16)
    a, b = torch.zeros(8, 32, dtype=torch.float16), torch.zeros(32, 24, dtype=torch.float16)
    tma, a_desc, b_desc, k_major = TG.tma_operands(a, b, cfg)
    assert tma and not k_major and a_desc.block_shape == [16, 16] and b_desc.block_shape == [16, 32]
    tma, _, b_desc, k_major = TG.tma_operands(a, torch.zeros(24, 32, dtype=torch.float16).t(), cfg)
    assert tma and k_major and b_desc.block_shape == [32, 16] and list(b_desc.shape) == [24, 32]
    for why, args in {"config without tma": (a, b, plain), "fp32": (a.float(), b.float(), cfg),
                      "empty": (a[:0], b, cfg), "unaligned base": (torch.zeros(8 * 32 + 1, dtype=torch.float16)[1:].view(8, 32), b, cfg),
                      "a column-major": (torch.zeros(32, 8, dtype=torch.float16).t(), b, cfg),
                      "b strided both ways": (a, torch.zeros(32, 48, dtype=torch.float16)[:, ::2], cfg),
                      # rows a tensor map cannot lay out: one row repeated (stride 0), rows overlapping
                      "a expanded": (torch.zeros(1, 32, dtype=torch.float16).expand(8, 32), b, cfg),
                      "b overlapping rows": (a, torch.zeros(64 * 8 + 16, dtype=torch.float16).as_strided((32, 24), (8, 1)),
                                             cfg)}.items():
        assert TG.tma_operands(*args) == (False, None, None, False), why


def test_warmup_runs_again_when_the_tf32_switch_changes(monkeypatch):
    """TF32 on or off compiles another GEMM variant, loaded at its first launch: a signature seen
    with the other setting must warm up again (else that load happens while a peer spins)."""
    from overlapkernels.ops import _kernel_warmup as warmup

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    tf32 = [False]
    monkeypatch.setattr(warmup, "matmul_allows_tf32", lambda: tf32[0])
    world, launches = _FakeCudaWorld(True), []
    for allowed in (False, True, True, False):
        tf32[0] = allowed
        warmup.warm(world, "a", lambda a=allowed: launches.append(a))
    assert launches == [False, True] and world.barriers == 4
