"""A small GPT built from the parallel layers: TP (+SP) inside blocks, CP over the sequence.

Layout: tokens [B, S] -> hidden [S(/TP under SP)(/CP), B, hidden] -> logits [S_local, B, V/TP].
``loss`` takes the full batch on every rank and keeps this rank's part of the sequence (zigzag
over CP); its value is the global mean token loss on every rank, its gradient this rank's share,
so ``sync_grads`` (SP grads over TP, everything over CP) gives the gradient of the whole batch.
"""
from __future__ import annotations

import numbers
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _compat
from ..comm.collectives import all_reduce_coalesced
from ..kernels.ids import integer_ids
from ..layers import ColumnParallelLinear, RMSNorm, TransformerBlock, VocabParallelEmbedding
from ..layers.attention import check_cp_attention
from ..layers.embedding import check_token_ids
from ..layers.linear import default_init
from ..layers.norm import allreduce_sequence_parallel_grads
from ..layers.tags import PIPELINE_STAGE, KeepsTags, mark_context_parallel
from ..ops._validate import check_flag, check_size
from ..ops.cross_entropy import check_ignore_index, check_target_ids, vocab_parallel_cross_entropy
from ..ops.sequence_shard import check_layout_tag, shard_sequence
from ..parallel import ParallelDims


@dataclass
class GPTConfig:
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    max_seq_len: int
    sequence_parallel: bool = True
    method: str = "auto"
    cp_layout: str = "zigzag"
    ignore_index: int = -100
    # recompute each block's forward in backward (torch.utils.checkpoint, non-reentrant): a block
    # keeps only its input, at one more forward - its TP/CP communication included - per backward
    activation_checkpointing: bool = False
    # context-parallel attention: "ring" (ring_attention) or "ulysses" (ulysses_attention: all-to-alls;
    # num_heads / TP divisible by CP, num_kv_heads / TP divisible by CP or dividing it)
    cp_attention: str = "ring"
    # torch.compile each transformer block's forward, fullgraph (as torchtitan compiles its blocks;
    # the ops inside are opaque custom ops, see ops/_opaque): False, True (Inductor) or a backend name
    compile: bool | str = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden", "max_seq_len"):
            setattr(self, name, check_size(getattr(self, name), f"GPTConfig.{name}"))  # (numpy's ints too)
        self.sequence_parallel = check_flag(self.sequence_parallel, "GPTConfig.sequence_parallel")
        self.ignore_index = check_ignore_index(self.ignore_index, "GPTConfig.ignore_index")
        self.activation_checkpointing = check_flag(self.activation_checkpointing, "GPTConfig.activation_checkpointing")
        check_cp_attention(self.cp_attention, "GPTConfig.cp_attention")
        if not isinstance(self.compile, (bool, str)) or self.compile == "":
            raise TypeError(f"GPTConfig.compile={self.compile!r}: expected False, True (Inductor) or a "
                            "torch.compile backend name such as 'aot_eager'")


def check_segment_ids(segment_ids, tokens: torch.Tensor, same_device: bool = True) -> None:
    """Packed documents' ids: None, or integer ids shaped as the tokens [B, S] (and on their device)."""
    if segment_ids is None:
        return
    if not integer_ids(segment_ids) or segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids must be integer ids shaped as the tokens {tuple(tokens.shape)}, got "
                         + (f"{segment_ids.dtype} {tuple(segment_ids.shape)}" if isinstance(segment_ids, torch.Tensor)
                            else type(segment_ids).__name__))
    if same_device and segment_ids.device != tokens.device:
        raise ValueError(f"segment_ids is on {segment_ids.device} but the tokens are on {tokens.device}")


