"""Segment ids (packed documents): what counts as ids, for every layer that takes them (the kernels,
ring attention, the attention layer, the GPT and its trainer)."""
from __future__ import annotations

import torch


def integer_ids(t) -> bool:
    """A tensor of integer ids: any integer dtype, not bool."""
    return isinstance(t, torch.Tensor) and not (t.dtype == torch.bool or t.is_floating_point() or t.is_complex())
