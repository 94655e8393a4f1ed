"""Architecture matrix: NeuZip-lossless + fused updates train every decoder-only LM exactly as the dense model.

For each architecture (tiny random config, hidden 64, 2 layers, bf16 on CPU):

1. a dense model is saved with ``save_pretrained`` (MoE experts are then stored one by one, as real
   checkpoints are) and loaded back twice: dense by transformers, compressed by neutrain's loader;
2. the chunked loss neutrain trains with equals the model's own loss (soft-capping, logit scales);
3. two fused steps (stochastic rounding off) leave the compressed model bit-identical to the dense one;
4. a compressed checkpoint is written, a fresh model resumes from it and takes a third step, bit-identical
   to the model that kept going and to the dense one;
5. the dense export reloads with plain ``from_pretrained`` and gives logits identical to the trained model's.
"""

from __future__ import annotations

import copy

import pytest
import torch

VOCAB = 128
COMMON = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2,
}
ARCHITECTURES = {
    "llama": {"model_type": "llama"},
    "mistral": {"model_type": "mistral", "sliding_window": 8},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    # Gemma: scaled embedding (x sqrt(hidden)), (1 + w) norms, tied head; Gemma 2 also soft-caps
    # attention and final logits and has no SDPA.
    "gemma": {"model_type": "gemma", "head_dim": 16},
    # Soft-caps small enough to matter on a random model's logits.
    "gemma2": {"model_type": "gemma2", "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
               "final_logit_softcapping": 1.0, "attn_logit_softcapping": 2.0},
    "gemma3": {"model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
               "final_logit_softcapping": 2.0},
    "phi3": {"model_type": "phi3"},
    # MoE; Mixtral and Qwen2-MoE also add the router's load-balancing loss (output_router_logits).
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                "output_router_logits": True, "router_aux_loss_coef": 0.1},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64, "output_router_logits": True},
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
    "olmo2": {"model_type": "olmo2"},
    # Granite: embedding, residual and attention multipliers, logits divided by logits_scaling.
    "granite": {"model_type": "granite", "embedding_multiplier": 4.0, "logits_scaling": 2.0,
                "residual_multiplier": 0.5, "attention_multiplier": 0.25},
    # Cohere: logits times logit_scale, tied head, LayerNorm with no bias.
    "cohere": {"model_type": "cohere", "logit_scale": 0.5},
    "stablelm": {"model_type": "stablelm", "use_qkv_bias": True},
    "phi": {"model_type": "phi"},  # lm_head with a bias
    # MoE with shared experts, grouped routing and a first dense layer; MLA attention.
    "deepseek_v3": {"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16},
}
CODEC = {"steps": 16}  # short codec lanes: fast CPU reference coder on tiny tensors


def _config(arch):
    from transformers import AutoConfig

    raw = {**COMMON, **ARCHITECTURES[arch]}
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def _batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (2, 12), generator=g) for _ in range(n)]


def _optimizer(model):
    from neutrain.optim import AdaLomo

    return AdaLomo(model.parameters(), lr=2e-2, clip_mode="per_tensor", max_grad_norm=1.0,
                   stochastic_rounding=False).bind(model)


def _train(model, opt, batches):
    from neutrain.nn import causal_lm_loss

    model.train()
    for ids in batches:
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()


def _weights(model):
    from neutrain.nn import decompressed_state_dict

    return {k: v.clone() for k, v in decompressed_state_dict(model).items()}


def _assert_same_weights(a, b, what):
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())[:4]}"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: {len(differ)} tensor(s) differ, e.g. {differ[:3]}"


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


# Every architecture under attn_implementation "auto" (SDPA on CPU, eager where the architecture has
# none: Gemma 2, so no second eager run for it) and under "eager", but DeepSeek V3: transformers 5.24's
# eager MLA repeats K/V by num_key_value_groups (here 2) over keys that already have every head, and
# fails on the dense model itself. The file took 20.5 s on a quiet 2-core machine (each case 0.2-3 s).
MATRIX = [(arch, attn) for arch in ARCHITECTURES for attn in ("auto", "eager")
          if (arch, attn) not in (("gemma2", "eager"), ("deepseek_v3", "eager"))]


def _dense_and_compressed(tmp_path, arch, attn, device="cpu"):
    """A saved random base loaded twice: dense by transformers, compressed by neutrain (same attention)."""
    from transformers import AutoModelForCausalLM

    from neutrain.nn import compressed_weights
    from neutrain.nn.architecture import auto_attention
    from neutrain.nn.formats import load_compressed

    config = _config(arch)
    attn = auto_attention(config, cuda=False) if attn == "auto" else attn
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn).save_pretrained(
        tmp_path / "base")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16,
                                                 attn_implementation=attn).to(device)
    compressed, report = load_compressed(tmp_path / "base", device=device, dtype=torch.bfloat16, progress=False,
                                         codec_options=CODEC if device == "cpu" else None,
                                         config_overrides={"_attn_implementation": attn})
    assert report.converted == len(compressed_weights(compressed)) > 0
    return dense, compressed, attn


