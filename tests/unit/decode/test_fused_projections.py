"""Fused Q/K/V and gate/up projections in the decode engine: same logits, one GEMV per group, weights
held once, the model still trains and saves as before. CPU tests in fp32; ``gpu`` tests on the device."""

import copy

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from neutrain.compat.static_cache import static_cache_tensors
from neutrain.decode.engine import DecodeEngine
from neutrain.decode.fused_projections import (
    FusedMemberLinear,
    fuse_projections,
    projection_fusion,
    unfuse_projections,
)

PROMPT = torch.tensor([[4, 9, 33, 2, 17, 40, 1]])


def tiny(seed=0, family="llama", layers=2, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    cls, extra = (LlamaConfig, {}) if family == "llama" else (Qwen2Config, {"use_sliding_window": False})
    cfg = cls(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None, pad_token_id=0,
              **extra)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).to(device).eval()


def _decode_logits(engine, prompt, steps):
    """The engine's greedy tokens and the next-token logits after the prompt and after each step."""
    first = engine.prefill(prompt)
    tokens, logits = [int(first[0])], [engine.logits.clone()]
    for _ in range(steps):
        tokens.append(int(engine.step()[0]))
        logits.append(engine.logits.clone())
    return tokens, torch.stack(logits)


def _storage_bytes(model):
    """Bytes of the distinct storages behind the model's parameters (a shared storage counts once)."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


class _CountLinear(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is nn.functional.linear
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: Q/K/V with biases
def test_fused_engine_decodes_the_unfused_logits_and_tokens(family):
    plain, fused = tiny(1, family), tiny(1, family)
    reference = DecodeEngine(plain, max_len=48, fuse=False)
    fused.requires_grad_(False)  # a frozen model: the engine fuses by default
    engine = DecodeEngine(fused, max_len=48)
    assert reference.fused_groups == 0 and engine.fused_groups == 4  # 2 layers x (QKV, gate/up)
    want_tokens, want = _decode_logits(reference, PROMPT, 30)
    tokens, got = _decode_logits(engine, PROMPT, 30)
    assert tokens == want_tokens
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)  # fp32: the GEMM's summation order only


def test_a_fused_layer_runs_one_gemv_per_group():
    model = tiny(2, layers=3)
    counts = {}
    for fused in (False, True):
        if fused:
            fuse_projections(model)
        counter = _CountLinear()
        with torch.no_grad(), projection_fusion(model), counter:
            model(PROMPT)
        counts[fused] = counter.calls
    assert counts == {False: 3 * 7 + 1, True: 3 * 4 + 1}  # 7 linears a layer (+ lm_head) become 4


def test_fused_matrices_replace_the_weights_and_keep_parameters_and_state_dict():
    model = tiny(3)
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storage = _storage_bytes(model)
    assert fuse_projections(model) == 4
    assert _storage_bytes(model) == storage  # replaced, not duplicated
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[name] for name, p in model.named_parameters())  # an optimizer's references still hold
    attn = model.model.layers[0].self_attn
    base = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == base == attn.v_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.shape == (2 * 16, 64)  # GQA: 2 KV heads of 16
    assert fuse_projections(model) == 4 and _storage_bytes(model) == storage  # idempotent


@pytest.mark.slow
def test_training_after_fusion_matches_unfused_training_and_the_engine_sees_the_update():
    fused, plain = tiny(4), tiny(4)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (fused, plain)]  # built before the fusion
    assert DecodeEngine(fused, max_len=32).fused_groups == 0  # trainable: not fused unless asked
    engine = DecodeEngine(fused, max_len=32, fuse=True)
    engine.generate(PROMPT, 4)
    for model, opt in zip((fused, plain), optimizers):
        model.train()
        for _ in range(2):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name  # grads flow to the member views exactly as to separate weights
    tokens, got = _decode_logits(engine, PROMPT, 8)
    want_tokens, want = _decode_logits(DecodeEngine(plain, max_len=32, fuse=False), PROMPT, 8)
    assert tokens == want_tokens
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_save_pretrained_round_trip_after_fusion(tmp_path):
    model = tiny(5)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    got = loaded.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not any(isinstance(m, FusedMemberLinear) for m in loaded.modules())


def test_reallocated_weights_fall_back_then_fuse_again():
    model = tiny(6)
    fuse_projections(model)
    model.double()  # re-allocates every parameter: the groups' sharing is gone
    with torch.no_grad():
        want = model(PROMPT).logits
        counter = _CountLinear()
        with projection_fusion(model), counter:
            got = model(PROMPT).logits
    assert counter.calls == 2 * 7 + 1 and torch.equal(got, want)  # the separate GEMVs, on the current weights
    storage = _storage_bytes(model)
    assert fuse_projections(model) == 4 and _storage_bytes(model) == storage
    with torch.no_grad(), projection_fusion(model):
        torch.testing.assert_close(model(PROMPT).logits, want, atol=1e-12, rtol=1e-12)


def test_unfuse_gives_each_projection_its_own_storage():
    model = tiny(7)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    assert unfuse_projections(model) == 4
    attn = model.model.layers[1].self_attn
    assert type(attn.q_proj) is nn.Linear
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_hooked_projections_are_left_alone():
    hooked = tiny(8)
    hooked.model.layers[0].mlp.up_proj.register_forward_hook(lambda *a: None)
    assert fuse_projections(hooked) == 3  # the hooked layer's gate/up group stays as it was
    assert type(hooked.model.layers[0].mlp.gate_proj) is nn.Linear


# --- GPU: bf16 GEMMs and the CUDA-graph step ---


@pytest.mark.gpu
def test_cuda_graph_fused_engine_equals_unfused_and_adds_no_memory():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    plain = tiny(9, layers=4, device="cuda")
    fused = copy.deepcopy(plain)
    prompt = PROMPT.cuda()
    want_tokens, want = _decode_logits(DecodeEngine(plain, max_len=96, fuse=False), prompt, 60)
    torch.cuda.synchronize()
    weights_before = torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in fused.parameters())
    engine = DecodeEngine(fused, max_len=96, fuse=True)
    grown = torch.cuda.memory_allocated() - weights_before
    kv = sum(t.numel() * t.element_size() for pair in static_cache_tensors(engine.cache) for t in pair)
    assert grown < kv + 0.05 * weights, (grown, kv, weights)  # the fused matrices replaced the weights
    tokens, got = _decode_logits(engine, prompt, 60)
    assert engine.use_graph and tokens == want_tokens  # fp32: greedy identical
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # bf16: the fused GEMM sums in another order than the three separate ones, so the logits differ by
    # bf16 rounding: the fused engine's distance from the fp32 logits must be that of the unfused one
    # (at most twice it, + 1e-3), and the two within torch's bf16 tolerance (rtol 1.6e-2) + 1e-2.
    exact = tiny(10, layers=4, device="cuda")
    runs = [_decode_logits(DecodeEngine(exact, max_len=96, fuse=False), prompt, 8)]
    for fuse in (False, None):  # None: the default, which fuses a frozen model
        engine = DecodeEngine(copy.deepcopy(exact).bfloat16().requires_grad_(False), max_len=96, fuse=fuse)
        assert engine.fused_groups == (0 if fuse is False else 8)
        runs.append(_decode_logits(engine, prompt, 8))
    same = 0  # logits row j follows tokens[:j]: compare rows while the three decodes agree (a near tie may flip)
    while same < 8 and len({tuple(tokens[: same + 1]) for tokens, _ in runs}) == 1:
        same += 1
    ref, want, got = (logits[: same + 1] for _, logits in runs)
    unfused_err, fused_err = (want - ref).abs().max().item(), (got - ref).abs().max().item()
    assert fused_err <= 2 * unfused_err + 1e-3, (fused_err, unfused_err)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1.6e-2)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: Q/K/V with biases
def test_a_compressed_model_fuses_its_groups_and_decodes_the_dense_models_logits_bit_for_bit(family):
    """A compressed group decodes its members into one matrix and runs the dense model's fused product on it:
    the same logits, bit for bit, as the dense model in the engine (on a GPU the kernel depends on the shape,
    so an unfused compressed model would differ in the last bits)."""
    from neutrain.nn.convert import compress_model

    dense = tiny(3, family, dtype=torch.bfloat16)
    compressed = copy.deepcopy(dense)
    compress_model(compressed, progress=False)
    for model in (dense, compressed):
        model.requires_grad_(False)
    reference, engine = DecodeEngine(dense, max_len=48), DecodeEngine(compressed, max_len=48)
    assert reference.fused_groups == 4 and engine.fused_groups == 4
    want_tokens, want = _decode_logits(reference, PROMPT, 20)
    tokens, got = _decode_logits(engine, PROMPT, 20)
    assert tokens == want_tokens and torch.equal(got, want)
    # The fused path ran: one product a group (F.linear; an unfused compressed layer multiplies with mm).
    counter = _CountLinear()
    with torch.no_grad(), projection_fusion(compressed), counter:
        compressed(PROMPT)
    assert counter.calls == 4  # 2 layers x (QKV, gate/up)
    # One scratch matrix for every group, of the largest group's size (gate/up: 2 x 96 rows of 64).
    scratches = {m._neutrain_group.weight.data_ptr() for m in compressed.modules() if hasattr(m, "_neutrain_group")}
    assert len(scratches) == 1
    assert unfuse_projections(compressed) == 4 and DecodeEngine(compressed, max_len=48, fuse=False).fused_groups == 0
    assert torch.equal(_decode_logits(DecodeEngine(compressed, max_len=48, fuse=False), PROMPT, 20)[1], want)
