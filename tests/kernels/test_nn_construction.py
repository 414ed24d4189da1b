"""torchhal.kernels.nn modules made as torch.nn's are: on the meta device then to_empty() and
reset_parameters() (FSDP2/torchtitan-style init), with torch.nn's constructor arguments."""

from __future__ import annotations

import pytest
import torch

from torchhal.hal_core import InvalidArgumentError, UnsupportedError
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


NORMS = [(thnn.RMSNorm, torch.nn.RMSNorm), (thnn.LayerNorm, torch.nn.LayerNorm)]


@pytest.mark.parametrize(("ours", "torchs"), NORMS)
def test_norms_take_torch_nn_constructor_arguments(ours, torchs):
    """device=, dtype= and elementwise_affine (third, as torch.nn's) make what they make in torch.nn;
    without the affine parameters the output is torch's too."""
    for kwargs in ({"device": "meta"}, {"dtype": torch.bfloat16}):
        got, expected = ours(37, **kwargs), torchs(37, **kwargs)
        assert [(n, p.device, p.dtype) for n, p in got.named_parameters()] == [
            (n, p.device, p.dtype) for n, p in expected.named_parameters()
        ]
    got, expected = ours(normalized_shape=37), torchs(normalized_shape=37)  # torch's keyword was refused
    assert [(n, p.shape) for n, p in got.named_parameters()] == [
        (n, p.shape) for n, p in expected.named_parameters()
    ]
    got, expected = ours(37, 0.1, False), torchs(37, 0.1, False)
    assert list(got.state_dict()) == list(expected.state_dict()) == []
    x = 2 + torch.randn(3, 5, 37)
    torch.testing.assert_close(got(x), expected(x))
    assert "elementwise_affine=False" in repr(got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rms_norm_eps_none_is_torch_nn_rms_norms(dtype):
    """eps=None: the epsilon of the dtype torch computes in (fp32 for bf16), with x small enough
    that it matters; before, refused at the first forward only."""
    ours, torchs = thnn.RMSNorm(37, eps=None, dtype=dtype), torch.nn.RMSNorm(37, eps=None, dtype=dtype)
    with torch.no_grad():
        ours.weight.copy_(1 + 0.3 * torch.randn(37))
    torchs.load_state_dict(ours.state_dict())
    x = (1e-3 * torch.randn(4, 37)).to(dtype)
    torch.testing.assert_close(ours(x), torchs(x))


def test_rms_norm_variance_epsilon_can_be_set_as_hugging_face_code_does():
    norm, x = thnn.RMSNorm(37), 0.1 * torch.randn(4, 37)
    norm.variance_epsilon = 0.01
    assert norm.eps == 0.01
    torch.testing.assert_close(norm(x), torch.nn.RMSNorm(37, eps=0.01)(x))


@pytest.mark.parametrize("norm", [thnn.RMSNorm, thnn.LayerNorm])
def test_norms_refuse_more_than_the_last_dimension(norm):
    assert norm((37,)).normalized_shape == (37,)
    with pytest.raises(
        UnsupportedError,
        match=rf"{norm.__name__}: normalises over the last dimension only, got normalized_shape=\(5, 37\)",
    ):
        norm((5, 37))


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: thnn.SwiGLUMLP(37, 21, bias=True, **kw),
        lambda **kw: thnn.Attention(48, 4, 2, layer_idx=0, **kw),
    ],
    ids=["SwiGLUMLP", "Attention"],
)
def test_modules_of_linears_take_torch_nn_factory_keywords(make):
    """device= and dtype= reach every Linear, as torch.nn modules take them (they were refused)."""
    for kwargs, device, dtype in (
        ({"device": "meta"}, "meta", torch.float32),
        ({"dtype": torch.bfloat16}, "cpu", torch.bfloat16),
    ):
        module = make(**kwargs)
        assert {(p.device.type, p.dtype) for p in module.parameters()} == {(device, dtype)}


@pytest.mark.parametrize("norm", [thnn.RMSNorm, thnn.LayerNorm])
def test_norms_take_hugging_faces_hidden_size_keyword_too(norm):
    """`RMSNorm(hidden_size=..., eps=...)` is Hugging Face's spelling, which these modules stand in
    for; naming the first parameter as torch.nn does must not break it. One of the two, not both."""
    size = int(torch.randint(8, 64, ()).item())
    assert norm(hidden_size=size).normalized_shape == norm(size).normalized_shape == (size,)
    for given in ({"normalized_shape": size, "hidden_size": size}, {}):
        with pytest.raises(
            InvalidArgumentError, match=rf"{norm.__name__}: give normalized_shape .* or hidden_size"
        ):
            norm(**given)
