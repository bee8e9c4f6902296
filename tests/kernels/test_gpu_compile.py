"""The Triton kernels compile for the H200 (sm_90) on a machine without a GPU.

The interpreter, which runs the kernel tests on a CPU, accepts programs that the compiler
rejects (a loop-carried variable that changes shape; the shortlist search's first version
failed so, on the GPU only). These tests build, in the configurations the engine
launches, the kernels CI cannot otherwise compile. Triton's own library functions are
interpreter objects once Triton is imported under TRITON_INTERPRET=1, so the compiles
run in one child process without it."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SELECT_TYPES = dict(scores_ptr="*fp32", kv_lens_ptr="*i32", pages_ptr="*i64", counts_ptr="*i32",
                    scratch_ptr="*i32", stride_sb="i32", stride_sh="i32", HKV="i32", P="i32", K="i32")
SPLIT_TYPES = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
SPLIT_TYPES.update({name: "*i32" for name in ("page_table_ptr", "kv_lens_ptr", "num_sel_ptr", "counter_ptr")})
SPLIT_TYPES.update({name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "logits_ptr", "lse_ptr")})
SPLIT_TYPES.update(sel_ptr="*i64", qk_scale="fp32")
SPLIT_TYPES.update({name: "i32" for name in (
    "stride_qb", "stride_qh", "stride_kp", "stride_ko", "stride_kh", "stride_vp", "stride_vo", "stride_vh",
    "stride_pt", "stride_sel_b", "stride_sel_h", "stride_ns_b", "stride_ns_h", "stride_ob", "stride_oh",
    "num_splits", "logits_len", "HKV", "HQ")})

# id -> (module, kernel, helpers, types, constexprs, num_warps)
BUILDS = {}
for shortlist in (True, False):  # the 128K benchmark's launch: 8320-page table, top 92, groups of 32
    for radix in (1, 2, 4):
        BUILDS[f"quest_select-shortlist{int(shortlist)}-radix{radix}"] = (
            "quest_select", "_select_kernel", ["_page_keys", "_kth_largest", "_shortlist_select"], SELECT_TYPES,
            dict(PAGE_SIZE=16, SINK_PAGES=4, RECENT=512, TOTAL=2048, TOP=92, BLOCK_P=8192, BLOCK_K=256,
                 RADIX_BITS=radix, SHORT_RADIX=radix, SHORTLIST=shortlist, GROUP=32, BLOCK_G=512, CAP=512), 16)
# dense split-K decode, GQA 4, d 128, bf16: plain, every head's logits (H2O), the group's max
# logit (OmniKV); partials merged by the second kernel, by the last program, or one split
for store, combine in ((0, 0), (0, 2), (1, 0), (2, 0), (2, 1), (2, 2)):
    BUILDS[f"split_decode-logits{store}-combine{combine}"] = (
        "paged_decode", "_decode_split_kernel", ["_merge_splits"], SPLIT_TYPES,
        dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, CHUNK=2048, BLOCK_N=64, MODE=0,
             STORE_LOGITS=store, DOT_PREC="tf32", COMBINE=combine, BLOCK_S=64, STORE_LSE=True), 4)

CHILD = """
import importlib, json, sys
from sparseengine.kernels.testing import compile_for_gpu
out = {}
for name, (module, kernel, helpers, types, consts, warps) in json.loads(sys.stdin.read()).items():
    mod = importlib.import_module("sparseengine.kernels." + module)
    try:
        compiled = compile_for_gpu(getattr(mod, kernel), helpers, types, consts, num_warps=warps)
        out[name] = "ok" if compiled.asm.get("cubin") else "no cubin"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"[-2000:]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def built():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(BUILDS), capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", BUILDS)
def test_compiles_for_sm90(built, name):
    assert built[name] == "ok", built[name]
