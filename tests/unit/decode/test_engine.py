"""DecodeEngine: Hugging Face's greedy decode token for token, exact sampling, no host synchronisation.

CPU tests run the engine eagerly (fp32, tiny Llama); the ``gpu`` tests run the CUDA-graph path and
``torch.cuda.set_sync_debug_mode("error")`` on the device machine.
"""

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.decode import engine as engine_module
from neutrain.decode.engine import DecodeEngine, sample_tokens
from neutrain.nn import compress_model
from tests.unit.speculative.test_generate import chi_square, chi_square_threshold


def tiny_llama(seed=0, attn="sdpa", vocab=48, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).to(device).eval()


def hf_greedy(model, prompt, new, **kw):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                              do_sample=False, pad_token_id=0, **kw)


PROMPTS = torch.tensor([[4, 9, 33, 2, 17], [40, 1, 8, 8, 30]])


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_equals_hf_greedy(attn, batch):
    model = tiny_llama(attn=attn)
    prompt = PROMPTS[:batch]
    reference = hf_greedy(model, prompt, 40)
    out = DecodeEngine(model, max_len=48, batch=batch).generate(prompt, max_new_tokens=40)
    assert torch.equal(out, reference)


@pytest.mark.slow
def test_engine_is_reusable_and_steps_one_token_at_a_time():
    model = tiny_llama(1)
    engine = DecodeEngine(model, max_len=32)
    for prompt in (PROMPTS[:1], PROMPTS[1:], PROMPTS[:1, :2]):  # a new prompt restarts the static cache
        reference = hf_greedy(model, prompt, 10)
        first = engine.prefill(prompt)
        tokens = [int(first[0])] + [int(engine.step()[0]) for _ in range(9)]
        assert tokens == reference[0, prompt.shape[1]:].tolist()
        assert engine.host_length == int(engine.length) == prompt.shape[1] + 9


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_eos_stops_rows_like_hf(batch):
    model = tiny_llama(2)
    prompts = PROMPTS[:batch]
    free = hf_greedy(model, PROMPTS, 30)[:, 5:]
    # An EOS that row 0 reaches early and row 1 later or never: rows end at different steps
    # (batch 2: row 0 is padded), or the only row ends and the output is cut (batch 1).
    eos = int(free[0, 3])
    ends = [row.index(eos) if eos in row else None for row in free.tolist()]
    assert ends[0] is not None and ends[0] != ends[1], ends
    reference = hf_greedy(model, prompts, 30, eos_token_id=eos)
    assert (reference.shape[1] == 5 + ends[0] + 1) == (batch == 1)
    for check_every in (1, 4, 64):
        out = DecodeEngine(model, max_len=40, batch=batch).generate(prompts, 30, eos_token_id=eos, check_every=check_every)
        assert torch.equal(out, reference), check_every


@pytest.mark.slow
def test_greedy_on_compressed_model_equals_dense_hf_greedy():
    dense = tiny_llama(3)
    compressed = tiny_llama(3)
    report = compress_model(compressed, progress=False)
    assert report.converted > 0 and type(compressed.lm_head).__name__ == "CompressedLinear"
    prompt = PROMPTS[:1]
    out = DecodeEngine(compressed, max_len=24).generate(prompt, max_new_tokens=12)
    assert torch.equal(out, hf_greedy(dense, prompt, 12))


