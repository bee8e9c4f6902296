"""Greedy, temperature, top-k and top-p sampling, seeded per request."""

from __future__ import annotations

import torch

from sparseengine.kernels import row_argmax
from sparseengine.kernels._common import ArrivalCounters
from sparseengine.sampling_params import SamplingParams


def greedy(logits: torch.Tensor, counters: torch.Tensor | None = None) -> torch.Tensor:
    """`logits.argmax(-1)`: on a GPU with `row_argmax.SAMPLER_USES_KERNEL` the row-split
    kernel (5.4 us a step at 6 x 128256 on the H200 against torch's 27.2; `counters`: its
    arrival counters, default the device's), torch's otherwise and past the kernel's rows a
    launch."""
    if (logits.is_cuda and row_argmax.SAMPLER_USES_KERNEL and logits.shape[0] <= row_argmax.MAX_ROWS
            and logits.shape[-1] > 0):
        return row_argmax.row_argmax_triton(logits, counters=counters)
    return logits.argmax(dim=-1)


class Sampler:
    """Per engine: its seeded generators, and the greedy kernel's arrival counters, so that
    two engines replaying their graphs on two streams of one GPU never share them."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}
        self._argmax_counters = ArrivalCounters(row_argmax.MAX_ROWS)

    def argmax_counters(self, device: torch.device) -> torch.Tensor:
        """This sampler's row-argmax counters on `device` (`ArrivalCounters`)."""
        return self._argmax_counters.on(device)

    def generator(self, seq_id: int, seed: int | None, device: torch.device) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            self._generators[seq_id] = gen
        return gen

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> list[int]:
        """logits [B, V] (floating) -> one token per row."""
        return self.sample(logits, params, seq_ids).tolist()

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> torch.Tensor:
        """logits [B, V] (floating: the model's dtype) -> one token per row, int64 on logits' device; nothing
        waits for the device (the engine reads the tokens a step later)."""
        out = greedy(logits, self.argmax_counters(logits.device) if logits.is_cuda else None)
        if all(p.greedy for p in params):
            return out
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = logits[i].float() / p.temperature
            if p.top_k > 0 and p.top_k < row.numel():
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(row, descending=True)
                cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
                drop = cum - torch.softmax(sorted_logits, dim=-1) > p.top_p  # keep the token crossing top_p
                sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
                row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
            probs = torch.softmax(row, dim=-1)
            gen = self.generator(seq_ids[i], p.seed, logits.device)
            out[i] = torch.multinomial(probs, 1, generator=gen)[0]
        return out
