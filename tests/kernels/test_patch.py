"""torchhal.kernels.patch on tiny random-initialised Hugging Face Llama, Qwen2 and Mistral models.

A deep copy of each model is patched; logits, the loss and every parameter's gradient are held to
FlashAttention's rule against the unpatched model run in fp64 (2x the unpatched fp32 model's own
error for logits and the loss, 3x for gradients, plus conftest's floor): the patched model may be as
far from exact as Hugging Face's fp32 computation is, a small multiple more for a different
summation order, and no further. The fp64 model's loss is transformers' causal-LM loss without its
upcast to fp32 (which would make the truth only as exact as the model under test); the patched
model's loss is ops.linear_cross_entropy's, with no logits. torchhal.ops dispatches through
conftest's `plain_hal` (references, ATen, SDPA: fast) in most tests, and for each family once end
to end through `triton_hal` (every op on its Triton candidate in the interpreter, fp32, at fewer
tokens: the interpreter takes seconds per training step; test_nn and the op tests cover the kernels
at other shapes). Whole-model fp64 truth is cheap at these sizes, so the Triton cases are held to the
same rule as the plain ones, not to a looser tolerance.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import subprocess
import sys
import types
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face patch tests need transformers (pip install torchhal[hf])"
)

import torchhal.kernels  # noqa: E402
from torchhal.hal_core import UnsupportedError, telemetry  # noqa: E402
from torchhal.kernels import hf_attention  # noqa: E402
from torchhal.kernels import hf_patch as patch_module  # noqa: E402
from torchhal.kernels import nn as thnn  # noqa: E402

BATCH, SEQ, LAYERS = 2, 17, 2
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    rms_norm_eps=0.05,  # far from the default, so a norm that ignored it would show
)
QWEN2_WINDOWS = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)
FAMILIES = {  # Qwen2: qkv bias, a full layer then a sliding one; Mistral: every layer sliding
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", QWEN2_WINDOWS),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
}


def make_model(family: str, **overrides) -> torch.nn.Module:
    """A random model whose weights are large enough to make attention far from uniform and norms
    far from identity (Hugging Face's 0.02 init would hide mistakes in both). In training mode,
    where a patched model's loss is fused (these configs have no dropout, so the numbers are
    eval mode's)."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **{**extra, **overrides})
    model = getattr(transformers, model_cls)(config).float().train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    return model


def _fallbacks() -> dict[str, int]:
    prefix = thnn.FALLBACK_COUNTER + ",reason="
    return {k.removeprefix(prefix): v for k, v in telemetry.counts().items() if k.startswith(prefix)}


def exact_causal_lm_loss(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_
):
    """transformers' ForCausalLMLoss without its upcast to fp32, so the fp64 model's loss stays fp64."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    logits, target = logits.reshape(-1, vocab_size), shift_labels.reshape(-1)
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def fp64_truth(model):
    truth = copy.deepcopy(model).double()
    truth.loss_function = exact_causal_lm_loss  # this instance only
    return truth


def with_ignored(labels):
    """A masked prompt in the first sequence and padding at the end of the last, as in fine-tuning."""
    labels = labels.clone()
    labels[0, :4] = -100
    labels[-1, -3:] = -100
    return labels


def _run(model, ids, labels, **kwargs):
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _loss_and_gradients_match(check_error, got, same, truth):
    (got_out, got_grads), (same_out, same_grads), (truth_out, truth_grads) = got, same, truth
    assert got_out.logits is None and same_out.logits is not None  # the fused loss made no logits
    assert got_out.loss.dtype == same_out.loss.dtype == torch.float32
    check_error("loss", got_out.loss, same_out.loss, truth_out.loss, 2.0)
    assert got_grads.keys() == same_grads.keys()
    for name, grad in got_grads.items():
        check_error(f"gradient of {name}", grad, same_grads[name], truth_grads[name], 3.0)


def _assert_report(report) -> None:
    counts = {kind: report.count(kind) for kind in ("rms_norm", "mlp", "attention", "loss")}
    assert counts == {"rms_norm": 2 * LAYERS + 1, "mlp": LAYERS, "attention": LAYERS, "loss": 1}
    paths = {s.path: s.kind for s in report.swapped}
    assert paths["model.norm"] == "rms_norm" and paths["model.layers.1.mlp"] == "mlp"
    assert paths["model.layers.0.self_attn"] == "attention" and paths["lm_head"] == "loss"
    assert paths["model.layers.1.post_attention_layernorm"] == "rms_norm"
    assert [(x.path, x.kind) for x in report.left] == [("model.rotary_emb", "rotary_embedding")]
    assert report.attn_implementation == ("sdpa", "torchhal")
    assert "5 rms_norm" in str(report) and "1 loss" in str(report) and report.to_dict()["swapped"][0]["path"]


# the ops of one training step (forward and backward) and of one forward without gradients, with
# how often each runs: per layer two norms, a rope, an attention and an MLP, then the final norm
TRAINING_CALLS = {
    "rms_norm": 2 * LAYERS + 1, "rms_norm_backward": 2 * LAYERS + 1,
    "rope": LAYERS, "rope_backward": LAYERS, "swiglu": LAYERS, "swiglu_backward": LAYERS,
    "attention_forward": LAYERS, "attention_backward": LAYERS,
    "linear_cross_entropy_forward": 1, "linear_cross_entropy_backward": 1,
}  # fmt: skip
INFERENCE_CALLS = {"rms_norm": 2 * LAYERS + 1, "rope": LAYERS, "swiglu": LAYERS, "attention": LAYERS}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_match_the_unpatched_model(on_plain, check_error, family):
    """Loss (fused, with ignored labels), gradients and, without labels, logits, on the fast candidates
    (references, ATen, SDPA): the module logic at the full test size."""
    model = make_model(family)
    patched, truth = copy.deepcopy(model), fp64_truth(model)
    report = torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (BATCH, SEQ))
    labels = with_ignored(ids)
    before = _fallbacks()

    truth_run, same_run = _run(truth, ids, labels), _run(model, ids, labels)
    assert on_plain == []  # the unpatched model runs no torchhal op
    _loss_and_gradients_match(check_error, _run(patched, ids, labels), same_run, truth_run)
    check_error("logits", _logits(patched, ids), _logits(model, ids), _logits(truth, ids), 2.0)
    assert set(TRAINING_CALLS) <= {op for op, _ in on_plain}
    assert _fallbacks() == before  # every attention call was expressible: no mask, no dropout
    _assert_report(report)


DECODE_OPS = ("attention", "attention_forward")  # the ops the split-KV candidate serves
TRITON_BATCH, TRITON_SEQ = 1, 13  # the interpreter runs one program per row: few tokens, and
# 13 positions still put most queries past Mistral's window (5) and Qwen2's (6)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_match_the_unpatched_model_on_the_triton_kernels(on_triton, check_error, family):
    """Each family end to end on the Triton candidates (interpreter, fp32): the fused loss with ignored
    labels and every parameter's gradient after one training step, then the logits of a forward
    without labels (the no-gradient kernels), all under the rule against the fp64 model. Llama: GQA,
    full causal; Qwen2: qkv bias, a full and a sliding-window layer; Mistral: every layer sliding.

    `on_triton` records the candidate selected for every dispatch and conftest's guard fails the test
    when a kernel raised and fell back, so every call ran its Triton kernel: a family whose modules
    went to a reference or SDPA candidate, missed an op, or ran one twice fails here."""
    model = make_model(family)
    patched, truth = copy.deepcopy(model), fp64_truth(model)
    report = torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (TRITON_BATCH, TRITON_SEQ))
    labels = with_ignored(ids)
    before = _fallbacks()

    truth_run, same_run = _run(truth, ids, labels), _run(model, ids, labels)
    assert on_triton == []  # the unpatched model runs no torchhal op
    _loss_and_gradients_match(check_error, _run(patched, ids, labels), same_run, truth_run)
    training = list(on_triton)
    on_triton.clear()
    check_error("logits", _logits(patched, ids), _logits(model, ids), _logits(truth, ids), 2.0)
    inference = list(on_triton)

    assert Counter(op for op, _ in training) == TRAINING_CALLS
    assert Counter(op for op, _ in inference) == INFERENCE_CALLS
    # attention's forward on the split-KV kernel (13 tokens: few query rows per kv head), all else
    # on the FlashAttention and row kernels
    assert {c for op, c in training + inference if op not in DECODE_OPS} == {"triton"}
    assert {c for op, c in training + inference if op in DECODE_OPS} == {"triton_decode"}
    assert _fallbacks() == before  # and no module fell back to transformers' attention or loss
    _assert_report(report)


def make_causal_lm(family: str, lm_head: str) -> torch.nn.Module:
    """lm_head "bias": a biased lm_head (transformers' forward adds the bias); "tied": the input
    embedding's weight; "plain": its own weight."""
    model = make_model(family, tie_word_embeddings=lm_head == "tied")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (lm_head == "tied")
    if lm_head == "bias":
        biased = torch.nn.Linear(*model.lm_head.weight.shape[::-1], bias=True)
        with torch.no_grad():
            biased.weight.copy_(model.lm_head.weight)
            biased.bias.normal_(0, 0.5)
        model.lm_head = biased
    return model


@pytest.mark.parametrize(("family", "lm_head"), [("llama", "bias"), ("qwen2", "tied"), ("mistral", "plain")])
def test_the_fused_loss_over_num_items_in_batch_matches(on_plain, check_error, family, lm_head):
    """Random labels (not the inputs) with ignored tokens, the summed loss over num_items_in_batch as
    Trainer passes it under gradient accumulation (here: this micro-batch is a third of the tokens)."""
    model = make_causal_lm(family, lm_head)
    patched, truth = copy.deepcopy(model), fp64_truth(model)
    torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (BATCH, SEQ))
    labels = with_ignored(torch.randint(0, 128, (BATCH, SEQ)))
    items = torch.tensor(3 * int((labels[:, 1:] != -100).sum()))
    _loss_and_gradients_match(
        check_error, *(_run(m, ids, labels, num_items_in_batch=items) for m in (patched, model, truth))
    )
    assert {"linear_cross_entropy_forward", "linear_cross_entropy_backward"} <= {op for op, _ in on_plain}


def test_shift_labels_logits_to_keep_and_ignore_index_as_transformers(on_plain):
    model = make_model("llama")
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (BATCH, SEQ))
    cases = {  # transformers' loss takes shift_labels as given, for the positions logits_to_keep keeps
        "shift_labels": dict(shift_labels=with_ignored(torch.randint(0, 128, (BATCH, 7))), logits_to_keep=7),
        "ignore_index": dict(ignore_index=int(ids[0, 5])),  # also pads the shifted labels' last position
    }
    for why, kwargs in cases.items():
        with torch.no_grad():
            expected, got = model(ids, labels=ids, **kwargs), patched(ids, labels=ids, **kwargs)
        assert got.logits is None, why
        torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=2e-5, msg=why)


