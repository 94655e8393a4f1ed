"""Speculative decoding: exact multi-draft verification, tree decoding, draft distillation."""
from neutrain.speculative.verify import (
    SCHEMES,
    acceptance_formula,
    marginal_output,
    output_distribution,
    verify_step,
)
from neutrain.speculative.selection import choose_rule, p_star
from neutrain.speculative.spectr import spectr_acceptance, spectr_rho
