"""RULER-style synthetic long-context tasks, generated offline at any length (seeded)."""

from experiments.ruler.generator import RULER_TASKS, RulerSample, generate_sample
from experiments.ruler.scoring import score_sample, string_match_all, string_match_part

__all__ = ["RULER_TASKS", "RulerSample", "generate_sample", "score_sample", "string_match_all",
           "string_match_part"]
