"""The Trainer on a GPU (an NCCL world of one): float16 weights with fsdp.GradScaler (its overflow
flag and scale on the device), clipping, ZeRO-3 and activation checkpointing, as the CPU tests
check them in 4-D compositions (tests/test_train_options.py) - here the CUDA paths run."""
import math

import pytest
import torch

pytestmark = pytest.mark.gpu


def _float16_training_on_cuda():
    import overlapkernels as ok
    from overlapkernels.models import GPTConfig
    from overlapkernels.models.train import Trainer
    from overlapkernels.runtime import fsdp

    config = GPTConfig(vocab_size=32, hidden=32, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden=64,
                       max_seq_len=16, activation_checkpointing=True)
    scaler = fsdp.GradScaler(init_scale=2.0 ** 24, growth_interval=3)
    trainer = Trainer(config, ok.init_parallel(), dtype=torch.float16, grad_scaler=scaler, max_grad_norm=1.0,
                      zero_stage=3, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-2))
    assert trainer.device.type == "cuda"
    tokens = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(1))
    history = []
    for _ in range(16):
        loss = trainer.step(tokens, (3 * tokens + 1) % 32)
        history.append((trainer.last_step_skipped, scaler.get_scale(), loss, trainer.last_grad_norm))
    return history


def test_float16_training_with_loss_scaling_on_cuda():
    from overlapkernels.comm.rank_pool import RankPool

    with RankPool(1, backend="nccl", timeout=90.0) as pool:  # within gpu-check's 120 s gpu_tests step
        (history,) = pool.run(_float16_training_on_cuda)
    skipped = [s for s, _, _, _ in history]
    scales = [scale for _, scale, _, _ in history]
    losses = [loss for _, _, loss, _ in history]
    # 2**24 overflows the float16 logits' gradients: skipped and halved until it does not
    first_step = skipped.index(False)
    assert first_step >= 1 and scales[:first_step] == [2.0 ** (23 - i) for i in range(first_step)], history
    assert all(math.isfinite(loss) for loss in losses), history
    assert all(math.isfinite(norm) for s, _, _, norm in history if not s), history
    # a skipped step left the weights as they were: the next step's loss is the same, to the bit
    assert losses[:first_step + 1] == [losses[0]] * (first_step + 1), history
    assert losses[-1] < 0.6 * losses[0], history
