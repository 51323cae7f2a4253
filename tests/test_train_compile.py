"""The Trainer with compiled blocks (``GPTConfig.compile``: each block's forward one fullgraph
torch.compile graph, the ops inside opaque custom ops, the FSDP hooks eager around it): two steps
train as one uncompiled process does, in 4-D compositions with ZeRO-1/2/3 and activation
checkpointing; zero-bubble schedules are refused with it."""
import pytest
import torch

import overlapkernels as ok
from overlapkernels.models import GPTConfig
from overlapkernels.models.train import Trainer
from test_train_4d import CONFIG, _compose_on_rank


def _compiled_on_rank(layout, schedule, zero_stage, recompute):
    from torch._dynamo.utils import counters

    counters.clear()
    losses = _compose_on_rank(layout, schedule, zero_stage=zero_stage, recompute=recompute, compile="aot_eager")
    # compiled indeed (one graph shared by the blocks: their parameters are its inputs), never broken
    # or recompiled (ZeRO-3 frees and regathers the parameters between calls)
    assert counters["stats"]["unique_graphs"] == 1 and counters["stats"]["calls_captured"] > 0, dict(counters["stats"])
    assert not counters["graph_break"] and not counters["recompiles"]
    return losses


@pytest.mark.parametrize("layout, schedule, zero_stage, recompute", [
    (dict(tp=2, pp=2), "1f1b", 1, False),
    (dict(cp=2, tp=2), "1f1b", 3, False),  # ring attention over CP, ZeRO-3's gathers around the graph
    (dict(dp=2, pp=2), "gpipe", 2, True),  # each compiled block recomputed in backward
])
def test_compiled_blocks_train_as_one_process(rank_pool, layout, schedule, zero_stage, recompute):
    results = rank_pool(4).run(_compiled_on_rank, layout, schedule, zero_stage, recompute)
    assert all(r == results[0] for r in results)


def test_compile_is_checked_and_refused_with_zero_bubble_schedules(world_of_one):
    for bad in (1, "", None):
        with pytest.raises(TypeError, match="GPTConfig.compile"):
            GPTConfig(**CONFIG, compile=bad)
    with pytest.raises(ValueError, match="zero-bubble W would have none to run"):
        Trainer(GPTConfig(**CONFIG, compile="aot_eager"), ok.init_parallel(), schedule="zb-h1")
    torch.manual_seed(0)
    trainer = Trainer(GPTConfig(**CONFIG, compile="aot_eager"), ok.init_parallel(), schedule="1f1b")
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in trainer.stage.blocks.values())


def test_a_deep_copy_of_a_compiled_gpt_runs_its_own_weights(world_of_one):
    """copy.deepcopy (an EMA, a frozen reference): the copy's compiled blocks run the copy's weights,
    not the original's (a closure over the original block was shared by the copy)."""
    import copy

    from overlapkernels.models import GPT
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG, compile="aot_eager"), ok.init_parallel(), dtype=torch.float64)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.mul_(0.5)
    tokens = torch.randint(0, 16, (2, 8))
    twin.loss(tokens, tokens).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in twin.blocks.parameters())
    for block, original in zip(twin.blocks.values(), model.blocks.values()):
        assert block.forward.__self__ is block and original.forward.__self__ is original
