"""How split-K decode cuts each row's KV into chunks (`split_k_decode`'s plan).

A launch's grid is (request x KV head rows, splits) and depends only on static shapes
(CUDA-graph safe). The plan is `split_plan`'s `(chunk, num_splits)`: fixed chunks over
the page table's capacity (chunk > 0), or each row cutting its own length, read on the
device, into `num_splits` chunks (chunk 0). `fine_splits_for` and `min_chunk_for` give the
kernel's run-time refinements of the two (a short row cut finer among fixed chunks; no
per-row chunk shorter than a minimum). Which plan by how many rows, measured on the H200,
is in the constants below.
"""
from __future__ import annotations

import torch

from . import _common
from ._common import cdiv, next_pow2

# The auto plan cuts short rows finer only when each row should fill this many chunks
# (rows <= ~4 * SMs / 8: batch <= 9 at 8 KV heads on the H200). Llama-3.1-8B shape at 128K
# (results/decode_throughput_128k_records.jsonl, commit 8ff9d8e, finer cut at every batch):
# SnapKV / PyramidKV (total 2048) +13-32% at batch 1-8 against c20ce76, mixed at 16
# (SnapKV total 8192 -4%), -2 to -9% at 32-64, where a row fills few chunks anyway and the
# kernel's run-time chunk (not a constexpr) cost ~4% (bench --splits, 64 x 2304 tokens:
# 262 us against 252 with the fixed chunk). Where fewer chunks a row are wanted, the plan
# cuts each row by its own length (MID_ROW_SPLITS, below) since 4b2f8b9's measurements.
FINE_MIN_SPLITS = 8
# Rows between those (want_splits < FINE_MIN_SPLITS) and rows that fill the GPU alone cut
# their own lengths into this many times want_splits chunks (`split_plan`). H200, per launch
# in a CUDA graph (bench_gpu --splits, commit 4b2f8b9), us, fixed 2048-token chunks (the
# plan before) against a row's own length in 1x / 2x / 4x want_splits chunks: SnapKV's
# compacted rows in a 133120-token table, 16 x 2304 tokens 90.0 vs 48.1 / 50.6 / 50.1,
# 32 x 2304 123.7 vs 91.8 / 85.7 / 89.6, 64 x 2304 255 vs 154 / 158 / 163, 16 x 8448 156.5
# vs 167 / 151 / 143.5, 32 x 8448 308 vs 304 / 271 / 274.5, 64 x 8448 622 vs 531 / 529 /
# 536; long rows filling their table, 16 x 32K 497 vs 616 / 536 / 515, 32 x 32K 1016 vs
# 1131 / 997 / 1013. 4x is within 6% of the best everywhere. A row far longer than its
# neighbours (a ragged batch) then runs in fewer, longer programs than fixed chunks give it.
MID_ROW_SPLITS = 4
# Rows that fill the GPU on their own (batch >= 66 at 8 KV heads) had one program each: 584
# rows of SnapKV total 8192 (8448 tokens, batch 73) then read 71.6% of the limit against
# 88.1% at batch 64 (cd491c9). Below 8 rows an SM they now take two chunks of at least this
# many least auto chunks (2048 tokens on a GPU), so short rows stay one chunk. H200, per
# launch (bench_gpu --splits-large, results/decode_splits_h200.jsonl): at f6fdc30, 73 x 8448
# tokens 665 us against 774 one program a row, 128 x 2304 (one chunk with items) 295 against
# 280; end to end SnapKV total 8192 at batch 73 2688 tok/s (80.8% of the limit). Up to
# ceil(16 * SMs / rows) chunks merged in the split kernel (638b4df) ran 73 x 8448 in 609 us
# but cost the short rows 8-11% (183 x 2304: 455 against 411), 3-7% with the merge kernel.
MIN_ROW_CHUNK_BLOCKS = 8


def want_splits(rows: int, device: torch.device) -> int:
    """Splits a row so that (request, KV head, chunk) programs fill the GPU ~4 times over."""
    return max(1, cdiv(4 * _common.num_sms(device), rows))


def auto_kv_chunk(capacity: int, rows: int, device: torch.device) -> int:
    """Fixed chunks so that (request, KV head, chunk) programs fill the GPU a few times over."""
    lo = _least_chunk(device)
    # H200, Hkv=8, d=128 bf16: 1K-2K token chunks ran at 3.7-4.3 TB/s at B=1x128K and B=32x32K.
    return max(lo, min(2048, next_pow2(cdiv(max(capacity, 1), want_splits(rows, device)))))