class GPT(KeepsTags, nn.Module):
    """The whole model, or with ``pipeline_stage=(s, n)`` stage s of n: the embedding on stage 0,
    layers [s L/n, (s+1) L/n), the final norm and LM head on stage n-1. Parameter names are the
    whole model's (blocks keep their global index), so dense state dicts shard onto any stage."""

    def __init__(self, config: GPTConfig, dims, *, dtype=None, device=None, pipeline_stage=None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config={type(config).__name__}: expected a GPTConfig")
        self.config, self.dims = config, dims
        stage, stages = pipeline_stage or (0, 1)
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (stage, stages)) \
                or not 0 <= stage < stages:
            raise ValueError(f"pipeline_stage={pipeline_stage!r}: expected (stage, num_stages) of integers with "
                             "0 <= stage < num_stages")
        if config.num_layers % stages:
            raise ValueError(f"pipeline_stage={pipeline_stage}: num_layers={config.num_layers} must split evenly "
                             f"into {stages} stages")
        per_stage = config.num_layers // stages
        if not isinstance(dims, ParallelDims):  # duck-typed dims would fail deep inside a layer
            shown = "None" if dims is None else type(dims).__name__
            raise TypeError(f"dims={shown}: expected a ParallelDims, from ok.init_parallel(...) (one process too: "
                            "its TP/CP/PP sizes of 1)")
        self.first, self.last = stage == 0, stage == stages - 1
        self.__dict__[PIPELINE_STAGE] = (stage, stages)  # (clipping without dims= refuses a part of a model)
        layer_ids = range(stage * per_stage, (stage + 1) * per_stage)
        tp = dims.tp_group
        self.cp_group = dims.cp_group if dims.cp_size > 1 else None
        sp = config.sequence_parallel and dims.tp_size > 1
        self.sequence_parallel = sp
        kw = dict(dtype=dtype, device=device)
        # every stage builds (and draws the random weights of) the embedding and every layer, in
        # order, and keeps its own: so initial weights never depend on the pipeline split
        embed = VocabParallelEmbedding(config.vocab_size, config.hidden, tp, sequence_parallel=sp, **kw)
        if self.first:
            self.embed = embed
        blocks = {}
        for i in range(config.num_layers):
            block = TransformerBlock(config.hidden, config.num_heads, config.num_kv_heads, config.ffn_hidden, tp,
                                     cp_group=self.cp_group, cp_layout=config.cp_layout, sequence_parallel=sp,
                                     method=config.method, cp_attention=config.cp_attention, **kw)
            if i in layer_ids:
                blocks[str(i)] = block
        self.blocks = nn.ModuleDict(blocks)
        if config.compile:
            backend = "inductor" if config.compile is True else config.compile
            compiled = torch.compile(TransformerBlock.forward, backend=backend, fullgraph=True)
            for block in blocks.values():
                # the forward only, not the module call: its hooks (fsdp's gathers) stay eager, outside.
                # A bound method, not a closure over this block: copy.deepcopy rebinds it to the copy
                # (a compiled bound method is copied as is, and the copy ran the original's weights)
                block.forward = types.MethodType(compiled, block)
        if self.last:
            self.norm = RMSNorm(config.hidden, sequence_parallel=sp, group=tp, **kw)
            self.lm_head = ColumnParallelLinear(config.hidden, config.vocab_size, tp, bias=False,
                                                sequence_parallel=sp, method=config.method, **kw)
        if self.cp_group is not None:  # every gradient is partial over CP: fsdp.shard sums it there
            mark_context_parallel(self, self.cp_group)

    def reset_parameters(self) -> None:
        """Redraw every weight as construction did, after ``to_empty`` of a meta build: the same values
        for the same seed. Like construction it draws (and drops) the embedding and the layers that
        other pipeline stages keep, so initial weights never depend on the pipeline split."""
        if self.first:
            self.embed.reset_parameters()
        else:
            default_init(torch.empty(self.config.vocab_size, self.config.hidden))  # (the embedding's draw)
        kept = next(iter(self.blocks.values()))
        for i in range(self.config.num_layers):
            if str(i) in self.blocks:
                self.blocks[str(i)].reset_parameters()
            else:  # another stage's layer: the same draws, into a kept layer put back afterwards
                with torch.no_grad():
                    saved = [p.detach().clone() for p in kept.parameters()]
                    kept.reset_parameters()
                    for p, value in zip(kept.parameters(), saved):
                        p.copy_(value)
        if self.last:
            self.norm.reset_parameters()
            self.lm_head.reset_parameters()

    def check_ids(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """The whole batch's token and target ids, checked on every rank before any rank takes its
        part: where ranks see different parts (CP, pipeline stages, DP replicas) a bad id in one
        part failed that rank alone, while its peers waited for it in the ring or an all-reduce.
        On CUDA tensors a device-side assert, as torch's embedding and cross-entropy give."""
        check_token_ids(tokens, self.config.vocab_size)
        if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"targets must be an integer tensor of token ids, got "
                            f"{getattr(targets, 'dtype', type(targets).__name__)}")
        check_target_ids(targets, self.config.vocab_size, self.config.ignore_index)

    def local_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of a [B, S] batch along the sequence (all of it without CP)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tuple(tokens.shape)}")
        seq, cp, tp = tokens.shape[1], self.dims.cp_size, self.dims.tp_size
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} > max_seq_len={self.config.max_seq_len}")
        pieces = 1 if self.cp_group is None else cp * (2 if self.config.cp_layout == "zigzag" else 1)
        local = seq // cp if self.cp_group is not None else seq
        if seq % pieces or (self.sequence_parallel and local % tp):
            raise ValueError(f"sequence length {seq} cannot be split: it must be divisible by {pieces} "
                             f"(CP size {cp}, layout {self.config.cp_layout!r}) and the per-rank length {local} by "
                             f"the TP size {tp} under sequence parallelism")
        if self.cp_group is None:
            return tokens
        return shard_sequence(tokens, self.cp_group, dim=1, layout=self.config.cp_layout)

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S_local] token ids (first stage) or hidden states -> hidden states, or the logits shard
        [S_local, B, V/TP] (last stage). ``segment_ids`` [B, S_local]: packed documents, attention
        within each (sharded as the tokens)."""
        if self.first:
            if x.dim() == 2 and x.shape[1] * self.dims.cp_size > self.config.max_seq_len:  # [B, S/CP] ids
                raise ValueError(f"sequence length {x.shape[1] * self.dims.cp_size} > "
                                 f"max_seq_len={self.config.max_seq_len}")
            if self.cp_group is not None:  # ids sharded by shard_sequence in another layout than the config's
                check_layout_tag(x, "tokens", 1, self.cp_group, self.config.cp_layout, "GPT")
            x = self.embed(x)
            if not self.sequence_parallel:
                x = x.transpose(0, 1)  # [S, B, hidden]
        recompute = self.config.activation_checkpointing and torch.is_grad_enabled()
        if segment_ids is not None and self.cp_group is not None:  # (here: the copy below carries no layout tag)
            check_layout_tag(segment_ids, "segment_ids", 1, self.cp_group, self.config.cp_layout, "GPT")
        if recompute and segment_ids is not None:  # saved for the recompute: the caller may refill its buffer
            segment_ids = segment_ids.clone()
        for block in self.blocks.values():
            # every rank recomputes the same blocks in the same order: the collectives inside pair up
            x = checkpoint(block, x, segment_ids, use_reentrant=False) if recompute else block(x, segment_ids)
        return self.lm_head(self.norm(x)) if self.last else x

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mean token loss of the whole batch (same value on every rank). ``segment_ids`` [B, S]:
        the document of each token where rows pack several (attention stays within a document)."""
        if targets.shape != tokens.shape:  # (local_tokens would name a bad targets "tokens")
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal tokens shape {tuple(tokens.shape)} "
                             "([B, S])")
        check_segment_ids(segment_ids, tokens)
        tokens_local, targets_local = self.local_tokens(tokens), self.local_tokens(targets)
        segments_local = None if segment_ids is None else self.local_tokens(segment_ids)
        self.check_ids(tokens, targets)  # the whole batch: under CP a rank's part would hide its peers' ids
        logits = self(tokens_local, segments_local)  # through __call__, so module hooks (fsdp) run
        per_token = vocab_parallel_cross_entropy(logits, targets_local.transpose(0, 1), self.dims.tp_group,
                                                 ignore_index=self.config.ignore_index)
        local_sum = per_token.sum()
        count = (targets_local != self.config.ignore_index).sum().to(local_sum.dtype)
        if self.cp_group is None:
            return local_sum / count.clamp(min=1)
        totals = torch.stack([local_sum.detach(), count])
        dist.all_reduce(totals, group=self.cp_group)
        global_sum, global_count = totals
        # value: the global mean, bitwise alike on every rank (x - x is exactly 0; local_sum + (global_sum -
        # local_sum) rounded differently per rank); gradient: this rank's share of it
        return (local_sum - local_sum.detach() + global_sum) / global_count.clamp(min=1)

    def sync_grads(self) -> None:
        """After backward: SP-partial gradients summed over TP, then every gradient over CP.
        Not needed under ``fsdp.shard``, which sums both itself; parameters it manages are skipped
        here (summing twice would multiply them by the TP or CP size). Under torch's FSDP2 over the
        DP mesh it sums each rank's gradient shards; a mesh that also holds CP peers is refused."""
        from ..layers.tags import tensor_parallel_parameters

        grads = []
        if self.cp_group is not None:  # (under fsdp.shard the units sum over CP themselves)
            # under torch's FSDP2 over DP: each rank's local gradient shard (a view), the same
            # shard index on its CP peers (they share the DP coordinate), found also when the
            # modules hold unsharded parameters after backward
            grads = [p.grad for _, p, _ in tensor_parallel_parameters(self)
                     if p.grad is not None and not getattr(p, "_fsdp_sums_context_parallel", False)]
            peers = set(dist.get_process_group_ranks(self.cp_group)) - {dist.get_rank()}
            meshes = {id(g.device_mesh): g.device_mesh for g in grads if hasattr(g, "device_mesh")}  # a few, shared
            for mesh in meshes.values():  # before any sum: a refused call leaves the gradients as they were
                if peers & set(mesh.mesh.flatten().tolist()):
                    # a mesh over DP x CP has already averaged over CP, and CP peers hold other shards
                    raise ValueError("sync_grads: torch's FSDP2 shards these parameters over a mesh that holds CP "
                                     "peers (it averaged their partial gradients, 1/cp of the sum); wrap the "
                                     "model with fully_shard(..., mesh=dims.mesh['dp'])")
        if self.sequence_parallel:
            allreduce_sequence_parallel_grads(self, self.dims.tp_group)
        if self.cp_group is not None:
            all_reduce_coalesced([g.to_local() if hasattr(g, "to_local") else g for g in grads], self.cp_group)


