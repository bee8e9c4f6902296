"""The Triton kernels compile for the H200 (sm_90) on a machine without a GPU.

The interpreter, which runs the kernel tests on a CPU, accepts programs that the compiler
rejects (a loop-carried variable that changes shape; the shortlist search's first version
failed so, on the GPU only). These tests build, in the configurations the engine
launches, the kernels CI cannot otherwise compile. Triton's own library functions are
interpreter objects once Triton is imported under TRITON_INTERPRET=1, so the compiles
run in one child process without it."""
import collections
import json
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from sparseengine.kernels.testing import child_env, ptx_in_child, record_launches  # noqa: E402

SELECT_TYPES = dict(scores_ptr="*fp32", kv_lens_ptr="*i32", pages_ptr="*i64", counts_ptr="*i32",
                    scratch_ptr="*i32", maxima_ptr="*fp32", stride_sb="i32", stride_sh="i32", HKV="i32", P="i32",
                    K="i32", N_GROUPS="i32")
SPLIT_TYPES = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
SPLIT_TYPES.update({name: "*i32" for name in ("page_table_ptr", "kv_lens_ptr", "num_sel_ptr", "counter_ptr",
                                               "meta_ptr")})
SPLIT_TYPES.update({name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "logits_ptr", "lse_ptr")})
SPLIT_TYPES.update(sel_ptr="*i64", qk_scale="fp32")
SPLIT_TYPES.update({name: "i32" for name in (
    "stride_qb", "stride_qh", "stride_kp", "stride_ko", "stride_kh", "stride_vp", "stride_vo", "stride_vh",
    "stride_pt", "stride_sel_b", "stride_sel_h", "stride_ns_b", "stride_ns_h", "stride_ob", "stride_oh",
    "num_splits", "fine_splits", "min_chunk", "logits_len", "HKV", "HQ", "rows")})

# id -> (module, kernel, helpers, types, constexprs, num_warps)
BUILDS = {}
for shortlist in (True, False):  # the 128K benchmark's launch: 8320-page table, top 92, groups of 32
    for radix in (1, 2, 4):
        BUILDS[f"quest_select-shortlist{int(shortlist)}-radix{radix}"] = (
            "quest_select", "_select_kernel", ["_page_keys", "_kth_largest", "_shortlist_select"], SELECT_TYPES,
            dict(PAGE_SIZE=16, SINK_PAGES=4, RECENT=512, TOTAL=2048, TOP=92, BLOCK_P=8192, BLOCK_K=256,
                 RADIX_BITS=radix, SHORT_RADIX=radix, SHORTLIST=shortlist, GROUP=32, BLOCK_G=512, CAP=512,
                 L_BITS=16, SCRATCH=1024, GIVEN_MAXIMA=False), 16)
# ... as the engine launches it: blocks of 4096, 8 warps, the group maxima from the page scores
BUILDS["quest_select-given-maxima"] = (
    "quest_select", "_select_kernel", ["_page_keys", "_kth_largest", "_shortlist_select"], SELECT_TYPES,
    dict(PAGE_SIZE=16, SINK_PAGES=4, RECENT=512, TOTAL=2048, TOP=92, BLOCK_P=4096, BLOCK_K=256, RADIX_BITS=2,
         SHORT_RADIX=4, SHORTLIST=True, GROUP=32, BLOCK_G=512, CAP=512, L_BITS=16, SCRATCH=1024, GIVEN_MAXIMA=True),
    8)
# Quest at total 8192 on the same table (top 476): groups of 16, 1024 maxima, room 2048, as launched
BUILDS["quest_select-total8192"] = (
    "quest_select", "_select_kernel", ["_page_keys", "_kth_largest", "_shortlist_select"], SELECT_TYPES,
    dict(PAGE_SIZE=16, SINK_PAGES=4, RECENT=512, TOTAL=8192, TOP=476, BLOCK_P=4096, BLOCK_K=1024, RADIX_BITS=2,
         SHORT_RADIX=4, SHORTLIST=True, GROUP=16, BLOCK_G=1024, CAP=2048, L_BITS=16, SCRATCH=4096,
         GIVEN_MAXIMA=False), 8)
