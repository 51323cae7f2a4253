"""Pure settings of the Triton kernels: where they run interpreted (and bf16 is refused), and what a
wait's timeout becomes on the device (nanoseconds of the GPU timer, or interpreter polls)."""
import torch

from overlapkernels.kernels.interpreter import bf16_miscomputed, interpreted
from overlapkernels.kernels.triton.signals import INTERPRETER_POLLS_PER_SECOND, WaitBudget, polls, wait_budget

CUDA = torch.device("cuda", 0)  # (only its type is read: no GPU needed)


def test_tensors_on_a_gpu_run_interpreted_under_triton_interpret(monkeypatch):
    """TRITON_INTERPRET=1 interprets every kernel, a GPU tensor's too: bf16 is miscomputed there as on
    CPU, so it is refused there as well."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreted(CUDA) and bf16_miscomputed(torch.bfloat16, CUDA)
    assert not bf16_miscomputed(torch.float16, CUDA)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not interpreted(CUDA) and not bf16_miscomputed(torch.bfloat16, CUDA)
    assert interpreted(torch.device("cpu")) and bf16_miscomputed(torch.bfloat16, torch.device("cpu"))


def test_a_wait_budget_is_nanoseconds_on_a_gpu_and_polls_in_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert wait_budget(2.5, CUDA) == WaitBudget(2_500_000_000, True)
    assert wait_budget(1e9, CUDA) == WaitBudget(10 ** 18, True)  # the largest timeout still fits an int64
    assert wait_budget(1e-12, CUDA) == WaitBudget(1, True)  # never a budget of 0: a wait that cannot wait
    assert wait_budget(0.5, torch.device("cpu")) == WaitBudget(INTERPRETER_POLLS_PER_SECOND // 2, False)
    assert wait_budget(1e-9, torch.device("cpu")) == WaitBudget(1, False) and polls(7) == WaitBudget(7, False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert wait_budget(2.5, CUDA) == WaitBudget(int(2.5 * INTERPRETER_POLLS_PER_SECOND), False)
