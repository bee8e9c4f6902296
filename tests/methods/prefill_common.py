"""Shared by the prefill-side method tests: engine settings, prompts, a float64 softmax
reference, and one torch thread for their tiny matrices."""

from __future__ import annotations

import math

import pytest
import torch

from sparseengine import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE = dict(dtype="float32", page_size=8, kv_cache_memory=0.01, device="cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster than two, and far faster on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prompt_ids(n, seed=1):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ref_softmax_row(q_row, keys, d):
    """Probabilities of one query row [d] over keys [m, d], float64."""
    return torch.softmax((keys.double() @ q_row.double()) / math.sqrt(d), dim=0)
