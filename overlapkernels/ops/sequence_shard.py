"""Sequence layouts of a context-parallel group: which part of the sequence each rank holds.

``contiguous``: rank r holds block r of P. ``zigzag``: the sequence is cut in 2P chunks and rank r
holds chunks r and 2P-1-r, so under a causal mask every rank has the same amount of work.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather, reduce_scatter
from ..parallel import resolve_group
from ._autograd import first_order_only, not_a_view
from ._opaque import opaque_under_compile, resized
from ._validate import check_tensor

LAYOUTS = ("contiguous", "zigzag")


# shard_sequence tags its result with its layout, and ring_attention its output, so that a tensor
# given to ring_attention or unshard_sequence with another layout is refused rather than attended
# or reordered wrongly without an error: the API's defaults differ (shard/unshard_sequence
# "zigzag", ring_attention "contiguous"), so one dropped layout= would do exactly that. A tag is per
# (dim, group): a tensor sharded over CP along the sequence and over another group along another dim
# keeps both. Best effort: new tensors (projections, .to() / .contiguous() copies) carry none.
_LAYOUT_TAG = "_overlapkernels_layouts"  # {(dim, id(group)): layout}


def tag_layout(x: torch.Tensor, dim: int, group, layout: str, inherit=None) -> torch.Tensor:
    """Tag ``x`` as laid out by ``layout`` along ``dim`` over ``group``, keeping ``inherit``'s other
    tags: a part cut along one dim keeps its layout along the others, and a part of a part (USP: a
    ring's part cut within a group) keeps the outer group's along the same dim. Eager mode only:
    under torch.compile the ops are opaque calls (see ``_opaque``) whose results carry no attributes."""
    if torch.compiler.is_compiling():
        return x
    tags = {key: value for key, value in getattr(inherit, _LAYOUT_TAG, {}).items() if key != (dim, id(group))}
    tags[(dim, id(group))] = layout
    setattr(x, _LAYOUT_TAG, tags)
    return x


def check_layout_tag(x, name: str, dim: int, group, layout: str, what: str) -> None:
    if layout not in LAYOUTS or torch.compiler.is_compiling():  # (no tags under compile: see tag_layout)
        return  # the caller's own check names a bad layout
    tagged = getattr(x, _LAYOUT_TAG, {}).get((dim, id(group)))
    if tagged is not None and tagged != layout and dist.get_world_size(group) > 1:
        raise ValueError(f"{what}: {name} was laid out with layout={tagged!r} (by shard_sequence or ring_attention) "
                         f"but layout={layout!r} was passed; pass one layout to shard_sequence, ring_attention and "
                         "unshard_sequence (their defaults differ: 'zigzag' for shard/unshard_sequence, "
                         "'contiguous' for ring_attention)")


def check_layout(layout, name: str = "layout") -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{name}={layout!r}: expected one of {list(LAYOUTS)}")
    return layout


def segments(layout: str, world: int, rank: int, local_len: int) -> list[tuple[int, int, int]]:
    """(offset in the local sequence, global start position, length) of each contiguous piece."""
    if layout == "contiguous":
        return [(0, rank * local_len, local_len)]
    half = local_len // 2
    return [(0, rank * half, half), (half, (2 * world - 1 - rank) * half, half)]


def _chunk_order(layout: str, world: int) -> list[int]:
    """Global chunk indices in the order ranks 0..P-1 hold them (2P chunks for zigzag)."""
    if layout == "contiguous":
        return list(range(world))
    return [c for r in range(world) for c in (r, 2 * world - 1 - r)]


def _split_count(layout: str, world: int) -> int:
    return world if layout == "contiguous" else 2 * world


def reorder_parts(x: torch.Tensor, dim: int, layout: str, world: int, to_sequence: bool) -> torch.Tensor:
    """Along ``dim``: the ranks' parts in rank order (what an all-gather or all-to-all lines up) to the
    sequence's own order (``to_sequence``), or back. Contiguous: the same order (``x`` itself)."""
    if layout == "contiguous" or world == 1:
        return x
    order = _chunk_order(layout, world)  # the global chunk at each rank-order position
    chunks = x.chunk(_split_count(layout, world), dim=dim)
    if to_sequence:
        where = {c: pos for pos, c in enumerate(order)}
        return torch.cat([chunks[where[c]] for c in range(len(order))], dim=dim)
    return torch.cat([chunks[c] for c in order], dim=dim)


def _check(x, dim, layout, name):
    check_tensor(name, x)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is not a dim of {name} with shape {tuple(x.shape)}")
    return dim % x.dim(), check_layout(layout)


def _resized_fake(x, group, dim, grow):
    """``x`` empty with ``dim`` times (or divided by) the group size: a fake result for torch.compile."""
    return resized(x, _check(x, dim, "contiguous", "x")[0], dist.get_world_size(resolve_group(group)), grow)


@opaque_under_compile(fake=lambda x, group=None, *, dim=1, layout="zigzag": _resized_fake(x, group, dim, False))  # see _opaque
def shard_sequence(x, group=None, *, dim=1, layout="zigzag"):
    """This rank's part of the full sequence ``x`` (same on every rank), laid out as ``layout``."""
    group = resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dim, layout = _check(x, dim, layout, "x")
    parts = _split_count(layout, world)
    if x.shape[dim] % parts:
        raise ValueError(f"x.shape[{dim}]={x.shape[dim]} is not divisible by {parts} "
                         f"({'2 x ' if layout == 'zigzag' else ''}the group size {world}, layout={layout!r})")
    chunks = x.chunk(parts, dim=dim)
    mine = _chunk_order(layout, world)[rank * (parts // world):(rank + 1) * (parts // world)]
    return tag_layout(torch.cat([chunks[c] for c in mine], dim=dim), dim, group, layout, inherit=x)


class _Unshard(torch.autograd.Function):
    """Gather every rank's part and put the chunks back in sequence order. Backward: each rank's
    part of the gradient, summed over ranks (the gathered tensor may feed different losses)."""

    @staticmethod
    def forward(ctx, x_local, group, dim, layout):
        world = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.layout = group, dim, layout
        gathered, _ = all_gather(x_local.movedim(dim, 0).contiguous(), group)  # rank-major chunks
        full = reorder_parts(gathered, 0, layout, world, to_sequence=True)
        # contiguous, as a tensor built whole would be: callers .view() the full sequence
        # and not marked a view (when it already is contiguous, e.g. batch 1 or dim 0): an in-place op
        # on a Function's view output raises (see ops/_autograd.not_a_view)
        return not_a_view(full.movedim(0, dim).contiguous())

    @staticmethod
    @first_order_only("unshard_sequence")
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        rank_major = reorder_parts(grad.movedim(ctx.dim, 0), 0, ctx.layout, world, to_sequence=False).contiguous()
        local, _ = reduce_scatter(rank_major, ctx.group)
        return local.movedim(0, ctx.dim), None, None, None


@opaque_under_compile(fake=lambda x_local, group=None, *, dim=1, layout="zigzag": _resized_fake(x_local, group, dim, True))
def unshard_sequence(x_local, group=None, *, dim=1, layout="zigzag"):
    """Gather the parts that ``shard_sequence`` laid out and reorder them into the full sequence."""
    group = resolve_group(group)
    dim, layout = _check(x_local, dim, layout, "x_local")
    check_layout_tag(x_local, "x_local", dim, group, layout, "unshard_sequence")
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise ValueError(f"x_local.shape[{dim}]={x_local.shape[dim]} is odd; a zigzag part holds two equal chunks")
    return _Unshard.apply(x_local, group, dim, layout)
