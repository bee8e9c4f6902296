"""Where does Quest's CUDA page choice (`quest_select.cu`) spend its ~10 us a launch?
(128K benchmark shape: B=6, Hkv=8, 8320 pages, the top 92 middle pages, KPT 36.)

Times per launch in a CUDA graph of 30 launches (`bench_common.per_launch_us`), on the
page scores of random bounds, on random scores and on those rounded to 1 decimal (ties),
from patched copies of the kernel's source (built with nvcc in a temporary folder), each
stopping `select_row` at a later stage:
- `entry`: returns at once (the launch's floor);
- `fixed`: + the row staged in shared memory, kv_len, the sink / recent slots;
- `keys`: + the keys from shared memory and the threads' maxima;
- `bound`: + L, warp 0's passes over the maxima (`qsel::BOUND_PASSES`, 8 before session 54, now 12);
- `count`: + the block scan counting the candidates (>= L);
- `cands`: + the candidates into shared memory;
- `full`: the kernel as it is (+ the candidates' ranks and the writes);
- `baseline` (with a second argument, another version of the header, as a commit's): that kernel whole.
And whole variants, each checked against the Triton kernel's choice:
- `load_unrolled`: the row's float4 loads all issued before any is stored to shared memory;
- `load_direct`: each thread loads its own KPT keys as float4 straight from global memory
  (no staging, no barrier);
- `rank_split`: the ranks' loop in three warp-uniform ranges, comparing j with i only over
  the warp's own candidates;
- `bound_ranks`: L the exact m-th largest of the threads' maxima, each thread ranking its own
  against all (`rank_of`), where warp 0 settles its top bits by passes;
- `bound_bits16`, `bound_bits24`, `bound_bits32` (those the header does not build): warp 0's search settles L to
  16, 24 or 32 bits (8, 12 or 16 passes): the closer to the m-th largest maximum, the fewer candidates to rank;
- `vec_off`: `quest_select_cuda.VEC = False` (each thread loads its KPT scores one by one).
Also the rows' candidate counts (keys >= L, computed here in torch as the kernel does: `n_cand_*` with L
settled to 32 bits, `n_cand_bits16_*` and `n_cand_bits24_*` to 16 and 24, the kernel's 8 and 12 passes), largest
and mean.
The launch's time is its slowest row's: a row past 256 candidates ranks two a thread.

    python scripts/probe_quest_select_cuda_stages.py OUT.jsonl [BASELINE.cuh] [--engine-batch B]

`--engine-batch B` first runs an eager Quest engine of B 128K requests (the benchmark's shape) and
adds the page scores it handed the choice at its last step (layers 2, 16, 31) as score sets: the
rows the kernel meets in the engine, in the engine's row layout (B=3 fits an H100's 80 GB).

At cc4169a (an H100, the kernel then picking by warp 0's 16-pass search) it also ran
`bound_8bits` (L settled to 8 bits: on the page scores many more candidates, 21.4 us).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparseengine.kernels import nvcc_build, quest_select_cuda  # noqa: E402

KERNELS = Path(quest_select_cuda.__file__).parent
HEADER = "quest_select.cuh"
STOP = "  if (a.P > 0) return;  // probe\n"
ROW0 = "  const float* scores = a.scores + b * a.sb + h * a.sh;\n"
FIXED = "  if (everything) return;\n"
KEYS = "  s.maxima[tid] = mx;\n  __syncthreads();\n"
BOUND = "  const unsigned bound = s.bound;\n"
COUNT = "  const int n_cand = total.x;\n"
CANDS = "    __syncthreads();\n"  # the candidates stored; then the pick
PICK = "    if (n_cand <= THREADS) block_pick"
STAGED = "    for (int i = tid; i < (a.P + 3) / 4; i += THREADS) staged[i] = src[i];\n"
UNROLLED = """    float4 v[KPT / 4];
    const int n4 = (a.P + 3) / 4;
