"""What a party can reach in memory: the object graph walk behind the tests that each secret is
held by its owner only and that no party holds another."""

from __future__ import annotations

import functools
import types

import numpy as np
import torch


def reachable(root: object, *, stop: set[int]) -> list[object]:
    """Every object reachable from ``root``: attributes, containers, bound methods' owners and
    closures, without crossing into the objects in ``stop`` (the network). Byte strings (PSI
    keys are raw bytes) are listed; other scalars are not."""
    seen = set(stop)
    found: list[object] = []
    stack = [root]
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, (str, int, float, bool, type(None))):
            continue
        seen.add(id(value))
        found.append(value)
        if isinstance(value, bytes | torch.Tensor | np.ndarray | type | types.ModuleType):
            continue
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        if isinstance(value, types.MethodType):
            stack.append(value.__self__)
        if isinstance(value, types.FunctionType) and value.__closure__:
            stack.extend(cell.cell_contents for cell in value.__closure__)
        if isinstance(value, functools.partial):
            stack.extend([value.func, *value.args, *value.keywords.values()])
        if hasattr(value, "__dict__") and not isinstance(value, types.FunctionType):
            stack.extend(vars(value).values())
    return found
