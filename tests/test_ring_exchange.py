"""Ring.exchange's contract with the backend, checked against a fake batch_isend_irecv: the test
decides when each message "arrives", so ordering bugs fail deterministically (no sleeps, no races).
The real exchanges run over gloo in test_ring_attention_internals_gloo.py."""
from datetime import timedelta

import pytest
import torch

from overlapkernels.comm import ring as ring_mod


class FakeWork:
    """A posted send or receive: a receive's buffer is filled only when waited for, as a message
    that arrives just then."""

    def __init__(self, op, payload, log):
        self.op, self.payload, self.log = op, payload, log

    def wait(self, timeout=None):
        self.log.append(timeout)
        if self.op[0] == "irecv":
            self.op[1].copy_(self.payload.reshape(self.op[1].shape))
        return True


@pytest.fixture
def fake_backend(monkeypatch):
    """Each receive gets the payload that ``incoming`` names for its position among the receives."""
    state = {"incoming": [], "waits": [], "ops": []}

    def batch(ops):
        state["ops"] = ops
        recvs = iter(state["incoming"])
        return [FakeWork(op, next(recvs) if op[0] == "irecv" else None, state["waits"]) for op in ops]

    monkeypatch.setattr(ring_mod.dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(ring_mod.dist, "isend", "isend")
    monkeypatch.setattr(ring_mod.dist, "irecv", "irecv")
    monkeypatch.setattr(ring_mod.dist, "P2POp", lambda kind, tensor, peer, group, tag: (kind, tensor, peer, tag))
    monkeypatch.setattr(ring_mod.Ring, "global_rank", lambda self, r: r % self.world_size)
    return state


def test_every_ring_wait_passes_the_group_timeout(fake_backend):
    """On gloo a P2P wait is bounded only by the timeout its group was created with unless wait()
    is given one: each work of a host-only ring's exchange waits with the ring's timeout."""
    fake_backend["incoming"] = [torch.ones(2), torch.ones(3)]
    ring = ring_mod.Ring(None, 0, 2, host_only=True, timeout=timedelta(seconds=3))
    ring_mod.wait_all(ring.exchange([torch.ones(2), torch.ones(3)], 1, [torch.zeros(2), torch.zeros(3)], 1))
    assert fake_backend["waits"] == [timedelta(seconds=3)] * 4


def test_the_tag_reaches_every_send_and_receive(fake_backend):
    fake_backend["incoming"] = [torch.ones(2)]
    ring = ring_mod.Ring(None, 0, 2, host_only=True, timeout=timedelta(seconds=3))
    ring_mod.wait_all(ring.exchange(torch.ones(2), 1, torch.zeros(2), 1, tag=7))
    assert [(op[0], op[3]) for op in fake_backend["ops"]] == [("isend", 7), ("irecv", 7)]


def test_a_strided_receive_is_copied_in_after_its_message_arrives(fake_backend):
    """The backends take dense buffers: a strided receive lands in a contiguous one and is copied
    into the caller's tensor on wait, after the message, never before (it would keep the poison)."""
    fake_backend["incoming"] = [torch.arange(6.0).reshape(2, 3)]
    recv = torch.full((3, 2), float("nan")).t()  # strided [2, 3]
    ring = ring_mod.Ring(None, 0, 2, host_only=True, timeout=timedelta(seconds=3))
    works = ring.exchange(torch.ones(2, 3), 1, recv, 1)
    assert recv.isnan().all()  # nothing copied at post time
    ring_mod.wait_all(works)
    assert torch.equal(recv, torch.arange(6.0).reshape(2, 3))
    assert not fake_backend["ops"][1][1].isnan().any() and fake_backend["ops"][1][1].is_contiguous()
