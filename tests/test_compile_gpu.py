"""torch.compile with Inductor through the ops on a GPU: the GPT over CP=2 (two processes sharing
cuda:0, gloo moving K/V through host memory; the ring on the Triton kernels in bf16), each op an
opaque custom op among Inductor's Triton kernels, against the same model eager. Buffers Inductor
reuses on the current stream while an op still holds them would show as gradients tens of percent
off (as on CPU before _SavedPrivately); bf16 and Inductor's fusion move them by a few percent at most.
Its own step in `make gpu-check` (gpu_compile), last: the Inductor build takes a while."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def _compiled_gpt_on_cuda():
    import overlapkernels as ok
    from overlapkernels.models import GPT, GPTConfig

    torch.cuda.set_device(0)
    config = GPTConfig(vocab_size=64, hidden=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=256,
                       max_seq_len=256)
    g = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, 64, (2, 256), generator=g).cuda() for _ in range(2))
    dims = ok.init_parallel(cp=2)
    torch.manual_seed(0)
    eager = GPT(config, dims, dtype=torch.bfloat16, device="cuda")
    compiled = GPT(config, dims, dtype=torch.bfloat16, device="cuda")
    compiled.load_state_dict(eager.state_dict())
    want = eager.loss(tokens, targets)
    want.backward()
    got = torch.compile(compiled.loss, fullgraph=True)(tokens, targets)
    got.backward()
    errors = {name: float((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm())
              for (name, p), q in zip(compiled.named_parameters(), eager.parameters())}
    return float(got), float(want), errors


def test_inductor_gpt_over_cp_on_one_gpu(rank_pool):
    for got, want, errors in rank_pool(2).run(_compiled_gpt_on_cuda):
        assert got == pytest.approx(want, rel=2e-2)
        assert max(errors.values()) < 5e-2, errors
