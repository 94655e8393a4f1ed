"""Module-specific behaviour kept under NeuZip: logit transforms, scaled embeddings, refusals, attention choice."""

import shutil

import pytest
import torch

from neutrain.compress import compress
from neutrain.nn import (
    CompressedWeight,
    compress_model,
    linear_cross_entropy,
)
from neutrain.nn.architecture import (
    LogitTransform,
    UnsupportedArchitectureError,
    auto_attention,
)
from neutrain.nn.convert import build_module

from .nn_helpers import (
    CODEC,
    GradCapture,
    dense_and_compressed,
    token_batches,
    train,
    weights,
)


@pytest.mark.parametrize("transform, bias", [
    (LogitTransform(softcap=2.0), False), (LogitTransform(scale=0.5), True), (LogitTransform(divisor=3.0), False),
], ids=["softcap", "scale-bias", "divisor"])
def test_chunked_loss_applies_the_models_logit_transform(transform, bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=bias)
    hidden = torch.randn(6, 16, requires_grad=True)
    labels = torch.randint(0, 40, (6,))
    labels[2] = -100
    expected = torch.nn.functional.cross_entropy(transform.apply(head(hidden)), labels)
    expected.backward()
    want = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
    hidden.grad = head.weight.grad = None
    if bias:
        head.bias.grad = None
    loss = linear_cross_entropy(hidden, head, labels, chunk_bytes=6 * 4 * 8, logit_transform=transform)  # 5 chunks
    loss.backward()
    got = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_streamed_lm_head_update_with_soft_capping_equals_the_full_gradient():
    from neutrain.optim import LOMO

    softcap = LogitTransform(softcap=1.5)
    results = []
    for streaming in (True, False):
        _, model = dense_and_compressed(seed=3)
        opt = LOMO(model.parameters(), lr=0.1, stochastic_rounding=False, allow_streaming=streaming,
                   chunk_numel=64 * 32)
        model.config.final_logit_softcapping = softcap.softcap  # what causal_lm_loss reads
        train(model, opt, token_batches(2, seed=2), chunk_bytes=24 * 4 * 64)
        assert opt.streamed_updates == (4 if streaming else 0)  # lm_head and embedding, 2 steps
        results.append(weights(model))
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_scaled_embedding_keeps_its_scale_in_forward_and_backward():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    dense = Gemma3TextScaledWordEmbedding(50, 16, padding_idx=0, embed_scale=16 ** 0.5).to(torch.bfloat16)
    weight = CompressedWeight(compress(dense.weight.detach(), **CODEC))
    weight.optimizer = GradCapture()
    emb = build_module(dense, weight, "model.embed_tokens")
    assert float(emb.embed_scale) == 4.0
    ids = torch.tensor([[0, 3, 3, 49]])
    grad = torch.randn(1, 4, 16).bfloat16()
    out_dense, out = dense(ids), emb(ids)
    assert torch.equal(out, out_dense)
    out_dense.backward(grad)
    out.backward(grad)
    assert torch.equal(weight.optimizer.grads[weight.key], dense.weight.grad)


def test_modules_with_other_forwards_are_refused_with_one_clear_line():
    class ShiftedEmbedding(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) + 1

    class OwnLinear(torch.nn.Linear):
        def forward(self, x):
            return x @ self.weight.T

    dense = ShiftedEmbedding(8, 4)
    with pytest.raises(UnsupportedArchitectureError, match=r"^emb: ShiftedEmbedding\.forward is neither") as info:
        build_module(dense, CompressedWeight(compress(dense.weight.detach(), **CODEC)), "emb")
    assert "\n" not in str(info.value)
    with pytest.raises(UnsupportedArchitectureError, match=r"^0: OwnLinear overrides nn\.Linear\.forward"):
        compress_model(torch.nn.Sequential(OwnLinear(4, 4)), progress=False, codec_options=CODEC)


def test_auto_attention_picks_what_the_architecture_supports(tmp_path):
    from transformers import AutoConfig

    from neutrain.config import load_recipe
    from neutrain.data import byte_tokenizer
    from neutrain.trainer.modeling import build_model
    from tests.helpers import write_recipe

    assert auto_attention(AutoConfig.for_model("gemma2"), cuda=False) == "eager"  # SDPA cannot soft-cap
    assert auto_attention(AutoConfig.for_model("llama"), cuda=False) == "sdpa"
    assert auto_attention(AutoConfig.for_model("gemma2"), cuda=True) == "neutrain_sage"  # softcap: math fallback
    gemma2 = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64}
    recipe = load_recipe(write_recipe(tmp_path, model={"config": gemma2, "attn_implementation": "auto"}))
    for weights_mode in ("dense", "neuzip-lossless"):
        model = build_model(recipe.model, byte_tokenizer(), use_cpu=True, weights=weights_mode)
        assert model.config._attn_implementation == "eager", weights_mode
    # SageAttention asked for on CPU falls back to what Gemma 2 supports, not to SDPA.
    sage = load_recipe(write_recipe(tmp_path, "sage.yaml", model={"config": gemma2, "attn_implementation": "neutrain_sage"}))
    assert build_model(sage.model, byte_tokenizer(), use_cpu=True).config._attn_implementation == "eager"
    # An explicit backend the architecture lacks: one line naming the key, the class and the way out.
    sdpa = load_recipe(write_recipe(tmp_path, "sdpa.yaml", model={"config": gemma2, "attn_implementation": "sdpa"}))
    with pytest.raises(UnsupportedArchitectureError, match=r"^model\.attn_implementation: Gemma2ForCausalLM has no "
                                                           r"sdpa attention in transformers \(use auto or eager\)$"):
        build_model(sdpa.model, byte_tokenizer(), use_cpu=True)


