"""Tiny Llama models (fp32, CPU) and helpers shared by the eval tests."""

import torch
import transformers

from neutrain import compat


def tiny_llama(layers: int = 4, vocab: int = 97, heads: int = 4, kv_heads: int = 2, hidden: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=4096,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # Larger-than-default weights make attention peaked, so a wrong key or value changes the logits visibly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, prompt_len: int, cache) -> torch.Tensor:
    """Teacher-forced logits: prefill ``ids[:, :prompt_len]`` then feed the rest one token at a time."""
    kwarg = compat.cache_forward_kwarg(model)
    outs = [model(input_ids=ids[:, :prompt_len], use_cache=True, **{kwarg: cache}).logits]
    for i in range(prompt_len, ids.shape[1]):
        outs.append(model(input_ids=ids[:, i : i + 1], use_cache=True, **{kwarg: cache}).logits)
    return torch.cat(outs, dim=1)



class LiveBytes:
    """Bytes of the tensors created inside the block that are still alive, and their peak (CPU or GPU alike).

    A ``TorchDispatchMode`` sees every op's outputs: a new storage counts until the last tensor on it is
    collected; a view of a tensor made before the block counts nothing. What the CUDA caching allocator's
    ``max_memory_allocated`` measures on a GPU, for the CPU tests of the throughput part's batch sizing.

    Example:
        >>> with LiveBytes() as live:
        ...     a = torch.zeros(1000)       # 4,000 bytes
        ...     b = a + 1                   # 8,000 at the peak
        ...     del a
        >>> live.now, live.peak
        (4000, 8000)
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer._record(out, (args, kwargs))
                return out

        self._mode = _Mode()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors on it]
        self.now = self.peak = 0

    def _record(self, out, inputs) -> None:
        import weakref

        from torch.utils._pytree import tree_leaves

        given = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key:
                continue
            if key not in self.live:
                if key in given:  # a view (or in-place result) of a tensor made outside the block
                    continue
                self.live[key] = [storage.nbytes(), 0]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.live[key][1] += 1
            weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if not entry[1]:
                del self.live[key]
                self.now -= entry[0]

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
