"""transformers registration of ``attn_implementation="neutrain_sage"`` (CPU: quantized reference)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.attention import counters, register, reset_counters
from neutrain.attention.reference import accuracy_metrics
from neutrain.attention.registration import neutrain_sage_attention_forward, neutrain_sage_mask


def _model(name, head_dim=64, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=2 * head_dim, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=97, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=name).eval()


def test_register_is_idempotent_and_model_matches_sdpa():
    assert register() == "neutrain_sage" and register() == "neutrain_sage"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert "neutrain_sage" in AttentionInterface._global_mapping
    assert "neutrain_sage" in AttentionMaskInterface._global_mapping
    ids = torch.randint(0, 97, (2, 40))
    reset_counters()
    with torch.no_grad():
        sage = _model("neutrain_sage")(ids).logits
        ref = _model("sdpa")(ids).logits
    assert counters["reference"] == 2 and counters["fallback"] == 0
    assert accuracy_metrics(sage, ref)["cos"] > 0.999


@pytest.mark.slow
def test_padding_mask_is_honoured():
    register()
    model = _model("neutrain_sage")
    ids = torch.randint(0, 97, (2, 48))
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[0, :8] = 0  # left padding
    reset_counters()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits[0, 8:]
        alone = model(ids[:1, 8:]).logits[0]
        ignored = model(ids).logits[0, 8:]  # padding tokens attended
    assert counters["fallback"] == 0 and counters["reference"] == 6  # 3 calls x 2 layers
    err = (padded - alone).abs().max() / alone.abs().max()
    err_ignored = (ignored - alone).abs().max() / alone.abs().max()
    assert err < 0.05 and err_ignored > 4 * err


@pytest.mark.slow
def test_packed_sequences_follow_position_ids():
    register()
    model = _model("neutrain_sage", head_dim=128)
    a, b = torch.randint(0, 97, (1, 30)), torch.randint(0, 97, (1, 34))
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(30), torch.arange(34)])[None]
    reset_counters()
    with torch.no_grad():
        out = model(packed, position_ids=pos).logits[0]
        sep = torch.cat([model(a).logits[0], model(b).logits[0]])
        unpacked = model(packed).logits[0]
    assert counters["fallback"] == 0
    err = (out - sep).abs().max() / sep.abs().max()
    assert err < 0.05 and (unpacked[30:] - sep[30:]).abs().max() / sep.abs().max() > 4 * err


def test_mask_function_returns_padding_mask_or_none():
    assert neutrain_sage_mask(batch_size=1, attention_mask=None, kv_length=4) is None
    assert neutrain_sage_mask(batch_size=1, attention_mask=torch.ones(1, 4, dtype=torch.bool), kv_length=4) is None
    m = torch.tensor([[0, 1, 1, 1]])
    assert torch.equal(neutrain_sage_mask(attention_mask=m, kv_length=4), m.bool())


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("case", ["decode", "dropout", "softcap", "sliding_window", "head_dim"])
def test_fallbacks_are_counted_and_match_sdpa_math(case):
    reset_counters()
    d = 32 if case == "head_dim" else 64
    n_q = 1 if case == "decode" else 24
    q = torch.randn(1, 4, n_q, d)
    k, v = torch.randn(1, 2, 24, d), torch.randn(1, 2, 24, d)
    kwargs = {"softcap": 30.0} if case == "softcap" else {"sliding_window": 8} if case == "sliding_window" else {}
    dropout = 0.5 if case == "dropout" else 0.0
    out, weights = neutrain_sage_attention_forward(_Module(), q, k, v, None, dropout=dropout, **kwargs)
    assert weights is None and out.shape == (1, n_q, 4, d)
    assert counters["fallback"] == 1 and counters["kernel"] == 0 and counters["reference"] == 0
    if case in ("dropout",):
        return
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) * d ** -0.5
    if case == "softcap":
        s = torch.tanh(s / 30.0) * 30.0
    qpos = torch.arange(n_q)[:, None] + 24 - n_q
    kpos = torch.arange(24)[None]
    allowed = kpos <= qpos
    if case == "sliding_window":
        allowed &= qpos - kpos < 8
    ref = (torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vv).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-5)


def test_recipe_asking_for_sage_gets_sdpa_on_cpu_and_the_kernel_on_gpu(caplog):
    """The default recipe names neutrain_sage: on CPU the model is built with SDPA, with one warning."""
    from neutrain.config import validate_recipe
    from neutrain.data import byte_tokenizer
    from neutrain.trainer.modeling import build_model

    recipe = validate_recipe({
        "model": {"init": "random", "tokenizer": "byte", "attn_implementation": "neutrain_sage",
                  "config": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512}},
        "data": {"datasets": [{"path": "python-stdlib", "type": "text"}]},
    })
    model_cfg, tok = recipe.model, byte_tokenizer()
    with caplog.at_level("WARNING", logger="neutrain.trainer.modeling"):
        model = build_model(model_cfg, tok, use_cpu=True)
    assert model.config._attn_implementation == "sdpa"
    assert any("neutrain_sage needs a CUDA GPU" in r.getMessage() for r in caplog.records)
    if torch.cuda.is_available():
        assert build_model(model_cfg, tok, use_cpu=False).config._attn_implementation == "neutrain_sage"


def test_auto_attention_builds_sdpa_on_cpu_and_dispatching_sage_on_gpu():
    """``attn_implementation: auto`` is a valid recipe value: SDPA on CPU, the dispatching
    ``neutrain_sage`` function on a GPU (which itself runs SDPA wherever the table says so)."""
    from neutrain.config import validate_recipe
    from neutrain.data import byte_tokenizer
    from neutrain.trainer.modeling import build_model

    recipe = validate_recipe({
        "model": {"init": "random", "tokenizer": "byte", "attn_implementation": "auto",
                  "config": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512}},
        "data": {"datasets": [{"path": "python-stdlib", "type": "text"}]},
    })
    assert build_model(recipe.model, byte_tokenizer(), use_cpu=True).config._attn_implementation == "sdpa"
    if torch.cuda.is_available():
        model = build_model(recipe.model, byte_tokenizer(), use_cpu=False)
        assert model.config._attn_implementation == "neutrain_sage"
