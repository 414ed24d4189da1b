"""`torchhal.kernels.patch` in use: what a Hugging Face user runs on a patched
model beyond one forward and backward, held to the unpatched model on fresh random inputs (tiny fp32
models, torchhal.ops on conftest's `plain_hal`: the module logic, not the kernels)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face patch tests need transformers (pip install torchhal[hf])"
)

import torchhal.kernels  # noqa: E402
from tests.kernels.test_patch import LAYERS, _fallbacks, make_model  # noqa: E402


@pytest.mark.skipif(
    not hasattr(transformers, "ContinuousBatchingConfig"), reason="transformers without continuous batching"
)
@pytest.mark.parametrize("implementation", ["sdpa", "paged|eager"])
def test_continuous_batching_fills_the_paged_cache_and_decodes_as_generate(implementation):
    """`generate_batch` (continuous batching, what `transformers serve` runs) refuses the "torchhal"
    attention by name, so a user switches the patched model to "sdpa" or "paged|eager". From 5.24 its
    PagedAttentionCache takes the attention forward's keyword arguments (`update(k, v, layer_idx,
    kwargs=kwargs)`) and reads its indices from them; the patched forward passed the old cache_kwargs
    dict, so every request failed inside the cache (KeyError 'cu_seq_lens_k') and generate_batch
    returned no tokens. Mistral: the prompts pass its window of 5. The batching runs in a thread of
    its own, on the default HAL (a `use()` block does not reach it)."""
    model = make_model("mistral")
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    patched.set_attn_implementation(implementation)
    prompts = [torch.randint(1, 128, (9,)).tolist(), torch.randint(1, 128, (4,)).tolist()]
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    expected = [model.generate(torch.tensor([p]), generation_config=config)[0, len(p) :] for p in prompts]
    small = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=32)
    out = patched.generate_batch(
        inputs=prompts, generation_config=config, continuous_batching_config=small, warmup=False
    )
    got = [out[request].generated_tokens for request in sorted(out)]
    assert got == [e.tolist() for e in expected] and all(len(g) == 6 for g in got)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_a_cache_continued_by_chunks_longer_than_the_window_matches(on_plain, family):
    """Chunks of several tokens against a filled sliding-window cache (chunked prefill, assisted
    decoding): seq_q > 1 with seq_q < seq_k, chunks longer than the window, the fast path throughout."""
    model = make_model(family)
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (2, 21))
    caches = [transformers.DynamicCache(config=m.config) for m in (model, patched)]
    before = _fallbacks()
    with torch.no_grad():
        for lo, hi in ((0, 8), (8, 15), (15, 16), (16, 21)):
            expected = model(ids[:, lo:hi], past_key_values=caches[0], use_cache=True).logits
            got = patched(ids[:, lo:hi], past_key_values=caches[1], use_cache=True).logits
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
    assert _fallbacks() == before
    assert "attention" in {op for op, _ in on_plain}


@pytest.mark.parametrize(
    "rope",
    [
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        dict(rope_type="linear", factor=2.0),
        dict(rope_type="dynamic", factor=2.0),  # 80 positions: past max_position_embeddings (64)
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_scaled_rope_variants_match(on_plain, rope):
    """transformers' rotary module stays and makes cos/sin (attention scaling included) for every RoPE
    variant; the patched attention applies them through ops.rope."""
    model = make_model("llama", rope_parameters={**rope, "rope_theta": 10000.0})
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (1, 80))
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, model(ids).logits, rtol=1e-5, atol=2e-5)
    assert "rope" in {op for op, _ in on_plain}


def test_gradient_checkpointing_keeps_loss_and_gradients(on_plain):
    """Checkpointed decoder layers re-run the patched modules in the backward."""
    model = make_model("qwen2", tie_word_embeddings=True)
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (2, 11))
    grads = []
    for m in (model, patched):
        m.train()
        m.gradient_checkpointing_enable()
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads.append((loss, {n: p.grad for n, p in m.named_parameters()}))
    (expected_loss, expected), (got_loss, got) = grads
    torch.testing.assert_close(got_loss, expected_loss, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    calls = [op for op, _ in on_plain]
    assert calls.count("rope") == 2 * LAYERS  # each layer's forward, again in its backward


def _hook(model, seen):
    """What a user or accelerate attaches before patching: hooks that change a norm's and an MLP's
    outputs, and an attention forward replaced on the instance (as accelerate's add_hook_to_module
    does for device_map and offload)."""
    layers = model.model.layers
    layers[0].input_layernorm.register_forward_hook(lambda module, args, out: out * 1.5)
    layers[1].mlp.register_forward_hook(lambda module, args, out: out + 0.1)
    attention = layers[1].self_attn
    own = attention.forward

    def moved(*args, **kwargs):
        seen.append(type(attention).__name__)
        return own(*args, **kwargs)

    attention.forward = moved


def test_hooked_modules_are_left_with_their_hooks(on_plain):
    """Replacing a norm or MLP dropped the hooks registered on it, and rewiring an attention forward
    replaced on the instance dropped that forward, all without a word (with accelerate's offload the
    weights would then never be loaded). They are left, reported, and their hooks run."""
    model = make_model("llama")
    hooked = copy.deepcopy(model)
    expected_seen, seen = [], []
    _hook(model, expected_seen)
    _hook(hooked, seen)
    report = torchhal.kernels.patch(hooked)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hooked(ids).logits, model(ids).logits, rtol=1e-5, atol=2e-5)
    assert seen == expected_seen == ["LlamaAttention"]
    left = {x.path: x.reason for x in report.left}
    for path in ("model.layers.0.input_layernorm", "model.layers.1.mlp", "model.layers.1.self_attn"):
        assert "accelerate" in left[path], path
    assert report.count("rms_norm") == 2 * LAYERS and report.count("attention") == LAYERS - 1
    assert report.count("mlp") == LAYERS - 1 and report.count("loss") == 1
    assert {"rms_norm", "swiglu", "rope", "attention"} <= {op for op, _ in on_plain}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eval_mode_with_labels_returns_the_logits_evaluation_reads(on_plain, family):
    """Trainer.evaluate runs the model in eval mode with labels and builds compute_metrics'
    predictions from the output's logits: a patched model returned logits=None there, so the
    predictions were empty. In eval mode the forward is transformers' own (loss and logits); in
    training mode the loss is fused and no logits are made."""
    model = make_model(family)
    patched = copy.deepcopy(model)
    torchhal.kernels.patch(patched)
    ids = torch.randint(0, 128, (2, 11))
    labels = ids.clone()
    labels[0, :3] = -100
    for m in (model, patched):
        m.eval()
    with torch.no_grad():
        expected, got = model(ids, labels=labels), patched(ids, labels=labels)
    assert got.logits is not None
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.loss, expected.loss)
    patched.train()
    assert patched(ids, labels=labels).logits is None  # training: the fused loss


def test_a_compiled_model_is_refused_by_name():
    """patch(torch.compile(model)) swapped the modules but not the loss forward, silently (the
    OptimizedModule is not a *ForCausalLM): patch before compiling, as the docstring says."""
    model = make_model("llama")
    compiled = torch.compile(model)
    with pytest.raises(torchhal.hal_core.InvalidArgumentError, match=r"OptimizedModule of LlamaForCausalLM"):
        torchhal.kernels.patch(compiled)
    assert torchhal.kernels.patch(model).swapped  # the model itself patches


def _with_dropin_attention(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with each layer's attention replaced by torchhal.kernels.nn.Attention holding its weights."""
    from torchhal.kernels import nn as thnn

    dropin = copy.deepcopy(model)
    config = model.config
    for index, layer in enumerate(dropin.model.layers):
        attention = thnn.Attention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, layer_idx=index
        )
        attention.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = attention.train(model.training)
    return dropin


def test_dropin_attention_generates_with_a_static_cache_as_the_model_it_stands_in_for(on_plain):
    """transformers gives a static cache's prefill no mask, meaning SDPA's top-left causal mask over
    all the cache's slots: the drop-in read it bottom-right, so the prompt attended the empty slots
    (first-step logits 1.3 off, other tokens generated)."""
    model = make_model("llama").eval()
    dropin = _with_dropin_attention(model)
    prompt = torch.randint(1, 128, (1, 9))
    kw = dict(
        max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0
    )
    for implementation in ("static", "dynamic"):
        want = model.generate(prompt, cache_implementation=implementation, **kw)
        got = dropin.generate(prompt, cache_implementation=implementation, **kw)
        assert torch.equal(got.sequences, want.sequences), implementation
        for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
            torch.testing.assert_close(g, w, msg=f"{implementation} step {step}")


def test_dropin_attention_weights_of_a_padded_batch_stay_finite(on_plain):
    """With output_attentions the drop-in computes the weights in plain PyTorch: a padding row,
    every key masked, was NaN (-inf everywhere), and the NaN reached the sequence's real tokens in
    the next layer; it now has the uniform weights transformers' eager attention gives it."""
    model = make_model("llama").eval()
    dropin = _with_dropin_attention(model)
    ids = torch.randint(1, 128, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        got = dropin(ids, attention_mask=mask, output_attentions=True)
    assert got.logits.isfinite().all() and all(w.isfinite().all() for w in got.attentions)
    torch.testing.assert_close(got.logits[0, 3:], want[0, 3:])
    torch.testing.assert_close(got.logits[1], want[1])


class _Wrapper(torch.nn.Module):
    """What PEFT's PeftModel is to patch: the causal LM inside another module, its config shown."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.base_model = inner
        self.config = inner.config

    def forward(self, **kwargs):
        return self.base_model(**kwargs)


def test_a_wrapped_causal_lm_gets_its_loss_fused_and_reported(on_plain):
    """patch(peft_model) swapped the modules but left the loss unfused, and its report said nothing
    of the loss: the causal LM inside the wrapper now gets the fused loss, reported at its path."""
    model = make_model("llama")
    reference = copy.deepcopy(model)
    wrapper = _Wrapper(model)
    report = torchhal.kernels.patch(wrapper)
    assert {s.path: s.kind for s in report.swapped}["base_model.lm_head"] == "loss"
    ids = torch.randint(0, 128, (2, 9))
    got = wrapper(input_ids=ids, labels=ids)
    want = reference(input_ids=ids, labels=ids)
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.loss, want.loss)
