"""Whether a draft pays: the tokens a speculative round commits against what the round costs.

Plain decoding commits one token per target step. A speculative round runs ``draft_len`` draft steps and one
target forward that verifies every drafted token, and commits ``block_efficiency`` tokens on average. With a
draft step costing ``c`` target steps, a round costs about ``1 + draft_len * c`` target steps, and the draft
pays only when a round commits more tokens than that. ``c`` comes from the models' sizes: the weights one
decoded token multiplies (the decoder layers and the output head; the embedding lookup costs next to
nothing). The K rows of a draft step share one pass over its weights and count once.

Why: the quick start's draft is a quarter of a 4M-parameter target (its embedding and head are most of
it), so a round costs 2.77 target steps; at acceptance 0 it committed 1.0 token a round and
``neutrain generate --draft`` took 88 s where plain decoding took 42 s.
:class:`Probe` measures the first rounds and stops speculating when they do not pay; the output law is
unchanged, since every committed token is an exact sample from the target and plain decoding continues it.

Example:
    >>> pays(1.84, 2.77), pays(3.1, 2.77)
    (False, True)
"""

from __future__ import annotations

PROBE_ROUNDS = 8
"""Rounds measured before the verdict: enough to tell 1 token a round from 3, few enough to cost little."""


def decode_weights(model) -> int:
    """The weights one decoded token multiplies: the decoder layers' projections and the output head.

    Read from the config (the parameters of a NeuZip-compressed model are not its weights' count); a
    config without the usual fields falls back to every parameter.

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
        ...                       num_key_value_heads=1, vocab_size=4096)
        >>> decode_weights(SimpleNamespace(config=cfg))
        4063232
    """
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    try:
        hidden, layers, inner = int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.intermediate_size)
        heads, vocab = int(cfg.num_attention_heads), int(cfg.vocab_size)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return sum(p.numel() for p in model.parameters())
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim  # q and o; k and v
    return layers * (attention + 3 * hidden * inner) + vocab * hidden  # gated MLP; the output head


def round_cost(target, drafts, draft_len: int) -> float:
    """What one speculative round costs, in target steps: the verification plus ``draft_len`` steps of each draft.

    Example:
        >>> from types import SimpleNamespace
        >>> def model(layers):
        ...     return SimpleNamespace(config=SimpleNamespace(hidden_size=256, num_hidden_layers=layers,
        ...         intermediate_size=768, num_attention_heads=4, num_key_value_heads=1, vocab_size=4096))
        >>> round(round_cost(model(4), [model(1)], draft_len=4), 2)
        2.77
    """
    drafts = list(drafts) if isinstance(drafts, (list, tuple)) else [drafts]
    step = sum(decode_weights(d) for d in drafts) / max(decode_weights(target), 1)
    return 1.0 + draft_len * step


def pays(block_efficiency: float, cost: float) -> bool:
    """A draft pays when a round commits more tokens than the target steps it costs."""
    return block_efficiency > cost


class Probe:
    """``keep_going(stats)`` for :func:`neutrain.speculative.generate`: False once :data:`PROBE_ROUNDS` rounds
    have committed no more tokens a round than ``cost`` (:func:`round_cost`); True otherwise, and always after.

    Example:
        >>> from types import SimpleNamespace
        >>> probe = Probe(cost=2.77)
        >>> probe(SimpleNamespace(target_calls=8, block_efficiency=1.0)), probe.verdict
        (False, 'does not pay')
    """

    def __init__(self, cost: float, rounds: int = PROBE_ROUNDS):
        self.cost, self.rounds = cost, rounds
        self.verdict: str | None = None  # "pays" or "does not pay" once measured
        self.block_efficiency: float | None = None  # over the measured rounds

    def __call__(self, stats) -> bool:
        if self.verdict is None and stats.target_calls >= self.rounds:
            self.block_efficiency = stats.block_efficiency
            self.verdict = "pays" if pays(stats.block_efficiency, self.cost) else "does not pay"
        return self.verdict != "does not pay"

    def line(self, draft_len: int, acceptance: float) -> str:
        """The one line ``neutrain generate`` prints when it stops speculating."""
        return (f"[draft does not pay: over the first {self.rounds} rounds, acceptance {acceptance:.2f} and "
                f"{self.block_efficiency:.2f} tokens per target call, below the {self.cost:.2f} target steps a round of "
                f"{draft_len} draft steps costs; decoding without it]")
