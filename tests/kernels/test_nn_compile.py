"""torchhal.kernels.nn under torch.compile(fullgraph=True): RMSNorm inside autocast, and the module
fallbacks (counted, logged once), traced without a graph break, against plain-PyTorch references on
fresh random inputs."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from torchhal.hal_core import telemetry
from torchhal.kernels import nn as thnn

HIDDEN = 24


def _keys(reason):
    """The counter's keys for `reason`: traced (once per compiled graph), then eager (per call)."""
    counter = thnn.FALLBACK_COUNTER
    return f"{counter},compiled=true,reason={reason}", f"{counter},reason={reason}"


def _hf_rms_norm(x, weight, eps):
    """Hugging Face's LlamaRMSNorm.forward: normalise in fp32, round to x's dtype, times the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.fixture
def said() -> io.StringIO:
    """The module log's lines, with every fallback reason not yet said in this process."""
    telemetry.configure(log_level="warning", log_stream=(stream := io.StringIO()))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(thnn, "_warned", set())
        yield stream


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_compiles_whole_inside_autocast_as_it_runs_eager(on_plain, dtype):
    """The module turns autocast off around the op (Hugging Face's dtype, not the op's autocast
    policy) with torch._C._DisableAutocast, which Dynamo cannot trace: fullgraph failed under
    torch.autocast. Compiled, it returns eager's values, dtype and gradients."""
    norm = thnn.RMSNorm(HIDDEN, eps=0.1, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(HIDDEN))
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 5, HIDDEN, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 5, HIDDEN, dtype=dtype)
    results = []
    for run in (norm, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
        (dx, dw) = torch.autograd.grad(out, (x, norm.weight), grad)
        results.append((out, dx, dw))
    (eager, eager_dx, eager_dw), (got, dx, dw) = results
    assert got.dtype == eager.dtype == dtype
    torch.testing.assert_close((got, dx, dw), (eager, eager_dx, eager_dw), rtol=0, atol=0)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, _hf_rms_norm(x.detach(), norm.weight.detach(), 0.1), **tol)


def _reference_attention(attn, x, cos, sin, allowed):
    """Llama attention in plain PyTorch: projections, rotate-half RoPE, SDPA with the boolean mask."""
    batch, seq, _ = x.shape

    def project(linear):
        return linear(x).view(batch, seq, -1, attn.head_dim).transpose(1, 2)

    def rotate_half(u):
        half = u.shape[-1] // 2
        return torch.cat((-u[..., half:], u[..., :half]), dim=-1)

    q, k, v = project(attn.q_proj), project(attn.k_proj), project(attn.v_proj)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    groups = attn.num_key_value_groups
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def test_fallbacks_compile_whole_counted_per_graph_and_said_once(on_plain, said):
    """A fallback logged its warning through structlog and counted per call, neither of which
    Dynamo traces: fullgraph failed at the first call of a padded batch (nn.Attention with a mask)
    or of a bf16 x with an fp32 weight (RMSNorm). Traced, each is counted once per compiled graph
    (attribute compiled=true; a per-call count was a guard on its own value, one recompilation per
    call) and said once per reason, eager calls included. More calls than Dynamo's recompile limit
    (8) pass, each against the reference."""
    attn = thnn.Attention(32, 4, 2).eval()
    rotary = thnn.RotaryEmbedding(attn.head_dim)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    attend = torch.compile(lambda x, pe, mask: attn(x, pe, mask)[0], fullgraph=True, backend="eager")
    norm = thnn.RMSNorm(32, eps=0.1)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(32))
    normalise = torch.compile(norm, fullgraph=True, backend="eager")
    reasons = ("attention_mask", "rms_norm_mixed_dtypes")
    before = {key: telemetry.counts().get(key, 0) for r in reasons for key in _keys(r)}
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(2, 6, 32)
            cos, sin = rotary(x, torch.arange(6).expand(2, 6))
            keep = torch.rand(2, 1, 1, 6) < 0.7
            keep[..., 0] = True  # every row keeps a key
            mask = keep & causal
            got = attend(x, (cos, sin), mask)
            torch.testing.assert_close(
                got, _reference_attention(attn, x, cos, sin, mask), rtol=1e-5, atol=1e-5
            )
            xb = torch.randn(4, 32).bfloat16()
            torch.testing.assert_close(normalise(xb), _hf_rms_norm(xb, norm.weight, 0.1), rtol=0, atol=0)
        attn(x, (cos, sin), mask)  # eager after: counted per call, not said again
        norm(xb)
    added = {key: telemetry.counts().get(key, 0) - was for key, was in before.items()}
    for reason in reasons:
        compiled, eager = _keys(reason)
        assert added[compiled] == 1 and added[eager] == 1, added  # one graph each, one eager call
        assert said.getvalue().count(f"reason={reason}") == 1, said.getvalue()


def test_the_traced_record_is_marked_as_the_public_decorator_marks():
    """nn marks `_record_traced` by hand (importing torch._dynamo at import costs seconds): the mark
    must be exactly what torch.compiler.assume_constant_result sets."""

    def probe():
        return None

    marked = set(vars(torch.compiler.assume_constant_result(probe)))
    assert marked and marked <= set(vars(thnn._record_traced)), marked