@pytest.mark.slow
def test_moe_experts_train_like_dense_under_activation_checkpointing():
    import copy

    from transformers import AutoModelForCausalLM, MixtralConfig

    from neutrain.optim import LOMO

    from .nn_helpers import enable_checkpointing

    cfg = MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
    compressed = copy.deepcopy(dense)
    compress_model(compressed, progress=False, codec_options=CODEC)
    experts = compressed.model.layers[0].mlp.experts
    assert sorted(experts.compressed_params) == ["down_proj", "gate_up_proj"]
    assert not any(p.dim() == 3 for p in compressed.parameters())  # no dense expert stack left
    enable_checkpointing(compressed)
    data = token_batches(2, seed=4)
    start = weights(dense)
    train(dense, LOMO(dense.parameters(), lr=0.1, stochastic_rounding=False), data)
    train(compressed, LOMO(compressed.parameters(), lr=0.1, stochastic_rounding=False), data)
    a, b = weights(dense), weights(compressed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.experts.gate_up_proj"], start["model.layers.0.mlp.experts.gate_up_proj"])
    assert experts.compressed_params["gate_up_proj"].version == 2  # one update per step, whole stack


def test_truncated_moe_checkpoint_names_the_stack_it_cannot_build(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, MixtralConfig

    from neutrain.errors import CheckpointError
    from neutrain.nn.formats import load_compressed

    cfg = MixtralConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=64, num_local_experts=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    dropped = [k for k in state if k.endswith("experts.1.w3.weight")]
    assert dropped  # the checkpoint really stores experts one by one
    save_file({k: v for k, v in state.items() if k not in dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"cannot build model\.layers\.0\.mlp\.experts\.gate_up_proj from 3 "):
        load_compressed(tmp_path, device="cpu", progress=False, codec_options=CODEC)


@pytest.mark.slow
@pytest.mark.parametrize("hooks", [True, False], ids=["saved-as-references", "outer-hooks-active"])
def test_decoded_expert_stacks_do_not_outlive_the_forward(monkeypatch, hooks):
    import gc
    import weakref

    from transformers import AutoModelForCausalLM, MixtralConfig

    import neutrain.nn.experts as experts_module
    from neutrain.nn import causal_lm_loss, stack_views
    from neutrain.optim import LOMO

    cfg = MixtralConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=256, num_local_experts=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
    compress_model(model, progress=False, codec_options=CODEC)
    opt = LOMO(model.parameters(), lr=0.1, stochastic_rounding=False).bind(model)
    if not hooks:  # as under activation checkpointing: the stacks are left to the outer hooks
        monkeypatch.setattr(stack_views.compat, "saved_tensor_hooks_active", lambda: True)
    decoded = []
    apply = experts_module._DecodeStack.apply

    def recording(*args):
        out = apply(*args)
        decoded.append(weakref.ref(out))
        return out

    monkeypatch.setattr(experts_module._DecodeStack, "apply", recording)
    before = stack_views.CACHE.decodes
    loss = causal_lm_loss(model, *(token_batches(1, seed=1)[0],) * 2)
    gc.collect()
    assert len(decoded) == 4  # 2 layers x (gate_up_proj, down_proj), each decoded once per forward
    alive = sum(ref() is not None for ref in decoded)
    assert alive == (0 if hooks else 4)
    opt.backward(loss)
    assert stack_views.CACHE.decodes - before == (4 if hooks else 0)  # backward re-decodes each stack once
    assert not stack_views.CACHE.stacks


def test_attention_choice_on_a_missing_base_model_is_a_recipe_error(tmp_path):
    from neutrain.config import RecipeError, load_recipe
    from neutrain.data import byte_tokenizer
    from neutrain.trainer.modeling import build_model
    from tests.helpers import write_recipe

    # A model directory that is gone by the time the model is built (a missing one is refused while the recipe loads).
    (tmp_path / "no-such-model").mkdir()
    (tmp_path / "no-such-model" / "config.json").write_text("{}")
    recipe = load_recipe(write_recipe(tmp_path, model={"init": "pretrained", "config": None,
                                                       "base_model": str(tmp_path / "no-such-model")}))
    shutil.rmtree(tmp_path / "no-such-model")
    with pytest.raises(RecipeError, match=r"^model\.base_model: cannot load the config of '.*no-such-model'"):
        build_model(recipe.model, byte_tokenizer(), use_cpu=True)