def shard_dense_state_dict(model: nn.Module, dense: dict, group=None) -> dict:
    """This rank's state dict from a dense (TP=1) one: tensor-parallel parameters are cut along
    their ``partition_dim`` over the TP group (``group``, else ``model.dims.tp_group``); the rest
    is copied. Works for any module built from the parallel layers, also wrapped by torch's FSDP2
    (between steps, its parameters sharded): the TP split comes from the names the layers remember,
    and each value becomes a DTensor laid out as its parameter, cut locally (no communication)."""
    from ..layers.tags import tensor_parallel_parameters

    group = group if group is not None else _tp_group_of(model)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    params = {name: (param, dim) for names, param, dim in tensor_parallel_parameters(model) for name in names}
    out = {}
    for name, value in model.state_dict().items():
        if name not in params:  # buffers, Megatron's _extra_state: as the dense model has them
            out[name] = dense.get(name, value)
            continue
        (param, partition_dim), full = params[name], dense[name]
        want = list(param.shape)  # (a DTensor's shape is its whole tensor's)
        if partition_dim is not None:
            want[partition_dim] *= world
        # the whole dense shape, not this rank's chunk: every rank refuses alike (chunks of an
        # uneven split differ, and may be missing)
        if tuple(full.shape) != tuple(want):
            raise ValueError(f"{name}: dense shape {tuple(full.shape)} does not shard to {tuple(param.shape)} "
                             f"(over {world} TP ranks: expected {tuple(want)})")
        if partition_dim is not None:
            full = full.chunk(world, dim=partition_dim)[rank]
        if hasattr(param, "device_mesh"):  # FSDP2: this rank's piece, in the parameter's layout
            out[name] = _compat.distribute_locally(full.detach().to(param.device, param.dtype), param.device_mesh,
                                                   param.placements)
        else:
            out[name] = full.clone()
    return out


