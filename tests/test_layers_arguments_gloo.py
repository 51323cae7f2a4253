"""Parallel layers' arguments, checked at construction and at the first forward - before any rank
communicates - with errors that name the argument, its value and what was expected."""
import re

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.layers import (ColumnParallelLinear, LayerNorm, ParallelMLP, ParallelSelfAttention, RMSNorm,
                                   RowParallelLinear, VocabParallelEmbedding)
from overlapkernels.layers.norm import mark_sequence_parallel
from comm_guard import no_communication
from test_layers_gloo import F64, _groups, _randn


def _bad_layers_on_rank():
    tp, _, world, _ = _groups()
    cases = [
        (lambda: ColumnParallelLinear(4, 3, tp), r"out_features=3 is not divisible by the tensor-parallel size 2"),
        (lambda: RowParallelLinear(3, 4, tp), r"in_features=3 is not divisible by the tensor-parallel size 2"),
        (lambda: ColumnParallelLinear(4, 4, tp, gather_output=True, sequence_parallel=True), r"gather_output=True"),
        (lambda: RowParallelLinear(4, 4, tp, input_is_parallel=False, sequence_parallel=True),
         r"needs input_is_parallel=True"),
        (lambda: VocabParallelEmbedding(7, 4, tp), r"num_embeddings=7 is not divisible"),
        (lambda: VocabParallelEmbedding(8, 4, tp, sequence_parallel=True)(torch.zeros(1, 3, dtype=torch.long)),
         r"sequence length 3 is not divisible by the tensor-parallel size 2 \(sequence_parallel=True\)"),
        (lambda: ParallelSelfAttention(8, 2, 1, tp), r"num_kv_heads=1 is not divisible by the tensor-parallel size 2"),
        (lambda: ParallelSelfAttention(8, 3, 1, tp), r"hidden=8 is not divisible by num_heads=3"),
        (lambda: ParallelMLP(8, 5, tp), r"ffn_hidden=5 is not divisible"),
        (lambda: ColumnParallelLinear(4, 4, tp, method="fast"), r"method='fast'"),
        (lambda: ok.vocab_parallel_cross_entropy(torch.ones(2, 3), torch.zeros(3, dtype=torch.long), tp),
         r"target shape \(3,\) must equal logits_shard.shape\[:-1\] \(2,\)"),
        (lambda: RowParallelLinear(4, 4, tp, sequence_parallel=True)(torch.ones(3, 1, 2)),
         r"RowParallelLinear\(sequence_parallel=True\), which scatters x's dim 0 \(the sequence of \[S, B, H\]\) over "
         r"the tensor-parallel ranks: x.shape\[scatter_dim=0\]=3 is not divisible by the group size 2"),
        (lambda: RowParallelLinear(4, 4, tp, sequence_parallel=True)(torch.ones(2)),
         r"RowParallelLinear\(sequence_parallel=True\).*: x must have at least 2 dims"),
        # a wrong input width, in the layer's terms (the op would name a_shard/b, torch's matmul only
        # "mat1 and mat2 shapes cannot be multiplied"), with or without sequence parallelism
        (lambda: ColumnParallelLinear(8, 4, tp, sequence_parallel=True)(torch.ones(3, 1, 7)),
         r"ColumnParallelLinear: x.shape=\(3, 1, 7\), expected a last dim of 8 \(in_features\)"),
        (lambda: ColumnParallelLinear(8, 4, tp)(torch.ones(3, 1, 7)), r"ColumnParallelLinear: x.shape=\(3, 1, 7\)"),
        (lambda: RowParallelLinear(8, 4, tp)(torch.ones(3, 1, 8)),
         r"RowParallelLinear: x.shape=\(3, 1, 8\), expected a last dim of 4 \(in_features / tensor-parallel size"),
        (lambda: RowParallelLinear(8, 4, tp, input_is_parallel=False)(torch.ones(3, 1, 4)),
         r"expected a last dim of 8 \(in_features\)"),
        (lambda: ParallelMLP(8, 4, tp)(torch.ones(3, 1, 6)), r"ParallelMLP: x.shape=\(3, 1, 6\), expected a last dim of 8"),
        (lambda: ParallelSelfAttention(8, 2, 2, tp)(torch.ones(3, 1, 6)),
         r"ParallelSelfAttention: x.shape=\(3, 1, 6\), expected a last dim of 8 \(hidden\)"),
        # a 0-dim input has no last dim: named as such, not an IndexError from x.shape[-1]
        (lambda: ColumnParallelLinear(8, 4, tp)(torch.tensor(1.0)),
         r"ColumnParallelLinear: x.shape=\(\), expected a last dim of 8 \(in_features\)"),
        (lambda: ParallelSelfAttention(8, 4, 3, tp), r"^num_heads=4 is not a multiple of num_kv_heads=3$"),
        (lambda: ParallelSelfAttention(6, 2, 2, tp), r"^hidden=6 / num_heads=2 gives an odd head dim 3: rotary "),
        (lambda: ParallelSelfAttention(8, 2, 2, tp, cp_layout="ring"),
         r"^cp_layout='ring': expected one of \['contiguous', 'zigzag'\]$"),
        (lambda: ParallelSelfAttention(8, 2, 2, tp)(torch.ones(3, 8)),
         r"^x must be \[S, B, hidden\], got shape \(3, 8\)$"),
        # segment_ids in the layer's terms before the QKV gather communicates (under SP, x holds 1/TP of S_local)
        (lambda: ParallelSelfAttention(8, 2, 2, tp, sequence_parallel=True)(torch.ones(2, 1, 8),
                                                                              torch.zeros(1, 2, dtype=torch.long)),
         r"^ParallelSelfAttention: segment_ids.shape=\(1, 2\), expected \[B, S_local\] = \[1, 4\]"),
        (lambda: ParallelSelfAttention(8, 2, 2, tp, sequence_parallel=True)(torch.ones(2, 1, 8), torch.zeros(1, 4)),
         TypeError, r"^ParallelSelfAttention: segment_ids.dtype=torch.float32: expected integer ids$"),
        (lambda: RowParallelLinear(8, 4, tp)([[1.0] * 4]), TypeError,
         r"^RowParallelLinear: x must be a torch.Tensor, got list$"),
        (lambda: mark_sequence_parallel(torch.nn.Parameter(torch.ones(2)), True, tp, owner=torch.nn.Linear(2, 2)),
         r"^mark_sequence_parallel: owner Linear does not hold this parameter directly \(register it on the module "
         r"first\)$"),
        # sizes are integers >= 1: 0 heads divided by zero, 0 kv heads silently meant num_heads, negative
        # head counts built a module with negative head_dim, and torch's own error named no argument
        (lambda: ParallelSelfAttention(16, 0, 2, tp), r"^num_heads=0: expected an integer >= 1$"),
        (lambda: ParallelSelfAttention(16, 4, 0, tp), r"^num_kv_heads=0: expected an integer >= 1$"),
        (lambda: ParallelSelfAttention(16, -4, -2, tp), r"^num_heads=-4: expected an integer >= 1$"),
        (lambda: ParallelSelfAttention(16.0, 4, 2, tp), r"^hidden=16.0: expected an integer >= 1$"),
        (lambda: ColumnParallelLinear(-4, 4, tp), r"^in_features=-4: expected an integer >= 1$"),
        (lambda: ColumnParallelLinear(4, -4, tp), r"^out_features=-4: expected an integer >= 1$"),
        (lambda: RowParallelLinear(4, 0, tp), r"^out_features=0: expected an integer >= 1$"),
        (lambda: ParallelMLP(8, True, tp), r"^ffn_hidden=True: expected an integer >= 1$"),
        (lambda: VocabParallelEmbedding(16, 0, tp), r"^embedding_dim=0: expected an integer >= 1$"),
        (lambda: RMSNorm(0), r"^hidden=0: expected an integer >= 1$"),  # (built an empty norm)
        (lambda: LayerNorm(0), r"^hidden=0: expected an integer >= 1$"),
        # switches are bools: "no" is truthy, so it silently meant on (and another input shape)
        (lambda: ColumnParallelLinear(4, 4, tp, sequence_parallel="no"), TypeError,
         r"^sequence_parallel='no': expected a bool$"),
        (lambda: ColumnParallelLinear(4, 4, tp, gather_output="yes"), TypeError, r"^gather_output='yes': expected a bool$"),
        (lambda: RowParallelLinear(4, 4, tp, input_is_parallel="True"), TypeError,
         r"^input_is_parallel='True': expected a bool$"),
        (lambda: RowParallelLinear(4, 4, tp, bias="False"), TypeError, r"^bias='False': expected a bool$"),
        (lambda: ParallelMLP(8, 4, tp, sequence_parallel="False"), TypeError, r"^sequence_parallel='False'"),
        (lambda: ParallelSelfAttention(8, 2, 2, tp, sequence_parallel=2), TypeError, r"^sequence_parallel=2: expected"),
        (lambda: VocabParallelEmbedding(8, 4, tp, sequence_parallel="on"), TypeError, r"^sequence_parallel='on'"),
        (lambda: RMSNorm(4, sequence_parallel="no", group=tp), TypeError, r"^sequence_parallel='no': expected a bool$"),
        # cross entropy's ignore_index is an int, as F.cross_entropy's (5.0 ignored class 5, 1.5 nothing,
        # None failed inside after the first all-reduce); a 0-d logits_shard has no vocabulary dim
        (lambda: ok.vocab_parallel_cross_entropy(torch.ones(2, 3), torch.zeros(2, dtype=torch.long), tp,
                                                 ignore_index=5.0), TypeError,
         r"^ignore_index=5.0: expected an int \(a target id to ignore, -100 by default\)$"),
        (lambda: ok.vocab_parallel_cross_entropy(torch.ones(2, 3), torch.zeros(2, dtype=torch.long), tp,
                                                 ignore_index=None), TypeError, r"^ignore_index=None: expected an int"),
        (lambda: ok.vocab_parallel_cross_entropy(torch.tensor(1.0), torch.tensor(0), tp),
         r"^logits_shard.shape=\(\): expected \[..., V/P\]"),
    ]
    for i, (make, *error, pattern) in enumerate(cases):
        error = error[0] if error else ValueError
        try:
            with no_communication():  # refused before any collective, not after one every rank ran
                make()
        except (ValueError, TypeError) as exc:
            assert type(exc) is error and re.search(pattern, str(exc)), (i, repr(exc))
        else:
            raise AssertionError(f"case {i}: no {error.__name__}")
    # what torch's own layers take for a switch stays accepted: numpy's bools, bool tensors, None (off)
    numpy = pytest.importorskip("numpy")
    with no_communication():
        assert ColumnParallelLinear(4, 4, tp, bias=None).bias is None
        assert RowParallelLinear(4, 4, tp, sequence_parallel=numpy.True_).sequence_parallel is True
        assert RMSNorm(4, sequence_parallel=torch.tensor(False)).weight.shape == (4,)
    stray = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="does not hold this parameter"), no_communication():
        mark_sequence_parallel(stray, True, tp, owner=torch.nn.Linear(2, 2))
    assert not hasattr(stray, "sequence_parallel") and not hasattr(stray, "sequence_parallel_group")  # left untagged
    total = torch.ones(1)
    dist.all_reduce(total)
    return int(total)


