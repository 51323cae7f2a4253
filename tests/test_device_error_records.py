"""symm/fused's device error records on GPUs are read a call late (no host sync per call): the
queue raises them in call order, check_pending_errors() raises one at once, and one still pending at
exit is printed and fails the process. (fsdp.save and Trainer.step checking every rank's first:
test_fsdp_checkpoint_atomic_gloo.py, test_train_4d.py.)"""
import subprocess
import sys

import pytest
import torch


def test_pending_device_errors_are_raised_on_demand_and_reported_at_exit(monkeypatch, capsys):
    """symm/fused on GPUs raise a wait's timeout one call late (no host sync per call): the last
    call's must still surface - check_pending_errors() raises it, the exit hook prints it."""
    from types import SimpleNamespace

    from overlapkernels.comm import process_world as pw
    from overlapkernels.kernels.errors import SignalTimeoutError

    def flush():
        raise SignalTimeoutError("ok/all_gather_matmul[fused]: rank 1 timed out waiting for chunk 0 from rank 0")

    monkeypatch.setattr(pw, "_worlds", {"k": SimpleNamespace(_errors=SimpleNamespace(flush=flush))})
    with pytest.raises(SignalTimeoutError, match="rank 1 timed out waiting for chunk 0"):
        pw.check_pending_errors()
    assert pw.report_pending_errors() is True
    assert "overlapkernels: SignalTimeoutError: ok/all_gather_matmul[fused]: rank 1" in capsys.readouterr().err


def test_a_timeout_pending_at_exit_fails_the_process():
    """Was: printed at exit, and the process exited 0, so a launcher saw a job whose last step's
    results were garbage succeed. Now it exits with status 1 (and prints it); nothing pending: 0.
    The check is registered at import, so handlers registered later still run before it."""
    code = ("import atexit, sys\nfrom types import SimpleNamespace\n"
            "from overlapkernels.comm import process_world as pw\n"
            "from overlapkernels.kernels.errors import SignalTimeoutError\n"
            "def flush():\n    raise SignalTimeoutError('ok/matmul_reduce_scatter[symm]: rank 0 timed out')\n"
            "def clean():\n    pass\n"
            "pw._worlds['k'] = SimpleNamespace(_errors=SimpleNamespace(flush=flush if sys.argv[1] == 'pending' else clean))\n"
            "atexit.register(print, 'a handler registered after import overlapkernels ran')\nprint('done')\n")
    for pending, status in (("pending", 1), ("none", 0)):
        out = subprocess.run([sys.executable, "-c", code, pending], capture_output=True, text=True, timeout=120)
        assert out.returncode == status, (pending, out.returncode, out.stderr)
        assert out.stdout == "done\na handler registered after import overlapkernels ran\n", out.stdout
        assert ("overlapkernels: SignalTimeoutError: ok/matmul_reduce_scatter[symm]: rank 0 timed out" in out.stderr) \
            is (pending == "pending"), out.stderr


def test_deferred_error_records_raise_in_call_order():
    """The queue behind a call-late timeout (CUDA events faked): poll raises only records whose
    copy has landed, oldest first, and stops at the first pending one; flush waits for the rest."""
    from overlapkernels.kernels.errors import SignalTimeoutError
    from overlapkernels.kernels.triton import signals

    class Event:
        def __init__(self, done):
            self.done, self.waited = done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True

    fine = torch.zeros(4, dtype=torch.int32)
    timed_out = torch.tensor([signals.ERR_READY_TIMEOUT.value, 1, 2, 0], dtype=torch.int32)
    check = signals.DeferredErrorCheck()
    events = [Event(True), Event(False), Event(True)]
    check._pending = [(events[0], fine, "op0", 1), (events[1], timed_out, "op1", 2), (events[2], fine, "op2", 3)]
    check.poll()  # the first record is clean; the second has not landed: nothing raised, it stays
    assert [p[2] for p in check._pending] == ["op1", "op2"]
    with pytest.raises(SignalTimeoutError, match=r"op1: rank 1 timed out waiting for chunk 2 from rank 0 \(call 2\)"):
        check.flush()
    assert events[1].waited and [p[2] for p in check._pending] == ["op2"]
    check.flush()
    assert check._pending == [] and events[2].waited


def test_a_destroyed_groups_world_still_has_its_pending_errors_raised(monkeypatch):
    """A world whose group was destroyed is kept (its symmetric memory is never freed) among the
    retired values: a timeout its last call left pending must still be raised, not dropped."""
    from types import SimpleNamespace

    from overlapkernels.comm import group_cache, process_world as pw
    from overlapkernels.kernels.errors import SignalTimeoutError

    def flush():
        raise SignalTimeoutError("ok/matmul_reduce_scatter[symm]: rank 1 timed out (a retired world)")

    world = pw.ProcessPeerWorld.__new__(pw.ProcessPeerWorld)  # (no group needed: only its error queue is read)
    world._errors = SimpleNamespace(flush=flush)
    monkeypatch.setattr(pw, "_worlds", {})
    monkeypatch.setattr(group_cache, "_retired", [object(), world])  # other caches' values are skipped
    with pytest.raises(SignalTimeoutError, match="a retired world"):
        pw.check_pending_errors()


def test_an_error_record_without_its_abort_slot_is_refused():
    """The waits read err[ABORT_SLOT] (index 4): a 4-element record (the CUDA library's layout) would
    be read past its end."""
    from overlapkernels.kernels.errors import ERROR_RECORD_LEN, check_error_record, new_error_record

    check_error_record(new_error_record("cpu"))
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(ERROR_RECORD_LEN, dtype=torch.int64),
                torch.zeros(2 * ERROR_RECORD_LEN, dtype=torch.int32)[::2]):
        with pytest.raises(ValueError, match="expected a contiguous int32 error record of 5 elements"):
            check_error_record(bad)
