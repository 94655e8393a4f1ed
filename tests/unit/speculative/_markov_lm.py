"""A tiny causal LM whose next-token law is a fixed table of (previous, current) token.

It reads its context the way attention does: a query may look only at keys its
mask allows (a 4D additive mask, or causal when none is given), and it finds
its previous token as the allowed key at ``position - 1``. Its cache is a real
``DynamicCache`` holding token ids as keys and positions as values, so tree
masks, position ids and cache compaction are all exercised, while the
probability of any continuation is a product of table entries.
"""

import itertools

import torch
from transformers import DynamicCache


class MarkovLM(torch.nn.Module):
    def __init__(self, vocab: int, seed: int, sharpness: float = 1.5):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        # Row `vocab` of the first index is "no previous token" (position 0).
        self.table = torch.nn.Parameter(sharpness * torch.randn(vocab + 1, vocab, vocab, generator=gen), requires_grad=False)
        self.vocab = vocab

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True, **_):
        batch, length = input_ids.shape
        cache = past_key_values if past_key_values is not None else DynamicCache()
        past = cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(past, past + length)[None].expand(batch, -1)
        position_ids = position_ids.expand(batch, -1)
        tokens, positions = cache.update(
            input_ids[:, None, :, None].float(), position_ids[:, None, :, None].float(), 0
        )
        tokens, positions = tokens[:, 0, :, 0].long(), positions[:, 0, :, 0].long()
        if attention_mask is not None and attention_mask.dim() == 4:
            allowed = attention_mask[:, 0] == 0
        else:
            allowed = torch.ones(length, past + length, dtype=torch.bool).tril(past)[None]
        allowed = allowed.expand(batch, -1, -1)
        parent = allowed & (positions[:, None, :] == position_ids[:, :, None] - 1)
        has_parent = parent.any(-1)
        assert bool((parent.sum(-1) <= 1).all()), "two keys claim the previous position"
        assert bool((has_parent | (position_ids == 0)).all()), "previous token not visible"
        prev = torch.where(has_parent, (parent.long() * tokens[:, None, :]).sum(-1), torch.full_like(input_ids, self.vocab))
        logits = self.table[prev, input_ids]
        return type("Out", (), {"logits": logits, "past_key_values": cache})()

    def sequence_probs(self, prompt: list[int], steps: int, temperature: float = 1.0) -> dict[tuple, float]:
        """Exact probability of every continuation of ``steps`` tokens."""
        out = {}
        for cont in itertools.product(range(self.vocab), repeat=steps):
            seq, prob = list(prompt), 1.0
            for tok in cont:
                prev = seq[-2] if len(seq) > 1 else self.vocab
                prob *= float(torch.softmax(self.table[prev, seq[-1]].double() / temperature, -1)[tok])
                seq.append(tok)
            out[cont] = prob
        return out
