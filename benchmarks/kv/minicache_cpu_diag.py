"""MiniCache on a real model, layer by layer, on CPU: is the loss the method or the code?

For one prompt of the real-model benchmark's task (SmolLM2-135M-Instruct, its own tokenizer), prefilled
once with a full ``DynamicCache`` and once with ``MiniCache`` (the paper's settings: pairs (l, l+1) from
L/2, SLERP t=0.6, per-token norms kept, gamma=0.05 distinct retention; keys post-RoPE, as cached):

* ``adjacent``: per adjacent layer pair, the mean over tokens of the cosine between the two layers'
  per-token key (and value) vectors, all KV heads side by side (the paper's Fig. 1a measure), and
  ``pre_rope_keys`` the same on the k_proj outputs (hooks, not the cache: an independent check that
  RoPE does not change it, as it must not: both layers rotate a position by the same angle);
* ``merged``: per merged layer, the relative error ||restored - full|| / ||full|| of its keys and values as
  the cache restores them (``_MergedStream.read``), the same computed from the closed form
  (direction at angle t*Omega from layer l-1: error^2 = 2 - 2 cos(t Omega) for l-1, 2 - 2 cos((1-t) Omega)
  for l, outside the retained rows), and the relative error of the layer's attention output for the
  next token's query (the full run's query, so each layer's error is its own, not propagated);
* ``next_token``: whether the first answer token (greedy) survives, full vs MiniCache.

Writes the ``<--name>`` row of ``benchmarks/kv/results.jsonl`` (``write_result``: commit, settings, and the KV targets
by name, none of which this study measures).

Usage:
    PYTHONPATH=. python benchmarks/kv/minicache_cpu_diag.py [--len 512] [--start-layer 15] [--t 0.6] [--gamma 0.05]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import write_result  # noqa: E402
from benchmarks.kv._kv_targets import targets_of_a_study  # noqa: E402

from neutrain.eval.kv import MiniCache  # noqa: E402
from neutrain.eval.kv.minicache import per_token  # noqa: E402



def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a - b).norm() / b.norm().clamp_min(1e-30)), 4)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float(torch.nn.functional.cosine_similarity(per_token(a), per_token(b), dim=-1).mean()), 4)


@torch.inference_mode()
def diagnose(model, ids: torch.Tensor, start_layer=None, t=0.6, gamma=0.05) -> dict:
    layers = model.model.layers
    captured: dict[int, dict] = {}

    def pre_hook(i):
        def hook(module, args, kwargs):
            captured.setdefault(i, {})["hidden"] = kwargs["hidden_states"]
            captured[i]["rope"] = kwargs["position_embeddings"]
        return hook

    def kproj_hook(i):
        def hook(module, args, out):
            captured.setdefault(i, {})["k_pre"] = out
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.self_attn.k_proj.register_forward_hook(kproj_hook(i)) for i, layer in enumerate(layers)]
    prompt, last = ids[:, :-1], ids[:, -1:]
    try:
        full = DynamicCache(config=model.config)
        model(prompt, past_key_values=full, use_cache=True)
        cfg = model.config
        kvh, hd = cfg.num_key_value_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
        k_pre = [captured[i]["k_pre"].view(1, -1, kvh, hd).transpose(1, 2).float() for i in range(len(layers))]
        # the next token's query per layer, from the full run
        logits_full = model(last, past_key_values=full, use_cache=True).logits[0, -1]
        queries = []
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            h = captured[i]["hidden"]
            q = attn.q_proj(h).view(1, 1, -1, hd).transpose(1, 2)
            cos, sin = captured[i]["rope"]
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            queries.append(q.float())
        mini = MiniCache(model.config, start_layer=start_layer, t=t, gamma=gamma, merge_every=None)
        model(prompt, past_key_values=mini, use_cache=True)
        logits_mini = model(last, past_key_values=mini, use_cache=True).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    n = prompt.shape[1]
    keys = [layer.keys[:, :, :n].float() for layer in full.layers]
    values = [layer.values[:, :, :n].float() for layer in full.layers]
    out = {"tokens": n, "start_layer": mini.start_layer, "t": t, "gamma": gamma, "adjacent": [], "merged": []}
    for i in range(len(keys) - 1):
        out["adjacent"].append({"layers": [i, i + 1], "keys": cosine(keys[i], keys[i + 1]),
                                "pre_rope_keys": cosine(k_pre[i], k_pre[i + 1]),
                                "values": cosine(values[i], values[i + 1])})
    groups = cfg.num_attention_heads // kvh
    for i, layer in enumerate(mini.layers):
        if layer.role == "exact":
            continue
        pair = layer.pair
        # restore each stream in the cache's own order (side 0 before side 1) over the prompt block
        restored = {}
        for name, stream in (("keys", pair.keys), ("values", pair.values)):
            saved = stream.residual
            stream.residual = [None, None]
            restored[name] = [stream.read(0)[:, :, :n].float(), stream.read(1)[:, :, :n].float()]
            stream.residual = saved
        side = layer.side
        k_hat, v_hat = restored["keys"][side], restored["values"][side]
        first = i - side
        omega_k = torch.arccos(torch.nn.functional.cosine_similarity(per_token(keys[first]), per_token(keys[first + 1]), dim=-1).clamp(-1, 1))
        angle = (t if side == 0 else 1 - t) * omega_k
        index = torch.cat(pair.keys.retained_index, dim=-1).long()
        kept = torch.zeros_like(omega_k, dtype=torch.bool)
        kept[index[0], index[1]] = True
        k2 = (per_token(keys[i]) ** 2).sum(-1)
        closed = math.sqrt(float(((2 - 2 * torch.cos(angle)) * k2 * ~kept).sum() / k2.sum()))
        q = queries[i]
        ref = torch.nn.functional.scaled_dot_product_attention(q, keys[i], values[i], enable_gqa=True)
        hat = torch.nn.functional.scaled_dot_product_attention(q, k_hat, v_hat, enable_gqa=True)
        out["merged"].append({"layer": i, "side": "l-1" if side == 0 else "l", "key_rel_error": rel(k_hat, keys[i]),
                              "key_rel_error_closed_form": round(closed, 4),
                              "value_rel_error": rel(v_hat, values[i]),
                              "retained_keys": int(index.shape[1]), "attention_output_rel_error": rel(hat, ref)})
    assert groups >= 1
    out["next_token"] = {"full": int(logits_full.argmax()), "minicache": int(logits_mini.argmax()),
                         "logit_rel_error": rel(logits_mini, logits_full)}
    out["stats"] = {k: v for k, v in mini.stats().items() if k in ("merges", "retained_tokens", "compression_ratio")}
    return out


def main():
    from neutrain.eval.real_model import load_smollm2
    from neutrain.eval.tasks import generate_task

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--start-layer", type=int, default=None)
    p.add_argument("--t", type=float, default=0.6)
    p.add_argument("--gamma", type=float, default=0.05)
    p.add_argument("--name", default="minicache_smollm2_layers", help="the record's name (its row in benchmarks/kv/results.jsonl)")
    args = p.parse_args()
    model, tok = load_smollm2()
    sample = generate_task("niah_single", tok, args.len, 1, seed=42)[0]
    ids = tok(sample.prompt + " " + sample.answers[0], return_tensors="pt", add_special_tokens=False).input_ids
    # the prompt plus the first answer token: its query is the one the diagnosis uses
    ids = ids[:, : tok(sample.prompt, return_tensors="pt", add_special_tokens=False).input_ids.shape[1] + 1]
    res = diagnose(model, ids, args.start_layer, args.t, args.gamma)
    print("pair      cos K (cached)  cos K (k_proj)  cos V")
    for a in res["adjacent"]:
        print(f"{a['layers']!s:9} {a['keys']:>14} {a['pre_rope_keys']:>15} {a['values']:>6}")
    print("layer side  K err  K err (closed form)  V err  attn-out err  retained")
    for m in res["merged"]:
        print(f"{m['layer']:5} {m['side']:4} {m['key_rel_error']:6} {m['key_rel_error_closed_form']:20} "
              f"{m['value_rel_error']:6} {m['attention_output_rel_error']:13} {m['retained_keys']:9}")
    print("next token", res["next_token"], res["stats"])
    settings = {"model": "SmolLM2-135M-Instruct", "task": "niah_single", "seed": 42, "tokens": args.len,
                "start_layer": args.start_layer, "t": args.t, "gamma": args.gamma, "device": "cpu"}
    targets = targets_of_a_study({}, "this study measures per-layer restore and attention errors, not accuracy")
    print("wrote", write_result(args.name, settings, res, targets=targets))


if __name__ == "__main__":
    main()
