"""The host walk of one speculative round: verify the drafts' tokens against the target, depth by depth.

Both ways :func:`neutrain.speculative.generate` keeps its caches run this same code, which is why it
lives apart from either: the ``DynamicCache`` path walks a merged :class:`TokenTree`, the engine path
(:mod:`neutrain.speculative.rounds`) walks K independent chains of a fixed layout. All a walk needs
is, per draft ``k``, the tree node of its ``depth``-th token (``paths[k][depth]``), the target's
next-token law at every node, and the draft distributions.

From the root, the token-level scheme (:func:`verify_step`) runs on the next tokens of the drafts
that still match the committed prefix. Its output ``y`` is committed; drafts whose token equals ``y``
survive (also when ``y`` came from the residual: their continuations are still i.i.d. draft samples
given the prefix, docs/specdec.md §2.3). With no survivor the round ends; after a full draft a bonus
token is drawn from the target at the leaf. Temperature 0 commits the target's argmax at every node,
which is the target's greedy decode token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from neutrain.speculative.verify import sample_from, verify_step


@dataclass
class WalkResult:
    """What one walk committed.

    ``committed`` holds the accepted draft tokens and then one more (a residual draw, the
    correction, or the bonus token); ``accepted_nodes`` the tree nodes of the accepted tokens;
    ``chain`` a draft whose first ``len(committed) - 1`` tokens were accepted (0 if none were).
    """

    committed: list[int] = field(default_factory=list)
    accepted_nodes: list[int] = field(default_factory=list)
    chain: int = 0
    verified: int = 0
    accepted: int = 0


def walk(
    scheme: str,
    drafts: list[list[int]],
    paths: list[list[int]],
    target_rows: Callable[[int], torch.Tensor] | list[int],
    q_row: Callable[[int, int], torch.Tensor] | None,
    identical: bool,
    generator: torch.Generator | None,
    top_s: int = 5,
) -> WalkResult:
    """Walk the drafts from the root; returns what was committed.

    Args:
        scheme: the verification scheme (:data:`neutrain.speculative.verify.SCHEMES`).
        drafts: ``drafts[k]`` = draft k's tokens (all of one length).
        paths: ``paths[k][depth]`` = the tree node of ``drafts[k][depth]``; node 0 is the root.
        target_rows: at temperature 0 the target's argmax token at every node (a list); else a
            function from a node to the target's probabilities ``[V]`` after it.
        q_row: ``q_row(k, depth)`` = the distribution draft k sampled its ``depth``-th token from
            (None at temperature 0).
        identical: the drafts are i.i.d. samples of one draft model, so one ``q`` row serves every
            survivor (the schemes "spectr" and "importance" check that the rows agree).
        generator: the host generator of the acceptance coins.

    Example:
        >>> walk("sd", [[5, 6]], [[1, 2]], [5, 7, 1], None, True, None).committed  # greedy: 5 agrees, 6 != 7
        [5, 7]
    """
    greedy = isinstance(target_rows, list)
    result, node, depth, draft_len = WalkResult(), 0, 0, len(drafts[0])
    survivors = list(range(len(drafts)))
    while True:
        if depth >= draft_len:  # a full draft was accepted: bonus token from the leaf
            result.committed.append(target_rows[node] if greedy else sample_from(target_rows(node), generator))
            return result
        offered = [drafts[k][depth] for k in survivors]
        if greedy:
            y = target_rows[node]
            index = offered.index(y) if y in offered else None
        else:
            if identical:
                q = q_row(survivors[0], depth).expand(len(survivors), -1)
            else:
                q = torch.stack([q_row(k, depth) for k in survivors])
            step_scheme = "sd" if len(survivors) == 1 and scheme != "specinfer" else scheme
            y, index = verify_step(step_scheme, target_rows(node), q, offered, generator, top_s)
        result.verified += 1
        result.accepted += index is not None
        result.committed.append(y)
        survivors = [k for k in survivors if drafts[k][depth] == y]
        if not survivors:
            return result
        result.chain = survivors[0]
        node = paths[survivors[0]][depth]
        result.accepted_nodes.append(node)
        depth += 1
