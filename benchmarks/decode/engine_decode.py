"""Benchmark: the DecodeEngine's autoregressive decode at batch 1 against Hugging Face, and the HBM roofline.

One process, one GPU, the Llama-3-8B architecture with random N(0, 0.02) weights (the same seed for
every variant, so dense bf16 and NeuZip lossless hold the same numbers and must decode the same tokens):

* ``hf_generate``: ``model.generate`` (``DynamicCache``, eager), greedy, a fixed number of new tokens
  (dense weights only; ``inference.json`` has HF's decode on NeuZip weights);
* ``engine_eager``: :class:`~neutrain.decode.engine.DecodeEngine` without CUDA graphs;
* ``engine_graph``: the engine with one CUDA-graph replay per token (its default on a GPU), Q/K/V and
  gate/up fused into one GEMV each (:mod:`neutrain.decode.fused_projections`, the engine's default);
* ``engine_graph_unfused``: the same without the fusion (``fuse=False``: seven GEMVs a layer, as
  before the fusion). It runs after ``engine_graph`` on the same model, whose weights are then row blocks of the
  fused matrices: outside the engine's fusion context those are the plain separate GEMVs;
* ``engine_graph_compiled`` (and ``engine_graph_zgemv_compiled``): the row with its decoder layers compiled for the
  one-token step (``DecodeEngine(compile_layers=True)``, :mod:`neutrain.decode.compiled_layers`: RMSNorm, RoPE, SiLU
  and the residual adds fused by Inductor); the targets may take it, with its greedy agreement beside the figure;
* ``engine_graph_zgemv`` (NeuZip weights, CUDA): engine_graph with ``zgemv=True``: each compressed matrix
  converted once to the 12-bit zgemv layout (:mod:`neutrain.decode.zgemv`) and read by the GEMV that decodes it in
  registers, instead of decoding it to bf16 first; its row records the layout's bits per weight, and
  ``neuzip_lossless_over_bf16_decode`` takes the fastest of engine_graph and the zgemv rows (its ``method`` says which).
* ``engine_graph_zgemv_replace`` (NeuZip weights): the same with ``zgemv="replace"``, the serving mode: the layouts
  replace the NeuZip payloads (freed; a prefill decodes each matrix to bf16 from its layout). Beside tokens/s its
  row records ``zgemv_payload_bytes`` (what the payloads still hold, the layouts, how many weights are released),
  ``allocated_after_engine_gib`` (what the model and engine hold before decoding) and the peak allocated memory
  of the timed runs, to set beside dense's and engine_graph_zgemv's rows; the payloads are restored (exact,
  checksummed) after the row, and a failed restore is recorded as the row's ``detach_error``.

``gemv`` (CUDA, before the models): per Llama-3-8B decode shape ``(N, K)`` (fused and separate
projections, o_proj, down_proj, lm_head), the CUDA-event median of cuBLAS (``F.linear``) and of the
split-K Triton GEMV's configurations (:func:`choose_gemv`, each checked against the
fp32 reference first), the fastest per shape, and a step's GEMV time summed over its shapes with
cuBLAS and with the fastest of each. Where a Triton configuration won, ``engine_graph_gemv`` is the
engine_graph row with those shapes routed to it (``DecodeEngine(gemv=table)``), and
``ar_roofline_fraction_8b`` takes the faster of the two (its ``method`` says which).

Each engine row also has ``step_ms``: the median over ``repeats`` blocks of the CUDA-event time of the
``new_tokens - 1`` graph replays after a prefill, per step (no prefill, no host work in between).

Weights: dense bf16, NeuZip lossless and NeuZip lossy-3 (the lossless model re-rounded to 3 mantissa
bits, :func:`neutrain.nn.lora.compress_model_for_adapters`). ``--layers`` builds fewer decoder layers
when a call's time is short (recorded in the settings; the roofline is computed for the model built).
``--budget-s`` skips the variants left when the time is spent; a variant that fails records its error
and the others still run. ``benchmarks/decode/speculative.py`` runs this file in a subprocess for its 8B rows.

The roofline is the bytes one decode step must read (every weight but the input embedding, of
which one row is read, plus the KV cache of the context so far, averaged over the decode, plus the
logits: the lm_head's output and its fp32 copy, read by the sampler) over the bandwidth of a
device-to-device copy of 2 GiB measured in the same run (CUDA events, median of 20 after warm-up),
counting bytes read plus written. Targets (fixed names, ``benchmarks/decode/_spec_decode.py``'s ``ENGINE_TARGETS``):
``ar_roofline_fraction_8b`` = (bytes per token / ``step_ms`` of engine_graph, dense bf16) / copy
bandwidth, and ``neuzip_lossless_over_bf16_decode``. The JSON also gives the fraction from the whole
``generate``'s tokens/s (prefill included), and per engine the model's parameter bytes before and
after the engine was built (fusion must not add any) and memory three ways.

    NEUTRAIN_GIT_COMMIT=... NEUTRAIN_GIT_DIRTY=0 python benchmarks/decode/engine_decode.py   # GPU, 8B
    python benchmarks/decode/engine_decode.py --tiny --out-dir /tmp/engine_decode            # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import cuda_time_ms, git_provenance, write_result  # noqa: E402
from benchmarks.decode._spec_decode import GOALS  # noqa: E402  (the decode targets' names and goals)
from benchmarks.memory._train_peers import memory_row  # noqa: E402
from benchmarks.memory.train_memory import LLAMA3_8B, TINY  # noqa: E402  (the same 8B architecture)
from neutrain.nn.load import init_compressed  # noqa: E402
from neutrain.nn.lora import build_weights_for, compress_model_for_adapters  # noqa: E402
from neutrain.decode.engine import DecodeEngine  # noqa: E402
from neutrain.decode.gemv import gemv_reference, table_from, triton_gemv  # noqa: E402


def log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device, fn):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def copy_bandwidth(device, nbytes: int, warmup: int = 3, iters: int = 20) -> float:
    """Bytes read plus written per second by a device-to-device copy of ``nbytes`` (median of ``iters``
    CUDA-event timings after ``warmup`` copies; wall time on the CPU)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    secs = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            secs.append(start.elapsed_time(end) / 1e3)
        else:
            secs.append(timed(device, lambda: dst.copy_(src))[1])
    return 2 * nbytes / statistics.median(secs)  # the buffers are freed on return