def gather_dense_state_dict(model: nn.Module, group=None, *, grads: bool = False) -> dict:
    """The dense (TP=1) state dict - or, with ``grads``, the dense gradients - on every rank. The
    state dict has every key of ``model.state_dict()`` (buffers and ``_extra_state`` as they are),
    so a dense model loads it strictly. Works under torch's FSDP2 too (to export a trained model):
    its DTensors are gathered over their mesh, and the TP split is known from the names our layers
    remember (FSDP2 drops the tags). Every rank of the model's TP and FSDP2 groups must call it.
    ``model`` may also be what ``fsdp.shard`` returned (any stage): its units are gathered over DP
    (``full_state_dict``), keyed as the model inside it, then over TP; weights only, since its
    gradients live in the DP-sharded masters that ``step()`` consumes."""
    from ..layers.tags import tensor_parallel_parameters
    from ..runtime.fsdp.sharded import ShardedModule

    if isinstance(model, ShardedModule):
        return _gather_dense_from_fsdp(model, group, grads)
    group = group if group is not None else _tp_group_of(model)
    dense = {}
    for names, param, partition_dim in tensor_parallel_parameters(model):  # the same order on every rank
        t = param.grad if grads else param
        if t is None:
            continue
        t = t.detach()
        if hasattr(t, "full_tensor"):  # FSDP2's shard: all-gather over its mesh
            t = t.full_tensor()
        t = _gathered_over_tp(t, partition_dim, group).clone()  # never the model's own memory
        dense.update((name, t) for name in names)  # tied: one tensor under each of its names, as state_dict does
    if grads:
        return dense
    return {name: dense[name] if name in dense else (value.detach().clone() if torch.is_tensor(value) else value)
            for name, value in model.state_dict().items()}


