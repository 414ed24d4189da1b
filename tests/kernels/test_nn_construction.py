"""torchhal.kernels.nn modules made as torch.nn's are: on the meta device then to_empty() and
reset_parameters() (FSDP2/torchtitan-style init), with torch.nn's constructor arguments."""

from __future__ import annotations

import pytest
import torch

from torchhal.kernels import nn as thnn

CONSTRUCTORS = {
    "RMSNorm": lambda: thnn.RMSNorm(37),
    "LayerNorm": lambda: thnn.LayerNorm(37),
    "LayerNorm(bias=False)": lambda: thnn.LayerNorm(37, bias=False),
    "SwiGLUMLP": lambda: thnn.SwiGLUMLP(37, 21, bias=True),
    "Attention": lambda: thnn.Attention(48, 4, 2, bias=True, layer_idx=0),
    "RotaryEmbedding": lambda: thnn.RotaryEmbedding(12, theta=500000.0),
}


@pytest.mark.parametrize("name", list(CONSTRUCTORS))
def test_meta_init_then_reset_parameters_is_a_fresh_module(name):
    """What construction draws under a seed, reset_parameters after meta + to_empty draws under it;
    RotaryEmbedding's inv_freq, in no state_dict, is recomputed (else cos/sin come from garbage)."""
    with torch.device("meta"):
        module = CONSTRUCTORS[name]()
    module.to_empty(device="cpu")
    torch.manual_seed(1234)
    fresh = CONSTRUCTORS[name]()
    torch.manual_seed(1234)
    module.reset_parameters()
    expected = dict(fresh.named_parameters()) | dict(fresh.named_buffers())
    got = dict(module.named_parameters()) | dict(module.named_buffers())
    assert list(got) == list(expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if name == "RotaryEmbedding":
        positions = torch.randint(0, 4000, (2, 9))
        torch.testing.assert_close(module(torch.empty(0), positions), fresh(torch.empty(0), positions))


def test_rotary_embedding_repr_names_its_tables():
    assert repr(thnn.RotaryEmbedding(12, theta=500000.0)) == (
        "RotaryEmbedding(head_dim=12, theta=500000.0, attention_scaling=1.0)"
    )
