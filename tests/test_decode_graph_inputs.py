"""The decode graph's host side, on the CPU (no capture): the page-table rows it re-sends
and the packed step inputs it stages in one copy."""

from __future__ import annotations

import types

import numpy as np

from sparseengine.engine.cuda_graphs import DecodeGraphs


def graphs(layers=2, max_batch=4, max_pages=6) -> DecodeGraphs:
    model = types.SimpleNamespace(config=types.SimpleNamespace(num_layers=layers))
    return DecodeGraphs(model, None, None, None, "cpu", max_batch=max_batch, max_pages=max_pages)


def test_graph_page_table_rows_follow_their_requests():
    """The decode graph's host page table rewrites (and marks for upload) only the rows whose
    request or pages changed; a row is zero past its pages."""
    g = graphs()
    t = g.page_tables([7, 8], [[3, 4, 5], [1]])
    assert t.tolist() == [[3, 4, 5, 0, 0, 0], [1, 0, 0, 0, 0, 0]] and g._dirty == (0, 2)
    g.page_tables([7, 8], [[3, 4, 5], [1]])
    assert g._dirty is None  # nothing changed: nothing travels
    t = g.page_tables([7, 8], [[3, 4], [1, 9]])  # a trim and an append
    assert t.tolist() == [[3, 4, 0, 0, 0, 0], [1, 9, 0, 0, 0, 0]] and g._dirty == (0, 2)
    t = g.page_tables([8], [[1, 9]])  # request 7 finished: row 0 now holds request 8
    assert t.tolist() == [[1, 9, 0, 0, 0, 0]] and g._dirty == (0, 1)
    g.page_tables([8, 11], [[1, 9], [2, 2, 2, 2, 2, 2]])
    assert g._dirty == (1, 2) and g.host_table[1].tolist() == [2] * 6
    pages = [1, 9]
    g.page_tables([8, 11], [pages, [2] * 6])
    pages[1] = 5  # the same list object, changed in place: compared by value
    assert g.page_tables([8, 11], [pages, [2] * 6])[0].tolist()[:2] == [1, 5] and g._dirty == (0, 1)


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
