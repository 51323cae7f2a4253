"""The kernels' plain-Python helpers, one process: what counts as segment ids, the fused GEMMs'
32-bit offset limit on each operand, and the symmetric buffers' alignment and prefixes."""
import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_every_integer_dtype_is_ids(dtype):
    from overlapkernels.kernels.ids import integer_ids

    assert integer_ids(torch.zeros(2, 3, dtype=dtype))


@pytest.mark.parametrize("value", [torch.zeros(3, dtype=torch.bool), torch.zeros(3), torch.zeros(3, dtype=torch.float16),
                                   torch.zeros(3, dtype=torch.complex64), [0, 1, 1], 3, None])
def test_bools_floats_complex_and_non_tensors_are_not_ids(value):
    from overlapkernels.kernels.ids import integer_ids

    assert integer_ids(value) is False


def test_every_operand_past_the_limit_is_named_and_the_output_chunk_counts_n():
    """fused_sizes_error: a [rows, K] chunk, b [K, N], an output chunk [rows, N], each refused from
    its 2^31st element (last offset 2^31 - 1 fits), and all that do not fit named together."""
    from overlapkernels.kernels.offsets import fused_sizes_error, offsets_error

    assert fused_sizes_error(1 << 16, 1, 1 << 15) is None  # an output chunk of exactly 2^31 elements
    said = fused_sizes_error(1 << 16, 1, (1 << 15) + 1)
    assert said.startswith("fused GEMM: the output chunk spans 2147549184 elements (65536 rows per chunk, K=1, N=32769)")
    assert fused_sizes_error(1, 1 << 16, 1 << 15) is None  # b of exactly 2^31 elements
    assert fused_sizes_error(1, 1 << 16, (1 << 15) + 1).startswith("fused GEMM: the b spans 2147549184 elements")
    both = offsets_error({"a chunk": 1 << 31, "b": 5, "output chunk": 1 << 32}, "x")
    assert both.startswith("fused GEMM: the a chunk spans 2147483649 elements, the output chunk spans 4294967297 "
                           "elements (x); ")


def test_last_offset_of_views():
    from overlapkernels.kernels.offsets import last_offset

    base = torch.empty(6, 10, device="meta")
    for view in (base, base.t(), base[1:4, ::3], base.view(60)[7:8], base[:, 2]):
        assert last_offset(view.shape, view.stride()) == max(
            i * view.stride(0) + (j * view.stride(1) if view.dim() > 1 else 0)
            for i in range(view.shape[0]) for j in range(view.shape[1] if view.dim() > 1 else 1))


def test_the_dtypes_the_fused_gemms_take():
    from overlapkernels.kernels.offsets import fused_dtype_error

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert fused_dtype_error(dtype) is None
    for dtype in (torch.float64, torch.int32):
        assert fused_dtype_error(dtype).startswith(f"method='fused' computes float32, float16 or bfloat16 operands, "
                                                   f"got {dtype}; use method='symm'")


def _symmetric(peers, rank=0):
    from overlapkernels.comm.symmetric import SymmetricTensor

    return SymmetricTensor(rank, len(peers), peers[rank], torch.tensor([p.data_ptr() for p in peers]), tuple(peers))


def test_symmetric_buffers_8_bytes_off_16_are_refused_with_their_address():
    """16 bytes is the kernels' vector width: 8-byte aligned is not enough (storage[2:] of an
    aligned float32 storage starts 8 bytes in), and the message shows the misaligned address."""
    storage = torch.zeros(32, dtype=torch.float32)
    assert storage.data_ptr() % 16 == 0
    _symmetric([storage[:8], storage[16:24]])
    off = storage[18:26]
    with pytest.raises(ValueError, match=rf"ranks \[1\] start at addresses not divisible by 16: \['{hex(off.data_ptr())}'\]"):
        _symmetric([storage[:8], off])


def test_a_prefix_of_the_whole_buffer_is_the_buffer():
    peers = [torch.arange(12.0) + 100 * q for q in range(2)]
    whole = _symmetric(peers, rank=1)
    part = whole.prefix((3, 4))
    assert torch.equal(part.local, peers[1].view(3, 4)) and torch.equal(part.peer(0), peers[0].view(3, 4))
    assert whole.prefix((0,)).local.numel() == 0


def test_the_abort_slot_follows_the_four_fields_a_wait_writes():
    """A wait that gives up writes [code, rank, chunk, peer] (signals.py stores err + 1..3); the host's
    abort flag after them: in slot 3 a failing wait's peer id would read as an abort (and an abort
    as the peer)."""
    from overlapkernels.kernels.errors import ABORT_SLOT, ERROR_RECORD_LEN, new_error_record

    assert ABORT_SLOT == 4 and ERROR_RECORD_LEN == 5
    assert new_error_record("cpu").tolist() == [0] * 5


def test_a_peer_failure_is_a_signal_timeout_to_catch():
    """Callers that catch SignalTimeoutError around a step also catch a peer's failure."""
    import overlapkernels as ok
    from overlapkernels.kernels.errors import PeerFailedError, SignalTimeoutError

    assert ok.PeerFailedError is PeerFailedError and ok.SignalTimeoutError is SignalTimeoutError
    with pytest.raises(SignalTimeoutError, match="rank 1 failed"):
        raise PeerFailedError("rank 1 failed")
    assert issubclass(PeerFailedError, RuntimeError)
