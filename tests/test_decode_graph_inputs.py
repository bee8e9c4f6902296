"""The decode graph's host side, on the CPU (no capture): the page-table rows it re-sends
and the packed step inputs it stages in one copy."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from sparseengine.engine.cuda_graphs import DecodeGraphs
from sparseengine.engine.page_table import PageTable
from sparseengine.engine.sequence import Sequence
from sparseengine.sampling_params import SamplingParams


def graphs(layers=2, max_batch=4, max_pages=6) -> DecodeGraphs:
    model = types.SimpleNamespace(config=types.SimpleNamespace(num_layers=layers))
    return DecodeGraphs(model, None, None, None, "cpu", max_batch=max_batch, max_pages=max_pages)


def test_graph_page_table_rows_follow_their_requests():
    """The decode graph's host page table rewrites (and marks for upload) only the rows whose
    request or pages changed; a row is zero past its pages."""
    g = graphs()
    a, b = PageTable([3, 4, 5]), PageTable([1])
    t = g.page_tables([7, 8], [a, b])
    assert t.tolist() == [[3, 4, 5, 0, 0, 0], [1, 0, 0, 0, 0, 0]] and g._dirty == (0, 2)
    g.page_tables([7, 8], [a, b])
    assert g._dirty is None  # nothing changed: nothing travels
    del a[2:]
    b.append(9)  # a trim and an append
    t = g.page_tables([7, 8], [a, b])
    assert t.tolist() == [[3, 4, 0, 0, 0, 0], [1, 9, 0, 0, 0, 0]] and g._dirty == (0, 2)
    t = g.page_tables([8], [b])  # request 7 finished: row 0 now holds request 8
    assert t.tolist() == [[1, 9, 0, 0, 0, 0]] and g._dirty == (0, 1)
    c = PageTable([2] * 6)
    g.page_tables([8, 11], [b, c])
    assert g._dirty == (1, 2) and g.host_table[1].tolist() == [2] * 6
    g.page_tables([8, 11], [b, c])
    b[1] = 5  # a page written in place
    assert g.page_tables([8, 11], [b, c])[0].tolist()[:2] == [1, 5] and g._dirty == (0, 1)
    g.page_tables([8, 11], [b, PageTable([2] * 6)])  # a new table object with the same pages
    assert g._dirty == (1, 2)


def test_page_table_marks_the_first_page_changed():
    t = PageTable([5, 6, 7])
    assert t.take_changed_from() == 0 and t.take_changed_from() is None  # new: all of it, then nothing
    t += [8, 9]
    t.append(10)
    assert t.take_changed_from() == 3 and t == [5, 6, 7, 8, 9, 10]
    del t[4:]
    t[2] = 1
    assert t.take_changed_from() == 2
    t.pop()
    assert t.take_changed_from() == 3
    t += []  # a decode step that needs no new page appends nothing: nothing to re-send
    t.extend(iter(()))
    assert t.take_changed_from() is None
    t.extend(p for p in (11, 12))  # a generator is consumed once, and marks
    assert t.take_changed_from() == 3 and t == [5, 6, 1, 11, 12]
    seq = Sequence([1, 2], SamplingParams(), num_layers=1)
    seq.page_table = [4, 4]  # any list assigned to a request becomes a tracked table
    assert isinstance(seq.page_table, PageTable) and seq.page_table.take_changed_from() == 0


def test_tracked_rows_rewrite_only_changed_pages_and_stay_exact():
    """Random appends, trims, in-place writes and new tables, requests moving between rows
    and skipping steps: every step's rows are exactly the requests' pages, zero past them,
    and a row outside the re-sent range did not change."""
    rng, width = random.Random(0), 12
    g = graphs(max_batch=4, max_pages=width)
    tables = {sid: PageTable(rng.sample(range(60), rng.randint(1, 6))) for sid in range(6)}
    for _ in range(400):
        t = tables[rng.randrange(6)]
        op = rng.randrange(5)
        if op == 0 and len(t) < width:
            t += [rng.randrange(60) for _ in range(rng.randint(1, width - len(t)))]
        elif op == 1 and len(t) > 1:
            del t[rng.randint(1, len(t) - 1):]
        elif op == 2:
            t[rng.randrange(len(t))] = rng.randrange(60)
        elif op == 3:
            tables[rng.randrange(6)] = PageTable(rng.sample(range(60), rng.randint(1, width)))
        rows = rng.sample(range(6), rng.randint(1, 4))
        before = g.host_table.copy()
        out = g.page_tables(rows, [tables[s] for s in rows])
        for b, sid in enumerate(rows):
            assert out[b].tolist() == list(tables[sid]) + [0] * (width - len(tables[sid]))
        lo, hi = g._dirty or (0, 0)
        outside = [r for r in range(4) if not lo <= r < hi]
        assert (g.host_table[outside] == before[outside]).all()


def test_step_inputs_travel_in_one_buffer_with_padding_rows():
    g = graphs(layers=3, max_batch=8)
    assert g.ids.untyped_storage().data_ptr() == g.lens.untyped_storage().data_ptr()  # one buffer
    assert (g.slots == -1).all() and (g.lens == 1).all()  # padding before any step
    slots = np.arange(9, dtype=np.int64).reshape(3, 3) + 100
    lens = np.arange(9, dtype=np.int32).reshape(3, 3) + 7
    g.stage_inputs([5, 6, 7], [50, 60, 70], slots, lens, size=4)
    assert g.ids[:3].tolist() == [5, 6, 7] and g.positions[:3].tolist() == [50, 60, 70]
    assert g.slots[:, :3].tolist() == slots.tolist() and g.lens[:, :3].tolist() == lens.tolist()
    assert g.slots[:, 3].tolist() == [-1] * 3 and g.lens[:, 3].tolist() == [1] * 3  # the bucket's padding row
    g.stage_inputs([9], [90], slots[:, :1], lens[:, :1], size=2)  # a smaller batch: row 1 is padding again
    assert g.ids[0] == 9 and g.slots[:, 1].tolist() == [-1] * 3 and g.lens[:, 1].tolist() == [1] * 3


@pytest.mark.parametrize("method,knobs,want_rows", [
    ("vanilla", {}, 1000), ("snapkv", {}, 1000),  # short prompts keep every token: any length
    ("streamingllm", {}, 4 + 8 + 1),  # sink + recent + the step's new token
    ("h2o", {}, 4 + 24 + 8 + 1), ("h2o", dict(h2o_decode_interval=5), 4 + 24 + 8 + 5),
])
def test_graph_table_width_follows_the_longest_row(tiny_llama, method, knobs, want_rows):
    """The decode graph's page table is as wide as the method's longest row needs (plus one
    token), not max_model_len, for eviction methods; a request past it runs eager."""
    from sparseengine import LLM
    from sparseengine.engine.cuda_graphs import table_pages
    from sparseengine.engine.sequence import Sequence
    from sparseengine.sampling_params import SamplingParams

    with LLM(str(tiny_llama[0]), sparse_method=method, sink_tokens=4, budget=24, recent_tokens=8,
             max_model_len=1000, page_size=8, kv_cache_memory=0.01, **knobs) as llm:
        pages = table_pages(llm.method, 1000, 8)
    assert pages == -(-(want_rows + 1) // 8)
    g = graphs(max_pages=pages)
    short, long = (Sequence([1], SamplingParams(), 1) for _ in range(2))
    short.page_table, long.page_table = [0] * pages, [0] * (pages + 1)
    assert g.fits([short]) and not g.fits([short, long])


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels on CPU tensors: the interpreter, "
                    "which tests/conftest.py sets only on a machine without CUDA")
@pytest.mark.parametrize("method,graph_key", [("quest", False), ("deltakv", True)])
def test_cpu_decode_graphs_sample_the_eager_tokens(method, graph_key, tiny_llama, tiny_method_knobs):
    """The engine's decode graphs on the CPU, each capture a ``Rerun`` (the same forward over
    the graph's static buffers and context), with the Triton provider interpreted: the runner
    sends the pure-decode steps there. Four requests of different lengths finishing at
    different steps: 4 rows, then 3 (the bucket of 4 with a padding row), then 2 (a bucket of
    2). Seeded sampled tokens equal the eager engine's. Quest's hooks are capturable: one
    graph per bucket. DeltaKV's graphs are keyed by its requests' state, so the bucket of 4 is
    captured again when a request leaves it."""
    from sparseengine import LLM, SamplingParams
    from sparseengine.engine.cuda_graphs import Rerun, table_pages

    knobs = {k: v for k, v in tiny_method_knobs.items() if k.startswith(method)}
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (70, 45, 58, 52)]
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, seed=s)
              for m, s in ((12, 1), (4, 2), (12, 3), (7, 4))]
    out = {}
    for graphs in (False, True):
        with LLM(str(tiny_llama[0]), attention_provider="triton", sparse_method=method, sink_tokens=4, budget=24,
                 recent_tokens=8, num_kv_pages=64, max_num_batched_tokens=512, max_model_len=128, **knobs) as llm:
            if graphs:
                g = llm.runner.graphs = DecodeGraphs(
                    llm.model, llm.kv_cache, llm.provider, llm.method, llm.device, max_batch=4,
                    max_pages=table_pages(llm.method, llm.max_model_len, llm.config.page_size),
                    exact_buckets=2)  # buckets 1, 2, 4: three requests replay the graph of 4
            out[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
            steps = llm.runner.graph_steps
    assert steps == 11, steps  # every step after the prefill: 3 with four requests, 3 with three, 5 with two
    assert out[True] == out[False]
    four = [(4, (4, graph_key))] * (2 if graph_key else 1)
    assert g.captured == four + [(2, (2, graph_key))], g.captured
    assert all(isinstance(held[1], Rerun) for held in (*g.graphs.values(), *g.keyed.values()))