def test_bad_layer_arguments(rank_pool):
    assert rank_pool(2).run(_bad_layers_on_rank) == [2, 2]


def _cp_group_arguments_on_rank():
    """cp_group went unchecked until the first forward (after the QKV gather under SP); a CP group
    of one rank made zigzag refuse odd lengths, though it splits nothing."""
    tp, one, world, rank = _groups()
    refused = []
    for bad in ([0, 1], "cp", 3):
        try:
            ParallelSelfAttention(16, 2, group=one, cp_group=bad, dtype=F64)
        except TypeError as exc:
            refused.append(str(exc).startswith(f"cp_group={bad!r}: expected a torch.distributed ProcessGroup"))
    torch.manual_seed(0)
    plain = ParallelSelfAttention(16, 2, group=one, dtype=F64)
    torch.manual_seed(0)
    cp_one = ParallelSelfAttention(16, 2, group=one, cp_group=one, cp_layout="zigzag", dtype=F64)
    x = _randn(5, 1, 16, seed=2)  # odd length
    return refused, cp_one.cp_group is None and torch.equal(cp_one(x), plain(x))


def test_cp_group_is_checked_at_construction_and_one_rank_splits_nothing(rank_pool):
    assert rank_pool(2).run(_cp_group_arguments_on_rank) == [([True] * 3, True)] * 2