@pytest.mark.parametrize("use_cache", [True, False])
def test_return_dict_false_keeps_transformers_tuple_positions(on_plain, use_cache):
    """to_tuple() drops None fields, so without logits the cache moved into the logits slot and
    `loss, logits = out[:2]` bound it; the slot stays, holding None."""
    model = make_model("llama")
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (BATCH, SEQ))
    labels = with_ignored(torch.randint(0, 128, (BATCH, SEQ)))
    with torch.no_grad():
        expected = model(ids, labels=labels, return_dict=False, use_cache=use_cache)
        got = patched(ids, labels=labels, return_dict=False, use_cache=use_cache)
    assert len(got) == len(expected) and got[1] is None
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=2e-5)
    assert [type(x) for x in got[2:]] == [type(x) for x in expected[2:]]


def test_opting_out_and_falling_back_run_the_transformers_loss(on_plain, monkeypatch):
    """patch(loss=False), return_logits=True per call, and what the fused op cannot express (counted)
    all run transformers' forward: logits and its loss."""
    model = make_model("mistral")
    ids = torch.randint(0, 128, (1, SEQ))
    with torch.no_grad():
        expected = model(ids, labels=ids)

    def transformers_loss(m, **kwargs):
        with torch.no_grad():
            out = m(ids, labels=ids, **kwargs)
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=2e-5)

    unfused = copy.deepcopy(model)
    report = torchhal.kernels.patch(unfused, loss=False)
    assert "forward" not in vars(unfused) and report.count("loss") == 0
    assert [(x.path, x.reason) for x in report.left if x.kind == "loss"] == [
        ("lm_head", "patch(..., loss=False)")
    ]
    transformers_loss(unfused)

    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    assert inspect.signature(patched.forward) == inspect.signature(model.forward)  # what Trainer reads
    transformers_loss(patched, return_logits=True)
    before = _fallbacks()
    patched.config.final_logit_softcapping = 30.0
    transformers_loss(patched)
    patched.config.final_logit_softcapping = None
    patched.loss_function = lambda **kwargs: exact_causal_lm_loss(**kwargs)  # a custom loss
    transformers_loss(patched)
    del patched._loss_function
    seen = []
    hook = patched.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    transformers_loss(patched)
    hook.remove()
    assert seen == [(1, SEQ, 128)]
    with monkeypatch.context() as m:  # a kernel library replacing the class forward after patching
        transformers_forward = type(model).forward
        m.setattr(type(model), "forward", lambda self, *a, **k: transformers_forward(self, *a, **k))
        transformers_loss(patched)
    after = _fallbacks()
    reasons = ("loss_softcapping", "loss_function", "loss_lm_head", "loss_forward")
    assert {r: after.get(r, 0) - before.get(r, 0) for r in reasons} == dict.fromkeys(reasons, 1)
    with torch.no_grad():  # back on the fused path; as a tuple: its logits slot holds None
        loss, logits, _cache = patched(ids, labels=ids, return_dict=False)
    torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=2e-5)
    assert logits is None
    assert _fallbacks() == after

    class Overriding(type(model)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    subclassed = copy.deepcopy(model)
    subclassed.__class__ = Overriding
    report = torchhal.kernels.patch(subclassed)
    assert report.count("loss") == 0 and "forward" not in vars(subclassed)
    assert [x.reason for x in report.left if x.kind == "loss"] == [
        "Overriding.forward is not transformers' MistralForCausalLM.forward"
    ]


def test_the_fused_loss_under_autocast_casts_as_lm_head_would(on_plain):
    """transformers' lm_head runs in the autocast dtype, so the op computes on bf16 hidden states and
    weight (it casts them under autocast, as lm_head's matmul would); the loss is within 2x
    transformers' error of the exact loss on those rounded inputs, plus one bf16 rounding (the op
    returns the loss in its inputs' dtype; it is fp32 afterwards, as transformers')."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    lm_head = torch.nn.Linear(64, 128)
    hidden, labels = torch.randn(BATCH, SEQ, 64), with_ignored(torch.randint(0, 128, (BATCH, SEQ)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ForCausalLMLoss(lm_head(hidden), labels, 128)
        got = patch_module.causal_lm_loss(hidden, lm_head.weight, labels, lm_head.bias)
    rounded = [t.detach().to(torch.bfloat16) for t in (hidden, lm_head.weight, lm_head.bias)]
    cast_by_hand = patch_module.causal_lm_loss(rounded[0], rounded[1], labels, rounded[2])
    torch.testing.assert_close(got, cast_by_hand, rtol=0, atol=0)
    assert got.dtype == expected.dtype == torch.float32
    truth = exact_causal_lm_loss(F.linear(*(t.double() for t in rounded)), labels, 128)
    error, base = (got.double() - truth).abs().item(), (expected.double() - truth).abs().item()
    assert error <= 2 * base + torch.finfo(torch.bfloat16).eps * truth.abs().item(), (error, base)


def test_the_parity_test_sees_the_sliding_window(on_plain):
    """Mistral's window (5 of 17 keys) changes the logits far beyond the tolerance above, so the parity
    test would catch a window off by one or ignored (the off-by-one is checked directly in test_nn)."""
    windowed = make_model("mistral")
    full = copy.deepcopy(windowed)
    full.config.sliding_window = None
    ids = torch.randint(0, 128, (1, SEQ))
    with torch.no_grad():
        assert (windowed(ids).logits - full(ids).logits)[:, 5:].abs().max() > 0.1


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_unpatched_model_and_the_shared_config_stay_as_they_were(on_plain, family):
    """Models built from one config object share it: patching one must not switch the other."""
    model = make_model(family)
    sibling = type(model)(model.config).eval()
    sibling.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (1, SEQ))
    with torch.no_grad():
        expected = sibling(ids).logits
    weight = model.model.layers[0].input_layernorm.weight
    torchhal.kernels.patch(model)

    assert model.model.layers[0].input_layernorm.weight is weight  # shared, not copied
    assert model.config is not sibling.config and sibling.config._attn_implementation == "sdpa"
    assert all(m.config is model.config for m in model.modules() if hasattr(m, "config"))
    assert "forward" not in vars(sibling.model.layers[0].self_attn) and "forward" not in vars(sibling)
    assert type(sibling.model.layers[0].mlp).__name__.endswith("MLP")
    assert not isinstance(sibling.model.norm, thnn.RMSNorm)
    calls = len(on_plain)
    with torch.no_grad():
        torch.testing.assert_close(sibling(ids).logits, expected, rtol=0, atol=0)
    assert len(on_plain) == calls
    assert list(model.state_dict()) == list(sibling.state_dict())
    model.load_state_dict(sibling.state_dict())  # strict: same names and shapes


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padding_mask_falls_back_counted_and_matches(on_plain, family):
    """Left padding: transformers' mask goes to its own SDPA attention (counted), never to the causal op."""
    model = make_model(family)
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :4] = 0
    before = _fallbacks().get("attention_mask", 0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        got = patched(input_ids=ids, attention_mask=mask).logits
    assert _fallbacks().get("attention_mask", 0) == before + LAYERS
    assert not any(op.startswith("attention") for op, _ in on_plain)
    # both compute the same fp32 attention; they differ by kernel rounding in norms, rope and swiglu
    torch.testing.assert_close(got[0, 4:], expected[0, 4:], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=2e-5)
    with torch.no_grad():  # an all-ones mask is plain causal: no fallback
        patched(input_ids=ids, attention_mask=torch.ones_like(mask))
    assert _fallbacks().get("attention_mask", 0) == before + LAYERS


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_a_kv_cache_decodes_through_the_op(on_plain, family):
    """Greedy decoding past Mistral's and Qwen2's windows (9 + 8 tokens): every step attends with
    seq_q < seq_k (bottom-right causal) through ops.attention, with sliding caches where configured."""
    model = make_model(family)
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    prompt = torch.randint(0, 128, (BATCH, 9))  # longer than the windows: the prefill is windowed too
    kwargs = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    before = _fallbacks()
    expected = model.generate(prompt, **kwargs)
    got = patched.generate(prompt, **kwargs)
    assert _fallbacks() == before
    assert "attention" in {op for op, _ in on_plain}
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=1e-4, atol=1e-4)
    assert torch.equal(got.sequences, expected.sequences)


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_a_patched_attention_fills_the_kv_cache_under_either_name(on_plain, name):
    """transformers 5.24 passes the KV cache to attention modules as `cache`, no longer `past_key_values`:
    a forward that read only the old name left the cache empty and attended to the new keys alone (the
    generate tests diverged from the second token). A Cache under a name it does not know is refused."""
    model = make_model("llama")
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    attention_forward = inspect.signature(type(model.model.layers[0].self_attn).forward)
    own_name = "cache" if "cache" in attention_forward.parameters else "past_key_values"  # as layers pass it
    caches = [transformers.DynamicCache(config=model.config) for _ in range(2)]
    hidden = torch.randn(BATCH, 6, COMMON["hidden_size"])
    with torch.no_grad():
        for step in (slice(0, 5), slice(5, 6)):  # prefill, then one decode step against the cache
            positions = torch.arange(step.start, step.stop)[None]
            rotary = model.model.rotary_emb(hidden[:, step], positions)
            expected, _ = model.model.layers[0].self_attn(
                hidden[:, step], rotary, None, **{own_name: caches[0]}
            )
            got, _ = patched.model.layers[0].self_attn(hidden[:, step], rotary, None, **{name: caches[1]})
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == 6
    with pytest.raises(UnsupportedError, match="KV cache"):
        patched.model.layers[0].self_attn(hidden[:, 5:], rotary, None, kv=caches[1])