def _least_chunk(device: torch.device) -> int:
    return 256 if device.type == "cuda" else 32


def _fills_gpu(rows: int, device: torch.device) -> bool:
    """Rows fill the GPU's ~4 blocks per SM on their own (one program a row would)."""
    return rows >= 4 * _common.num_sms(device)


def split_plan(capacity: int, rows: int, device: torch.device, kv_chunk: int | None = None,
               row_splits: int | None = None) -> tuple[int, int]:
    """(chunk, num_splits) of a launch; chunk 0 = each row cuts its own length (read on the
    device) into num_splits chunks. Auto, by how many programs a row should fill
    (`want_splits`):
    - rows that fill the GPU's ~4 blocks per SM on their own: each over its own length, so a
      page table far wider than the rows (a CUDA graph's, sized for max_model_len) spawns no
      empty programs, in up to `ceil(8 * SMs / rows)` chunks (2 below 8 rows an SM, else 1)
      of at least `min_chunk_for`'s tokens (a row shorter than two of those is one chunk);
    - few rows (`want_splits >= FINE_MIN_SPLITS`): fixed `auto_kv_chunk` chunks over the
      capacity (a row's long KV spread evenly whatever its neighbours' lengths; a short row
      is cut finer, `fine_splits_for`);
    - between (batch 10-65 at 8 KV heads on the H200): each row over its own length in
      `MID_ROW_SPLITS * want_splits` chunks (no longer than the capacity cut in chunks of
      `auto_kv_chunk`'s least), where the fixed chunks' grid over a wide table was almost
      all empty programs.
    Measured on the H200 (bench_gpu --splits, split_k_decode, Hq 32 / Hkv 8 / d 128 bf16,
    results/decode_splits_h200.jsonl): 183 rows x 2304 tokens in a 133120-token table 0.41 ms
    one program a row against 0.72 ms in fixed 2048-token chunks; the middle band in
    `MID_ROW_SPLITS`."""
    if kv_chunk is not None:
        if kv_chunk < 16 or kv_chunk & (kv_chunk - 1):
            raise ValueError(f"kv_chunk must be a power of two >= 16, got {kv_chunk}")
        return kv_chunk, max(1, cdiv(capacity, kv_chunk))
    if row_splits is not None:
        return 0, int(row_splits)
    if _fills_gpu(rows, device):  # two chunks a row below 8 rows an SM; `min_chunk_for` keeps short rows whole
        return 0, cdiv(8 * _common.num_sms(device), rows)
    want = want_splits(rows, device)
    if want < FINE_MIN_SPLITS:
        return 0, max(1, min(MID_ROW_SPLITS * want, cdiv(capacity, _least_chunk(device))))
    chunk = auto_kv_chunk(capacity, rows, device)
    return chunk, max(1, cdiv(capacity, chunk))


def fine_splits_for(plan: tuple[int, int], rows: int, device: torch.device, auto: bool,
                    fine_splits: int | None = None) -> int:
    """How many chunks a row shorter than the plan's fixed chunks would fill cuts its own
    length into (0: never finer). `plan`: `split_plan`'s (chunk, num_splits); `auto`: the
    plan is the automatic one (no kv_chunk or row_splits given). Auto fixed chunks:
    `want_splits` when that is at least `FINE_MIN_SPLITS` (few rows), at most the grid's;
    `fine_splits` overrides (0 off); a per-row plan has nothing to refine."""
    chunk, num_splits = plan
    if not chunk:
        return 0
    if fine_splits is None:
        want = want_splits(rows, device)
        return min(num_splits, want) if auto and want >= FINE_MIN_SPLITS else 0
    return min(num_splits, int(fine_splits))


def min_chunk_for(plan: tuple[int, int], rows: int, device: torch.device, auto: bool,
                  min_chunk: int | None = None) -> int:
    """The least chunk a per-row plan cuts a row into (0: none): a row of n items runs in
    `min(num_splits, max(1, n // min_chunk))` chunks. Auto: `MIN_ROW_CHUNK_BLOCKS` of the
    least auto chunk (2048 tokens on a GPU) where rows fill the GPU on their own (their
    plan allows several chunks a row for long rows only); `min_chunk` overrides."""
    chunk, num_splits = plan
    if chunk or num_splits == 1:
        return 0
    if min_chunk is None:
        fill = auto and _fills_gpu(rows, device)
        return MIN_ROW_CHUNK_BLOCKS * _least_chunk(device) if fill else 0
    return max(0, int(min_chunk))
