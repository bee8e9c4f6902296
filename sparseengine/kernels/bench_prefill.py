"""The chunked prefill's launches side by side on the GPU (`bench_gpu --prefill-launches`):
tile rows, key block, warps, stages and the split of unmasked from diagonal blocks
(`paged_prefill.PrefillLaunch`), each timed with `triton.testing.do_bench` (median) and
checked against the default launch's output on the same inputs. Also the steps whose rows
take different paths: a mixed step's decode rows routed out of the prefill or not
(`--mixed-steps`), and a decode step whose rows are partly dense (`--partly-dense-decode`)."""
from __future__ import annotations

import torch

from .bench_common import BF16, D, HKV, HQ, PS, emit, host_ms, per_launch_us
from .paged_prefill import paged_prefill_triton, prefill_launch
from .testing import random_paged_kv

# Swept launches (the GPU test runs each against the reference); the first is the launch
# before session 34; the module's defaults for the device are among them (each row says).
PREFILL_LAUNCHES = (
    dict(block_rows=64, block_n=64, num_warps=4, num_stages=2, split_mask=False),
    dict(block_rows=64, block_n=64, num_warps=4, num_stages=2, split_mask=True),
    dict(block_rows=64, block_n=64, num_warps=4, num_stages=3, split_mask=True),
    dict(block_rows=128, block_n=64, num_warps=8, num_stages=3, split_mask=True),
    dict(block_rows=128, block_n=128, num_warps=8, num_stages=3, split_mask=True),
    dict(block_rows=128, block_n=32, num_warps=4, num_stages=3, split_mask=True),
    dict(block_rows=256, block_n=64, num_warps=8, num_stages=3, split_mask=True),
    dict(block_rows=256, block_n=128, num_warps=8, num_stages=2, split_mask=True),
    dict(block_rows=256, block_n=128, num_warps=8, num_stages=3, split_mask=True),
)
# (cached tokens before the chunk + chunk, chunk): a chunk at the end of a long prompt, and a
# whole prompt in one pass (the TTFT benchmark's prefill)
PREFILL_SHAPES = ((32768, 4096), (131072, 16384), (32768, 32768))


def causal_flops(ctx: int, chunk: int) -> int:
    """Multiply-adds x 2 of QK^T and PV for a chunk's rows over the keys each sees."""
    return 4 * HQ * D * sum(ctx - chunk + i + 1 for i in range(chunk))


def bench_prefill_launches(out_path, shapes=PREFILL_SHAPES, launches=PREFILL_LAUNCHES):
    from triton.testing import do_bench

    for ctx, chunk in shapes:
        kv = random_paged_kv([ctx], HKV, D, PS, generator=torch.Generator().manual_seed(0), dtype=BF16,
                             device="cuda", poison=False)
        q = torch.randn(chunk, HQ, D, device="cuda", dtype=BF16, generator=torch.Generator("cuda").manual_seed(1))
        cu = torch.tensor([0, chunk], device="cuda", dtype=torch.int32)
        args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
        want = paged_prefill_triton(*args, max_q_len=chunk, min_q_len=chunk)
        default = prefill_launch(device=q.device, head_dim=D, min_q_len=chunk)
        flops = causal_flops(ctx, chunk)
        for kw in launches:
            launch = prefill_launch(**kw, device=q.device, head_dim=D, min_q_len=chunk)
            row = {"kind": "prefill_launch", "kv_len": ctx, "q_len": chunk, **vars(launch),
                   "default": launch == default}
            try:
                got = paged_prefill_triton(*args, max_q_len=chunk, min_q_len=chunk, **kw)
                ms = do_bench(lambda: paged_prefill_triton(*args, max_q_len=chunk, min_q_len=chunk, **kw),
                              return_mode="median")
                emit(out_path, {**row, "ms": ms, "TFLOPs": flops / ms / 1e9,
                                "max_abs_diff_vs_default": (got.float() - want.float()).abs().max().item()})
            except Exception as e:  # noqa: BLE001 - record it and go on to the next launch
                emit(out_path, {**row, "error": repr(e)[:500]})


# A mixed step (decode rows beside one prefill chunk): (label, decode rows' cache lengths,
# (chunk's cache length, chunk), pages a decode row selects (0: dense), share of the chunk's
# key blocks a block mask keeps (0: no block mask; flashprefill_v2's path))
MIXED_STEPS = (
    ("5 x 128K decode + 4K chunk at 32K", (131072,) * 5, (32768, 4096), 0, 0),
    ("63 x 8K decode + 4K chunk at 16K", (8192,) * 63, (16384, 4096), 0, 0),
    ("5 x 128K decode over 129 pages + 4K chunk at 32K", (131072,) * 5, (32768, 4096), 129, 0),
    ("5 x 128K decode + 4K chunk at 32K, 30% of its blocks", (131072,) * 5, (32768, 4096), 0, 0.3),
    ("the same with column sums (decode rows 1, the chunk's last 32)", (131072,) * 5, (32768, 4096), 0, 0.3, (1, 32)),
)