def test_output_attentions_falls_back_to_eager_weights(on_plain):
    model = make_model("mistral")
    eager, patched = copy.deepcopy(model), copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (1, SEQ))
    before = _fallbacks().get("output_attentions", 0)
    with torch.no_grad():
        expected = eager(ids, output_attentions=True)
        got = patched(ids, output_attentions=True)
    assert _fallbacks().get("output_attentions", 0) == before + LAYERS
    assert len(got.attentions) == LAYERS  # captured by transformers' hooks on the attention class
    torch.testing.assert_close(got.attentions, expected.attentions, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=2e-5)


def test_attention_dropout_in_training_falls_back(on_plain):
    model = make_model("llama", attention_dropout=0.1)
    torchhal.kernels.patch(model)
    before = _fallbacks().get("dropout", 0)
    model.train()
    model(torch.randint(0, 128, (1, SEQ))).logits.sum().backward()
    assert _fallbacks().get("dropout", 0) == before + LAYERS


def _mask_arguments(q_length, q_offset, **kwargs):
    """Keyword arguments of transformers' mask functions: before 5.1 the query positions were a tensor."""
    from transformers.masking_utils import sdpa_mask

    if "cache_position" in inspect.signature(sdpa_mask).parameters:
        return dict(cache_position=torch.arange(q_offset, q_offset + q_length), **kwargs)
    return dict(q_length=q_length, q_offset=q_offset, **kwargs)


