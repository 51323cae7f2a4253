"""The GPT trained in 4-D compositions (PP with TP/SP, DP, CP) equals single-process training."""
import collections
import contextlib
import dataclasses

import pytest
import torch

import overlapkernels as ok
from overlapkernels.models import GPT, GPTConfig, shard_dense_state_dict
from overlapkernels.models.train import Trainer
from overlapkernels.ops import weight_grad_store
from overlapkernels.runtime import fsdp
from overlapkernels.runtime.fsdp.flat_unit import FlatUnit

CONFIG = dict(vocab_size=16, hidden=8, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden=16, max_seq_len=8)


def _compose_on_rank(layout, schedule, sequence_parallel=True, lose_grad=False, zero_stage=1, max_grad_norm=None,
                     init_scale=None, recompute=False, reduce_per_microbatch=True, documents=False, compile=False):
    """The trainer's losses and weights after two steps equal single-process training's. With
    ``max_grad_norm``, both clip; with ``init_scale``, the trainer scales its loss (by a power of 2:
    exact in float64, so nothing may differ) and returns its grad norms and skip flags too. With
    ``recompute``, the trainer's GPT checkpoints its blocks' activations (each block runs its
    forward once more per microbatch, in backward). Counts each ZeRO unit's reduce-scatters and
    all-gathers per step: once per microbatch, or once per step without ``reduce_per_microbatch``.
    ``documents``: rows packing documents (segment ids, each row its own boundaries). ``compile``: the
    trainer's GPT compiles its blocks (``GPTConfig.compile``: a backend)."""
    config = GPTConfig(**CONFIG, method="decomposed", sequence_parallel=sequence_parallel)
    trainer_config = dataclasses.replace(config, activation_checkpointing=recompute, compile=compile)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
               for _ in range(2)]
    batches[1][1][2, 3:7] = batches[1][1][5, 0] = -100  # padding: the mean is over the real tokens
    # a document boundary after token 1-6 of each row (a second one in odd rows), or None
    ids = [(torch.arange(8)[None] >= torch.randint(1, 7, (8, 1), generator=g)).long()
           + (torch.arange(8)[None] >= 7) * (torch.arange(8)[:, None] % 2) if documents else None for _ in batches]
    torch.manual_seed(0)
    dense = GPT(config, ok.init_parallel(), dtype=torch.float64)
    start = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in dense.state_dict().items()}
    # SGD with momentum: unlike AdamW it is sensitive to the gradient's scale (averaging, CP/TP sums)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    opt = sgd(dense.parameters())
    want_losses, want_norms = [], []
    for (tokens, targets), segment_ids in zip(batches, ids):
        opt.zero_grad()
        loss = dense.loss(tokens, targets, segment_ids)
        loss.backward()
        if max_grad_norm is not None:
            want_norms.append(float(torch.nn.utils.clip_grad_norm_(dense.parameters(), max_grad_norm)))
            assert want_norms[-1] > 2 * max_grad_norm  # so the trainer must clip too
        opt.step()
        want_losses.append(float(loss))

    dims = ok.init_parallel(**layout)
    scaler = None if init_scale is None else fsdp.GradScaler(init_scale=init_scale)
    trainer = Trainer(trainer_config, dims, schedule=schedule, dtype=torch.float64, dense_state_dict=start, optimizer=sgd,
                      zero_stage=zero_stage, max_grad_norm=max_grad_norm, grad_scaler=scaler,
                      reduce_per_microbatch=reduce_per_microbatch)
    norms, skipped, block_calls = [], [], []
    for block in trainer.stage.blocks.values():
        block.register_forward_pre_hook(lambda *_: block_calls.append(1))
    with _recording_w(trainer.stage, lose_grad) as deferred, _counting_unit_collectives() as counts:
        losses = []
        for (tokens, targets), segment_ids in zip(batches, ids):
            counts.clear()
            losses.append(trainer.step(tokens, targets, segment_ids))
            norms.append(trainer.last_grad_norm)
            skipped.append(trainer.last_step_skipped)
            # per unit and step: once, or (ZeRO-2/3) once per microbatch - ZB-H1's after its W, with
            # what its B left, so a unit without W gradients skips the closing Ws that follow no new
            # B (at most pp - 1 of them); ZeRO-1 at the step
            m = trainer.schedule.num_microbatches
            reduces = [n for (op, _), n in counts.items() if op == "reduce"]
            want = 1 if zero_stage == 1 or not reduce_per_microbatch else m
            fewest = want - (dims.pp_size - 1) if schedule == "zb-h1" and want > 1 else want
            assert max(reduces) == want and min(reduces) >= fewest, counts
            if zero_stage == 3:  # gathered around each forward and backward, or once for the step
                gathers = max(n for (op, _), n in counts.items() if op == "gather")
                assert gathers == 1 if not reduce_per_microbatch else gathers >= 2 * m, counts
    # forwards per block and microbatch: once, or once more in backward (recomputed)
    want_calls = len(trainer.stage.blocks) * 2 * trainer.schedule.num_microbatches * (1 + recompute)
    assert len(block_calls) == want_calls, f"{len(block_calls)} block forwards, expected {want_calls}"
    if max_grad_norm is not None:
        assert norms == pytest.approx(want_norms, rel=1e-12), f"grad norms {norms} != {want_norms}"
    else:
        assert norms == [None, None]
    assert skipped == [False, False]
    if schedule == "zb-h1":  # every W (m per step) gave each of the stage's linear weights its gradient
        linears = sorted(n for n, _ in trainer.stage.named_parameters() if n.endswith(_LINEAR_WEIGHTS))
        assert len(linears) == (7 if trainer.stage.first else 8), linears  # a block: 7; the head
        assert deferred == [linears] * (2 * trainer.schedule.num_microbatches), deferred
    else:
        assert deferred == []
    assert losses == pytest.approx(want_losses, abs=1e-12, rel=1e-12), f"losses {losses} != {want_losses}"
    # an unsharded twin of this rank's stage gives the layout (a ZeRO-3 stage has no state_dict of its own)
    twin = GPT(config, dims, dtype=torch.float64, pipeline_stage=(dims.pp_rank, dims.pp_size))
    want = shard_dense_state_dict(twin, dense.state_dict())
    full = trainer.sharded.full_state_dict()
    assert set(full) == set(want) and trainer.sharded.stage == zero_stage
    if zero_stage == 3:  # between steps a ZeRO-3 stage keeps only its shards
        assert all(p.numel() == 0 for p in trainer.stage.parameters())
    for name, t in full.items():
        if torch.is_tensor(t):
            torch.testing.assert_close(t, want[name], atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    if init_scale is not None:
        assert scaler.get_scale() == init_scale  # no overflow, and fewer steps than growth_interval
    return losses


# the GPT's matmuls with weights: QKV, attention output, MLP gate/up/down, and the LM head
_LINEAR_WEIGHTS = ("q_weight", "k_weight", "v_weight", "out.weight", "gate_weight", "up_weight", "down.weight",
                   "lm_head.weight")


@contextlib.contextmanager
def _recording_w(model, lose_grad):
    """Per W action (``WeightGradStore.run``), the sorted names of the parameters its closures gave
    gradients to. ``lose_grad``: a planted error only the numbers can show, each W drops the first
    gradient it computes (on every rank alike: all fail the same check, none waits in a collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    run, accumulate = weight_grad_store.WeightGradStore.run, weight_grad_store.accumulate
    deferred = []

    def recording_run(store):
        deferred.append([])
        run(store)
        deferred[-1].sort()

    def recording_accumulate(param, grad):
        deferred[-1].append(names[id(param)])
        if not (lose_grad and len(deferred[-1]) == 1):
            accumulate(param, grad)

    weight_grad_store.WeightGradStore.run, weight_grad_store.accumulate = recording_run, recording_accumulate
    try:
        yield deferred
    finally:  # the pool's processes run later tests too
        weight_grad_store.WeightGradStore.run, weight_grad_store.accumulate = run, accumulate


@contextlib.contextmanager
def _counting_unit_collectives():
    """{("reduce" | "gather", unit name): collectives posted} by fsdp's flat units while inside."""
    counts = collections.Counter()
    reduce_grads, gather = FlatUnit.reduce_grads, FlatUnit.gather

    def counting_reduce(unit, **kwargs):
        counts["reduce", unit.name] += 1
        return reduce_grads(unit, **kwargs)

    def counting_gather(unit, **kwargs):
        if not (unit.gathered or unit.pending_gather is not None):  # (else a wait for one already posted)
            counts["gather", unit.name] += 1
        return gather(unit, **kwargs)

    FlatUnit.reduce_grads, FlatUnit.gather = counting_reduce, counting_gather
    try:
        yield counts
    finally:  # the pool's processes run later tests too
        FlatUnit.reduce_grads, FlatUnit.gather = reduce_grads, gather


@pytest.mark.parametrize("layout, schedule, sp", [
    (dict(tp=2, pp=2), "1f1b", True), (dict(dp=2, pp=2), "gpipe", True), (dict(cp=2, pp=2), "1f1b", True),
    (dict(tp=2, dp=2), "1f1b", True),
    # ZB-H1: B leaves the weight gradients of the GPT's linears to W (SP: fused ops; TP w/o SP; no TP)
    (dict(tp=2, pp=2), "zb-h1", True), (dict(tp=2, pp=2), "zb-h1", False), (dict(dp=2, pp=2), "zb-h1", True),
])
def test_composition_matches_single_process(rank_pool, layout, schedule, sp):
    results = rank_pool(4).run(_compose_on_rank, layout, schedule, sp)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("zero_stage, schedule", [(2, "zb-h1"), (2, "gpipe"), (3, "1f1b"), (3, "zb-h1")])
def test_pipeline_with_zero_2_and_3_matches_single_process(rank_pool, zero_stage, schedule):
    """ZeRO-2/3 under a pipeline (DeepSpeed allows only ZeRO-1 there): each microbatch's gradients
    are reduce-scattered in its own backward (ZB-H1: in its W) and accumulate in the shards."""
    results = rank_pool(4).run(_compose_on_rank, dict(dp=2, pp=2), schedule, zero_stage=zero_stage)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("layout, schedule, zero_stage", [
    (dict(cp=2, pp=2), "1f1b", 1), (dict(tp=2, pp=2), "zb-h1", 2), (dict(dp=2, pp=2), "gpipe", 3)])
def test_packed_documents_train_as_single_process(rank_pool, layout, schedule, zero_stage):
    """Trainer.step(tokens, targets, segment_ids): every stage gets its microbatch's ids."""
    results = rank_pool(4).run(_compose_on_rank, layout, schedule, zero_stage=zero_stage, documents=True)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("zero_stage, schedule", [(2, "1f1b"), (3, "zb-h1")])  # (ZeRO-3 interleaved: test_train_options)
def test_reducing_once_per_step_matches_single_process(rank_pool, zero_stage, schedule):
    """reduce_per_microbatch=False: one reduce-scatter per unit and step (ZeRO-3: one all-gather),
    the gradients accumulated over the microbatches (ZB-H1: over its W actions too), same weights."""
    results = rank_pool(4).run(_compose_on_rank, dict(dp=2, pp=2), schedule, zero_stage=zero_stage,
                               reduce_per_microbatch=False)
    assert all(r == results[0] for r in results)


def test_bad_zero_stage_is_refused():
    for bad in (0, 4, 2.0, True, "2"):
        with pytest.raises(ValueError, match=rf"zero_stage={bad!r}: expected 1, 2 or 3".replace(".", r"\.")):
            Trainer(GPTConfig(**CONFIG), None, zero_stage=bad)


def test_bad_microbatch_counts_are_refused_not_defaulted():
    """0 (falsy) silently became the default, 2 x the pipeline size."""
    for bad in (0, -2, 0.0, False, 2.0):
        with pytest.raises(ValueError, match=rf"num_microbatches={bad!r}: expected an integer >= 1".replace(".", r"\.")):
            Trainer(GPTConfig(**CONFIG), None, num_microbatches=bad)


def _lost_grad_on_rank():
    try:
        _compose_on_rank(dict(tp=2, pp=2), "zb-h1", lose_grad=True)
    except AssertionError as exc:
        return str(exc).split()[0]
    return "missed"


def test_planted_lost_weight_grad_is_caught(rank_pool):
    assert rank_pool(4).run(_lost_grad_on_rank) == ["losses"] * 4


_BAD_BATCHES = [  # (tokens shape, targets shape, message)
    ((6, 8), (6, 8), "batch size 6 must be divisible by dp x microbatches = 1 x 4"),
    ((4, 8), (4, 6), "tokens (4, 8) and targets (4, 6) must both be [B, S]"),
    ((8,), (8,), "tokens (8,) and targets (8,) must both be [B, S]"),
    ((4, 10), (4, 10), "sequence length 10 > max_seq_len=8"),
]


def _bad_batch_on_rank():
    dims = ok.init_parallel(tp=2, pp=2)
    trainer = Trainer(GPTConfig(**CONFIG), dims, dtype=torch.float64)
    messages = []
    for tokens, targets, _ in _BAD_BATCHES:  # one trainer: a refused batch leaves nothing in flight
        try:
            trainer.step(torch.zeros(tokens, dtype=torch.long), torch.zeros(targets, dtype=torch.long))
        except ValueError as exc:  # on every rank, middle stages included, before any P2P
            messages.append(str(exc))
        else:
            messages.append("accepted")
    batch = torch.zeros(4, 8, dtype=torch.long)
    for ids in (batch[:, :4], batch.float()):  # segment ids: shaped as the tokens, integers
        try:
            trainer.step(batch, batch, ids)
        except ValueError as exc:
            messages.append(str(exc).split(", got")[0])
    return messages


def test_bad_batch_is_refused_on_every_rank(rank_pool):
    ids_refused = "segment_ids must be integer ids shaped as the tokens (4, 8)"
    for messages in rank_pool(4).run(_bad_batch_on_rank):
        assert messages == [message for _, _, message in _BAD_BATCHES] + [ids_refused] * 2


def _bad_ids_on_rank():
    """Each rank sees a part of the batch (dp=2 x pp=2: rows by DP, ids on stage 0, targets on stage
    1): a bad id in the last row reaches one rank's embedding or loss only. That rank raised and the
    others waited for it in the pipeline's P2P."""
    dims = ok.init_parallel(dp=2, pp=2)
    trainer = Trainer(GPTConfig(**CONFIG), dims, dtype=torch.float64)
    said = []
    for which, value in (("tokens", 16), ("tokens", -1), ("targets", 16), ("targets", -7)):
        batch = {"tokens": torch.zeros(8, 8, dtype=torch.long), "targets": torch.zeros(8, 8, dtype=torch.long)}
        batch[which][7, 5] = value
        try:
            trainer.step(batch["tokens"], batch["targets"])
        except (ValueError, IndexError) as exc:  # on every rank, before any P2P
            said.append(f"{type(exc).__name__}: {exc}")
    try:
        trainer.step(torch.zeros(8, 8, dtype=torch.long), torch.zeros(8, 8))
    except TypeError as exc:
        said.append(f"TypeError: {exc}")
    return said


def test_bad_ids_are_refused_on_every_rank(rank_pool):
    for said in rank_pool(4).run(_bad_ids_on_rank):
        assert said == ["IndexError: tokens hold ids outside [0, 16), e.g. 16",
                        "IndexError: tokens hold ids outside [0, 16), e.g. -1",
                        "ValueError: target holds ids outside [0, 16) that are not ignore_index=-100, e.g. 16",
                        "ValueError: target holds ids outside [0, 16) that are not ignore_index=-100, e.g. -7",
                        "TypeError: targets must be an integer tensor of token ids, got torch.float32"], said


def _pending_timeout_on_rank_1():
    """dp=2: rank 1 holds a symm/fused call's device timeout not yet raised (checked a call late).
    The step stops on both ranks before the optimizer, whose weights stay as they were."""
    from pending_timeout import pending_timeout_on

    dims = ok.init_parallel(dp=2)
    trainer = Trainer(GPTConfig(**CONFIG), dims, dtype=torch.float64)
    before = {k: v.clone() for k, v in trainer.sharded.full_state_dict().items() if torch.is_tensor(v)}
    try:
        with pending_timeout_on(1, "ok/matmul_reduce_scatter[symm]: rank 1 timed out waiting for rank 0's partial"):
            trainer.step(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))
        said = "stepped"
    except (RuntimeError, ValueError) as exc:
        said = f"{type(exc).__name__}: {exc}"
    after = trainer.sharded.full_state_dict()
    return said, all(torch.equal(before[k], after[k]) for k in before)


def test_a_timeout_pending_on_one_rank_stops_the_step_on_every_rank(rank_pool):
    """Was: its error surfaced at the next symm/fused call, after the optimizer had applied the
    timed-out call's garbage (and a checkpoint could have saved it)."""
    timeout = "SignalTimeoutError: ok/matmul_reduce_scatter[symm]: rank 1 timed out waiting for rank 0's partial"
    rank0, rank1 = rank_pool(2).run(_pending_timeout_on_rank_1)
    assert rank1 == (timeout, True)
    assert rank0 == (f"PeerFailedError: Trainer.step: rank 1 of the group failed, so this rank stops too: {timeout}",
                     True)
