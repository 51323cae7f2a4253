"""The GPT trained in 4-D compositions (PP with TP/SP, DP, CP) equals single-process training."""
import pytest
import torch

import overlapkernels as ok
from overlapkernels.models import GPT, GPTConfig, shard_dense_state_dict
from overlapkernels.models.train import Trainer

CONFIG = dict(vocab_size=16, hidden=8, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden=16, max_seq_len=8)


def _compose_on_rank(layout, schedule):
    config = GPTConfig(**CONFIG, method="decomposed")
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
               for _ in range(2)]
    batches[1][1][2, 3:7] = batches[1][1][5, 0] = -100  # padding: the mean is over the real tokens
    torch.manual_seed(0)
    dense = GPT(config, ok.init_parallel(), dtype=torch.float64)
    start = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in dense.state_dict().items()}
    # SGD with momentum: unlike AdamW it is sensitive to the gradient's scale (averaging, CP/TP sums)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    opt = sgd(dense.parameters())
    want_losses = []
    for tokens, targets in batches:
        opt.zero_grad()
        loss = dense.loss(tokens, targets)
        loss.backward()
        opt.step()
        want_losses.append(float(loss))

    dims = ok.init_parallel(**layout)
    trainer = Trainer(config, dims, schedule=schedule, dtype=torch.float64, dense_state_dict=start, optimizer=sgd)
    losses = [trainer.step(tokens, targets) for tokens, targets in batches]
    assert losses == pytest.approx(want_losses, abs=1e-12, rel=1e-12), (losses, want_losses)
    want = shard_dense_state_dict(trainer.stage, dense.state_dict())
    for name, t in trainer.sharded.full_state_dict().items():
        if torch.is_tensor(t):
            torch.testing.assert_close(t, want[name], atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    return losses


@pytest.mark.parametrize("layout, schedule", [
    (dict(tp=2, pp=2), "1f1b"), (dict(dp=2, pp=2), "gpipe"), (dict(cp=2, pp=2), "1f1b"), (dict(tp=2, dp=2), "1f1b"),
])
def test_composition_matches_single_process(rank_pool, layout, schedule):
    results = rank_pool(4).run(_compose_on_rank, layout, schedule)
    assert all(r == results[0] for r in results)


def _bad_batch_on_rank():
    dims = ok.init_parallel(tp=2, pp=2)
    trainer = Trainer(GPTConfig(**CONFIG), dims, dtype=torch.float64)
    try:
        trainer.step(torch.zeros(6, 8, dtype=torch.long), torch.zeros(6, 8, dtype=torch.long))
    except ValueError as exc:  # on every rank, middle stages included, before any P2P
        return str(exc)


def test_bad_batch_is_refused_on_every_rank(rank_pool):
    for message in rank_pool(4).run(_bad_batch_on_rank):
        assert message == "batch size 6 must be divisible by dp x microbatches = 1 x 4"
