"""Speculative decoding: exact multi-draft verification and tree decoding.

* :func:`verify_step` -- the single-position rule of each scheme ("sd",
  "specinfer", "spectr", "importance"), with :func:`output_distribution`,
  :func:`marginal_output` and :func:`acceptance_formula` for exact checks.
* :func:`generate` -- single- and multi-draft speculative sampling with one
  tree-masked target forward per round.
* ``generate(..., engine=True)`` runs its rounds on decode engines
  (:class:`neutrain.decode.DecodeEngine`, :mod:`neutrain.speculative.rounds`): one CUDA
  graph and one host synchronisation per round.

Drafts are trained by :mod:`neutrain.distill`.

Example:
    >>> import torch
    >>> from neutrain.speculative import verify_step
    >>> p = torch.tensor([0.6, 0.4], dtype=torch.float64)
    >>> verify_step("sd", p, p[None], [1])
    (1, 0)
"""

from neutrain.speculative.generate import SpeculativeOutput, SpeculativeStats, generate
from neutrain.speculative.selection import choose_rule, p_star
from neutrain.speculative.spectr import spectr_acceptance, spectr_rho
from neutrain.speculative.verify import (
    SCHEMES,
    acceptance_formula,
    marginal_output,
    output_distribution,
    verify_step,
)

__all__ = [
    "SCHEMES",
    "SpeculativeOutput",
    "SpeculativeStats",
    "acceptance_formula",
    "choose_rule",
    "generate",
    "marginal_output",
    "output_distribution",
    "p_star",
    "spectr_acceptance",
    "spectr_rho",
    "verify_step",
]