#pragma unroll
    for (int j = 0; j < KPT / 4; ++j) if (tid + j * THREADS < n4) v[j] = src[tid + j * THREADS];
#pragma unroll
    for (int j = 0; j < KPT / 4; ++j) if (tid + j * THREADS < n4) staged[tid + j * THREADS] = v[j];
"""
WARP_BOUND = """  if (warp == 0) {  // 1. L from the threads' maxima (a lane holds GROUPS_PER_LANE)
    unsigned g[GROUPS_PER_LANE];
#pragma unroll
    for (int i = 0; i < GROUPS_PER_LANE; ++i) g[i] = s.maxima[lane * GROUPS_PER_LANE + i];
    const unsigned bound = warp_kth<GROUPS_PER_LANE, BOUND_PASSES>(g, m);
    if (lane == 0) s.bound = bound;
  }
"""
RANK_BOUND = "  if (mx != 0u && rank_of(s.maxima, THREADS, tid, mx) == m - 1) s.bound = mx;  // probe\n"
RANK_LOOP = """  int r = 0;
#pragma unroll 4
  for (int j = 0; j < (n + 3) / 4; ++j) {  // an earlier key counts from k on (k - 1 < it), a later one above k
    const uint4 v = k4[j];
    const int j0 = 4 * j;
    r += (v.x > k - (j0 < i)) + (v.y > k - (j0 + 1 < i)) + (v.z > k - (j0 + 2 < i)) + (v.w > k - (j0 + 3 < i));
  }
"""
RANK_SPLIT = """  int r = 0;  // probe: warp-uniform ranges, only the warp's own 8 uint4s compare j with i
  const int lo = (i & ~31) >> 2, hi = min(lo + 8, (n + 3) >> 2), end = (n + 3) >> 2;
  const unsigned km1 = k - 1;
#pragma unroll 4
  for (int j = 0; j < lo; ++j) {
    const uint4 v = k4[j];
    r += (v.x > km1) + (v.y > km1) + (v.z > km1) + (v.w > km1);
  }
  for (int j = lo; j < hi; ++j) {
    const uint4 v = k4[j];
    const int j0 = 4 * j;
    r += (v.x > k - (j0 < i)) + (v.y > k - (j0 + 1 < i)) + (v.z > k - (j0 + 2 < i)) + (v.w > k - (j0 + 3 < i));
  }
#pragma unroll 4
  for (int j = hi; j < end; ++j) {
    const uint4 v = k4[j];
    r += (v.x > k) + (v.y > k) + (v.z > k) + (v.w > k);
  }
