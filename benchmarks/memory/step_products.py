"""Which matrix products one training step issues: compressed (variant d) against dense (variant c).

Builds the two variants as ``benchmarks/memory/train_memory.py`` does (dense: ``from_config`` on the device;
compressed: ``init_compressed``; activation checkpointing on, non-reentrant; fused LOMO, lr 1e-4,
``max_grad_norm`` 1.0, ``--clip-mode`` as there), warms up two steps, then counts every aten matrix
product of one step with a ``TorchDispatchMode``: op, operand shapes and layouts (N: row-major,
T: a transposed view), phase (forward, checkpoint recompute, backward) and what it is (the projection,
identified by its weight's shape; the lm_head chunk's logits, dH, dW), plus the decodes of each
compressed weight. Prints the table of products by kind, dense count, compressed count.

    python benchmarks/memory/step_products.py                       # tiny Llama on the CPU (a minute)
    python benchmarks/memory/step_products.py --full --device cuda  # Llama-3-8B shapes, seq 1024, batch 8

Decodes: on the CPU the decoded weights are kept between uses by default; ``NEUTRAIN_KEEP_DECODED_MIB=0``
decodes as a GPU does (shared slots, :mod:`neutrain.nn.buffers`). The lm_head and embedding are read
by row blocks, which the per-weight decode counter does not count.

The tiny default scales the loss's vocabulary chunk and the optimizer's update chunk so that the
lm_head is walked in 8 chunks of 128 rows with update blocks of 256 (Llama-3-8B at batch 8 x 1024:
63 chunks of 2,048 rows, blocks of 4,096); ``--full`` keeps the library's defaults.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm", "mv", "addmv", "dot",
            "_int_mm"}
TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def _layout(t) -> str:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        return "-"
    if t.is_contiguous():
        return "N"
    return "T" if t.stride(0) == 1 else "S"


class ProductCounter(TorchDispatchMode):
    """Records every matrix product: (phase, op, shapes, layouts, top neutrain frame)."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in PRODUCTS:
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            if name in ("addmm", "baddbmm", "addbmm"):
                mats = mats[-2:]
            frames = traceback.extract_stack()[:-1]
            files = [f.filename for f in frames]
            in_backward = torch._C._current_graph_task_id() != -1
            recompute = in_backward and any(f.endswith("torch/utils/checkpoint.py") for f in files)
            site = next((f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in reversed(frames)
                         if "/neutrain/" in f.filename), "autograd (C++)" if in_backward else "?")
            self.calls.append({"op": name, "shapes": [tuple(m.shape) for m in mats],
                               "layout": "".join(_layout(m) for m in mats),
                               "phase": "recompute" if recompute else "backward" if in_backward else "forward",
                               "site": site})
        return func(*args, **(kwargs or {}))


def _kind(call: dict, weights: dict[tuple, str], tokens: int, vocab: int) -> str:
    """What a product is: '<weight> fwd' (X W^T), '<weight> dX' (G W), '<weight> dW' (G^T X)."""
    if len(call["shapes"]) != 2:
        return "other"
    (m, k), (k2, n) = call["shapes"][0][-2:], call["shapes"][1][-2:]
    b_layout = call["layout"][1:2]
    if "linear_cross_entropy" in call["site"] and not call["site"].endswith("causal_lm_loss"):  # the chunked loss
        if m == tokens and k == weights.get("hidden"):
            return "lm_head chunk logits H.W_c^T"
        if m == tokens and n == weights.get("hidden"):
            return "lm_head chunk dH=G_c.W_c"
        if k == tokens and n == weights.get("hidden"):
            return "lm_head chunk dW_c=G_c^T.H"
    if m == tokens and (n, k) in weights and (b_layout == "T" or (k, n) not in weights):
        return f"{weights[(n, k)]} fwd X.W^T"
    if m == tokens and (k, n) in weights:
        return f"{weights[(k, n)]} dX=G.W"
    if k == tokens and (m, n) in weights:
        return f"{weights[(m, n)]} dW=G^T.X"
    return "other"