@pytest.mark.parametrize(("arch", "attn"), MATRIX)
def test_compressed_training_equals_dense_and_round_trips(tmp_path, arch, attn):
    from transformers import AutoModelForCausalLM

    from neutrain.storage.manifest import write_manifest
    from neutrain.export.hf import export_hf, load_checkpoint_model
    from neutrain.nn import causal_lm_loss
    from neutrain.nn.checkpoint import save_compressed_checkpoint

    dense, compressed, attn = _dense_and_compressed(tmp_path, arch, attn)
    dense_params = sum(p.numel() for p in dense.parameters())
    dense_left = sum(p.numel() for p in compressed.parameters())
    assert dense_left < dense_params * 0.1, f"only {1 - dense_left / dense_params:.0%} of the weights compressed"
    start = _weights(dense)
    _assert_same_weights(_weights(compressed), start, "loaded weights")

    # neutrain's chunked loss has the model's own semantics (fp32 copy: the two differ only by rounding there).
    ids = _batches(1, seed=9)[0]
    ref = copy.deepcopy(dense).float().train()
    with torch.no_grad():
        expected = ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(causal_lm_loss(ref, ids, ids), expected, rtol=1e-5, atol=1e-5)
    del ref

    # Two fused steps: compressed == dense, bit for bit, and the weights did move.
    batches = _batches(3, seed=1)
    opt_dense, opt = _optimizer(dense), _optimizer(compressed)
    _train(dense, opt_dense, batches[:2])
    _train(compressed, opt, batches[:2])
    trained = _weights(dense)
    _assert_same_weights(_weights(compressed), trained, "after 2 steps")
    moved = sum(int((trained[k] != start[k]).sum()) for k in start)
    assert moved > sum(v.numel() for v in start.values()) // 2, "updates were rounded away"

    # Checkpoint, resume in a fresh model, third step: identical to the uninterrupted runs.
    save_compressed_checkpoint(compressed, tmp_path / "checkpoint", "neuzip-lossless")
    write_manifest(tmp_path / "checkpoint")
    opt_state = copy.deepcopy(opt.state_dict())
    resumed, _ = load_checkpoint_model(tmp_path / "checkpoint")
    resumed.config._attn_implementation = attn
    _assert_same_weights(_weights(resumed), trained, "resumed weights")
    opt_resumed = _optimizer(resumed)
    opt_resumed.load_state_dict(opt_state)
    for model, optimizer in ((dense, opt_dense), (compressed, opt), (resumed, opt_resumed)):
        _train(model, optimizer, batches[2:])
    final = _weights(dense)
    _assert_same_weights(_weights(compressed), final, "after 3 steps")
    _assert_same_weights(_weights(resumed), final, "resumed, after 3 steps")

    # Dense export: plain transformers reloads it with the trained model's logits.
    export_hf(compressed, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation=attn)
    assert exported.dtype == torch.bfloat16
    probe = _batches(1, seed=5)[0]
    logits = _logits(compressed, probe)
    assert torch.equal(_logits(exported, probe), logits)
    assert torch.equal(_logits(dense, probe), logits)


@pytest.mark.parametrize("arch", ["gemma3", "mixtral"])
def test_neuzip_export_keeps_scaled_embedding_and_expert_stacks(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    import neutrain  # noqa: F401  (registers the neuzip quantizer)
    from neutrain.export.neuzip import export_neuzip
    from neutrain.nn import compress_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.bfloat16)
    probe = _batches(1, seed=5)[0]
    expected = _logits(model, probe)
    compress_model(model, progress=False, codec_options=CODEC)
    assert torch.equal(_logits(model, probe), expected)
    export_neuzip(model, tmp_path / "neuzip")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "neuzip")
    assert torch.equal(_logits(reloaded, probe), expected)