def _gathered_over_tp(t: torch.Tensor, partition_dim, group) -> torch.Tensor:
    """The whole tensor from every TP rank's slice along ``partition_dim`` (None, or one rank: ``t``)."""
    world = dist.get_world_size(group)
    if partition_dim is None or world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=partition_dim)


def _gather_dense_from_fsdp(sharded, group, grads: bool) -> dict:
    """``gather_dense_state_dict`` of an ``fsdp.shard`` model: over DP, then over TP."""
    from ..layers.tags import tensor_parallel_parameters

    if grads:  # refused before any collective: every rank refuses alike
        raise ValueError("gather_dense_state_dict(grads=True) of an fsdp.shard model: its gradients are reduced into "
                         "each unit's DP-sharded master and consumed by step(); only the weights export")
    group = group if group is not None else _tp_group_of(sharded.module)
    full = sharded.full_state_dict()  # a collective over DP: unsharded over DP, still sliced over TP
    split = {}
    for names, _, partition_dim in tensor_parallel_parameters(sharded.module):  # the same order on every rank
        name = next((n for n in names if n in full), None)
        if name is None:  # (a parameter state_dict leaves out, as torch's own state_dict may)
            continue
        t = _gathered_over_tp(full[name], partition_dim, group)
        split.update((n, t) for n in names if n in full)
    return {name: split.get(name, value) for name, value in full.items()}


def _tp_group_of(model):
    dims = getattr(model, "dims", None)
    if dims is None:
        raise ValueError("model has no .dims (ParallelDims): build it as GPT(config, dims)")
    return dims.tp_group
