"""Max-batch search, KV capacity and roofline arithmetic (no engine run)."""

from __future__ import annotations

import pytest

from experiments.throughput.capacity import Capacity, max_batch
from experiments.throughput.roofline import decode_step_cost
from sparseengine import Config
from sparseengine.models.loader import SHAPES_DIR
from sparseengine.models.model_config import ModelConfig


@pytest.mark.parametrize("largest", [0, 1, 2, 3, 6, 7, 8, 200, 1000])
def test_search_finds_the_largest_batch_that_fits(largest) -> None:
    result = max_batch(lambda b: b <= largest)
    assert (result.largest, result.first_unfit) == (largest, largest + 1)
    probed = dict(result.probes)
    assert probed.get(largest + 1) is False  # the next size up was tried and did not fit
    assert largest == 0 or probed[largest] is True
    doubling = [b for b, _ in result.probes][: max(1, largest.bit_length() + 1)]
    assert doubling == [1 << i for i in range(len(doubling))]  # doubles first, then bisects
    assert len(result.probes) <= 2 * max(1, largest).bit_length() + 2


def test_capacity_counts_whole_pages() -> None:
    cap = Capacity(num_pages=100, page_size=16, pages_per_request=-(-(256 + 24) // 16), max_num_seqs=8)
    assert cap.pages_per_request == 18
    assert cap.fits(5) and not cap.fits(6)
    assert "needs 108" in cap.reason(6)
    assert not Capacity(1000, 16, 1, max_num_seqs=8).fits(9)
    evicting = Capacity(num_pages=80, page_size=16, pages_per_request=10, max_num_seqs=64, peak_pages_per_request=34)
    assert evicting.fits(5) and not evicting.fits(6)  # one request at its prefill peak, the rest compressed


def test_roofline_matches_benchmarks_md_for_llama_8b() -> None:
    import json

    model = ModelConfig.from_hf(json.loads((SHAPES_DIR / "llama-3.1-8b.json").read_text()), "llama-3.1-8b")
    cfg = Config.from_kwargs(model="llama-3.1-8b", load_format="dummy")
    one = decode_step_cost(model, cfg, 2, batch=1, context_len=131072)
    assert one.bytes / 1e9 == pytest.approx(32.2, rel=0.01)  # 15.0 GB weights + 17.2 GB KV
    six = decode_step_cost(model, cfg, 2, batch=6, context_len=131072)
    assert six.bytes / 1e9 == pytest.approx(118, rel=0.01)
    assert 6 / six.limit_s(4200, 790) == pytest.approx(213, rel=0.02)