def _draw_counts(model, prompt, rows, temperature, seed, forced=None):
    """Counts of the first sampled token (or, with ``forced``, of the token after it) over ``rows`` rows."""
    engine = DecodeEngine(model, max_len=8, batch=rows, seed=seed)
    drawn = engine.prefill(prompt.expand(rows, -1), temperature)
    if forced is not None:
        engine.tokens[:, prompt.shape[1]] = forced  # every row continues the same context
        drawn = engine.step()
    return torch.bincount(drawn, minlength=model.config.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("forced", [None, 5])
def test_sampling_follows_the_model_softmax(temperature, forced):
    model = tiny_llama(4, vocab=16)
    with torch.no_grad():  # sharpen the tiny model's near-uniform logits so that a wrong temperature shows
        model.lm_head.weight.mul_(8.0)
    prompt = torch.tensor([[3, 7, 1]])
    context = prompt if forced is None else torch.cat([prompt, torch.tensor([[forced]])], 1)
    with torch.no_grad():
        logits = model(context).logits[0, -1].double()
    rows = 4000
    counts = _draw_counts(model, prompt, rows, temperature, seed=11, forced=forced)
    probs = torch.softmax(logits / temperature, -1)
    stat, dof = chi_square(dict(enumerate(counts.tolist())), dict(enumerate(probs.tolist())), rows)
    assert stat < chi_square_threshold(dof), (stat, dof)
    # The test can fail: the same draws against the softmax at another temperature.
    wrong, _ = chi_square(dict(enumerate(counts.tolist())), dict(enumerate(torch.softmax(logits / (2 * temperature), -1).tolist())), rows)
    assert wrong > 3 * chi_square_threshold(dof)


@pytest.mark.slow
def test_sampling_is_reproducible_with_a_seed():
    model = tiny_llama(5)
    runs = [DecodeEngine(model, max_len=40, batch=2, seed=s).generate(PROMPTS, 30, temperature=1.0) for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_sample_tokens_greedy_and_temperature():
    logits = torch.tensor([[0.0, 5.0, -1.0], [2.0, 0.0, 1.0]])
    assert sample_tokens(logits, None, None).tolist() == [1, 0]
    gen = torch.Generator().manual_seed(0)
    cold = sample_tokens(logits.expand(200, 2, 3).reshape(400, 3), torch.tensor(1e-3, dtype=torch.float64), gen)
    assert cold.view(200, 2).eq(torch.tensor([1, 0])).all()  # T -> 0 is greedy


_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.slow
def test_generate_reads_nothing_back_but_the_allowed_syncs(monkeypatch):
    """CPU stand-in for the sync-debug test: any read of a tensor's value on the host outside
    ``allowed_sync`` fails (indexing with Python ints stays allowed; it reads no tensor)."""
    model = tiny_llama(6)
    engine = DecodeEngine(model, max_len=48)
    engine.generate(PROMPTS[:1], 4)  # first call: lazy initialisation in transformers may read values
    state = {"allowed": 0, "reads": []}
    original = engine_module.allowed_sync

    @contextlib.contextmanager
    def counting_allowed():
        state["allowed"] += 1
        with original():
            yield
        state["allowed"] -= 1

    def guard(name):
        real = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            if not state["allowed"]:
                state["reads"].append(name)
            return real(self, *a, **k)
        return read

    monkeypatch.setattr(engine_module, "allowed_sync", counting_allowed)
    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, guard(name))
    out = engine.generate(PROMPTS[:1], 40, eos_token_id=47, check_every=8)
    monkeypatch.undo()
    assert state["reads"] == [], state["reads"]
    assert out.shape[0] == 1
    # The guard does catch a host read (the test can fail).
    monkeypatch.setattr(torch.Tensor, "item", guard("item"))
    engine.length.item()
    assert state["reads"] == ["item"]


def test_bad_calls_say_what_is_wrong():
    model = tiny_llama(0)
    engine = DecodeEngine(model, max_len=8)
    with pytest.raises(RuntimeError, match="prefill"):
        engine.step()
    with pytest.raises(ValueError, match="max_len=8"):
        engine.generate(PROMPTS[:1], 4)
    with pytest.raises(ValueError, match="batch=1"):
        engine.prefill(PROMPTS)
    engine.prefill(PROMPTS[:1, :3])
    for _ in range(4):
        engine.step()
    with pytest.raises(ValueError, match="exceed max_len"):
        engine.step()


# --- GPU: the CUDA-graph path (run on the device machine) ---


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_equals_eager(dtype):
    model = tiny_llama(7, dtype=dtype, device="cuda")
    prompt = PROMPTS.cuda()
    eager = DecodeEngine(model, max_len=64, batch=2, cuda_graph=False).generate(prompt, 50)
    graphed = DecodeEngine(model, max_len=64, batch=2)
    assert graphed.use_graph
    assert torch.equal(graphed.generate(prompt, 50), eager)
    assert torch.equal(graphed.generate(prompt, 50), eager)  # replays of the captured graph on a new prompt
    if dtype == torch.float32:
        assert torch.equal(eager, hf_greedy(model, prompt, 50))


@pytest.mark.gpu
def test_cuda_graph_sampling_is_reproducible_and_follows_softmax():
    model = tiny_llama(8, device="cuda")
    prompt = PROMPTS.cuda()
    runs = [DecodeEngine(model, max_len=64, batch=2, seed=s).generate(prompt, 40, temperature=1.0) for s in (3, 3, 4)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    small = tiny_llama(9, vocab=16, device="cuda")
    with torch.no_grad():
        small.lm_head.weight.mul_(8.0)
    context = torch.tensor([[3, 7, 1, 5]], device="cuda")
    with torch.no_grad():
        probs = torch.softmax(small(context).logits[0, -1].double(), -1).cpu()
    counts = _draw_counts(small, context[:, :3], 4000, 1.0, seed=11, forced=5).cpu()  # step() runs the graph
    stat, dof = chi_square(dict(enumerate(counts.tolist())), dict(enumerate(probs.tolist())), 4000)
    assert stat < chi_square_threshold(dof), (stat, dof)


@pytest.mark.gpu
@pytest.mark.parametrize("compressed", [False, True])
def test_generate_makes_no_sync_but_the_allowed_ones(compressed):
    model = tiny_llama(10, dtype=torch.bfloat16, device="cuda")
    if compressed:
        compress_model(model, progress=False)
    engine = DecodeEngine(model, max_len=128)
    prompt = PROMPTS[:1].cuda()
    first = engine.generate(prompt, 100, eos_token_id=47, check_every=16)  # captures the graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            engine.length.item()  # the mode is on: an unannounced sync fails
        again = engine.generate(prompt, 100, eos_token_id=47, check_every=16)
        sampled = engine.generate(prompt, 100, temperature=1.0, eos_token_id=47, check_every=16)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(first, again) and sampled.shape[0] == 1


def test_static_cache_refusal_names_sliding_window_layers_and_allocates_nothing():
    from transformers import Gemma2Config

    from neutrain.compat.static_cache import static_cache_refusal

    gemma = AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=16))
    assert "StaticSlidingWindowLayer" in static_cache_refusal(gemma)
    with pytest.raises(ValueError, match="full-attention layers only"):
        DecodeEngine(gemma, max_len=8)
    llama = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    assert static_cache_refusal(llama) is None
