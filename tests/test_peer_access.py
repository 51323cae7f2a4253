"""peer_access_problem: the GPUs' pairwise peer read/write/atomics as NVML reports them (faked
here: a node of 4 GPUs, NVLink between 0-1, PCIe without P2P atomics elsewhere)."""
from types import SimpleNamespace

import pytest

from overlapkernels.comm.peer_access import peer_access_problem

UUIDS = ["5a1e0000-0000-0000-0000-00000000000%d" % i for i in range(4)]  # torch prints no "GPU-"
READ, WRITE, ATOMICS = 0, 1, 3
OK, NOT_SUPPORTED = 0, 5


def _fake_nvml(no_atomics=(), init_error=False, calls=None):
    calls = [] if calls is None else calls

    def p2p(a, b, index):
        calls.append((a, b, index))
        pair = frozenset((a, b))
        return NOT_SUPPORTED if index == ATOMICS and pair in no_atomics else OK

    def init():
        if init_error:
            raise RuntimeError("NVML Shared Library Not Found")

    return SimpleNamespace(
        nvmlInit=init, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetUUID=lambda h: f"GPU-{UUIDS[h]}".upper().encode(),
        nvmlDeviceGetP2PStatus=p2p, NVML_P2P_STATUS_OK=OK, NVML_P2P_STATUS_NOT_SUPPORTED=NOT_SUPPORTED,
        NVML_P2P_CAPS_INDEX_READ=READ, NVML_P2P_CAPS_INDEX_WRITE=WRITE, NVML_P2P_CAPS_INDEX_ATOMICS=ATOMICS)


def test_every_pair_with_peer_access_passes():
    calls = []
    assert peer_access_problem(UUIDS, _fake_nvml(calls=calls)) is None
    assert {frozenset((a, b)) for a, b, _ in calls} == {frozenset((i, j)) for i in range(4) for j in range(i + 1, 4)}
    assert {index for *_, index in calls} == {READ, WRITE, ATOMICS}


def test_a_pair_without_native_atomics_is_named():
    problem = peer_access_problem(UUIDS, _fake_nvml(no_atomics={frozenset((1, 2))}))
    assert problem == (f"GPUs {UUIDS[1]} and {UUIDS[2]} have no peer-to-peer atomics (NVML: NOT_SUPPORTED); "
                       "symm/fused need GPUs linked by NVLink (or PCIe P2P with native atomics)")
    # a group that does not use that pair is fine
    assert peer_access_problem([UUIDS[0], UUIDS[1]], _fake_nvml(no_atomics={frozenset((1, 2))})) is None


@pytest.mark.parametrize("uuids", [[UUIDS[2]] * 3, [UUIDS[0]]])
def test_ranks_sharing_one_gpu_need_no_nvml(uuids):
    assert peer_access_problem(uuids, SimpleNamespace()) is None  # an empty nvml: never asked


def test_no_verdict_where_nvml_cannot_answer():
    assert peer_access_problem(UUIDS, _fake_nvml(init_error=True)) is None
    assert peer_access_problem([UUIDS[0], "cuda:1"], _fake_nvml(no_atomics={frozenset((0, 1))})) is None  # old torch