def bytes_per_token(config, context: float, elem: int = 2) -> dict:
    """Bytes a decode step reads at ``context`` tokens (dense, ``elem`` bytes a value): ``weights``,
    ``kv``, ``logits`` (the lm_head's output and its fp32 copy, read by the sampler) and their ``total``."""
    h, inter, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 3 * h * inter + 2 * h
    weights = (layers * per_layer + h + vocab * h + h) * elem  # final norm, lm_head, one embedding row
    kv = 2 * layers * kv_heads * head_dim * context * elem
    logits = vocab * (elem + 4)
    return {"weights": weights, "kv": kv, "logits": logits, "total": weights + kv + logits}


def parameter_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's parameters and buffers (shared storage once)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def decode_shapes(config) -> dict[str, tuple[int, int]]:
    """The ``(N, K)`` of every linear of a batch-1 decode step, fused and separate."""
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"qkv_fused": (q + 2 * kv, h), "q": (q, h), "k_or_v": (kv, h), "o": (h, q), "gate_up_fused": (2 * inter, h),
            "gate_or_up": (inter, h), "down": (h, inter), "lm_head": (vocab, h)}


#: The Triton GEMV configurations tried per shape: (block_n, block_k, split).
CANDIDATES = tuple((bn, bk, s) for bn in (8, 16, 32) for bk in (256, 512) for s in (1, 2, 4))


def choose_gemv(shapes, dtype=torch.bfloat16, device="cuda", candidates=CANDIDATES, warmup: int = 5,
                iters: int = 30) -> list[dict]:
    """Per ``(N, K)``: the median CUDA-event time of ``F.linear`` (cuBLAS) and of every Triton candidate on
    random inputs, each checked against :func:`~neutrain.decode.gemv.gemv_reference` first; one row per shape
    with ``times_ms``, ``errors``, the ``best``, ``best_ms``, ``cublas_ms`` and the best's bytes read per second
    (:func:`~neutrain.decode.gemv.table_from` turns the rows into ``DecodeEngine(gemv=...)``'s table)."""
    rows = []
    for n, k in shapes:
        gen = torch.Generator(device=device).manual_seed(n * 7 + k)
        w = torch.randn(n, k, generator=gen, device=device).to(dtype)
        x = torch.randn(1, 1, k, generator=gen, device=device).to(dtype)
        want = gemv_reference(x, w).float()
        scale = want.abs().max().item()
        times = {"cublas": cuda_time_ms(lambda: torch.nn.functional.linear(x, w), warmup, iters)}
        errors = {}
        for config in candidates:
            f = triton_gemv(*config)
            name = "triton_n{}_k{}_s{}".format(*config)
            try:
                err = (f(x, w).float() - want).abs().max().item() / scale
                if err > 2e-2:  # a wrong result never wins
                    errors[name] = f"max relative error {err:.3g}"
                    continue
                times[name] = cuda_time_ms(lambda f=f: f(x, w), warmup, iters)
            except Exception as exc:  # a config that does not compile here is skipped, with the reason
                errors[name] = f"{type(exc).__name__}: {exc}"[:200]
        best = min(times, key=times.get)
        rows.append({"n": n, "k": k, "times_ms": times, "errors": errors, "best": best,
                     "best_ms": times[best], "cublas_ms": times["cublas"],
                     "best_bytes_per_s": n * k * w.element_size() / (times[best] / 1e3)})
        del w, x
    return rows


