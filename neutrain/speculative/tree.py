"""Token trees for verifying K draft sequences in one target forward.

The K drafts are merged into a prefix tree (equal prefixes share nodes). Node 0
is the last committed token, whose key/values are not cached yet; every other
node is one drafted token. The target sees the nodes in topological order with

* a 4D *additive* float mask ``[1, 1, N, past + N]``: 0 on every cached
  prefix column and on the node's ancestors-or-self, ``finfo.min`` elsewhere.
  transformers 5.x passes a rank-4 tensor through unchanged (docs/specdec.md §6.2),
  and an additive float mask works for both eager and SDPA attention;
* ``position_ids = past + depth``, so every node gets the rotary position it
  would have in a sequential decode.

Then ``logits[i]`` is the target's next-token distribution after the path to
node ``i``: it verifies ``i``'s children, and at a leaf it gives the bonus token.
"""

from __future__ import annotations

import torch

from neutrain.decode.engine import cache_kwargs


class TokenTree:
    """A prefix tree of drafted tokens rooted at the last committed token.

    Example:
        >>> tree = TokenTree(root_token=7)
        >>> tree.add_path([1, 2]), tree.add_path([1, 3])
        ([1, 2], [1, 3])
        >>> tree.tokens, tree.parents, tree.depths
        ([7, 1, 2, 3], [-1, 0, 1, 1], [0, 1, 2, 2])
    """

    def __init__(self, root_token: int):
        self.tokens = [int(root_token)]
        self.parents = [-1]
        self.depths = [0]
        self.children: list[dict[int, int]] = [{}]

    def __len__(self) -> int:
        return len(self.tokens)

    def add_path(self, tokens: list[int]) -> list[int]:
        """Insert a draft continuation of the root; returns its node ids, one per token."""
        node, nodes = 0, []
        for token in tokens:
            token = int(token)
            child = self.children[node].get(token)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.children.append({})
                self.children[node][token] = child
            node = child
            nodes.append(node)
        return nodes

    def ancestor_matrix(self) -> torch.Tensor:
        """``A[i, j] = True`` when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        allowed = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):  # parents come before children, so row parent is complete
            allowed[i] |= allowed[self.parents[i]]
        return allowed

    def attention_mask(self, past_length: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Additive mask ``[1, 1, N, past_length + N]`` (0 = attend, ``finfo.min`` = blocked)."""
        n = len(self.tokens)
        allowed = torch.cat([torch.ones(n, past_length, dtype=torch.bool), self.ancestor_matrix()], dim=1)
        mask = torch.zeros(n, past_length + n, dtype=dtype)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask.to(device)[None, None]

    def position_ids(self, past_length: int, device) -> torch.Tensor:
        """``past_length + depth`` for every node, shape ``[1, N]``."""
        return (torch.tensor(self.depths, dtype=torch.long) + past_length).to(device)[None]

    def input_ids(self, device) -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long, device=device)[None]


def tree_forward(model, tree: TokenTree, cache, past_length: int):
    """One forward of ``model`` over ``tree`` on top of ``cache``; returns logits ``[N, V]``."""
    device = next(model.parameters()).device
    # The mask must match the activations' dtype for SDPA; ``model.dtype`` (transformers) is the
    # compute dtype even when the first parameter is a compressed integer buffer.
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    out = model(
        input_ids=tree.input_ids(device),
        attention_mask=tree.attention_mask(past_length, dtype if dtype.is_floating_point else torch.float32, device),
        position_ids=tree.position_ids(past_length, device),
        use_cache=True,
        **cache_kwargs(model, cache),
    )
    return out.logits[0]

