"""Node-sized worlds: the other tests run 2 and 4 ranks, a real NVLink node runs TP=8 or CP=8, and its
TP groups are subgroups whose group ranks are not their global ranks. Here: 8 gloo ranks (ops, ring
attention and pipelines against the same dense references as the 2- and 4-rank tests), two
disjoint subgroups of odd sizes 3 and 5 with scattered global ranks working at the same time (a peer
addressed by its group rank instead of its global one, or a message crossing groups, fails here), and
the peer-memory algorithms with 8 threads."""
import pytest
import torch
import torch.distributed as dist

from nccl_like import replay_like_nccl
from overlapkernels.comm.rank_pool import RankPool
from overlapkernels.comm.thread_world import ThreadWorld
from test_ops_tp_gloo import _ag_case_on_rank, _rs_case_on_rank
from test_ops_tp_peer import _forward_cases_on_rank
from test_pipeline import _executor_on_rank
from test_ring_attention_gloo import _case_on_rank as _ring_case_on_rank
from test_ring_attention_precision_gloo import worst_excess

NODE = 8
SUBGROUPS = ([1, 4, 6], [0, 2, 3, 5, 7])  # odd sizes, global ranks neither contiguous nor starting at 0


@pytest.fixture(scope="module")
def node_pool():
    """8 ranks for this module only: the session's pools serve the 2- and 4-rank tests, and 8 idle
    processes would otherwise stay alive, holding memory, through every later module."""
    pool = RankPool(NODE, timeout=120.0)
    yield pool
    pool.close()


# One or two cases of the 2- and 4-rank tests' lists (8 ranks share 2 CPU cores in CI): what the size
# changes is the ring and the chunk arithmetic, which every case exercises.
def _ops_on_rank(method, group=None):
    f64 = torch.float64
    _ag_case_on_rank(method, (7, 3, 33), 0, [4, 9, 1], f64, True, False, False, group=group)  # QKV, bitwise
    _rs_case_on_rank(method, (2, 3, 7), 2, 33, 5, f64, True, group)  # 4-D, scattered along dim 2
    return True


def _ring_cases_on_rank(group=None):
    _ring_case_on_rank("zigzag", True, 4, 2, "bshd", False, group=group)  # GQA
    _ring_case_on_rank("contiguous", True, 4, 1, "sbhd", True, group=group)  # MQA, through the lse too
    return True


def test_tp_ops_on_eight_ranks(node_pool):
    """decomposed: the ring of 8 (baseline is torch's collectives, the same code at any size; it runs
    on the subgroups below)."""
    assert node_pool.run(_ops_on_rank, "decomposed") == [True] * NODE


def test_ring_attention_on_eight_ranks(node_pool):
    """Zigzag over 16 chunks, contiguous over 8, GQA/MQA, both formats, every gradient and the lse."""
    assert node_pool.run(_ring_cases_on_rank) == [True] * NODE


def test_sixteen_bit_ring_attention_on_eight_ranks_rounds_once(node_pool):
    """bf16 over 16 zigzag chunks: every result the exact value rounded once
    (test_ring_attention_precision_gloo.py has the bound and its plants)."""
    worst = worst_excess(node_pool, torch.bfloat16)
    assert max(worst.values()) <= 1.0, worst


@pytest.mark.parametrize("kind, v", [("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)])
def test_pipeline_of_eight_stages(node_pool, kind, v):
    """Exact gradients over 8 (16 virtual) stages; the P2P every rank posted keeps NCCL's rules."""
    results = node_pool.run(_executor_on_rank, kind, NODE, v)  # 8 microbatches: every stage busy at once
    assert sum(has_loss for has_loss, _ in results) == 1
    replay_like_nccl([log for _, log in results])


def _on_subgroups_on_rank():
    # new_group is collective over the world: every rank creates both groups, in the same order
    groups = [dist.new_group(ranks) for ranks in SUBGROUPS]
    mine = next(g for g, ranks in zip(groups, SUBGROUPS) if dist.get_rank() in ranks)
    assert dist.get_rank(mine) != dist.get_rank() or dist.get_rank() == 0  # group ranks are not global ranks
    _ops_on_rank("decomposed", mine)
    _ring_cases_on_rank(mine)
    return dist.get_world_size(mine)


def test_ops_and_ring_on_concurrent_odd_subgroups(node_pool):
    sizes = node_pool.run(_on_subgroups_on_rank)
    assert sizes == [3 if r in SUBGROUPS[0] else 5 for r in range(NODE)]


@pytest.mark.parametrize("method", ["fused"])
def test_peer_memory_methods_with_eight_threads(method):
    """One call per op (the 2- and 4-rank tests repeat calls): pulls in order rank+1 .. rank+7, eight
    chunk signals per op, the last rank a straggler; fp32 under the interpreter."""
    results = ThreadWorld(NODE, timeout=120).run(_forward_cases_on_rank, method, torch.float32, NODE - 1, calls=1)
    assert results == [True] * NODE