def gemv_table(config, dtype) -> dict:
    """Per decode shape the cuBLAS and Triton GEMV times (``choose_gemv``) and a fused step's GEMV sum both ways."""
    shapes = decode_shapes(config)
    rows = {name: row for name, row in zip(shapes, choose_gemv(list(shapes.values()), dtype=dtype))}
    per_step = {"qkv_fused": 1, "o": 1, "gate_up_fused": 1, "down": 1}
    layers = config.num_hidden_layers

    def step(key):
        return layers * sum(rows[name][key] * count for name, count in per_step.items()) + rows["lm_head"][key]

    return {"shapes": rows, "fused_step_gemv_ms_cublas": step("cublas_ms"), "fused_step_gemv_ms_best": step("best_ms")}


def step_ms(engine, prompt, new: int, repeats: int, device) -> float | None:
    """Median over ``repeats`` of the CUDA-event time per step of the ``new - 1`` steps after a prefill."""
    if device.type != "cuda":
        return None
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            engine.prefill(prompt)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(new - 1):
                engine.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / (new - 1))
    return statistics.median(times)


def build(config, weights: str, device, dtype):
    """The random-init model in ``weights`` form (dense, neuzip-lossless, neuzip-lossy-<k>), same seed for all."""
    model, _ = init_compressed(config, build_weights_for(weights), device, dtype=dtype, progress=False)
    if weights.startswith("neuzip-lossy"):
        compress_model_for_adapters(model, weights)  # the lossless matrices re-rounded, one at a time
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def free(device) -> None:
    gc.collect()  # transformers models hold reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_variant(model, prompt, new: int, repeats: int, methods: list[str], device,
                    gemv: dict | None = None) -> tuple[list[dict], dict]:
    """Rows (tokens/s, median over ``repeats`` timed runs after a warm-up) and the outputs, per method."""
    engines = {"engine_eager": dict(cuda_graph=False, fuse=True), "engine_graph": dict(fuse=True),
               "engine_graph_gemv": dict(fuse=True, gemv=gemv), "engine_graph_unfused": dict(fuse=False),
               "engine_graph_compiled": dict(fuse=True, compile_layers=True),
               "engine_graph_zgemv": dict(fuse=True, zgemv=True),
               "engine_graph_zgemv_compiled": dict(fuse=True, zgemv=True, compile_layers=True),
               "engine_graph_zgemv_replace": dict(fuse=True, zgemv="replace")}
    rows, outputs = [], {}
    for method in methods:
        engine, run, extra = None, None, {}
        try:
            if method in engines:
                before = parameter_bytes(model)
                engine = DecodeEngine(model, prompt.shape[1] + new, **engines[method])
                extra = {"fused_groups": engine.fused_groups, "parameter_bytes_before_engine": before,
                         "gemv_table": {f"{n}x{k}": c for (n, k), c in (gemv or {}).items()} if method == "engine_graph_gemv"
                         else None,
                         "parameter_bytes_after_engine": parameter_bytes(model)}
                if engine.zgemv_matrices:
                    from neutrain.decode.zgemv import zgemv_payload_bytes  # lazy: NeuZip rows only

                    layouts = [a.zw for a in model._neutrain_zgemv]
                    extra.update(zgemv_matrices=engine.zgemv_matrices, zgemv_bits_per_weight=8 * sum(
                        z.nbytes() for z in layouts) / sum(z.shape[0] * z.shape[1] for z in layouts),
                        zgemv_payload_bytes=zgemv_payload_bytes(model))
                if device.type == "cuda":
                    extra["allocated_after_engine_gib"] = torch.cuda.memory_allocated() / 2**30
                run = lambda e=engine: e.generate(prompt, new)  # noqa: E731
            else:
                run = lambda: model.generate(prompt, attention_mask=torch.ones_like(prompt),  # noqa: E731
                                             max_new_tokens=new, min_new_tokens=new, do_sample=False)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                out, _ = timed(device, run)  # warm-up (and, for engine_graph, the capture)
                secs = [timed(device, run)[1] for _ in range(repeats)]
            if engine is not None:
                extra["step_ms"] = step_ms(engine, prompt, new, repeats, device)
                if engine.gemv is not None:
                    extra["gemv_calls"] = engine.gemv.calls
            if device.type == "cuda":
                extra["memory"] = memory_row()
        except Exception as exc:  # record it, keep the other rows
            rows.append({"method": method, "error": f"{type(exc).__name__}: {exc}"[:400], **extra})
            log(rows[-1])
            continue
        finally:
            engine = run = None  # the engine's static cache and graph pool go before the next method's
            if method.startswith("engine_graph_zgemv"):
                from neutrain.decode.zgemv import detach_zgemv  # lazy: the row's layouts go with it

                try:
                    detach_zgemv(model)  # the replace row's payloads come back here, each checked by its checksum
                except Exception as exc:  # recorded with the row; the weights stay served, exact, by their layouts
                    extra["detach_error"] = f"{type(exc).__name__}: {exc}"[:400]
            free(device)
        outputs[method] = out.cpu()
        sec = statistics.median(secs)
        rows.append({"method": method, "tokens_per_s": new / sec, "ms_per_token": 1e3 * sec / new, "seconds": secs,
                     **extra})
        log(rows[-1])
    return rows, outputs