# dense split-K decode, GQA 4, d 128, bf16: plain, every head's logits (H2O), the group's max
# logit (OmniKV); partials merged by the second kernel, by the last program, or one split
# (the merge kernel or the last program); the balanced plan's flat grid over 520 rows, dense
# and over selected pages (Quest), merged by either
SPLIT_HELPERS = None  # found from the kernel's code
# (the group max held in registers, 32 tiles of a 2048-token chunk stored after the loop, as
# `_maxima_tiles` gives it, and a store a tile: a row's own chunk)
for store, combine in ((0, 0), (0, 2), (1, 0), (2, 0), (2, 1), (2, 2)):
    BUILDS[f"split_decode-logits{store}-combine{combine}"] = (
        "paged_decode", "_decode_split_kernel", SPLIT_HELPERS, SPLIT_TYPES,
        dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, CHUNK=2048, BLOCK_N=64, MODE=0,
             STORE_LOGITS=store, DOT_PREC="tf32", COMBINE=combine, BLOCK_S=64, STORE_LSE=True,
             FINE=combine != 2, BALANCED=False, BLOCK_R=1, SLACK=2, LOGIT_TILES=32 if store == 2 else 0), 4)
BUILDS["split_decode-logits2-row-chunks"] = (
    "paged_decode", "_decode_split_kernel", SPLIT_HELPERS, SPLIT_TYPES,
    dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, CHUNK=0, BLOCK_N=64, MODE=0,
         STORE_LOGITS=2, DOT_PREC="tf32", COMBINE=0, BLOCK_S=64, STORE_LSE=False, FINE=False, BALANCED=False,
         BLOCK_R=1, SLACK=2, LOGIT_TILES=0), 4)
for mode, combine in ((0, 0), (0, 1), (2, 0), (2, 1)):
    BUILDS[f"split_decode-balanced-mode{mode}-combine{combine}"] = (
        "paged_decode", "_decode_split_kernel", SPLIT_HELPERS, SPLIT_TYPES,
        dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, CHUNK=0, BLOCK_N=64, MODE=mode,
             STORE_LOGITS=0, DOT_PREC="tf32", COMBINE=combine, BLOCK_S=64, STORE_LSE=False, FINE=False,
             BALANCED=True, BLOCK_R=1024, SLACK=2, LOGIT_TILES=0), 4)

# DeltaKV's fused rebuild at a GPU tile (64 entries): int4 and float16 latents into a bf16
# cache (float16 product), and a float32 engine's (exact product). The first version
# compiled at the interpreter's tile of 16 and failed at 64 (a select on the latent row).
REBUILD_TYPES = dict(tok_ptr="*i64", slot_ptr="*i64", nb_ptr="*i16", scale_ptr="*fp16", zero_ptr="*fp16",
                     inv_freq_ptr="*fp32")
REBUILD_TYPES.update({name: "i32" for name in ("stride_addr", "stride_row", "tiles", "N", "R", "sink",
                                                "stride_codec", "stride_cp", "stride_co", "stride_ch")})
REBUILD_TYPES.update(addr_ptr="*i64")
for bits, dtype, prec in ((4, "bf16", "tf32"), (16, "bf16", "tf32"), (4, "fp32", "ieee")):
    types = dict(REBUILD_TYPES, lat_ptr="*u8" if bits == 4 else "*fp16", up_ptr="*fp16" if prec == "tf32" else "*fp32",
                 **{name: f"*{dtype}" for name in ("centers_ptr", "k_cache_ptr", "v_cache_ptr")})
    BUILDS[f"deltakv_rebuild-int{bits}-{dtype}"] = (
        "deltakv_rebuild", "_rebuild_kernel", [], types,
        dict(HKV=8, HALF=64, BLOCK_HALF=64, NB=4, BITS=bits, GROUP=32, PAGE_SIZE=16, BLOCK_M=64, BLOCK_R=64,
             BATCHED=bits == 4, DOT_PREC=prec), 4)

