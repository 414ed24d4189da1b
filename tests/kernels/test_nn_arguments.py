"""`torchhal.kernels.nn` at its edges: the KV cache's calling convention and
constructor arguments that computed NaN or failed far from their cause."""

from __future__ import annotations

import pytest
import torch

from torchhal.hal_core import InvalidArgumentError
from torchhal.kernels import nn as thnn


class _PagedCache:
    """transformers >= 5.24's paged convention (its PagedAttentionCache): `update(k, v, layer_idx,
    kwargs)` takes the attention forward's keyword arguments, reads where to write from them and fills
    in, in place, what the attention function reads next; here a request id selects the stored keys."""

    def __init__(self):
        self.kv = {}

    def update(self, k, v, layer_idx, kwargs):
        slot = (kwargs["request"], layer_idx)
        if slot in self.kv:
            k = torch.cat((self.kv[slot][0], k), dim=2)
            v = torch.cat((self.kv[slot][1], v), dim=2)
        self.kv[slot] = (k, v)
        kwargs["keys_seen"] = k.shape[2]
        return k, v


def test_a_cache_that_takes_the_forwards_kwargs_gets_them(on_plain):
    """Attention passed every cache a dict of sin, cos and cache_position (the pre-5.24 call): a cache
    of the 5.24 convention raised KeyError on it (continuous batching's `generate_batch` then returned
    no tokens). Two requests through one cache, prefill then a decode step each, against the full
    sequences."""
    torch.manual_seed(0)
    attn = thnn.Attention(32, 4, 2, layer_idx=0).eval()
    x = torch.randn(2, 7, 32)
    cos, sin = thnn.RotaryEmbedding(8)(x, torch.arange(7)[None])
    cache = _PagedCache()
    with torch.no_grad():
        full = attn(x, (cos, sin))[0]
        for request in (0, 1):
            hidden = x[request : request + 1]
            prefill = attn(hidden[:, :6], (cos[:, :6], sin[:, :6]), cache=cache, request=request)[0]
            step = attn(hidden[:, 6:], (cos[:, 6:], sin[:, 6:]), cache=cache, request=request)[0]
            torch.testing.assert_close(torch.cat((prefill, step), dim=1), full[request : request + 1])
    assert sorted(cache.kv) == [(0, 0), (1, 0)] and cache.kv[(1, 0)][0].shape[2] == 7
    assert "attention" in {op for op, _ in on_plain}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: thnn.RotaryEmbedding(8, theta=0.0),
            r"RotaryEmbedding: theta must be a finite number > 0, got 0\.0",
        ),
        (lambda: thnn.RotaryEmbedding(8, theta=-1e4), r"theta must be a finite number > 0, got -10000\.0"),
        (lambda: thnn.RotaryEmbedding(8, theta=float("inf")), r"theta must be a finite number > 0, got inf"),
        (lambda: thnn.RotaryEmbedding(-2), r"RotaryEmbedding: head_dim must be even and >= 0, got -2"),
        (
            lambda: thnn.Attention(2, 4),
            r"Attention: head_dim must be >= 1, got 0 \(hidden_size 2, num_heads 4\)",
        ),
        (lambda: thnn.Attention(32, 4, head_dim=0), r"Attention: head_dim must be >= 1, got 0"),
        (
            lambda: thnn.Attention(32, 4, dropout=1.5),
            r"Attention: dropout must be a number in \[0, 1\], got 1\.5",
        ),
        (lambda: thnn.Attention(32, 4, dropout=-0.1), r"dropout must be a number in \[0, 1\], got -0\.1"),
    ],
)
def test_constructor_arguments_that_cannot_work_are_refused_by_name(make, message):
    """theta <= 0 made NaN cos/sin without a word; a negative rotary head_dim raised torch.arange's
    "upper bound and lower bound inconsistent", Attention's head_dim 0 a ZeroDivisionError from the
    scaling; a dropout outside [0, 1] was accepted and failed only in training, inside SDPA, with a
    message about flash attention (torch.nn.Dropout refuses it at construction)."""
    with pytest.raises(InvalidArgumentError, match=message):
        make()


def test_the_boundaries_of_those_arguments_still_construct(on_plain):
    """dropout 0 and 1, head_dim 2, a small theta: legal, and computed."""
    torch.manual_seed(0)
    rotary = thnn.RotaryEmbedding(2, theta=0.5)
    x = torch.randn(1, 3, 8)
    cos, sin = rotary(x, torch.arange(3)[None])
    angle = torch.arange(3.0)[None, :, None]  # inv_freq = 1 / 0.5**0 = 1
    torch.testing.assert_close(cos, angle.cos().expand(1, 3, 2))
    torch.testing.assert_close(sin, angle.sin().expand(1, 3, 2))
    for dropout in (0.0, 1.0):
        attn = thnn.Attention(8, 4, dropout=dropout)
        assert attn.head_dim == 2 and attn(x, (cos, sin))[0].shape == x.shape
