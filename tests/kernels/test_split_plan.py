"""The split-K decode's plan rule (`split_plan.py`); the kernel under each plan is tested
in test_paged_decode.py."""
import pytest
import torch

from sparseengine.kernels.split_plan import fine_splits_for, split_plan


def test_split_plan_by_how_many_rows() -> None:
    cpu = torch.device("cpu")  # 4 "SMs": 16 program slots
    # Rows that fill the GPU: their own lengths in up to ceil(8 * SMs / rows) chunks (of at
    # least min_chunk_for's items), one program per row from 8 * SMs rows on.
    assert split_plan(4096, 16, cpu) == split_plan(4096, 31, cpu) == (0, 2)
    assert split_plan(4096, 32, cpu) == split_plan(133120, 999, cpu) == (0, 1)
    # Between: a row's own length in MID_ROW_SPLITS x want_splits (2) chunks, however wide
    # the table; no more than the capacity in chunks of the least auto chunk (32 on a CPU).
    assert split_plan(4096, 8, cpu) == split_plan(133120, 8, cpu) == (0, 8)
    assert split_plan(100, 8, cpu) == (0, 4)
    assert split_plan(4096, 2, cpu) == (512, 8)  # few rows: fixed chunks over the capacity
    assert split_plan(4096, 1, cpu) == (256, 16)
    assert split_plan(4096, 1, cpu, kv_chunk=16) == (16, 256)
    assert split_plan(4096, 1, cpu, row_splits=3) == (0, 3)
    with pytest.raises(ValueError, match="kv_chunk must be a power of two >= 16, got 24"):
        split_plan(4096, 1, cpu, kv_chunk=24)


def test_fine_splits_only_with_the_auto_plans_fixed_chunks():
    """The auto plan's fixed chunks split short rows finer (about `want_splits` chunks, at
    most the grid's) when rows are few (`want_splits` >= FINE_MIN_SPLITS); an explicit
    kv_chunk or row_splits does not unless fine_splits is given; a per-row plan never does."""
    cpu = torch.device("cpu")  # 4 "SMs": 16 program slots

    def fine(capacity, rows, kv_chunk=None, row_splits=None, **kw):
        plan = split_plan(capacity, rows, cpu, kv_chunk, row_splits)
        return fine_splits_for(plan, rows, cpu, kv_chunk is None and row_splits is None, **kw)

    assert fine(133120, 8) == 0  # 2048-token chunks, 65 of them; 16 / 8 rows: too few
    assert fine(133120, 2) == 8  # FINE_MIN_SPLITS
    assert fine(4096, 1) == 16  # 16 chunks of 256, want 16
    assert fine(600, 1) == 10  # 10 chunks of 64: no more than the grid
    assert fine(100, 1) == 4  # 4 chunks of 32 (the least chunk on a CPU)
    assert fine(133120, 16) == 0  # one program per row
    assert fine(4096, 1, kv_chunk=16) == fine(4096, 1, row_splits=3) == 0
    assert fine(4096, 1, kv_chunk=16, fine_splits=5) == 5
    assert fine(4096, 1, fine_splits=0) == 0