CHILD = """
import importlib, json, sys
from sparseengine.kernels.testing import compile_for_gpu
out = {}
for name, b in json.loads(sys.stdin.read()).items():
    kernel = getattr(importlib.import_module(b["module"]), b["kernel"])
    options = dict(b.get("options", {}))
    warps = options.pop("num_warps", 4)
    try:
        compiled = compile_for_gpu(kernel, b.get("helpers"), b["types"], b["constexprs"], num_warps=warps,
                                   options=options)
        out[name] = "ok" if compiled.asm.get("cubin") else "no cubin"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"[-2000:]
print(json.dumps(out))
"""


LAZY_CHILD = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from sparseengine.kernels._common import SHARED_HELPERS, module_helpers
def shared(f):  # (module, name) of the shared helpers f calls, and of those they call
    found = []
    for h in SHARED_HELPERS:
        if h in f.__code__.co_names:
            found += [(f.__globals__, h)] + shared(SHARED_HELPERS[h])
    return found
out = {}
for name, b in json.loads(sys.stdin.read()).items():
    kernel = getattr(importlib.import_module(b["module"]), b["kernel"])
    kernel[(1,)]  # what a launch does first (nothing runs): jit the kernel, bind what it calls
    module = kernel.fn.__globals__
    helpers = module_helpers(kernel.fn)
    called = [(module, h) for h in helpers] + shared(kernel.fn)
    called += [c for h in helpers for c in shared(getattr(module[h], "fn", module[h])) if c not in called]
    signature = {n: b["types"].get(n, "constexpr") for n in kernel._jitted.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel._jitted, signature=signature, constexprs=b["constexprs"]),
                              target=GPUTarget("cuda", 90, 32), options=b["options"])
    out[name] = dict(called=[h for _, h in called], plain=[h for m, h in called if not isinstance(m[h], JITFunction)],
                     cubin=bool(compiled.asm.get("cubin")))
print(json.dumps(out))
"""


def test_a_launch_binds_what_its_kernel_calls(device):
    """The engine's path, not the test builder's: a LazyKernel's first launch jits the
    helpers its kernel calls into the kernel's module (its own module's, nested ones
    included, and the shared online-softmax step; the chunked prefill's shared causal block
    and the softmax step that one calls, in its module; libdevice for the norms), and the
    kernel it jitted then builds for sm_90 as it is. Launches recorded from the wrappers."""
    from sparseengine import kernels as K
    from sparseengine.kernels.testing import random_paged_kv, randn

    gen = torch.Generator().manual_seed(0)
    kv = random_paged_kv([70, 33], 2, 128, 16, generator=gen, dtype=torch.bfloat16, device=device)
    q = randn(2, 8, 128, generator=gen, dtype=torch.bfloat16, device=device)
    scores = torch.randn(2, 2, 6, generator=gen).to(device)
    x = randn(5, 256, generator=gen, dtype=torch.bfloat16, device=device)
    with record_launches() as rec:
        K.paged_decode_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
        K.quest_select_pages_triton(scores, kv.kv_lens, 16, 4, 8, 32)
        K.add_rms_norm_triton(x, x.clone(), torch.ones(256, dtype=torch.bfloat16, device=device), 1e-6)
        K.paged_prefill_triton(randn(31, 8, 128, generator=gen, dtype=torch.bfloat16, device=device), kv.k_cache,
                               kv.v_cache, kv.page_table, kv.kv_lens,
                               torch.tensor([0, 20, 31], dtype=torch.int32, device=device), max_q_len=20)
    builds = {b["kernel"]: b for b in rec.launches}
    run = subprocess.run([sys.executable, "-c", LAZY_CHILD], input=json.dumps(builds), capture_output=True,
                         text=True, env=child_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"_decode_split_kernel", "_select_kernel", "_rms_norm_kernel", "_prefill_kernel"} <= set(out), sorted(out)
    assert {"softmax_step", "merge_splits", "balanced_chunk", "balanced_row_items"} <= set(
        out["_decode_split_kernel"]["called"])
    assert {"_page_keys", "_kth_largest", "_shortlist_select"} <= set(out["_select_kernel"]["called"])
    assert {"_load_h", "_round_to"} <= set(out["_rms_norm_kernel"]["called"])
    assert out["_prefill_kernel"]["called"] == ["causal_paged_block", "softmax_step"]
    for name, got in out.items():
        assert got["cubin"] and not got["plain"], (name, got)


def compile_in_child(builds: dict) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(builds), capture_output=True, text=True,
                         env=child_env(), timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built():
    builds = {name: dict(module="sparseengine.kernels." + module, kernel=kernel, helpers=helpers, types=types,
                         constexprs=consts, options={"num_warps": warps})
              for name, (module, kernel, helpers, types, consts, warps) in BUILDS.items()}
    return compile_in_child(builds)


@pytest.mark.parametrize("name", BUILDS)
def test_compiles_for_sm90(built, name):
    assert built[name] == "ok", built[name]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # bf16 garbage, interpreted
def test_every_kernel_launch_compiles_for_sm90(device):
    """Every Triton kernel of the package, launched by its wrapper as the engine launches
    it (bf16 attention inputs, GQA 4, head dim 128; short rows), recorded, then built for
    sm_90 with those very arguments' types and constexprs."""
    with record_launches() as rec:
        launch_every_kernel(device)
    kernels = {(b["module"], b["kernel"]) for b in rec.launches}
    assert len(kernels) >= 20, sorted(kernels)  # every kernel module took part
    results = compile_in_child({f"{i}-{b['kernel']}": b for i, b in enumerate(rec.launches)})
    failed = {name: r for name, r in results.items() if r != "ok"}
    assert not failed, failed