"""
DIRECT_SYNC = "    __syncthreads();  // the row staged\n"
DIRECT_READ = "      const float4 v = staged[page0 / 4 + j / 4];"
DIRECT_NEW = ("      const float4 v = page0 + j < a.P ? reinterpret_cast<const float4*>(scores)[page0 / 4 + j / 4]"
              " : make_float4(0.f, 0.f, 0.f, 0.f);")


STAGES = ("entry", "fixed", "keys", "bound", "count", "cands")  # cut short: no whole choice to check


def _replace(text: str, old: str, new: str) -> str:
    return nvcc_build.patch_once(text, old, new, HEADER)


def variants() -> dict[str, str]:
    src = (KERNELS / HEADER).read_text()
    direct = _replace(_replace(_replace(src, STAGED, ""), DIRECT_SYNC, ""), DIRECT_READ, DIRECT_NEW)
    return {
        "entry": _replace(src, ROW0, ROW0 + STOP),
        "fixed": _replace(src, FIXED, "  if (everything || a.P > 0) return;  // probe\n"),
        "keys": _replace(src, KEYS, KEYS + STOP),
        "bound": _replace(src, BOUND, BOUND + STOP),
        "count": _replace(src, COUNT, COUNT + "  if (a.P > 0) { if (n_cand < 0) out[0] = 0; return; }  // probe\n"),
        "cands": _replace(src, CANDS + PICK, CANDS + "  " + STOP + PICK),
        "full": src,
        "load_unrolled": _replace(src, STAGED, UNROLLED),
        "load_direct": direct,
        **({"rank_split": _replace(src, RANK_LOOP, RANK_SPLIT)} if RANK_LOOP in src else {}),  # a header without it
        **{f"bound_bits{2 * n}": _replace(src, WARP_BOUND, WARP_BOUND.replace("BOUND_PASSES>", f"{n}>"))
           for n in (8, 12, 16) if f"constexpr int BOUND_PASSES = {n};" not in src},
        "bound_ranks": _replace(_replace(_replace(src, WARP_BOUND, RANK_BOUND), "  unsigned maxima[THREADS];",
                                         "  alignas(16) unsigned maxima[THREADS];"),
                                KEYS, "  if (tid == 0) s.bound = 0u;\n" + KEYS),
    }


def build(name: str, header: str, tmp: Path):
    source = nvcc_build.patched_copy(KERNELS / "quest_select.cu", {HEADER: header}, tmp / name)
    return nvcc_build.load_library(source, [], f"libprobe_{name}.so", quest_select_cuda.SIGNATURES, f"probe {name}")


def keys_of(scores: torch.Tensor) -> torch.Tensor:
    """`qsel::key_of` in int64: the float's order as an unsigned int (-0.0 as +0.0)."""
    bits = torch.where(scores == 0, torch.zeros_like(scores), scores).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, bits ^ 0xFFFFFFFF, bits | 1 << 31)


def candidates(scores, n, sink_pages, recent, m, kpt=36, bits=32):
    """Per row, the count of keys >= L, L the m-th largest of the threads' KPT-page maxima (keys, 0 off the middle
    pages) settled to its top `bits` bits as warp 0's search does (a lower bound of it: more candidates)."""
    P = scores.shape[-1]
    recent_first = (n - recent) // 16
    keys = torch.zeros((*scores.shape[:2], 256 * kpt), dtype=torch.int64, device=scores.device)
    keys[..., sink_pages:recent_first] = keys_of(scores[..., sink_pages:min(recent_first, P)].float())
    maxima = keys.view(*scores.shape[:2], 256, kpt).amax(-1)
    bound = maxima.topk(m, dim=-1).values[..., -1:] & (0xFFFFFFFF ^ ((1 << (32 - bits)) - 1))
    return ((keys >= bound) & (keys != 0)).sum(-1)