def test_mask_function_refuses_what_none_cannot_mean():
    """None only for causal (or the config's sliding window), bottom-right aligned, without padding."""
    from transformers.masking_utils import causal_mask_function

    config = types.SimpleNamespace(model_type="mistral", sliding_window=5)
    plain = dict(
        batch_size=1, kv_length=7, kv_offset=0, mask_function=causal_mask_function, attention_mask=None,
        local_size=None, allow_is_causal_skip=True, config=config, device="cpu",
    )  # fmt: skip
    assert hf_attention.torchhal_mask(**_mask_arguments(3, 4, **plain)) is None
    assert hf_attention.torchhal_mask(**_mask_arguments(3, 4, **{**plain, "local_size": 5})) is None
    refused = {
        "static cache slots": (0, {}),
        "chunked attention": (4, dict(local_size=4)),
        "no skip allowed": (4, dict(allow_is_causal_skip=False)),
        "padding": (4, dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool))),
        "other model type": (4, dict(config=types.SimpleNamespace(model_type="gemma", sliding_window=None))),
    }
    for why, (q_offset, change) in refused.items():
        mask = hf_attention.torchhal_mask(**_mask_arguments(3, q_offset, **{**plain, **change}))
        assert isinstance(mask, torch.Tensor) and mask.shape == (1, 1, 3, 7), why


