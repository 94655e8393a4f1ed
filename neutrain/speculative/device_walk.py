"""The T > 0 walk of an engine round on the device, for SD and SpecInfer: no host decision inside a round.

The host walk (:mod:`neutrain.speculative.walk`) needs the round's fp32 logits on the host (one
large copy) and then spends about 1.4 ms per round in float64 softmaxes and residual draws
(``benchmarks/decode/NOTES.md``). Here the same walk runs on the device with fixed shapes and
no host value, so it is recorded in the round's CUDA graph and the host fetches only its outcome.

The walk over K chains of ``draft_len`` tokens (the fixed layout of :mod:`neutrain.speculative.rounds`:
node 0 is the root, node ``1 + k * draft_len + d`` chain k's token at depth d) goes depth by depth:

* ``p`` = the target's law at the current node; the surviving chains (all at depth 0) offer their
  tokens ``x_k``, tried in a uniformly random order that ignores their values (SpecInfer; K = 1 is SD);
* trial i accepts ``x_i`` with probability ``min(1, C_{i-1}(x_i) / q_i(x_i))``, where ``C_0 = p`` and
  a rejected trial leaves ``C_i = norm((C_{i-1} - q_i)^+)`` (``C_{i-1}`` when that has no mass). The
  residuals do not depend on the coins, so all K are computed first and the coins only pick the first
  accepting trial; with none, the output is drawn from ``C_K``;
* the chains whose token equals the output survive (also after a residual draw, as on the host); the
  walk reads the next law at the first survivor's node, and with no survivor the round ends;
* after a full chain a bonus token is drawn from the target at its leaf.

With one draft model the K chains are i.i.d. (``identical``): every trial uses the first survivor's
draft row, as the host walk does. All probabilities are float64 softmaxes of the same fp32 logits the
host would get; the draws use the exponential race ``argmax(C / E)``, ``E ~ Exp(1)``, and uniform
coins from the round's seeded generator. The exactness tests (``tests/unit/speculative``) check the
law of the committed tokens against the target, on the CPU and on the GPU.
"""

from __future__ import annotations

import torch

#: Schemes whose walk runs on the device (the others keep the host walk).
DEVICE_SCHEMES = ("sd", "specinfer")


def _first(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True of a 1-D mask (0 when there is none), as a 0-d device tensor."""
    k = mask.numel()
    return (mask.long() * torch.arange(k, 0, -1, device=mask.device)).argmax()


def _race(dist: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from the categorical ``dist`` (``[V]``, unnormalised is fine) by the exponential race."""
    e = torch.empty_like(dist).exponential_(generator=generator)
    return (dist / e).argmax()


def device_walk(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, identical: bool,
                generator: torch.Generator | None) -> torch.Tensor:
    """Walk K drafted chains against the target on the device; returns ``[draft_len + 5]`` int64:
    the committed tokens (``draft_len + 1`` slots, the first ``count`` valid), then ``count``,
    ``chain`` (a chain whose first ``count - 1`` tokens were accepted), ``verified`` and ``accepted``.

    Args:
        p: the target's laws ``[1 + K * draft_len, V]`` (float64) at the nodes of the fixed layout.
        q: the laws ``[K, draft_len, V]`` (float64) each chain's tokens were drawn from.
        tokens: the drafted tokens ``[K, draft_len]``.
        identical: the chains are i.i.d. draws of one draft model (trials use the first survivor's row).
        generator: the source of the coins and draws (on the tensors' device).

    Example:
        >>> import torch
        >>> p = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)  # root, then the one node
        >>> q = torch.tensor([[[0.0, 1.0]]], dtype=torch.float64)
        >>> device_walk(p, q, torch.tensor([[1]]), True, None).tolist()  # accepts 1, then the bonus 0
        [1, 0, 2, 0, 1, 1]
    """
    k, dl = tokens.shape
    device = tokens.device
    long = dict(dtype=torch.long, device=device)
    alive = torch.ones(k, dtype=torch.bool, device=device)
    done = torch.zeros((), dtype=torch.bool, device=device)
    node, chain = torch.zeros((), **long), torch.zeros((), **long)
    count, verified, accepted = (torch.zeros((), **long) for _ in range(3))
    committed = torch.zeros(dl + 1, **long)
    for d in range(dl):
        live = ~done
        order = torch.rand(k, generator=generator, dtype=torch.float64, device=device).argsort()
        rows = q[:, d]
        if identical:
            rows = rows.index_select(0, _first(alive).view(1)).expand(k, -1)
        rows = rows.index_select(0, order)
        offered = tokens[:, d].index_select(0, order)
        trying = alive.index_select(0, order)
        residuals = [p.index_select(0, node.view(1))[0]]  # C_0 .. C_K
        for i in range(k):
            left = (residuals[-1] - rows[i]).clamp_min(0.0)
            mass = left.sum()
            shrunk = torch.where(mass > 0, left / mass.clamp_min(torch.finfo(torch.float64).tiny), residuals[-1])
            residuals.append(torch.where(trying[i], shrunk, residuals[-1]))  # a dead chain's trial is skipped
        before = torch.stack(residuals[:-1])  # the law trial i compares with
        p_x = before.gather(1, offered.view(k, 1))[:, 0]
        q_x = rows.gather(1, offered.view(k, 1))[:, 0]
        chance = torch.where(p_x <= 0, 0.0, torch.where(q_x <= p_x, 1.0, p_x / q_x.clamp_min(torch.finfo(torch.float64).tiny)))
        coins = torch.rand(k, generator=generator, dtype=torch.float64, device=device)
        takes = trying & (coins < chance)
        took = takes.any()
        y = torch.where(took, offered.index_select(0, _first(takes).view(1))[0], _race(residuals[-1], generator))
        committed[d] = torch.where(live, y, committed[d])
        count += live.long()
        verified += live.long()
        accepted += (live & took).long()
        alive = alive & (tokens[:, d] == y) & live
        survived = alive.any()
        lead = _first(alive)
        chain = torch.where(survived, lead, chain)
        node = torch.where(survived, 1 + lead * dl + d, node)
        done = done | ~survived
    live = ~done
    bonus = _race(p.index_select(0, node.view(1))[0], generator)
    committed[dl] = torch.where(live, bonus, committed[dl])
    count += live.long()
    return torch.cat([committed, torch.stack([count, chain, verified, accepted])])
