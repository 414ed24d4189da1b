"""attention_varlen's offsets off the CPU: the Triton candidates used to trust them, so offsets that
did not rise from 0, ran past the token count or held a sequence longer than max_seqlen gave a
silently wrong answer (the grid covers max_seqlen rows per sequence) or read out of bounds. They now
queue the rule on the device (one Triton program and torch._assert_async, no sync); the references
check the offsets they read anyway.

On the CPU torch._assert_async raises at once, so the CPU stands in for a device here by leaving
`_checks.HOST_READ` (the device types whose checks read on the host); the kernels run through the
Triton interpreter."""

from __future__ import annotations

import io

import pytest
import torch

from torchhal.hal_core import InvalidArgumentError, telemetry
from torchhal.kernels import _checks, attention_varlen

OPS = ("attention_varlen", "attention_varlen_forward", "attention_varlen_backward")
SPARE = 3  # tokens after the last sequence, so that shifting every offset by one breaks one rule only


def _lengths(batch: int, g: torch.Generator) -> list[int]:
    """Fresh random lengths in [0, 9], some of them 0, and at least one of 2 or more."""
    lengths = torch.randint(0, 10, (batch,), generator=g)
    lengths[torch.rand(batch, generator=g) < 0.2] = 0
    lengths[torch.randint(0, batch, (1,), generator=g)] = 2 + int(torch.randint(0, 8, (1,), generator=g))
    return lengths.tolist()