def test_patch_is_callable_per_instance_and_refuses_other_models():
    model = make_model("llama")
    report = patch_module.patch(model)
    again = torchhal.kernels.patch(model)
    assert again.swapped == [] and {x.reason for x in again.left if x.kind in ("attention", "loss")} == {
        "already patched"
    }
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        expected, expected_loss = model(ids).logits, model(ids, labels=ids).loss
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # as torch.save does
            attn = clone.model.layers[0].self_attn
            assert attn.forward.module is attn  # the rewired forward follows the copy
            assert clone.forward.model is clone
            torch.testing.assert_close(clone(ids).logits, expected, rtol=0, atol=0)
            torch.testing.assert_close(clone(ids, labels=ids).loss, expected_loss, rtol=0, atol=0)
    assert type(attn).__name__ == "LlamaAttention" and report.count("attention") == LAYERS
    with pytest.raises(UnsupportedError, match=r"model type 'gpt2' .* supported: llama, qwen2, mistral"):
        torchhal.kernels.patch(types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2")))
    partial = torchhal.kernels.patch(make_model("qwen2"), attention=False)
    assert partial.count("attention") == 0 and partial.attn_implementation == ("sdpa", "sdpa")
    assert {x.reason for x in partial.left if x.kind == "attention"} == {"patch(..., attention=False)"}


def test_a_patched_model_saved_whole_runs_in_a_fresh_process(tmp_path):
    """torch.save of the whole model, torch.load where nothing was patched or registered yet.
    Fails before: transformers raised KeyError 'torchhal' (the config's attention implementation)."""
    model = make_model("llama")
    torchhal.kernels.patch(model)
    ids = torch.randint(0, 128, (BATCH, SEQ))
    with torch.no_grad():
        expected = model(ids).logits
    torch.save({"model": model, "ids": ids, "expected": expected}, tmp_path / "saved.pt")
    check = (
        "import sys, torch\n"
        "saved = torch.load(sys.argv[1], weights_only=False)\n"
        "with torch.no_grad():\n"
        "    got = saved['model'](saved['ids']).logits\n"
        "torch.testing.assert_close(got, saved['expected'])\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", check, str(tmp_path / "saved.pt")], capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr[-3000:]


def test_a_static_cache_falls_back_and_generates_the_same(on_plain):
    """A static cache attends over all its slots, empty ones masked: no causal mask says that."""
    model = make_model("llama")
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    prompt = torch.randint(0, 128, (1, 9))
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    before = _fallbacks().get("attention_mask", 0)
    expected = model.generate(prompt, cache_implementation="static", **kwargs)
    got = patched.generate(prompt, cache_implementation="static", **kwargs)
    assert _fallbacks().get("attention_mask", 0) == before + 4 * LAYERS  # prefill and every step
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=1e-4, atol=1e-4)
    assert torch.equal(got.sequences, expected.sequences)
