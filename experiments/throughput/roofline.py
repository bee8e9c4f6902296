"""The physical limit of one decode step (BENCHMARKS.md, "Physical limit").

bytes = weight bytes read + per request (KV bytes read + method metadata) + KV written;
flops = 2 x parameters x B + attention flops; limit = max(bytes / bandwidth, flops / rate);
``pct_of_limit = limit_time / measured_time``. Bandwidth and matmul rate are measured in
the same run (a device copy, a large matmul) unless given.

The KV term is best measured: the decode window asks each request's method runtime what
its step reads (``tokens_read``, ``metadata_bytes_read``) and passes it as ``measured``.
Otherwise, a runtime class may define
``decode_read_tokens(cls, config, context_len) -> (kv_tokens, metadata_bytes)``, what one
request's decode step reads per layer. Without it: dense methods read the whole context,
others ``min(context, sink + budget + recent)`` tokens and no metadata (an estimate).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 10,
                           blocks: int = 5) -> float:
    """Device-to-device copy, bytes read + written per second, in GB/s: the best of
    ``blocks`` timings of ``repeats`` copies each. A limit is a ceiling, so the fastest
    block counts: one block read 4176 GB/s in a job whose vanilla b=6 lane then ran at
    100.7% of the limit it gave (7faa7a8), where other jobs' single blocks read 4220-4258."""
    if repeats < 1 or blocks < 1:
        raise ValueError(f"repeats and blocks must be >= 1, got {repeats} and {blocks}")
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes * repeats / best / 1e9


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5) -> float:
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_tokens(config, context_len: int) -> tuple[float, float]:
    from sparseengine.method_registry import get_spec

    spec = get_spec(config.sparse_method)
    hook = getattr(spec.runtime, "decode_read_tokens", None)
    if hook is not None:
        tokens, meta = hook(config, context_len)
        return float(tokens), float(meta)
    if spec.family == "dense":
        return float(context_len), 0.0
    return float(min(context_len, config.total_attended)), 0.0


def mean_reads(model, config, context_lens: list[int]) -> tuple[float, float]:
    """``read_tokens``'s estimate averaged over requests of these lengths, as
    ``decode_step_cost``'s ``measured`` (KV tokens per layer, metadata bytes per step)."""
    reads = [read_tokens(config, n) for n in context_lens]
    return (sum(t for t, _ in reads) / len(reads), sum(m for _, m in reads) * model.num_layers / len(reads))


@dataclass(frozen=True)
class StepCost:
    bytes: float
    flops: float

    def limit_s(self, bandwidth_gbps: float, matmul_tflops: float) -> float:
        return max(self.bytes / (bandwidth_gbps * 1e9), self.flops / (matmul_tflops * 1e12))


def decode_step_cost(model, config, elem_bytes: int, batch: int, context_len: int,
                     measured: tuple[float, float] | None = None) -> StepCost:
    """Bytes moved and flops of one decode step at ``batch`` requests of ``context_len`` tokens.
    ``measured``: (KV tokens read per layer, metadata bytes read) per request, as the
    method runtime reported them during the run; otherwise the estimate above."""
    emb = model.vocab_size * model.hidden_size
    # Tied embeddings are read once, as the LM head; untied: the lookup reads B rows only.
    weights = model.num_parameters() - (0 if model.tie_word_embeddings else emb)
    kv_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * elem_bytes
    if measured is not None:
        tokens, meta_total = measured
    else:
        tokens, meta = read_tokens(config, context_len)
        meta_total = meta * model.num_layers
    per_request = tokens * kv_token + meta_total
    nbytes = weights * elem_bytes + batch * (per_request + kv_token)
    attn_flops = 4 * model.num_heads * model.head_dim * model.num_layers * tokens
    return StepCost(bytes=nbytes, flops=2 * weights * batch + batch * attn_flops)
