"""Op names that are not non-empty strings: refused by name, never a bare TypeError.

Registering (`define_op`, `register`) refuses them with InvalidArgumentError before anything
changes. Looking an op up (`op`, `candidates`, `signature`, `select`, `call`, `dispatch`,
`torchhal.ops.dispatch`) gives UnknownOpError for any name it does not define, an unhashable one
(a list, a dict) included, which was a bare "unhashable type" TypeError from a dict lookup.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torchhal
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import InvalidArgumentError, KernelRegistry, UnknownOpError
from torchhal.hal_core.kernels import NOT_SEEN
from torchhal.hal_core.settings import Settings

OP = "softsign"  # x / (1 + |x|): an op no core defines

BAD_NAMES = [["softsign"], {"op": "softsign"}, 3, "", None]
UNHASHABLE = [["softsign"], {"op": "softsign"}]


def softsign_signature(x: Any) -> tuple[torch.dtype, int]:
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(f"{OP}: x must be a tensor, got {type(x).__name__}")
    return x.dtype, x.dim()


def softsign_reference(x: torch.Tensor) -> torch.Tensor:
    return (x.double() / (1 + x.double().abs())).to(x.dtype)


def softsign_fp32(x: torch.Tensor) -> torch.Tensor:
    return (x.float() / (1 + x.float().abs())).to(x.dtype)


def random_input() -> torch.Tensor:
    return 3 * torch.randn(random.randint(2, 9), random.randint(17, 70))


@pytest.fixture
def hal(tmp_path: Any) -> Iterator[HardwareAbstractionLayer]:
    """A HAL with `softsign` and one candidate, set as the default HAL for the test."""
    settings = Settings.from_env(
        {"TORCHHAL_CACHE_DIR": str(tmp_path / "cache"), "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    made = HardwareAbstractionLayer(settings=settings)
    made.devices()
    made.kernels.define_op(OP, softsign_reference, signature=softsign_signature)
    made.kernels.register(OP, "fast", softsign_fp32, provider="acme", priority=50)
    torchhal.ops.set_default_hal(made)
    try:
        yield made
    finally:
        torchhal.ops.set_default_hal(None)


def assert_unchanged(
    hal: HardwareAbstractionLayer, ops: tuple[str, ...], candidates: tuple[Any, ...]
) -> None:
    """The registry as it was: the same ops and candidates, and the op still runs the candidate."""
    assert hal.kernels.ops() == ops
    assert hal.kernels.candidates(OP) == candidates
    x = random_input()
    torch.testing.assert_close(torchhal.ops.dispatch(OP, x), softsign_reference(x))
    assert hal.kernels.select(OP, hal.device("cpu"), x).candidate.qualified_name == "acme/fast"


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_define_op_refuses_a_name_that_is_not_a_non_empty_string_and_keeps_the_registry(hal, name):
    ops, candidates = hal.kernels.ops(), hal.kernels.candidates(OP)
    with pytest.raises(InvalidArgumentError) as raised:
        hal.kernels.define_op(name, softsign_reference, signature=softsign_signature)
    assert str(raised.value) == f"define_op: the op's name must be a non-empty string, got {name!r}"
    assert_unchanged(hal, ops, candidates)


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_register_refuses_an_op_name_that_is_not_a_non_empty_string_and_keeps_the_registry(hal, name):
    """A list or dict was a bare TypeError ("unhashable type"); an int, None or "" an
    UnknownOpError, as if the op were merely undefined rather than the argument wrong."""
    ops, candidates = hal.kernels.ops(), hal.kernels.candidates(OP)
    with pytest.raises(InvalidArgumentError) as raised:
        hal.kernels.register(name, "faster", softsign_fp32, provider="acme", priority=60)
    assert str(raised.value) == f"register: op must be a non-empty string, got {name!r}"
    assert_unchanged(hal, ops, candidates)


@pytest.mark.parametrize("part", ["name", "provider"])
@pytest.mark.parametrize("value", [["faster"], "", 7], ids=repr)
def test_register_refuses_a_candidate_or_provider_name_that_is_not_a_non_empty_string(hal, part, value):
    """A list or empty candidate name was kept (`acme/['faster']`, `acme/`), and with a priority
    above the others chosen for every call."""
    ops, candidates = hal.kernels.ops(), hal.kernels.candidates(OP)
    names = {"name": "faster", "provider": "acme", part: value}
    with pytest.raises(InvalidArgumentError) as raised:
        hal.kernels.register(OP, names["name"], softsign_fp32, provider=names["provider"], priority=60)
    qualified = f"{names['provider']}/{names['name']}"
    where = f"register: candidate {qualified!r} of op '{OP}'"
    assert str(raised.value) == f"{where}: {part} must be a non-empty string, got {value!r}"
    assert_unchanged(hal, ops, candidates)


@pytest.mark.parametrize("name", UNHASHABLE, ids=repr)
def test_looking_up_an_unhashable_op_name_is_an_unknown_op_naming_its_type(hal, name):
    """Every lookup entry raised a bare TypeError ("unhashable type: 'list'") from its dict lookup."""
    registry, device, x = hal.kernels, hal.device("cpu"), random_input()
    lookups = {
        "op": lambda: registry.op(name),
        "candidates": lambda: registry.candidates(name),
        "signature": lambda: registry.signature(name, x),
        "select": lambda: registry.select(name, device, x),
        "call": lambda: registry.call(name, device, x),
        "dispatch": lambda: registry.dispatch(name, None, lambda _op, _first: device, x),
        "hal.dispatch": lambda: hal.dispatch(name, x),
        "ops.dispatch": lambda: torchhal.ops.dispatch(name, x),
    }
    expected = rf"^unknown op of type {type(name).__name__} \(op names are strings\); defined ops: .*{OP}"
    for lookup in lookups.values():
        with pytest.raises(UnknownOpError, match=expected):
            lookup()
    # the seen-layouts fast path runs nothing for a name it cannot look up: `dispatch` names it
    assert registry.dispatch_seen(name, None, (x,)) is NOT_SEEN
    assert_unchanged(hal, registry.ops(), registry.candidates(OP))


def test_a_registry_without_a_hal_refuses_bad_op_names_too():
    """The registry alone (as a plugin's hook sees it): register names the argument before the
    op lookup, and an unhashable name at dispatch is an unknown op."""
    registry = KernelRegistry()
    registry.define_op(OP, softsign_reference, signature=softsign_signature)
    with pytest.raises(InvalidArgumentError, match=r"^register: op must be a non-empty string, got \['x'\]$"):
        registry.register(["x"], "fast", softsign_fp32, provider="acme")
    assert [c.qualified_name for c in registry.candidates(OP)] == ["torchhal/reference"]
    with pytest.raises(
        UnknownOpError, match=r"^unknown op of type dict \(op names are strings\); defined ops: softsign$"
    ):
        registry.dispatch({}, None, lambda _op, _first: None, random_input())
