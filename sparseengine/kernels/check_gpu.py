"""Every Triton kernel against its torch reference at a medium bf16 shape on the GPU
(`python -m sparseengine.kernels.bench_gpu` runs it first); one JSON line per kernel."""
from __future__ import annotations

import torch

from . import (decode_colsum_ref, decode_colsum_triton, deltakv_rebuild_ref, deltakv_rebuild_triton,
               omnikv_scores_ref, omnikv_scores_triton, paged_decode_ref, paged_decode_triton,
               paged_kv_write_ref, paged_kv_write_triton, paged_prefill_ref, paged_prefill_triton,
               prefill_window_colsum_ref, prefill_window_colsum_triton, quest_page_scores_ref,
               quest_page_scores_triton, sparse_decode_ref, sparse_decode_triton, sparse_page_decode_ref,
               sparse_page_decode_triton, update_page_minmax_ref, update_page_minmax_triton)
from .bench_common import BF16, D, HKV, HQ, PS, emit
from .block_sparse_prefill import block_sparse_prefill_ref, block_sparse_prefill_triton
from .testing import random_paged_kv, randn, rel_err


def _pairs(a, b):
    return zip(a, b) if isinstance(a, tuple) else [(a, b)]


def check_kernels(out_path):
    """Each Triton kernel against its reference at a medium bf16 shape."""
    from sparseengine.methods.deltakv_store import CodecStore
    gen = torch.Generator().manual_seed(0)
    lens = [4000, 1234, 777, 2048]
    kv = random_paged_kv(lens, HKV, D, PS, generator=gen, dtype=BF16, device="cuda", poison=False)
    B = len(lens)
    q = randn(B, HQ, D, generator=gen, dtype=BF16, device="cuda")
    base = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    idx = torch.stack([torch.stack([torch.randperm(n, generator=gen)[:512] for _ in range(HKV)]) for n in lens])
    idx, num = idx.int().cuda(), torch.full((B, HKV), 512, dtype=torch.int32, device="cuda")
    pidx = torch.stack([torch.stack([torch.randperm(-(-n // PS), generator=gen)[:32] for _ in range(HKV)])
                        for n in lens]).int().cuda()
    pnum = torch.full((B, HKV), 32, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 512, 512 + 64, 512 + 64 + 1, 512 + 64 + 1 + 300], device="cuda").int()
    qp = randn(int(cu[-1]), HQ, D, generator=gen, dtype=BF16, device="cuda")
    hi = torch.zeros(kv.k_cache.shape[0], HKV, D, device="cuda", dtype=BF16)
    lo = hi.clone()
    slots = torch.cat([kv.slots(b) for b in range(B)])
    update_page_minmax_ref(kv.k_cache, slots, hi, lo)
    n = 3000
    qs, ks, vs = (randn(n, h, D, generator=gen, dtype=BF16, device="cuda") for h in (HQ, HKV, HKV))
    bmask = (torch.rand(HQ, -(-n // 128), -(-n // 128), generator=gen) < 0.3).cuda()
    codec = CodecStore(5000, 10, 4, 4, 2 * HKV * D, 256, BF16, "cuda")
    codec.write_random(5000, torch.Generator(device="cuda").manual_seed(0))
    up = randn(256, 2 * HKV * D, generator=gen, device="cuda") / 16
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    tok = torch.randperm(5000, generator=gen)[:1000].cuda() + 4
    tok_slots = torch.randperm(kv.k_cache.shape[0] * PS, generator=gen)[:1000].cuda()

    def rebuild(fn):
        caches = kv.k_cache.clone(), kv.v_cache.clone()
        fn(codec.full(), up, inv_freq, tok, tok_slots, *caches, 4)
        return caches

    def minmax(fn):
        a, b = torch.zeros_like(hi), torch.zeros_like(lo)
        fn(kv.k_cache, slots, a, b)
        return a, b

    def kv_write(fn):
        caches = kv.k_cache.clone(), kv.v_cache.clone()
        new = randn(5, HKV, D, generator=torch.Generator().manual_seed(1), dtype=BF16, device="cuda")
        fn(new, new, *caches, torch.tensor([3, -1, 40, 41, 7], device="cuda"))
        return caches

    cases = {
        "paged_kv_write": (lambda: kv_write(paged_kv_write_ref), lambda: kv_write(paged_kv_write_triton)),
        "paged_decode": (lambda: paged_decode_ref(*base, return_lse=True),
                         lambda: paged_decode_triton(*base, return_lse=True)),
        "paged_prefill": (lambda: paged_prefill_ref(qp, *base[1:], cu, return_lse=True),
                          lambda: paged_prefill_triton(qp, *base[1:], cu, return_lse=True)),
        "sparse_decode": (lambda: sparse_decode_ref(*base, idx, num), lambda: sparse_decode_triton(*base, idx, num)),
        "sparse_page_decode": (lambda: sparse_page_decode_ref(*base, pidx, pnum),
                               lambda: sparse_page_decode_triton(*base, pidx, pnum)),
        "decode_colsum": (lambda: decode_colsum_ref(*base), lambda: decode_colsum_triton(*base)),
        "prefill_window_colsum": (
            lambda: prefill_window_colsum_ref(qp, kv.k_cache, kv.page_table, kv.kv_lens, cu, 32),
            lambda: prefill_window_colsum_triton(qp, kv.k_cache, kv.page_table, kv.kv_lens, cu, 32)),
        "update_page_minmax": (lambda: minmax(update_page_minmax_ref), lambda: minmax(update_page_minmax_triton)),
        "quest_page_scores": (lambda: quest_page_scores_ref(q, hi, lo, kv.page_table, kv.kv_lens, PS),
                              lambda: quest_page_scores_triton(q, hi, lo, kv.page_table, kv.kv_lens, PS)),
        "omnikv_scores_logits": (lambda: omnikv_scores_ref(q, kv.k_cache, kv.page_table, kv.kv_lens),
                                 lambda: omnikv_scores_triton(q, kv.k_cache, kv.page_table, kv.kv_lens)),
        "omnikv_scores_probs": (lambda: omnikv_scores_ref(q, kv.k_cache, kv.page_table, kv.kv_lens, "probs"),
                                lambda: omnikv_scores_triton(q, kv.k_cache, kv.page_table, kv.kv_lens, "probs")),
        "deltakv_rebuild": (lambda: rebuild(deltakv_rebuild_ref), lambda: rebuild(deltakv_rebuild_triton)),
        "block_sparse_prefill": (lambda: block_sparse_prefill_ref(qs, ks, vs, bmask),
                                 lambda: block_sparse_prefill_triton(qs, ks, vs, bmask)),
    }
    ok = True
    for name, (ref_fn, tri_fn) in cases.items():
        try:
            pairs = list(_pairs(tri_fn(), ref_fn()))
            errs = [rel_err(t, r) for t, r in pairs]
            nan = any(bool(t.isnan().any()) for t, _ in pairs)
            passed = max(errs) < 2e-2 and not nan
            emit(out_path, {"kind": "check", "kernel": name, "rel_err": max(errs), "nan": nan, "ok": passed})
        except Exception as e:  # report and go on: one broken kernel must not hide the others
            passed = False
            emit(out_path, {"kind": "check", "kernel": name, "ok": False, "error": repr(e)[:500]})
        ok &= passed
    return ok