def build(variant: str, config_kwargs: dict, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**config_kwargs)
    config._attn_implementation = "sdpa"
    if variant == "c":
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        from neutrain.nn.load import init_compressed

        model, _ = init_compressed(config, "neuzip-lossless", device, dtype=torch.bfloat16, progress=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model, config


def one_variant(variant: str, args, config_kwargs: dict) -> dict:
    from neutrain.nn import causal_lm_loss, compressed_weights
    from neutrain.optim import optimizer_spec

    model, config = build(variant, config_kwargs, args.device)
    opt_kwargs = {"chunk_numel": args.chunk_numel} if args.chunk_numel else {}
    rule = optimizer_spec("lomo").resolve()
    opt = rule(model.parameters(), lr=1e-4, clip_mode=args.clip_mode, max_grad_norm=1.0, **opt_kwargs).bind(model)
    loss_kwargs = {"chunk_bytes": args.chunk_bytes} if args.chunk_bytes else {}
    gen = torch.Generator().manual_seed(1)

    def step():
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)
        opt.backward(causal_lm_loss(model, ids, ids, **loss_kwargs))
        opt.step()

    for _ in range(args.warmup):
        step()
    cws = compressed_weights(model) if variant != "c" else []
    before = {w.name: w.decodes for w in cws}
    counter = ProductCounter()
    with counter:
        step()
    decodes = {w.name: w.decodes - before[w.name] for w in cws}
    hidden = config.hidden_size
    shapes: dict = {"hidden": hidden}
    for name, mod in model.named_modules():
        if isinstance(getattr(mod, "weight", None), torch.Tensor) or hasattr(mod, "compressed"):
            shape = tuple(mod.compressed.shape) if hasattr(mod, "compressed") else tuple(mod.weight.shape)
            if len(shape) == 2 and "embed" not in name and "lm_head" not in name:
                short = name.rsplit(".", 1)[-1]
                shapes[shape] = shapes[shape] + "/" + short if shape in shapes and short not in shapes[shape] \
                    else shapes.get(shape, short)
    tokens = args.batch * args.seq
    for call in counter.calls:
        call["kind"] = _kind(call, shapes, tokens, config.vocab_size)
    del model, opt
    gc.collect()
    return {"calls": counter.calls, "decodes": decodes, "layers": config.num_hidden_layers}


def table(dense: dict, comp: dict) -> list[dict]:
    def key(c):
        return (c["kind"], c["phase"], c["op"], " x ".join(map(str, c["shapes"])), c["layout"])

    cd = collections.Counter(key(c) for c in dense["calls"])
    cc = collections.Counter(key(c) for c in comp["calls"])
    sites = collections.defaultdict(set)
    for tag, run in (("c", dense), ("d", comp)):
        for c in run["calls"]:
            sites[key(c)].add(f"{tag}: {c['site']}")
    rows = []
    for k in sorted(set(cd) | set(cc)):
        rows.append({"kind": k[0], "phase": k[1], "op": k[2], "shapes": k[3], "layout": k[4],
                     "dense": cd[k], "compressed": cc[k], "sites": sorted(sites[k])})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="Llama-3-8B shapes, seq 1024, batch 8, library chunks")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, help="decoder layers (default: 2 tiny, 32 full)")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--warmup", type=int, default=2, help="steps before the counted one (train_memory: 2)")
    ap.add_argument("--clip-mode", default="per_tensor", choices=("none", "per_tensor", "global_stale", "global_exact"))
    ap.add_argument("--chunk-bytes", type=int, help="the loss's fp32 chunk budget (default: scaled when tiny)")
    ap.add_argument("--chunk-numel", type=int, help="the optimizer's chunk (default: scaled when tiny)")
    ap.add_argument("--json", help="also write the rows and decode counts here")
    args = ap.parse_args()
    if args.full:
        from benchmarks.memory.train_memory import LLAMA3_8B

        cfg = dict(LLAMA3_8B)
        args.seq, args.batch = args.seq or 1024, args.batch or 8
    else:
        cfg = dict(TINY)
        args.seq, args.batch = args.seq or 64, args.batch or 3
        tokens = args.seq * args.batch
        args.chunk_bytes = args.chunk_bytes or 4 * tokens * 128  # 8 chunks of 128 rows
        args.chunk_numel = args.chunk_numel or 256 * cfg["hidden_size"]  # update blocks of 256 rows
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    comp = one_variant("d", args, cfg)
    dense = one_variant("c", args, cfg)
    rows = table(dense, comp)
    print(f"one step after {args.warmup} warm-up: {args.batch} x {args.seq} tokens, {cfg['num_hidden_layers']} layers, "
          f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}, clip {args.clip_mode}")
    print(f"{'product':34} {'phase':9} {'op':5} {'shapes':28} {'lay':3} {'dense':>5} {'comp':>5}  site")
    for r in rows:
        mark = "" if r["dense"] == r["compressed"] else "  <--"
        print(f"{r['kind']:34} {r['phase']:9} {r['op']:5} {r['shapes']:28} {r['layout']:3} {r['dense']:5} "
              f"{r['compressed']:5}{mark}  {'; '.join(r['sites'])}")
    n_c, n_d = len(dense["calls"]), len(comp["calls"])
    print(f"total products: dense {n_c}, compressed {n_d}, difference {n_d - n_c}")
    per = collections.Counter(comp["decodes"].values())
    print("decodes per compressed weight this step (count: weights):", dict(sorted(per.items())),
          "total", sum(comp["decodes"].values()))
    for name, n in comp["decodes"].items():
        if "layers.0." in name or "layers" not in name:
            print(f"  {name}: {n}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "decodes": comp["decodes"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