def bench_mixed_steps(out_path, steps=MIXED_STEPS, provider_name="triton"):
    """A provider's attention of a mixed step with its decode rows routed
    (`triton_provider.ROUTE_DECODE_ROWS`: the Triton provider's go to the split-K decode,
    FlashInfer's to its paged decode or their selection) and not, beside the chunk alone.
    One context a step: a FlashInfer plan is made once and reused, as by a step's layers."""
    from triton.testing import do_bench

    from sparseengine.attention import triton_provider
    from sparseengine.attention.provider import make_provider
    from sparseengine.engine.step_context import BlockMask, LayerView, ScoreRows, Selection, StepContext

    provider = make_provider(provider_name, torch.device("cuda"))
    for label, decode_lens, (ctx_len, chunk), pages, density, *colsum_rows in steps:
        lens = list(decode_lens) + [ctx_len]
        q_lens = (1,) * len(decode_lens) + (chunk,)
        kv = random_paged_kv(lens, HKV, D, PS, generator=torch.Generator().manual_seed(0), dtype=BF16,
                             device="cuda", poison=False)
        q = torch.randn(sum(q_lens), HQ, D, device="cuda", dtype=BF16, generator=torch.Generator("cuda").manual_seed(1))
        cu = torch.tensor((0,) + q_lens, device="cuda").cumsum(0).int()
        view = LayerView(torch.zeros(0, dtype=torch.long, device="cuda"), kv.kv_lens, tuple(lens), kv.page_table)
        selection, block_mask = None, None
        if pages:
            picked = torch.linspace(0, decode_lens[0] // PS - 1, pages, device="cuda").long().expand(HKV, -1)
            sel = Selection.from_lists([picked] * len(decode_lens) + [None], HKV, "cuda")
            selection = Selection(sel.token_indices, sel.num_selected, sel.dense, PS)
        if density:
            bs = 128
            first = (ctx_len - chunk) // bs
            shape = (HQ, (ctx_len - 1) // bs - first + 1, -(-ctx_len // bs))
            mask = torch.rand(shape, generator=torch.Generator().manual_seed(2)) < density
            block_mask = BlockMask(bs, (None,) * len(decode_lens) + (mask.cuda(),))
        score_rows = None
        if colsum_rows:
            one_rows, chunk_rows = colsum_rows[0]
            score_rows = ScoreRows((one_rows,) * len(decode_lens) + (chunk_rows,))
        row = {"kind": "mixed_step", "provider": provider.name, "step": label, "decode_rows": len(decode_lens),
               "selected_pages": pages, "block_density": density, "chunk_alone": "provider.attend",
               "score_rows": list(score_rows.rows) if score_rows else None}
        outs = {}
        for route in (True, False):
            triton_provider.ROUTE_DECODE_ROWS = route
            ctx = StepContext([None] * len(lens), q_lens, cu, False, [view], None, None, None, None)  # new plans
            fn = lambda: provider.attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, score_rows,  # noqa: E731
                                         block_mask=block_mask)
            outs[route] = fn()
            row["ms_routed" if route else "ms_not_routed"] = do_bench(fn, return_mode="median")
        triton_provider.ROUTE_DECODE_ROWS = True
        last = len(lens) - 1
        alone = StepContext([None] * len(lens), q_lens, cu, False, [view], None, None, None, None).group([last])
        mask = None if block_mask is None else BlockMask(bs, block_mask.masks[-1:])
        alone_rows = None if score_rows is None else ScoreRows(score_rows.rows[-1:])
        fn = lambda: provider.attend(q[-chunk:], kv.k_cache, kv.v_cache, alone.step, alone.view(view),  # noqa: E731
                                     None, alone_rows, block_mask=mask)
        row["ms_chunk_alone"] = do_bench(fn, return_mode="median")
        row["max_abs_diff_routed_vs_not"] = (outs[True][0].float() - outs[False][0].float()).abs().max().item()
        if score_rows is not None:
            row["colsum_max_abs_diff_routed_vs_not"] = max((a - b).abs().max().item()
                                                           for a, b in zip(outs[True][1], outs[False][1]))
        emit(out_path, row)


def bench_mixed_steps_flashinfer(out_path):
    """`bench_mixed_steps` through the FlashInfer provider (its steps without a block mask,
    which FlashInfer's provider hands to Triton)."""
    bench_mixed_steps(out_path, [s for s in MIXED_STEPS if not s[4]], "flashinfer")


# A decode step where some rows read their whole cache and the others a selection (OmniKV's
# or DeltaKV's choice leaves a request dense while its prompt is within the total): (label,
# cache lengths of the rows with a selection, of the dense rows, pages each selected row reads)
PARTLY_DENSE_STEPS = (
    ("5 x 128K over 129 pages + 1 dense 2K row", (131072,) * 5, (2048,), 129),
    ("5 x 128K over 129 pages + 3 dense 2K rows", (131072,) * 5, (2048,) * 3, 129),
    ("31 x 32K over 129 pages + 1 dense 2K row", (32768,) * 31, (2048,), 129),
)


def bench_partly_dense_decode(out_path, steps=PARTLY_DENSE_STEPS, providers=("triton", "flashinfer")):
    """One layer's attention of a decode step whose rows are partly dense, through each
    provider that is installed: `attend` (each kernel over its own rows: the whole-cache
    decode over the dense rows, the sparse decode over the others) against what it ran
    before 6af40da, both kernels over every row and a per-row pick (`ms_both_over_all`),
    its whole-cache decode being the provider's and its sparse decode Triton's."""
    from triton.testing import do_bench

    from sparseengine.attention.provider import make_provider
    from sparseengine.attention.triton_provider import TritonAttentionProvider
    from sparseengine.engine.step_context import LayerView, Selection, StepContext

    sparse = TritonAttentionProvider()
    for name in providers:
        try:
            provider = make_provider(name, torch.device("cuda"))
        except Exception as e:  # noqa: BLE001 - an optional provider not installed: say so, go on
            emit(out_path, {"kind": "partly_dense_decode", "provider": name, "error": repr(e)[:300]})
            continue
        for label, sel_lens, dense_lens, pages in steps:
            lens = list(sel_lens) + list(dense_lens)
            kv = random_paged_kv(lens, HKV, D, PS, generator=torch.Generator().manual_seed(0), dtype=BF16,
                                 device="cuda", poison=False)
            q = torch.randn(len(lens), HQ, D, device="cuda", dtype=BF16,
                            generator=torch.Generator("cuda").manual_seed(1))
            cu = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
            view = LayerView(torch.zeros(0, dtype=torch.long, device="cuda"), kv.kv_lens, tuple(lens),
                             kv.page_table)
            picked = [torch.linspace(0, n // PS - 1, pages, device="cuda").long().expand(HKV, -1) for n in sel_lens]
            sel = Selection.from_lists(picked + [None] * len(dense_lens), HKV, "cuda")
            selection = Selection(sel.token_indices, sel.num_selected, sel.dense, PS)
            dense_rows = torch.tensor(selection.dense, device="cuda")[:, None, None]
            ctx = StepContext([None] * len(lens), (1,) * len(lens), cu, True, [view], None, None, None, None)
            split = lambda: provider.attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, None)[0]  # noqa: E731

            def both():
                whole = provider.attend(q, kv.k_cache, kv.v_cache, ctx, view, None, None)[0]
                return torch.where(dense_rows, whole, sparse._sparse_decode(q, kv.k_cache, kv.v_cache,
                                                                            kv.page_table, kv.kv_lens, selection))

            got, want = split(), both()  # also makes the step's groups and plans before any capture
            row = {"kind": "partly_dense_decode", "provider": provider.name, "step": label,
                   "selected_rows": len(sel_lens), "dense_rows": len(dense_lens), "selected_pages": pages,
                   "ms_split": do_bench(split, return_mode="median"),
                   "ms_both_over_all": do_bench(both, return_mode="median"),
                   "max_abs_diff": (got.float() - want.float()).abs().max().item()}
            # The host's time to issue one call (50 back to back, no sync between), and the
            # device's time alone: the split's small kernels take less than the host's
            # launches of them, which the eager times above include.
            row["ms_host_split"], row["ms_host_both_over_all"] = host_ms(split), host_ms(both)
            for key, fn in (("ms_split_graph", split), ("ms_both_over_all_graph", both)):
                try:
                    row[key] = per_launch_us(fn) / 1e3
                except Exception as e:  # noqa: BLE001 - FlashInfer's wrappers here are not made for capture
                    row[key + "_error"] = repr(e)[:300]
            emit(out_path, row)