@pytest.mark.parametrize("arch", ["gemma2", "qwen2_moe"])
def test_recipe_trains_resumes_and_exports(tmp_path, arch):
    """Through NeuTrainer: ``attn_implementation: auto``, NeuZip + AdaLomo, resume bit-exact, dense export."""
    from transformers import AutoModelForCausalLM

    from neutrain.trainer.callbacks import read_metrics
    from neutrain.config import load_recipe
    from neutrain.export.hf import export_hf
    from neutrain.cli.train import build_trainer
    from tests.helpers import write_recipe

    raw = {**COMMON, **ARCHITECTURES[arch]}
    for key in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id"):
        raw.pop(key)  # the byte tokenizer's
    recipe = load_recipe(write_recipe(
        tmp_path, model={"config": raw, "dtype": "bfloat16", "attn_implementation": "auto"},
        memory={"weights": "neuzip-lossless", "stochastic_rounding": True},
        train={"optimizer": "adalomo", "learning_rate": 1e-2, "max_steps": 4, "save_steps": 2,
               "lr_scheduler": "constant", "warmup_steps": 0},
        eval={"perplexity": False}, export={"format": "none"},
    ))
    ctx = build_trainer(recipe)
    model = ctx.trainer.model
    assert model.config._attn_implementation == ("eager" if arch == "gemma2" else "sdpa")
    assert not any(p.dim() == 3 for p in model.parameters()), "a dense expert stack is left"
    ctx.trainer.train()
    out = tmp_path / "out"
    losses = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    after = _weights(model)

    resumed = build_trainer(recipe)
    resumed.trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    again = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert [again[s] for s in (3, 4)] == [losses[s] for s in (3, 4)]
    _assert_same_weights(_weights(resumed.trainer.model), after, "resumed run")

    export_hf(model, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    probe = torch.randint(3, 200, (2, 10))
    model.config._attn_implementation = "eager"  # same kernels on both sides
    assert torch.equal(_logits(exported, probe), _logits(model, probe))


def _trained_through_recipe(tmp_path, base, weights, attn):
    from neutrain.cli.train import build_trainer
    from neutrain.config import load_recipe
    from tests.helpers import write_recipe

    recipe = load_recipe(write_recipe(
        tmp_path / weights, model={"init": "pretrained", "base_model": str(base), "tokenizer": None, "config": None,
                                   "dtype": "bfloat16", "attn_implementation": attn},
        memory={"weights": weights, "stochastic_rounding": False},
        train={"optimizer": "lomo", "learning_rate": 1e-3, "max_steps": 3, "save_steps": 100,
               "lr_scheduler": "constant", "warmup_steps": 0},
        eval={"perplexity": False}, export={"format": "none"},
    ))
    ctx = build_trainer(recipe)
    ctx.trainer.train()
    return _weights(ctx.trainer.model)


@pytest.mark.parametrize("arch", ["gemma3", "mixtral"])
def test_recipe_dense_and_compressed_train_the_same_model(tmp_path, arch):
    """Through the recipe path (LOMO, rounding off, ``attn_implementation: auto``) NeuZip lossless
    trains exactly the dense model. Gemma 3's soft-capped logits made the two drift when a dense model took
    transformers' own loss and a compressed one the chunked loss."""
    from transformers import AutoModelForCausalLM

    from neutrain.data import byte_tokenizer

    config, tokenizer = _config(arch), byte_tokenizer()
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    dense = _trained_through_recipe(tmp_path, tmp_path / "base", "dense", "auto")
    compressed = _trained_through_recipe(tmp_path, tmp_path / "base", "neuzip-lossless", "auto")
    _assert_same_weights(compressed, dense, f"{arch}, 3 LOMO steps")


SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", SDPA_BACKENDS)
@pytest.mark.parametrize("arch", [arch for arch in ARCHITECTURES if arch != "gemma2"])  # Gemma 2 has no SDPA
def test_compressed_training_equals_dense_under_each_sdpa_backend(tmp_path, monkeypatch, arch, backend):
    """On a GPU, each SDPA kernel (forced with ``sdpa_kernel``) sees the compressed model as it sees the dense one.

    A dense model trained twice first shows that the kernel's backward is itself reproducible, so a
    difference after that is the compressed path's. Junit for the H100 run:
    ``pytest -m gpu tests/integration/test_architectures.py -k sdpa_backend --junitxml
    $OUT/junit_sdpa_backends.xml``, folded into ``benchmarks/gpu_tests.jsonl`` by ``benchmarks/records.py add``.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    dense, compressed, attn = _dense_and_compressed(tmp_path, arch, "sdpa", device="cuda")
    twin = copy.deepcopy(dense)
    batches = [ids.cuda() for ids in _batches(3, seed=1)]
    try:
        with sdpa_kernel([getattr(SDPBackend, backend)]):  # only this kernel: a call it cannot serve raises
            for model in (dense, twin, compressed):
                _train(model, _optimizer(model), batches)
    except RuntimeError as exc:  # e.g. flash with a sliding-window mask, or GQA where the kernel has none
        if "No available kernel" not in str(exc):
            raise
        pytest.skip(f"{backend} cannot run {arch}'s attention calls: {str(exc).splitlines()[0]}")
    assert calls, "no SDPA call: the backend was not exercised"
    _assert_same_weights(_weights(twin), _weights(dense), f"{backend}: dense twice (the kernel itself)")
    _assert_same_weights(_weights(compressed), _weights(dense), f"{backend}: compressed vs dense")
