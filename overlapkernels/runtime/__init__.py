"""Training runtime: ``fsdp`` (ZeRO 1/2/3), ``pipeline`` (schedules and their executor), and
``clip_grad_norm_`` for models split over DP/PP/CP/TP."""
from .grad_norm import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
