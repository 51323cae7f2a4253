"""Peer access between GPUs as NVML reports it (faked here: a node of 4 GPUs, PCIe without P2P
atomics between 1 and 2), and the verdict every rank draws from all ranks' reports."""
from types import SimpleNamespace

from overlapkernels.comm.peer_access import failing_pairs, peer_access_problem

UUIDS = ["5a1e0000-0000-0000-0000-00000000000%d" % i for i in range(4)]  # as torch prints them: no "GPU-"
READ, WRITE, ATOMICS = 0, 1, 3
OK, NOT_SUPPORTED = 0, 5
NO_ATOMICS_1_2 = {(UUIDS[1], UUIDS[2]): "no peer-to-peer atomics (NVML: NOT_SUPPORTED)"}


def _fake_nvml(no_atomics=(), init_error=False, calls=None, no_read=()):
    calls = [] if calls is None else calls

    def p2p(a, b, index):
        calls.append((a, b, index))
        missing = {ATOMICS: no_atomics, READ: no_read}.get(index, ())
        return NOT_SUPPORTED if frozenset((a, b)) in missing else OK

    def init():
        if init_error:
            raise RuntimeError("NVML Shared Library Not Found")

    return SimpleNamespace(
        nvmlInit=init, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetUUID=lambda h: f"GPU-{UUIDS[h]}".upper().encode(),
        nvmlDeviceGetP2PStatus=p2p, NVML_P2P_STATUS_OK=OK, NVML_P2P_STATUS_NOT_SUPPORTED=NOT_SUPPORTED,
        NVML_P2P_CAPS_INDEX_READ=READ, NVML_P2P_CAPS_INDEX_WRITE=WRITE, NVML_P2P_CAPS_INDEX_ATOMICS=ATOMICS)


def test_every_pair_and_capability_is_asked():
    calls = []
    assert failing_pairs(_fake_nvml(calls=calls)) == {}
    assert {frozenset((a, b)) for a, b, _ in calls} == {frozenset((i, j)) for i in range(4) for j in range(i + 1, 4)}
    assert {index for *_, index in calls} == {READ, WRITE, ATOMICS}


def test_a_pair_without_native_atomics_is_found_and_named():
    assert failing_pairs(_fake_nvml(no_atomics={frozenset((1, 2))})) == NO_ATOMICS_1_2
    assert peer_access_problem(UUIDS, [{}, NO_ATOMICS_1_2]) == (
        f"GPUs {UUIDS[1]} and {UUIDS[2]} have no peer-to-peer atomics (NVML: NOT_SUPPORTED); symm/fused need GPUs "
        "linked by NVLink (or PCIe P2P with native atomics)")
    # NVML's "GPU-" form and case are the same GPU
    assert peer_access_problem([f"GPU-{u.upper()}" for u in UUIDS], [NO_ATOMICS_1_2]) is not None


def test_groups_not_using_a_failing_pair_or_sharing_one_gpu_are_fine():
    assert peer_access_problem([UUIDS[0], UUIDS[1], UUIDS[3]], [NO_ATOMICS_1_2] * 3) is None
    assert peer_access_problem([UUIDS[1]] * 4, [NO_ATOMICS_1_2] * 4) is None  # ranks sharing one GPU


def test_no_verdict_where_nvml_cannot_answer():
    assert failing_pairs(_fake_nvml(init_error=True)) == {}
    assert peer_access_problem(UUIDS, [{}, {}]) is None


def test_a_pair_missing_several_capabilities_is_named_by_the_first():
    """A PCIe pair with neither peer reads nor atomics: the report names what fails first (reads),
    the most basic access the kernels need."""
    pair = frozenset((0, 3))
    assert failing_pairs(_fake_nvml(no_atomics={pair}, no_read={pair})) == {
        (UUIDS[0], UUIDS[3]): "no peer-to-peer read (NVML: NOT_SUPPORTED)"}