#: The dense rows the decode targets may take (the fastest wins; its ``method`` is recorded beside the figure).
DENSE_METHODS = ("engine_graph", "engine_graph_compiled", "engine_graph_gemv")
#: The NeuZip-lossless rows ``neuzip_lossless_over_bf16_decode`` may take.
LOSSLESS_METHODS = ("engine_graph", "engine_graph_zgemv", "engine_graph_zgemv_compiled", "engine_graph_zgemv_replace")


def _tps(rows, weights, method):
    return next((r["tokens_per_s"] for r in rows
                 if r.get("weights") == weights and r.get("method") == method and "tokens_per_s" in r), None)


def _step(rows, weights, method):
    return next((r["step_ms"] for r in rows
                 if r.get("weights") == weights and r.get("method") == method and r.get("step_ms")), None)


def decode_targets(rows, same, best_method, per_token, bandwidth, roofline, layers, new) -> dict:
    """The decode targets from the measured rows: ``ar_roofline_fraction_8b`` from the fastest dense step, and
    ``neuzip_lossless_over_bf16_decode`` as the fastest lossless row over the fastest dense row, so a technique
    that speeds both (compiled layers) is not credited to the compression."""
    targets = {}
    dense_methods = dict.fromkeys((best_method, *DENSE_METHODS))  # best_method: the CPU's engine_eager
    lossless_methods = dict.fromkeys((best_method, *LOSSLESS_METHODS))
    fastest = min((m for m in dense_methods if _step(rows, "dense", m)), key=lambda m: _step(rows, "dense", m),
                  default=None)
    if fastest:
        fastest_step = _step(rows, "dense", fastest)
        targets["ar_roofline_fraction_8b"] = {
            "value": per_token / (fastest_step / 1e3) / bandwidth, "goal": GOALS["ar_roofline_fraction_8b"],
            "method": fastest, "layers": layers, "step_ms": fastest_step,
            "greedy_tokens_equal_to_engine_graph": same.get(f"dense/{fastest}", new) if fastest != best_method
            else new,
            "from_generate_tokens_per_s": _tps(rows, "dense", fastest) / roofline if _tps(rows, "dense", fastest)
            else None}
    dense_method = max((m for m in dense_methods if _tps(rows, "dense", m)), key=lambda m: _tps(rows, "dense", m),
                       default=None)
    lossless_method = max((m for m in lossless_methods if _tps(rows, "neuzip-lossless", m)),
                          key=lambda m: _tps(rows, "neuzip-lossless", m), default=None)
    if dense_method and lossless_method:
        bits = next((r.get("zgemv_bits_per_weight") for r in rows if r.get("weights") == "neuzip-lossless"
                     and r.get("method") == lossless_method), None)
        targets["neuzip_lossless_over_bf16_decode"] = {
            "value": _tps(rows, "neuzip-lossless", lossless_method) / _tps(rows, "dense", dense_method),
            "goal": GOALS["neuzip_lossless_over_bf16_decode"], "method": lossless_method,
            "dense_method": dense_method, "bits_per_weight": bits}
    return targets


