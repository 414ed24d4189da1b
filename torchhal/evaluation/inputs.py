"""Argument sets for the calls a measurement makes, their rotation, and stable hashes of them.

Timing one input over and over lets caches flatter the result: the second call finds its
operands already in L2. `Inputs` holds several argument sets and call c uses set c mod n,
so consecutive calls touch different memory; `sets_to_exceed_cache` says how many sets of a
given size that takes on a device (from its declared L2 size).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchhal.hal_core import Device, InvalidArgumentError, telemetry

log = telemetry.get_logger("torchhal.evaluation.inputs")

Args = tuple[Any, ...]


class Inputs:
    """Positional argument sets (call c gets set c mod len) and keyword arguments shared by all."""

    def __init__(self, sets: Sequence[Args], kwargs: Mapping[str, Any] | None = None) -> None:
        if len(sets) == 0:
            raise InvalidArgumentError("Inputs needs at least one argument set, got none")
        bad = [i for i, s in enumerate(sets) if not isinstance(s, tuple)]
        if bad:
            raise InvalidArgumentError(
                f"every argument set must be a tuple of positional arguments; set {bad[0]} is "
                f"{type(sets[bad[0]]).__name__}"
            )
        self.sets: tuple[Args, ...] = tuple(sets)
        self.kwargs: dict[str, Any] = dict(kwargs or {})

    @classmethod
    def fixed(cls, *args: Any, **kwargs: Any) -> Inputs:
        """One argument set, used for every call (no rotation)."""
        return cls([args], kwargs)

    @classmethod
    def generate(cls, make: Callable[[int], Args], count: int, **kwargs: Any) -> Inputs:
        """`count` sets made by `make(i)` before any timing starts."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidArgumentError(f"Inputs.generate: count must be an integer >= 1, got {count!r}")
        return cls([make(i) for i in range(count)], kwargs)

    def __len__(self) -> int:
        return len(self.sets)

    def for_call(self, call: int) -> Args:
        return self.sets[call % len(self.sets)]

    def map(self, convert: Callable[[Any], Any]) -> Inputs:
        """The same sets with `convert` applied to every tensor (an explicit dtype or device change)."""
        return Inputs(
            [tuple(_map_tensors(a, convert) for a in s) for s in self.sets],
            {k: _map_tensors(v, convert) for k, v in self.kwargs.items()},
        )

    def nbytes(self, index: int = 0) -> int:
        """Bytes of the tensors in one set."""
        return sum(t.numel() * t.element_size() for t in _tensors(self.sets[index]))

    def signature(self) -> dict[str, Any]:
        """What the sets look like (tensor dtypes, shapes and devices; other values' reprs), not
        their content: enough to tell whether timing samples of two runs are comparable."""
        return {
            "sets": [[_describe(a) for a in s] for s in self.sets],
            "kwargs": {k: _describe(v) for k, v in sorted(self.kwargs.items())},
        }

    def hash(self, index: int) -> str:
        """Stable hash of set `index` together with the shared keyword arguments."""
        return input_hash((self.sets[index], self.kwargs))


def sets_to_exceed_cache(device: Device, bytes_per_set: int, *, minimum: int = 2) -> int:
    """How many argument sets of `bytes_per_set` bytes, rotated, overflow twice the device's L2.

    A device that declares no L2 size gets `minimum` sets; that choice is logged.
    """
    if bytes_per_set <= 0:
        raise InvalidArgumentError(f"bytes_per_set must be > 0, got {bytes_per_set}")
    l2 = device.capabilities.l2_cache_bytes
    if l2 is None:
        log.info("device declares no L2 size; rotating the minimum number of sets", device=device.id)
        return minimum
    return max(minimum, math.ceil(2 * l2 / bytes_per_set) + 1)


def input_hash(value: Any) -> str:
    """sha256 of a canonical encoding of tensors (dtype, shape, bytes), numbers, strings and
    containers of them. Other objects are refused: their repr need not identify their content."""
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        digest.update(f"T{value.dtype}{tuple(value.shape)}:".encode())
        digest.update(data.numpy().tobytes())
    elif value is None or isinstance(value, (bool, int, str)):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, float):
        digest.update(b"float:" + struct.pack("<d", value))
    elif isinstance(value, (tuple, list)):
        digest.update(f"{type(value).__name__}[{len(value)}]".encode())
        for item in value:
            _feed(digest, item)
    elif isinstance(value, Mapping):
        digest.update(f"map[{len(value)}]".encode())
        for key in sorted(value, key=str):
            _feed(digest, str(key))
            _feed(digest, value[key])
    elif isinstance(value, torch.dtype):
        digest.update(f"dtype:{value};".encode())
    else:
        raise InvalidArgumentError(
            f"cannot hash an input of type {type(value).__name__}: give inputs as tensors, numbers, "
            "strings, dtypes, or tuples, lists and dicts of them"
        )


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return f"tensor({str(value.dtype).removeprefix('torch.')}, {tuple(value.shape)}, {value.device})"
    if isinstance(value, (tuple, list)):
        return [_describe(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in value.items()}
    return repr(value)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _map_tensors(value: Any, convert: Callable[[Any], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return convert(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, convert) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, convert) for v in value]
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, convert) for k, v in value.items()}
    return value
