"""Where a run's memory goes, decided before anything is built, and held to while it runs.

The planner (one training step's peak as named terms), the phase model, the step-time model, the automatic
fit of a training run to its device budget, the residency of ``neutrain generate``, and the measurement of
each phase's peak. None of it needs a trainer; ``neutrain estimate`` imports it without torch.
"""
