"""Shared by the prefill-side method tests: engine settings, prompts, a float64 softmax
reference."""

from __future__ import annotations

import math

import torch

from sparseengine import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE = dict(dtype="float32", page_size=8, kv_cache_memory=0.01, device="cpu")


def prompt_ids(n, seed=1):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ref_softmax_row(q_row, keys, d):
    """Probabilities of one query row [d] over keys [m, d], float64."""
    return torch.softmax((keys.double() @ q_row.double()) / math.sqrt(d), dim=0)