def launch_every_kernel(device):
    """One or two launches of each Triton wrapper (outputs unused)."""
    from sparseengine import kernels as K
    from sparseengine.kernels.omnikv_scores import omnikv_scores_triton
    from sparseengine.kernels.testing import random_paged_kv, randn

    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    hq, hkv, d, ps = 8, 2, 128, 16
    lens = [70, 33]
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=bf, device=device)
    base = (kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    q = randn(2, hq, d, generator=gen, dtype=bf, device=device)
    K.paged_decode_triton(q, *base)
    K.paged_decode_triton(q, *base, kv_chunk=16, return_lse=True)
    K.decode_colsum_triton(q, *base, max_kv_len=80)
    for fold in (True, False):  # the group maxima taken in atomically, or stored a KV head each
        K.decode_max_logits_triton(q, *base, max_kv_len=80, fold=fold)
    for mode in ("logits", "probs"):
        omnikv_scores_triton(q, kv.k_cache, kv.page_table, kv.kv_lens, mode, 80)
    idx = torch.randint(0, 33, (2, hkv, 24), generator=gen).to(device)
    num = torch.full((2, hkv), 24, dtype=torch.int32, device=device)
    K.sparse_decode_triton(q, *base, idx, num)
    K.sparse_page_decode_triton(q, *base, (idx[..., :2] // ps).contiguous(), torch.full_like(num, 2))
    k_new, v_new = (randn(3, hkv, d, generator=gen, dtype=bf, device=device) for _ in range(2))
    slots = torch.tensor([kv.slots(0)[69], kv.slots(1)[32], -1], device=device)
    K.paged_kv_write_triton(k_new, v_new, kv.k_cache, kv.v_cache, slots)
    kmax = kv.k_cache.new_zeros(kv.k_cache.shape[0], hkv, d)
    K.update_page_minmax_triton(kv.k_cache, slots, kmax, kmax.clone())
    scores = K.quest_page_scores_triton(q, kmax, kmax.clone(), kv.page_table, kv.kv_lens, ps)
    for pdl in (False, True):  # a decode step's keys folded in, first or after the tiles' loads
        K.quest_page_scores_triton(q, kmax, kmax.clone(), kv.page_table, kv.kv_lens, ps, k_cache=kv.k_cache,
                                   new_slots=slots[:2], pdl=pdl)
    K.quest_select_pages_triton(scores, kv.kv_lens, ps, 4, 8, 32)
    K.quest_select_pages_triton(scores, kv.kv_lens, ps, 4, 8, 32, shortlist=False)
    scores, maxima = K.quest_page_scores_and_maxima_triton(  # the shortlist's maxima from the scores' launch
        q, kmax, kmax.clone(), kv.page_table, kv.kv_lens, ps, group=2, sink_pages=1, recent_tokens=8,
        k_cache=kv.k_cache, new_slots=slots[:2])
    K.quest_select_pages_triton(scores, kv.kv_lens, ps, 4, 8, 32, group_maxima=maxima)
    cu = torch.tensor([0, 20, 31], dtype=torch.int32, device=device)
    qp = randn(31, hq, d, generator=gen, dtype=bf, device=device)
    K.paged_prefill_triton(qp, *base, cu, max_q_len=20)
    K.prefill_window_colsum_triton(qp, kv.k_cache, kv.page_table, kv.kv_lens, cu, 8, max_kv_len=80)
    masks = [torch.ones(hq, 2, 5, dtype=torch.bool, device=device), None]
    K.block_sparse_paged_prefill_triton(qp, *base, cu, masks, block_size=16)
    K.block_sparse_paged_prefill.block_sparse_window_colsum_triton(qp, kv.k_cache, kv.page_table, kv.kv_lens, cu, 8,
                                                                   masks, block_size=16)
    qs, ks, vs = (randn(40, h, d, generator=gen, dtype=bf, device=device) for h in (hq, hkv, hkv))
    K.block_sparse_prefill_triton(qs, ks, vs, torch.ones(hq, 3, 3, dtype=torch.bool, device=device), 16)
    x = randn(5, 256, generator=gen, dtype=bf, device=device)
    w = torch.ones(256, dtype=bf, device=device)
    K.rms_norm_triton(x, w, 1e-6)
    K.add_rms_norm_triton(x, x.clone(), w, 1e-6)
    qr, kr = randn(5, hq, d, generator=gen, dtype=bf, device=device), randn(5, hkv, d, generator=gen, dtype=bf,
                                                                            device=device)
    cos, sin = torch.ones(5, d, dtype=bf, device=device), torch.zeros(5, d, dtype=bf, device=device)
    K.rotary_qk_triton(qr, kr, cos, sin)
    K.rotary_kv_write_triton(qr, kr, kr.clone(), cos, sin, kv.k_cache, kv.v_cache,
                             torch.tensor([0, 5, -1, 40, 7], device=device))
    K.silu_mul_triton(randn(5, 512, generator=gen, dtype=bf, device=device))
    K.row_argmax_triton(torch.randn(3, 300, generator=gen).to(device), block=64)  # greedy sampling's logits
    picks = torch.randn(2, 1, 4200, generator=gen).to(device)  # OmniKV's pick from folded max logits
    K.omnikv_select_triton(picks, torch.tensor([4100, 3000], device=device), 64, 1472, 512,
                           page_table=torch.zeros(2, 263, dtype=torch.int32, device=device), page_size=16)
    K.row_argmax_triton(randn(2, 300, generator=gen, dtype=bf, device=device))
    wl = randn(64, 256, generator=gen, dtype=bf, device=device)
    for pdl in (False, True):  # the benchmark's launches: 3 stages, and the PDL path's prologue
        K.skinny_linear_triton(x, wl, block_n=32, block_k=64, num_stages=3, pdl=pdl)
    # the model's: a folded norm, a residual, and the weight's tiles through a tensor descriptor (TMA)
    K.skinny_linear_triton(x, wl, block_n=32, block_k=64, num_stages=5, rms_eps=1e-5)
    K.skinny_linear_triton(x, wl, block_n=32, block_k=64, num_stages=5,
                           residual=randn(5, 64, generator=gen, dtype=bf, device=device))
    for pdl in (False, True):
        K.skinny_linear_triton(x, wl, block_n=32, block_k=64, num_stages=5, rms_eps=1e-5, tma=True, pdl=pdl)
    from sparseengine.methods.deltakv_store import CodecStore
    for bits in (4, 16):  # the engine's store: bf16 centers, int16 neighbours; float32 Up
        store = CodecStore(60, 10, bits, 4, 2 * hkv * d, 32, bf, device)
        store.write_random(60, gen)
        up = randn(32, 2 * hkv * d, generator=gen, device=device)
        K.deltakv_rebuild_triton(store.full(), up, torch.ones(d // 2, device=device),
                                 torch.arange(4, 11, device=device), torch.arange(7, device=device),
                                 kv.k_cache, kv.v_cache, 4)
        # a batched step's: two rows, the second without a codec, float16 Up
        K.deltakv_rebuild_batched_triton([store.full(), None], up.half(), torch.ones(d // 2, device=device),
                                         torch.arange(4, 18, device=device).view(2, 7),
                                         torch.tensor([[0, 1, 2, 3, 4, 5, 6], [-1] * 7], device=device),
                                         kv.k_cache, kv.v_cache, 4)
    pool_s = torch.zeros(3, 8, ps, hkv, device=device)
    pool_p = torch.zeros(3, 8, ps, hkv, dtype=torch.int32, device=device)
    table = torch.arange(8, dtype=torch.int32, device=device).view(2, 4)
    colsum = torch.rand(2, hkv, 64, generator=gen).to(device)
    n_tok = torch.tensor([40, 30], dtype=torch.int32, device=device)
    K.h2o_scores_accumulate_triton(pool_s[0], pool_p[0], colsum, table, n_tok, n_tok - 1, n_tok - 1)
    K.h2o_victim_triton(pool_s, pool_p, table, torch.tensor([2, 0], device=device), torch.tensor([40, 30],
                        device=device), 20, 2, 4)


SHARED_CHILD = """
import importlib, json, sys
from sparseengine.kernels.testing import compile_for_gpu
out = {}
for name, b in json.loads(sys.stdin.read()).items():
    kernel = getattr(importlib.import_module(b["module"]), b["kernel"])
    options = dict(b.get("options", {}))
    compiled = compile_for_gpu(kernel, None, b["types"], b["constexprs"], num_warps=options.pop("num_warps", 4),
                               options=options)
    out[name] = compiled.metadata.shared
print(json.dumps(out))
"""
H200_SHARED_BYTES = 232448  # the most dynamic shared memory a block may take on sm_90


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_engine_linear_tiles_fit_shared_memory(device, dtype):
    """The model's linears at a decode step (skinny_linear with `engine_tiles`) at the
    Llama-3.1-8B shape's widths build for sm_90 within its shared memory in every dtype a
    model loads in (bf16's tiles in float32 would need 320 KB at the wide layers)."""
    from sparseengine.kernels import skinny_linear

    gen = torch.Generator().manual_seed(0)
    with record_launches() as rec:
        for n in (6144, 4096):  # qkv / gate_up / lm_head; o / down
            x = torch.randn(6, 64, generator=gen).to(dtype).to(device)
            w = torch.randn(n, 64, generator=gen).to(dtype).to(device)
            skinny_linear.skinny_linear_triton(x, w, **skinny_linear.engine_tiles(n, dtype))
    assert len(rec.launches) == 2, rec.launches
    run = subprocess.run([sys.executable, "-c", SHARED_CHILD], capture_output=True, text=True, env=child_env(),
                         input=json.dumps({str(i): b for i, b in enumerate(rec.launches)}), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    shared = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(0 < s <= H200_SHARED_BYTES for s in shared.values()), shared


def test_batched_rebuild_loads_as_wide_as_the_per_request_one():
    """The batched rebuild reads each row's codec through addresses it loads, which carry no
    alignment of their own; it declares them 16-byte aligned (``codec_addresses`` checks),
    so its loads of centers and latents are as wide as the per-request kernel's, whose
    pointer arguments a launch specialises (without that, the H200 ran the batched step
    with 2-byte loads of the centers: 3.3 ms a step slower, session 27)."""
    name, kernel, helpers, types, consts, warps = BUILDS["deltakv_rebuild-int4-bf16"]
    aligned = [k for k, t in types.items() if t.startswith("*")] + ["R", "stride_cp", "stride_co", "stride_ch"]
    builds = {str(batched): dict(module="sparseengine.kernels." + name, kernel=kernel, types=types, aligned=aligned,
                                 constexprs=dict(consts, BATCHED=batched, BLOCK_M=16)) for batched in (False, True)}
    loads = {k: collections.Counter(re.findall(r"ld\.global[a-z0-9.]*", ptx))
             for k, ptx in ptx_in_child(builds).items()}
    per_request, batched = loads["False"], loads["True"]
    assert per_request.get("ld.global.v4.b32", 0) >= 8, per_request  # the centers' 16-byte vectors
    for width in ("ld.global.b16", "ld.global.v4.b32", "ld.global.v2.b32", "ld.global.b8"):
        assert batched.get(width, 0) == per_request.get(width, 0), (batched, per_request)