def _layout_mismatch_on_rank():
    """x (or the GPT's ids) straight from shard_sequence in one layout, handed to an attention (a GPT)
    built with the other: it computed with the wrong positions and masks, silently (max error ~4 on
    O(1) outputs); refused now as unshard_sequence and ring_attention refuse it, before communicating."""
    from overlapkernels.models.gpt import GPT, GPTConfig

    world = dist.get_world_size()
    dims = ok.init_parallel(cp=world)
    layer = ParallelSelfAttention(8, 2, 2, ok.init_parallel().tp_group, cp_group=dims.cp_group, dtype=F64)
    x_local = ok.shard_sequence(_randn(8, 1, 8, seed=1), dims.cp_group, dim=0, layout="contiguous")
    said = []
    with no_communication():
        try:
            layer(x_local)
        except ValueError as exc:
            said.append(str(exc))
    config = GPTConfig(vocab_size=16, hidden=8, num_layers=1, num_heads=2, num_kv_heads=2, ffn_hidden=16,
                       max_seq_len=16)
    gpt = GPT(config, dims, dtype=F64)
    ids = ok.shard_sequence(torch.zeros(1, 8, dtype=torch.long), dims.cp_group, dim=1, layout="contiguous")
    with no_communication():
        try:
            gpt(ids)
        except ValueError as exc:
            said.append(str(exc))
    good = layer(ok.shard_sequence(_randn(8, 1, 8, seed=1), dims.cp_group, dim=0))  # the layer's zigzag: runs
    return said, good.shape


def test_a_cp_shard_in_another_layout_than_the_layers_is_refused(rank_pool):
    for said, shape in rank_pool(2).run(_layout_mismatch_on_rank):
        assert shape == (4, 1, 8) and len(said) == 2, said
        assert said[0].startswith("ParallelSelfAttention: x was laid out with layout='contiguous' (by shard_sequence "
                                  "or ring_attention) but layout='zigzag' was passed"), said[0]
        assert said[1].startswith("GPT: tokens was laid out with layout='contiguous'"), said[1]


def test_gpt_refuses_a_config_or_dims_of_another_type():
    """GPT(config, None) failed with an AttributeError from deep inside (None.tp_group); a dict for
    the config likewise. Both are refused by name, before anything is built (no process group needed)."""
    from overlapkernels.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=16, hidden=8, num_layers=1, num_heads=2, num_kv_heads=2, ffn_hidden=16,
                       max_seq_len=16)
    with pytest.raises(TypeError, match=r"^dims=None: expected a ParallelDims, from ok.init_parallel"):
        GPT(config, None)
    with pytest.raises(TypeError, match=r"^config=dict: expected a GPTConfig$"):
        GPT(dict(vocab_size=16), None)
