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


@pytest.mark.parametrize("largest, dense, want", [
    (215, 6, [1, 2, 4, 6, 8, 16, 32, 64, 128, 215]),
    (6, 6, [1, 2, 4, 6]),
    (1, 1, [1]),
    (8, 20, [1, 2, 4, 8]),  # dense_max never exceeds the lane's own largest batch
])
def test_batch_keywords_ladder_dense_max_and_max(largest, dense, want) -> None:
    from experiments.tasks.throughput import ThroughputTask

    task = ThroughputTask(batch_sizes=["ladder", "dense_max", "max"])
    assert task._batches(largest, dense) == want
    with pytest.raises(ValueError, match="ladder"):
        ThroughputTask(batch_sizes=["biggest"])._batches(largest, dense)


def test_dense_capacity_holds_whole_prompts() -> None:
    evicting = Capacity(num_pages=80, page_size=16, pages_per_request=10, max_num_seqs=64, peak_pages_per_request=34)
    assert max_batch(evicting.dense().fits).largest == 2  # 80 // 34
    assert max_batch(evicting.fits).largest == 5


def test_throughput_table_keeps_the_latest_measurement_and_the_hf_lane() -> None:
    import pandas as pd

    from experiments.aggregate import throughput_table

    base = {"task": "throughput", "model": "m", "context_length": 1024, "sink_tokens": 4, "budget": 8,
            "recent_tokens": 4, "prefill_sparse_method": "none", "decode/max_batch": 2}
    rows = [dict(base, sparse_method="vanilla", end_time="1", **{"decode/bs1/output_tok_s": 10.0,
                                                               "hf/bs1/output_tok_s": 1.0}),
            dict(base, sparse_method="vanilla", end_time="2", **{"decode/bs1/output_tok_s": 12.0,
                                                               "decode/bs1/gpu_power_capped_share": 0.25,
                                                               "decode/bs1/gpu_sm_mhz_mean": 1790.0}),
            dict(base, sparse_method="snapkv", end_time="1", **{"decode/bs2/output_tok_s": 30.0})]
    table = throughput_table(pd.DataFrame(rows)).set_index(["lane", "batch"])
    tp = table["output_tok_s"]
    assert tp[("vanilla", 1)] == 12.0  # the re-run replaced the first measurement
    assert table.loc[("vanilla", 1), ["gpu_power_capped_share", "gpu_sm_mhz_mean"]].tolist() == [0.25, 1790.0]
    assert tp[("hf_generate", 1)] == 1.0
    assert tp[("snapkv (total 16)", 2)] == 30.0
    assert len(tp) == 3


def test_throughput_table_drops_a_stale_largest_batch() -> None:
    """A later run of a lane whose largest batch came out one smaller: the earlier record's
    row at the batch that no longer fits goes, so the lane's largest is the later one."""
    import pandas as pd

    from experiments.aggregate import improvement_over_vanilla, throughput_table

    base = {"task": "throughput", "model": "m", "context_length": 1024, "sink_tokens": 4, "budget": 8,
            "recent_tokens": 4, "prefill_sparse_method": "none"}
    rows = [dict(base, sparse_method="snapkv", end_time="1", **{"decode/max_batch": 5, "decode/first_unfit_batch": 6,
                                                              "decode/bs1/output_tok_s": 9.0,
                                                              "decode/bs5/output_tok_s": 50.0}),
            dict(base, sparse_method="vanilla", end_time="1", **{"decode/max_batch": 1, "decode/first_unfit_batch": 2,
                                                               "decode/bs1/output_tok_s": 10.0}),
            dict(base, sparse_method="snapkv", end_time="2", **{"decode/max_batch": 4, "decode/first_unfit_batch": 5,
                                                              "decode/bs4/output_tok_s": 44.0})]
    tp = throughput_table(pd.DataFrame(rows))
    snap = tp[tp["lane"] == "snapkv (total 16)"].set_index("batch")["output_tok_s"]
    assert snap.to_dict() == {1: 9.0, 4: 44.0}  # batch 1 not measured again: kept; 5 no longer fits
    largest = improvement_over_vanilla(tp).set_index("lane").loc["snapkv (total 16)"]
    assert (largest["largest_batch"], largest["output_tok_s_at_largest"]) == (4, 44.0)


def test_hf_lane_times_generate_on_the_same_shape(tiny_llama) -> None:
    import torch

    from experiments.throughput import hf_generate

    folder, _ = tiny_llama
    r = hf_generate.measure({"model": str(folder)}, batch=2, prompt_tokens=16, new_tokens=5,
                            device=torch.device("cpu"), dtype=torch.float32)
    assert (r.batch, r.prompt_tokens, r.timed_steps, r.warmup_steps) == (2, 16, 4, 0)
    assert r.output_tok_s == pytest.approx(2 / r.step_s)
    assert 0 < r.step_s_median <= 4 * r.step_s
    r = hf_generate.measure({"model": str(folder)}, batch=1, prompt_tokens=16, new_tokens=6, warmup_steps=3,
                            device=torch.device("cpu"), dtype=torch.float32)
    assert (r.timed_steps, r.warmup_steps) == (2, 3)  # 6 tokens: the prefill's, 3 untimed, 2 timed
    assert r.cold_output_tok_s is None and r.warmup_calls == 0
    calls = []
    load = hf_generate._model

    def counted(*args):  # the real model, its generate calls counted
        model = load(*args)
        generate = model.generate
        model.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
        return model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_generate, "_model", counted)
        r = hf_generate.measure({"model": str(folder)}, batch=1, prompt_tokens=16, new_tokens=4, warmup_calls=2,
                                device=torch.device("cpu"), dtype=torch.float32)
    assert len(calls) == 3
    assert r.warmup_calls == 2 and r.timed_steps == 3
    assert r.cold_output_tok_s > 0 and r.cold_step_s_median > 0 and r.output_tok_s == pytest.approx(1 / r.step_s)
    with pytest.raises(ValueError, match="warmup_calls"):
        hf_generate.measure({"model": str(folder)}, 1, 8, 4, torch.device("cpu"), torch.float32, warmup_calls=-1)
    with pytest.raises(ValueError, match="new_tokens"):
        hf_generate.measure({"model": str(folder)}, 1, 8, 1, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="warmup_steps"):
        hf_generate.measure({"model": str(folder)}, 1, 8, 4, torch.device("cpu"), torch.float32, warmup_steps=3)


def test_copy_bandwidth_is_the_fastest_block(monkeypatch) -> None:
    """Blocks timed at 2, 1 and 3 s: the limit's bandwidth is the 1 s block's."""
    import torch

    from experiments.throughput import roofline

    clock = iter([0.0, 2.0, 10.0, 11.0, 20.0, 23.0])
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(clock))
    nbytes = 1 << 20
    got = roofline.measure_copy_bandwidth(torch.device("cpu"), nbytes, repeats=4, blocks=3)
    assert got == pytest.approx(2 * nbytes * 4 / 1.0 / 1e9)
    with pytest.raises(ValueError, match="blocks"):
        roofline.measure_copy_bandwidth(torch.device("cpu"), nbytes, blocks=0)