def _copy_rows(scores: torch.Tensor) -> torch.Tensor:
    """A copy of `scores [B, H, P]` in the same strides, its storage holding the last row's P
    rounded up to 4 floats as the engine's does (so `whole_rows` says of it what it says there)."""
    B, H, P = scores.shape
    sb, sh, _ = scores.stride()
    buf = torch.zeros((B - 1) * sb + (H - 1) * sh + -(-P // 4) * 4, device=scores.device, dtype=scores.dtype)
    return buf.as_strided((B, H, P), (sb, sh, 1)).copy_(scores)


def engine_rows(batch: int, layers=(2, 16, 31)) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The page scores Quest's engine hands the choice at its last decode step, for `layers`, with that step's
    kv_lens: an eager engine at the 128K benchmark's shape (dummy bf16 weights, `batch` synthesised 128K prompts,
    total 2048), the choice wrapped to keep copies of its rows (its 30 sparse layers call it in order)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from profile_decode_step import engine_kwargs, prompts_of

    from sparseengine import LLM, SamplingParams

    kept, calls, choose = {}, [0], quest_select_cuda.quest_select_pages_cuda

    def keep(scores, kv_lens, *rest, **kw):
        layer = 2 + calls[0] % 30
        calls[0] += 1
        if layer in layers:
            kept[layer] = (_copy_rows(scores), kv_lens.clone())
        return choose(scores, kv_lens, *rest, **kw)

    quest_select_cuda.quest_select_pages_cuda = keep
    try:
        with LLM(**engine_kwargs("quest", batch, 131072 + 2048, enforce_eager=True)) as llm:
            llm.generate(prompts_of([131072] * batch), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         prefill="synthesized")
    finally:
        quest_select_cuda.quest_select_pages_cuda = choose
    if calls[0] % 30 or set(kept) != set(layers):
        raise SystemExit(f"the engine's choice ran {calls[0]} times (not a multiple of 30 sparse layers)")
    return [(f"engine_b{batch}_layer{layer}", *kept[layer]) for layer in layers]


def main() -> None:
    import argparse

    from sparseengine.kernels import quest_scores, quest_select
    from sparseengine.kernels.bench_common import PS, per_launch_us
    from sparseengine.kernels.bench_quest import _score_inputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("baseline", nargs="?", help="another version of quest_select.cuh, timed whole")
    ap.add_argument("--engine-batch", type=int, help="also the rows of an eager Quest engine of this batch")
    args = ap.parse_args()
    sets = engine_rows(args.engine_batch) if args.engine_batch else []
    B, P, n = 6, 8320, 131072
    sink, recent, budget = 64, 512, 1472
    q, kmax, kmin, table, kv_lens = _score_inputs(B, P, n)
    real = quest_scores.quest_page_scores_triton(q, kmax, kmin, table, kv_lens, PS)
    gen = torch.Generator(device="cuda").manual_seed(0)
    noise = torch.randn(B, 8, P, generator=gen, device="cuda")
    sets += [("page_scores", real, kv_lens), ("randn", noise, kv_lens), ("randn_1dp", noise.round(decimals=1), kv_lens)]
    meta = {"hkv": 8, "device": torch.cuda.get_device_name(),
            "commit": os.environ.get("SPARSEENGINE_GIT_COMMIT", "unknown")}
    default = quest_select_cuda.library
    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a") as f:
        with ThreadPoolExecutor(8) as pool:  # nvcc runs as a subprocess: the builds run side by side
            texts = {**variants(), **({"baseline": Path(args.baseline).read_text()} if args.baseline else {})}
            built = {name: pool.submit(build, name, text, Path(tmp)) for name, text in texts.items()}
        libs = {name: job.result() for name, job in built.items()}
        libs["vec_off"] = default()

        def emit(rec):
            print(json.dumps(rec), flush=True)
            f.write(json.dumps(rec) + "\n")

        for scores_name, scores, lens in sets:
            shape = {"batch": scores.shape[0], "pages": scores.shape[-1], "kv_len": int(lens.max()),
                     "whole_rows": quest_select_cuda.whole_rows(scores), **meta}
            choice = (scores, lens, PS, sink, recent, budget)
            want = quest_select.quest_select_pages_triton(*choice)
            counts = {}
            for bits in (32, 16, 24):
                cand = candidates(scores, int(lens.max()), sink // PS, recent, budget // PS, bits=bits)
                tag = "n_cand" if bits == 32 else f"n_cand_bits{bits}"
                counts |= {f"{tag}_max": int(cand.max()), f"{tag}_mean": float(cand.float().mean()),
                           f"{tag}_rows_past_256": int((cand > 256).sum())}
            emit({"kind": "quest_select_cuda_candidates", "scores": scores_name, **shape, **counts})
            for rnd in range(2):
                for name, lib in libs.items():
                    quest_select_cuda.library = lambda lib=lib: lib  # noqa: E731
                    quest_select_cuda.VEC = name != "vec_off"
                    try:
                        fn = lambda: quest_select_cuda.quest_select_pages_cuda(*choice)  # noqa: E731
                        got = fn()
                        same = all(torch.equal(g, w) for g, w in zip(got, want))
                        emit({"kind": "quest_select_cuda_stage", "scores": scores_name, "stage": name, "round": rnd,
                              **shape, "us_per_launch": per_launch_us(fn),
                              "equals_kernel": None if name in STAGES else same})
                    finally:
                        quest_select_cuda.library, quest_select_cuda.VEC = default, True


if __name__ == "__main__":
    main()