def retarget(path: str) -> dict:
    """Recompute the targets of a stored record from its rows with :func:`decode_targets` (the rows, settings and
    provenance stay as measured); the record says so in ``targets_recomputed``."""
    record = json.loads(Path(path).read_text())
    settings, results = record["settings"], record["results"]
    best = "engine_graph"
    targets = decode_targets(results["decode"], results.get(f"greedy_tokens_equal_to_dense_{best}", {}), best,
                             settings["bytes_per_token"], settings["copy_bandwidth_bytes_per_s"],
                             settings["roofline_tokens_per_s"], 32 if settings.get("layers") is None
                             else settings["layers"], settings["new_tokens"])
    record["targets"] = targets
    record["targets_recomputed"] = "by benchmarks/decode/engine_decode.py --retarget from the rows as measured"
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on any device (smoke test)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row after one warm-up run")
    parser.add_argument("--weights", default="dense,neuzip-lossless,neuzip-lossy-3")
    parser.add_argument("--methods", default=None,
                        help="comma list of engine_graph, engine_graph_compiled, engine_graph_zgemv, "
                             "engine_graph_zgemv_compiled, engine_graph_zgemv_replace, engine_eager, hf_generate "
                             "(default: all that apply; hf_generate on dense weights only)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the architecture's 32)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip the variants left after this many seconds")
    parser.add_argument("--skip-hf", action="store_true", help="leave out hf_generate (run for dense weights only)")
    parser.add_argument("--gemv", action=argparse.BooleanOptionalAction, default=None,
                        help="time cuBLAS against the Triton GEMV per decode shape (default: on CUDA, not --tiny)")
    parser.add_argument("--out-dir", default=None, help="where the JSON goes (default: a row of benchmarks/decode/results.jsonl)")
    parser.add_argument("--retarget", metavar="JSON", default=None,
                        help="recompute the targets of a stored engine_decode record from its rows, and exit")
    args = parser.parse_args(argv)
    if args.retarget:
        return retarget(args.retarget)
    git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    from transformers import LlamaConfig

    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arch = dict(TINY if args.tiny else LLAMA3_8B)
    if args.layers:
        arch["num_hidden_layers"] = args.layers
    config = LlamaConfig(**arch, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    config._attn_implementation = "sdpa"
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    new = args.new_tokens
    bandwidth = copy_bandwidth(device, 1 << (24 if args.tiny else 31))
    read = bytes_per_token(config, args.prompt_len + new / 2, elem=torch.finfo(dtype).bits // 8)
    per_token = read["total"]
    roofline = bandwidth / per_token
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written); {per_token / 1e9:.3f} GB per token "
        f"(weights {read['weights'] / 1e9:.3f}, KV {read['kv'] / 1e9:.4f}, logits {read['logits'] / 1e9:.5f}); "
        f"roofline {roofline:.0f} tok/s")
    default_methods = (["engine_graph", "engine_graph_compiled", "engine_graph_gemv", "engine_graph_zgemv",
                        "engine_graph_zgemv_compiled", "engine_graph_zgemv_replace", "engine_graph_unfused", "hf_generate"]
                       if device.type == "cuda" else ["engine_eager", "hf_generate"])
    methods = args.methods.split(",") if args.methods else default_methods
    if args.skip_hf:
        methods = [m for m in methods if m != "hf_generate"]

    rows, outputs, gemv = [], {}, {}
    if args.gemv if args.gemv is not None else (device.type == "cuda" and not args.tiny):
        try:
            gemv.update(gemv_table(config, dtype))
            log("gemv per shape:", {name: (row["best"], round(row["best_ms"], 4), round(row["cublas_ms"], 4))
                                    for name, row in gemv["shapes"].items()})
            log(f"a fused step's GEMVs: cuBLAS {gemv['fused_step_gemv_ms_cublas']:.3f} ms, "
                f"fastest per shape {gemv['fused_step_gemv_ms_best']:.3f} ms")
        except Exception as exc:  # the decode rows still run
            gemv["error"] = f"{type(exc).__name__}: {exc}"[:400]
            log("gemv:", gemv["error"])
        free(device)

    def record() -> dict:
        """Write the JSON from the rows so far (after every variant: a run killed later keeps them)."""
        best_method = "engine_graph" if device.type == "cuda" else "engine_eager"
        same = {}  # greedy agreement with dense (bf16 HF and the engine may differ after a near tie)
        reference = outputs.get(("dense", best_method))
        for key, out in outputs.items():
            if reference is not None and key != ("dense", best_method):
                agree = (out[0, args.prompt_len:] == reference[0, args.prompt_len:]).long()
                same["/".join(key)] = int(agree.cumprod(0).sum())  # tokens equal before the first difference
        log(f"tokens equal to dense {best_method} before the first difference:", same)

        full = not args.tiny and not args.layers
        targets = decode_targets(rows, same, best_method, per_token, bandwidth, roofline, config.num_hidden_layers, new)
        if args.tiny:  # a tiny model's step is all launch latency: no roofline figure
            targets.pop("ar_roofline_fraction_8b", None)
        dense = _tps(rows, "dense", best_method)
        dense_step = _step(rows, "dense", best_method)
        lossy = _tps(rows, "neuzip-lossy-3", best_method)
        ratios = {"neuzip_lossy3_over_bf16_decode": lossy / dense} if dense and lossy else {}
        unfused_step = _step(rows, "dense", "engine_graph_unfused")
        if dense_step and unfused_step:
            ratios["fused_step_speedup"] = unfused_step / dense_step
        settings = {**vars(args), "arch": "tiny" if args.tiny else ("llama3-8b" if full else
                    f"llama3-8b shapes, {config.num_hidden_layers} of 32 layers"), "dtype": str(dtype), "batch": 1,
                    "timing": f"median of {args.repeats} synchronized runs of the whole generate after one warm-up",
                    "copy_bandwidth_bytes_per_s": bandwidth, "copy_bytes": 1 << (24 if args.tiny else 31),
                    "bytes_per_token": per_token, "bytes_per_token_split": read, "roofline_tokens_per_s": roofline,
                    "total_seconds": time.perf_counter() - start}
        results = {"decode": rows, "ratios": ratios, f"greedy_tokens_equal_to_dense_{best_method}": same, "gemv": gemv}
        path = write_result("engine_decode" + ("_tiny" if args.tiny else ""), settings, results, args.out_dir,
                            targets=targets, targets_note=None if targets else "tiny smoke run: no goal applies")
        log("wrote", path)
        return {"settings": settings, "results": results, "targets": targets}

    for weights in args.weights.split(","):
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            rows.append({"weights": weights, "skipped": f"time budget of {args.budget_s:.0f} s spent"})
            log(rows[-1])
            continue
        built = time.perf_counter()
        try:
            model = build(config, weights, device, dtype)
        except Exception as exc:
            rows.append({"weights": weights, "error": f"build: {type(exc).__name__}: {exc}"[:400]})
            log(rows[-1])
            free(device)
            continue
        build_s = time.perf_counter() - built
        table = table_from(gemv.get("shapes", {}).values())
        chosen = [m for m in methods if (m != "hf_generate" or weights == "dense")  # HF on NeuZip: inference.json
                  and (m != "engine_graph_gemv" or (table and weights == "dense"))  # only where Triton won
                  and (m != "engine_graph_compiled" or weights == "dense")  # NeuZip's compiled row is the zgemv one
                  and (not m.startswith("engine_graph_zgemv") or weights.startswith("neuzip"))]
        variant_rows, variant_out = measure_variant(model, prompt, new, args.repeats, chosen, device, table)
        for row in variant_rows:
            row.update(weights=weights, build_s=build_s)
            if "tokens_per_s" in row:
                row["roofline_fraction"] = row["tokens_per_s"] / roofline
        rows += variant_rows
        outputs.update({(weights, m): out for m, out in variant_out.items()})
        del model
        free(device)
        record()

    final = record()
    for r in rows:
        if "tokens_per_s" in r:
            step_text = f"; step {r['step_ms']:.3f} ms = {per_token / (r['step_ms'] / 1e3) / bandwidth:.3f} of the copy" \
                if r.get("step_ms") else ""
            print(f"{r['weights']:>16} {r['method']:>20} {r['tokens_per_s']:8.1f} tok/s {r['roofline_fraction']:6.3f} of "
                  f"roofline{step_text}")
    return final


if __name__ == "__main__":
    main()
