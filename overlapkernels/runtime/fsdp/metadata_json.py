"""What an fsdp checkpoint keeps as JSON in its metadata file: the optimizer's param_groups (a
tensor hyperparameter tagged so it loads back as a tensor), optimizer state that is not a tensor,
and the caller's ``extra`` state."""
from __future__ import annotations

import json

import torch


def holds_tensor(value) -> bool:
    if torch.is_tensor(value):
        return True
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(holds_tensor(v) for v in value)


def value_as_json(name: str, value) -> tuple:
    """(JSON text, None), or (None, why the checkpoint cannot keep optimizer state ``name``)."""
    if holds_tensor(value):
        return None, (f"optimizer state {name!r} is a {type(value).__name__} with tensors inside; a checkpoint keeps "
                      "tensors as state values of their own, or values JSON can keep")
    try:
        return json.dumps(value, sort_keys=True), None
    except (TypeError, ValueError) as exc:
        return None, (f"optimizer state {name!r} is a {type(value).__name__} the checkpoint cannot keep ({exc}); use "
                      "tensors, or numbers, strings, bools, None and lists of them")


def _plain(value):
    """``value`` for the JSON metadata: a tensor inside it (a tensor lr, for a compiled optimizer or a
    schedule that updates it in place) kept as {"tensor": value, "dtype": name}, so it loads back as
    a tensor, not a float, and json.dump, which takes no tensors, does not fail after every shard is
    written."""
    if torch.is_tensor(value):
        return {"tensor": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _back(value, now):
    """``_plain`` undone: its tensors back as tensors, copied into ``now`` (what the optimizer holds
    there) where it is a tensor of that shape (so its device stays: a capturable or compiled
    optimizer's CUDA lr; torch's load_state_dict then deep-copies the groups, as for any
    checkpoint), else CPU tensors. A list comes back as a tuple where the optimizer holds a tuple
    there (Adam's betas: JSON has lists only)."""
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        saved = torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
        if torch.is_tensor(now) and now.shape == saved.shape:
            with torch.no_grad():
                return now.copy_(saved)
        return saved
    if isinstance(value, list):
        nows = now if isinstance(now, (list, tuple)) and len(now) == len(value) else [None] * len(value)
        back = [_back(v, n) for v, n in zip(value, nows)]
        return tuple(back) if isinstance(now, tuple) else back
    return value


def json_groups(groups: list) -> list:
    """The optimizer's param_groups as JSON for the metadata (see ``_plain``)."""
    return [{key: _plain(value) for key, value in group.items()} for group in groups]


def tensor_groups(groups: list, current: list) -> list:
    """``json_groups`` undone (see ``_back``)."""
    return [{key: _back(value, mine.get(key)) for key, value in group.items()}
            for group, mine in zip(groups, current + [{}] * (len(groups) - len(current)))]


def _not_kept_exactly(value, where: str) -> str | None:
    """Where ``value`` holds something JSON would not give back as it is (None if nothing): json.dumps
    turns int keys into strings and tuples into lists without a word (a MultiStepLR's milestones
    Counter came back with string keys, and the schedule never decayed)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, list):
        return next((p for i, v in enumerate(value) if (p := _not_kept_exactly(v, f"{where}[{i}]"))), None)
    if type(value) is dict:
        for key, v in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r} ({type(key).__name__}; JSON keys are strings)"
            if (p := _not_kept_exactly(v, f"{where}[{key!r}]")) is not None:
                return p
        return None
    return f"{where} is a {type(value).__name__}"


def extra_problem(extra) -> str | None:
    """Why ``extra`` cannot go into the metadata as it is (None if it can)."""
    if extra is None:
        return None
    if type(extra) is not dict:
        return f"extra={type(extra).__name__}: expected a dict (of JSON values: the trainer's own state), or None"
    where = _not_kept_exactly(extra, "extra")
    if where is not None:
        return (f"{where}, which JSON would not give back as it is; use str keys, and numbers, strings, bools, None, "
                "lists and dicts (pickle and base64-encode anything else)")
    return None


def canonical_extra(extra) -> str | None:
    """One string per value, compared between ranks: NaN equals NaN, and 1, 1.0 and True differ."""
    return None if extra is None else json.dumps(extra, sort_keys=True)