def _offsets(lengths: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _break(rule: str, cu: torch.Tensor, total: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """cu changed so that it breaks `rule` alone, and the max_seqlen to pass with it."""
    cu, lengths = cu.clone(), cu.diff()
    roomy = total + 10  # a max_seqlen no length reaches
    if rule == "first-offset-not-0":  # every offset one up: the lengths and the room stay
        return cu + 1, roomy
    if rule == "decreasing":
        b = int(torch.randint(1, cu.shape[0], (1,), generator=g))
        cu[b] = cu[b - 1] - 1
        return cu, roomy
    if rule == "past-the-tokens":
        cu[-1] = total + 1
        return cu, roomy
    assert rule == "longer-than-max-seqlen"
    return cu, int(lengths.max()) - 1


RULES = ["first-offset-not-0", "decreasing", "past-the-tokens", "longer-than-max-seqlen"]


def _case(rule: str | None, which: str, batch: int, dtype: torch.dtype, seed: int):
    """(q, k, v, cu_q, cu_k, max_q, max_k): random packed tensors whose `which` offsets break `rule`."""
    g = torch.Generator().manual_seed(seed)
    lens = {"q": _lengths(batch, g), "k": _lengths(batch, g)}
    cu = {side: _offsets(lens[side], dtype) for side in "qk"}
    total = {side: sum(lens[side]) + SPARE for side in "qk"}
    longest = {side: max(lens[side]) for side in "qk"}  # the boundary: exactly the longest passes
    if rule is not None:
        cu[which], longest[which] = _break(rule, cu[which], total[which], g)
    q = torch.randn(total["q"], 2, 16, generator=g)
    k, v = (torch.randn(total["k"], 1, 16, generator=g) for _ in range(2))
    return q, k, v, cu["q"], cu["k"], longest["q"], longest["k"]


def _device_check(op, q, k, v, cu_q, cu_k, max_q, max_k):
    """What the Triton candidates run before their kernels."""
    from torchhal.kernels.triton_attention_kernels import offsets_ok

    attention_varlen.check_offsets(
        op,
        q,
        k,
        cu_q,
        cu_k,
        max_q,
        max_k,
        lambda: offsets_ok(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k),
    )


@pytest.fixture
def as_device(triton_hal, monkeypatch):
    """The CPU as a device with torch._assert_async (which raises there at once), Triton interpreted."""
    monkeypatch.setattr(_checks, "HOST_READ", {})
    monkeypatch.setattr(attention_varlen, "_last_queued", None)
    return triton_hal


BIG = 2500  # sequences: the check's loop takes three blocks of OFFSETS_BLOCK


@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("batch", [5, BIG], ids=["batch-5", f"batch-{BIG}"])
def test_device_check_refuses_each_broken_rule(as_device, rule, which, batch):
    case = _case(rule, which, batch, torch.int32, seed=len(rule) + batch + ord(which))
    with pytest.raises(
        RuntimeError, match=r"^attention_varlen_forward: cu_seqlens_q/_k must rise from 0 to at most"
    ):
        _device_check("attention_varlen_forward", *case)


def test_device_check_finds_a_bad_length_in_the_last_block(as_device):
    """One sequence too long among 2500, in the third block of the check's loop, on each side."""
    for which in "qk":
        q, k, v, cu_q, cu_k, max_q, max_k = _case(None, which, BIG, torch.int64, seed=7)
        cu = {"q": cu_q, "k": cu_k}
        cu[which][2300:] += 11  # sequence 2299 grows by 11, past max_seqlen (lengths are at most 9)
        grown = int(cu[which].diff()[2299])
        assert grown > (max_q if which == "q" else max_k)
        if which == "q":
            q = torch.randn(q.shape[0] + 11, 2, 16)
        else:
            k, v = torch.randn(k.shape[0] + 11, 1, 16), torch.randn(k.shape[0] + 11, 1, 16)
        with pytest.raises(RuntimeError, match=r"no sequence longer than max_seqlen_q/_k"):
            _device_check("attention_varlen", q, k, v, cu["q"], cu["k"], max_q, max_k)


@pytest.mark.parametrize("seed", range(6))
def test_device_check_agrees_with_the_host_rule(as_device, seed):
    """Random offsets, valid (random lengths, zero-length sequences, max_seqlen exactly the longest,
    int32 and int64, 1 to 2500 sequences) or with one rule broken on one side: the device flag is 1
    exactly where the host check passes, and the device check raises exactly there."""
    from torchhal.kernels.triton_attention_kernels import offsets_ok

    g = torch.Generator().manual_seed(100 + seed)
    batch = [1, 3, 17, 1024, 1025, BIG][seed]
    rule = RULES[int(torch.randint(0, len(RULES), (1,), generator=g))] if seed % 2 else None
    which = "qk"[int(torch.randint(0, 2, (1,), generator=g))]
    dtype = (torch.int32, torch.int64)[seed % 3 == 0]
    q, k, v, cu_q, cu_k, max_q, max_k = _case(rule, which, batch, dtype, seed)
    valid = rule is None
    assert offsets_ok(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k).tolist() == [int(valid)]
    if valid:
        attention_varlen._check_offsets("host", "q", cu_q.tolist(), q.shape[0], max_q)
        attention_varlen._check_offsets("host", "k", cu_k.tolist(), k.shape[0], max_k)
        _device_check("attention_varlen", q, k, v, cu_q, cu_k, max_q, max_k)
    else:
        with pytest.raises(InvalidArgumentError, match=rf"^host: (cu_seqlens|max_seqlen)_{which}"):
            attention_varlen._check_offsets(
                "host",
                which,
                (cu_q if which == "q" else cu_k).tolist(),
                (q if which == "q" else k).shape[0],
                max_q if which == "q" else max_k,
            )
        with pytest.raises(RuntimeError, match=r"read them on the host for the values\)$"):
            _device_check("attention_varlen", q, k, v, cu_q, cu_k, max_q, max_k)


def _candidates(hal, candidate, q, k, v, cu_q, cu_k, max_q, max_k):
    """The three ops' Triton candidates bound on valid offsets, as the registry would call them after
    the signature (which on a device does not read the offsets)."""
    batch = cu_q.shape[0] - 1
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.zeros(q.shape[1], q.shape[0])
    ones = torch.arange(batch + 1, dtype=cu_q.dtype)  # a token per sequence
    valid = (ones, ones, 1, 1)
    return (
        {
            "attention_varlen": candidate(hal, "attention_varlen", "triton", q, k, v, *valid),
            "attention_varlen_forward": candidate(hal, "attention_varlen_forward", "triton", q, k, v, *valid),
            "attention_varlen_backward": candidate(
                hal, "attention_varlen_backward", "triton", out, q, k, v, out, lse, *valid
            ),
        },
        out,
        lse,
    )


@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("rule", RULES)
def test_triton_candidates_queue_the_check(as_device, candidate, rule, which):
    """Each Triton candidate, called as the registry calls it on a device: the check fails (before,
    the kernels ran on the broken offsets and returned)."""
    q, k, v, cu_q, cu_k, max_q, max_k = _case(rule, which, 4, torch.int32, seed=3)
    bound, out, lse = _candidates(as_device, candidate, q, k, v, cu_q, cu_k, max_q, max_k)
    args = {
        "attention_varlen": (q, k, v),
        "attention_varlen_forward": (q, k, v),
        "attention_varlen_backward": (out, q, k, v, out, lse),
    }
    for op in OPS:
        with pytest.raises(
            RuntimeError, match=rf"^{op}: cu_seqlens_q/_k must rise from 0 .* for the values\)$"
        ):
            bound[op](*args[op], cu_q, cu_k, max_q, max_k, False, None)


@pytest.mark.parametrize("causal", [False, True])
def test_triton_candidates_pass_valid_offsets(as_device, candidate, causal):
    """Valid random offsets (zero-length sequences, max_seqlen exactly the longest, tokens after the
    last sequence) pass the queued check, and the candidates still give the reference's answer."""
    q, k, v, cu_q, cu_k, max_q, max_k = _case(None, "q", 6, torch.int64, seed=17 + causal)
    fixed = (cu_q, cu_k, max_q, max_k, causal, None)
    bound, _, _ = _candidates(as_device, candidate, q, k, v, cu_q, cu_k, max_q, max_k)
    out, lse = bound["attention_varlen_forward"](q, k, v, *fixed)
    want_out, want_lse = attention_varlen.reference_forward(q, k, v, *fixed)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bound["attention_varlen"](q, k, v, *fixed), want_out, rtol=1e-4, atol=1e-5)
    grad_out = torch.randn(out.shape)
    grads = bound["attention_varlen_backward"](grad_out, q, k, v, out, lse, *fixed)
    want = attention_varlen.reference_backward(grad_out, q, k, v, want_out, want_lse, *fixed)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_without_an_asynchronous_assert_the_offsets_are_read_logged_and_counted(
    as_device, candidate, monkeypatch
):
    """A device type without torch._assert_async: the candidates read the offsets on the host,
    name the values, warn once and count each read."""

    def missing(*args):
        raise NotImplementedError("no _assert_async kernel for this backend")

    monkeypatch.setattr(torch, "_assert_async", missing)
    telemetry.configure(log_level="warning", log_stream=(stream := io.StringIO()))
    key = f"{attention_varlen.HOST_OFFSET_CHECKS},device_type=cpu"
    before = telemetry.counts().get(key, 0)
    q, k, v, cu_q, cu_k, max_q, max_k = _case("longer-than-max-seqlen", "k", 4, torch.int64, seed=5)
    bound, _, _ = _candidates(as_device, candidate, q, k, v, cu_q, cu_k, max_q, max_k)
    for _ in range(2):
        with pytest.raises(
            InvalidArgumentError, match=r"^attention_varlen: max_seqlen_k must be >= the longest"
        ):
            bound["attention_varlen"](q, k, v, cu_q, cu_k, max_q, max_k, False, None)
    assert _checks.HOST_READ == {"cpu": True}
    assert stream.getvalue().count("no asynchronous device assert for this device type") == 1
    assert telemetry.counts()[key] == before + 2


@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("rule", RULES)
def test_references_check_the_offsets_they_read(rule, which):
    """The references, which a device without Triton reaches unchecked, refuse broken offsets with
    the values (before, they computed on them)."""
    q, k, v, cu_q, cu_k, max_q, max_k = _case(rule, which, 4, torch.int64, seed=11)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.zeros(q.shape[1], q.shape[0])
    total = (q if which == "q" else k).shape[0]
    message = (
        rf"(cu_seqlens_{which} must rise from 0 to at most {total} tokens, got \[|"
        rf"max_seqlen_{which} must be >= the longest sequence)"
    )
    calls = {
        "attention_varlen": lambda: attention_varlen.reference(q, k, v, cu_q, cu_k, max_q, max_k),
        "attention_varlen_forward": lambda: attention_varlen.reference_forward(
            q, k, v, cu_q, cu_k, max_q, max_k
        ),
        "attention_varlen_backward": lambda: attention_varlen.reference_backward(
            out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k
        ),
    }
    for op, call in calls.items():
        with pytest.raises(InvalidArgumentError, match=rf"^{op}: {message}"):
            call()


def test_a_device_assert_message_is_cut_to_the_length_cuda_takes(monkeypatch):
    """CUDA's torch._assert_async refuses a message of 255 characters or more (seen on an H100: the
    call raised, and the candidate fell back); the helper passes at most ASSERT_MESSAGE_LIMIT."""
    seen = []
    monkeypatch.setattr(_checks, "HOST_READ", {})
    monkeypatch.setattr(torch, "_assert_async", lambda ok, message: seen.append(message))
    message = "".join(chr(ord("a") + i % 26) for i in range(300))
    assert _checks.queue_device_assert(torch.device("cpu"), lambda: torch.tensor(True), message, "unused")
    assert seen == [message[: _checks.ASSERT_MESSAGE_LIMIT]]


class CountedFlag:
    """The check's device flag, counting how often it is queued."""

    def __init__(self, q, k, cu_q, cu_k, max_q, max_k) -> None:
        self.calls, self.args = 0, (cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)

    def __call__(self) -> torch.Tensor:
        from torchhal.kernels.triton_attention_kernels import offsets_ok

        self.calls += 1
        return offsets_ok(*self.args)


def _checked(q, k, cu_q, cu_k, max_q, max_k) -> int:
    flag = CountedFlag(q, k, cu_q, cu_k, max_q, max_k)
    attention_varlen.check_offsets("attention_varlen", q, k, cu_q, cu_k, max_q, max_k, flag)
    return flag.calls


def test_the_same_offsets_are_checked_once_until_they_are_written(as_device):
    """Every layer of a model gets the same offsets: the check's launches are paid once. An
    in-place write (here one that breaks the rule) or other bounds check them again."""
    q, k, _, cu_q, cu_k, max_q, max_k = _case(None, "q", 6, torch.int32, seed=11)
    assert _checked(q, k, cu_q, cu_k, max_q, max_k) == 1
    assert _checked(q, k, cu_q, cu_k, max_q, max_k) == 0
    assert _checked(q, k, cu_q, cu_k, max_q + 1, max_k) == 1  # other bounds
    assert _checked(q, k, cu_q.clone(), cu_k, max_q + 1, max_k) == 1  # other tensors, same values
    cu_q[-1] = q.shape[0] + 1  # past the tokens, written in place
    with pytest.raises(RuntimeError, match="cu_seqlens_q/_k must rise from 0"):
        _checked(q, k, cu_q, cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match="cu_seqlens_q/_k must rise from 0"):  # a failure is not kept
        _checked(q, k, cu_q, cu_k, max_q, max_k)


def test_offsets_are_checked_on_every_call_while_a_graph_is_captured(as_device, monkeypatch):
    """A captured graph replays what was launched, on whatever offsets are copied in later: the
    check must be in it even where the same offsets were checked before the capture."""
    q, k, _, cu_q, cu_k, max_q, max_k = _case(None, "k", 6, torch.int64, seed=12)
    assert _checked(q, k, cu_q, cu_k, max_q, max_k) == 1
    monkeypatch.setattr(attention_varlen, "_capturing", lambda device: True)
    assert _checked(q, k, cu_q, cu_k, max_q, max_k) == 1
    assert _checked(q, k, cu_q, cu_k, max_q, max_k) == 1


def test_inference_tensors_are_checked_on_every_call(as_device):
    """They have no version counter to remember (reading it raised, and the Triton candidate fell
    back to the reference for that signature for good)."""
    with torch.inference_mode():
        q, k, _, cu_q, cu_k, max_q, max_k = _case(None, "q", 6, torch.int32, seed=13)
        assert [_checked(q, k, cu_q, cu_k, max_q, max_k) for _ in range(2)] == [1, 1]
