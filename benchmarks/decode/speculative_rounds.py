"""Benchmark: one graph-replayed speculative round against the engine's autoregressive step.

Random-weight Llamas (so acceptance is near zero and says nothing): what this measures is the
*cost* of a round of ``generate(..., engine=True)`` (:mod:`neutrain.speculative.rounds`) beside
the cost of one token of :class:`~neutrain.decode.engine.DecodeEngine`'s graph-replayed
decode, and the split of a round into its device work (surgery, draft, verify), the one
device->host transfer, the host walk and the non-blocking hand-back. ``break_even_tokens`` is
how many tokens a round must commit (block efficiency) to beat autoregressive decoding.

At T = 1 the rounds of ``generate`` walk on the device (SD and SpecInfer,
:mod:`neutrain.speculative.device_walk`); the ``_graph_hostwalk`` rows run the same rounds with the
host walk (the original path) for comparison, and ``split_ms`` has ``device_walk_graph``: the walk
alone, captured in a graph.

    NEUTRAIN_GIT_COMMIT=... NEUTRAIN_GIT_DIRTY=0 python benchmarks/decode/speculative_rounds.py   # GPU
    python benchmarks/decode/speculative_rounds.py --tiny --out-dir /tmp/spec_rounds               # CPU smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import git_provenance, write_result
from benchmarks.decode._spec_decode import GOALS
from neutrain.compat.static_cache import (
    register_graph_generator,
    set_static_cache_length,
)
from neutrain.decode import DecodeEngine
from neutrain.speculative import generate
from neutrain.speculative.walk import walk

GEN = sys.modules["neutrain.speculative.generate"]  # the module (the package exports the function as ``generate``)


def llama(hidden, layers, heads, vocab, dtype, device, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), max_position_embeddings=4096,
                      eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).to(device).eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device, fn, repeat=1):
    sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeat


def graph_ms(device, fn, repeat=50, generators=()):
    """Milliseconds of one replay of ``fn`` captured alone (eager on CPU); ``generators`` it draws from
    must be registered with the graph."""
    if device.type != "cuda":
        return 1e3 * timed(device, fn, repeat)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        register_graph_generator(graph, generator)
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * timed(device, graph.replay, repeat)


def split(rounds, prompt, temperature, new):
    """Per-round milliseconds of each phase, from rounds replayed one phase at a time (a fresh start
    with as many rounds as fit the ``new`` tokens the caches have room for)."""
    n_rounds = max(new // (rounds.dl + 1), 1)
    rounds.start(prompt, temperature, temperature, seed=0)
    device, times = rounds.device, {"device_round": 0.0, "fetch": 0.0, "host_walk": 0.0, "commit": 0.0}
    paths = [[1 + k * rounds.dl + d for d in range(rounds.dl)] for k in range(rounds.k)]
    for _ in range(n_rounds):
        times["device_round"] += timed(device, rounds.launch)
        start = time.perf_counter()
        packed = rounds.fetch()
        times["fetch"] += time.perf_counter() - start
        start = time.perf_counter()
        tokens, target_out, draft_out = rounds.unpack(packed)
        rows = target_out.tolist() if temperature == 0 else GEN._law(target_out, temperature)
        q_row = None if temperature == 0 else GEN._law(draft_out, temperature)
        result = walk("sd" if rounds.k == 1 else "specinfer", tokens.tolist(), paths, rows, q_row, True, None)
        times["host_walk"] += time.perf_counter() - start
        times["commit"] += timed(device, lambda r=result: rounds.commit(r.chain, len(r.committed) - 1,
                                                                       r.committed[-1]))
    out = {name: 1e3 * t / n_rounds for name, t in times.items()}
    saved = rounds.n.clone()
    out["surgery_graph"] = graph_ms(device, lambda: (rounds._surgery(), rounds.n.copy_(saved)))
    width = rounds.k // len(rounds.drafts)
    out["draft_graph"] = graph_ms(device, lambda: [rounds._draft(e, slice(i * width, (i + 1) * width), rounds.n - 1)
                                                   for i, e in enumerate(rounds.drafts)],
                                   generators=[e.generator for e in rounds.drafts])
    out["verify_graph"] = graph_ms(device, lambda: (set_static_cache_length(rounds.target.cache, rounds.n - 1),
                                                    rounds._verify()))
    if temperature > 0:
        set_static_cache_length(rounds.target.cache, rounds.n - 1)
        logits, result = rounds._verify(), rounds.result.clone()
        out["device_walk_graph"] = graph_ms(device, lambda: rounds._walk(logits), generators=[rounds.walk_generator])
        rounds.result.copy_(result)
    return out


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test sizes")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    commit, dirty = git_provenance()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab, prompt_len, new = (32000, 64, 128) if not args.tiny else (64, 8, 16)
    target = llama(1024 if not args.tiny else 64, 16 if not args.tiny else 2, 16 if not args.tiny else 4, vocab,
                   dtype, device, 0)
    draft = llama(256 if not args.tiny else 32, 4 if not args.tiny else 1, 4, vocab, dtype, device, 1)
    prompt = torch.randint(1, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    engine = DecodeEngine(target, max_len=prompt_len + new + 1)
    engine.generate(prompt, new)  # capture
    ar_ms = 1e3 * timed(device, lambda: engine.generate(prompt, new), 3) / new
    rows = {"engine_ar_ms_per_token": ar_ms}
    for k, dl, temperature in [(1, 4, 0.0), (2, 4, 0.0), (1, 4, 1.0), (2, 4, 1.0)]:
        kw = {"num_drafts": k, "draft_len": dl, "temperature": temperature, "max_new_tokens": new}
        variants = [(True, True), (True, False), (False, True)] if temperature > 0 else [(True, True), (False, True)]
        for graphs, device_walk in variants:  # (CUDA graphs, the walk on the device at T > 0)
            if not graphs and device.type != "cuda":
                continue  # every CPU round is eager: the row would only repeat the first one
            device_schemes = GEN.DEVICE_SCHEMES
            GEN.DEVICE_SCHEMES = device_schemes if device_walk else ()
            try:
                generate(target, draft, prompt, engine=True, **kw)  # capture (or build) the rounds
                rounds = GEN._ROUNDS[target]
                rounds.use_graph = graphs and device.type == "cuda"
                holder = {}
                sec = timed(device, lambda h=holder, a=kw: h.update(out=generate(target, draft, prompt, engine=True, **a)))
            finally:
                GEN.DEVICE_SCHEMES = device_schemes
            stats = holder["out"].stats
            round_ms = 1e3 * sec / stats.target_calls
            name = f"K{k}_L{dl}_T{temperature:g}_{'graph' if rounds.use_graph else 'eager'}"
            name += "" if device_walk or temperature == 0 else "_hostwalk"
            rows[name] = {"round_ms": round_ms, "ms_per_token": 1e3 * sec / stats.committed_tokens,
                          "block_efficiency": stats.block_efficiency, "break_even_tokens": round_ms / ar_ms}
            if graphs and device_walk:  # a failing split must not cost the round timings above
                try:
                    rows[name]["split_ms"] = split(rounds, prompt, temperature, new)
                except RuntimeError as error:
                    rows[name]["split_error"] = repr(error)
            rounds.use_graph = device.type == "cuda"
        sec = timed(device, lambda h=holder, a=kw: h.update(out=generate(target, draft, prompt, engine=False, **a)))
        rows[f"K{k}_L{dl}_T{temperature:g}_dynamic"] = {"round_ms": 1e3 * sec / holder["out"].stats.target_calls}
    settings = {"target": "Llama hidden 1024 x 16 layers" if not args.tiny else "tiny", "draft": "hidden 256 x 4",
                "vocab": vocab, "prompt_len": prompt_len, "new_tokens": new, "dtype": str(dtype),
                "git_commit": commit, "git_dirty": dirty}
    # Random weights accept almost nothing, so none of the decode targets is measured here: they are named
    # without a value, and speculative.json (trained models) carries them.
    targets = {name: {"value": None, "goal": goal, "measured_in": "speculative.json"} for name, goal in GOALS.items()}
    path = write_result("speculative_rounds", settings, rows, args.out_dir, targets=targets,
                        targets_note="this benchmark measures a round's cost on random-weight models; "
                                     "the decode targets need trained models (speculative.json)")
    print(f"{'variant':28s} {'round ms':>9s} {'ms/token':>9s} {'break-even tok':>15s}")
    print(f"{'engine autoregressive':28s} {'':>9s} {ar_ms:9.3f}")
    for name, row in rows.items():
        if isinstance(row, dict):
            print(f"{name:28s} {row['round_ms']:9.3f} {row.get('ms_per_token', float('nan')):9.3f} "
                  f"{row.get('break_even_tokens', float('nan')):15.2f}  {row.get('split_ms', '')}")
    print("wrote", path)


if __name__ == "__main__":
    main()
