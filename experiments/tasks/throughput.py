"""Decode throughput (BENCHMARKS.md): the decode-only window at each batch size, the largest
batch that fits, end-to-end TTFT / TPOT, and the roofline (bytes per step, percent of the
physical limit with the bandwidth measured in the same run).

``batch_sizes`` holds integers and/or ``"max"`` (the largest batch that fits, found by
doubling then bisection against the engine's KV pool), ``"ladder"`` (1, 2, 4, ... below
the largest) and ``"dense_max"`` (the largest batch whose whole prompts fit the same pool:
vanilla's concurrency, for improvement-at-the-same-concurrency comparisons). Metrics are
per batch size under ``decode/bs<B>/``, plus ``decode/max_batch`` and
``decode/first_unfit_batch``.

``hf_batches``: for a dense method (registry family ``dense``), also time Hugging Face
``generate`` on the same model shape at these batch sizes (``hf/bs<B>/``), after the
engine has released the device.

``length_mix``: ragged batches (``experiments/throughput/length_mix.py``): ``[[prompt
tokens, count], ...]``, a pattern of prompt lengths that repeats over each batch (the
largest-batch search included); ``context_length`` then only names the context. Each
batch logs its prompts' mean length (``decode/bs<B>/prompt_tokens_mean``); the roofline
sums what each request's step reads.

``sample_clocks``: on a GPU, ``nvidia-smi`` samples the clocks and power through each
window (``experiments/throughput/gpu_clocks.py``): ``decode/bs<B>/gpu_sm_mhz_min``,
``gpu_power_w_mean``, ``gpu_power_capped_share`` (the samples with a power limit holding the
clocks down) and the rest of ``gpu_clocks.FIELDS``; empty where nothing was sampled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from experiments.tasks.base import Task, TaskEnv
from experiments.throughput import capacity, decode_window, gpu_clocks, hf_generate, roofline
from experiments.throughput.length_mix import LengthMix
from sparseengine.method_registry import get_spec


@dataclass
class ThroughputTask(Task):
    name: str = "throughput"
    context_length: int = 1024  # prompt tokens per request
    num_samples: int = 1  # unused; kept so every task has the same three basics
    output_len: int = 64
    warmup_steps: int = 4
    timed_steps: int = 16
    batch_sizes: list[Any] = field(default_factory=lambda: [1, "max"])
    prefill: str = "real"
    hf_batches: list[int] = field(default_factory=list)
    time_budget_s: float | None = None  # per job: skip batches predicted to overrun it ('max', 'dense_max' always run)
    hf_new_tokens: int = 17  # the prefill's token + hf_warmup_steps + the timed steps
    hf_warmup_steps: int = 0
    hf_warmup_calls: int = 0  # whole generate calls before the timed one (recorded as hf/bs*/cold_*)
    max_batch_limit: int = 4096
    bandwidth_gbps: float | None = None  # None: measured in this run by a device copy
    matmul_tflops: float | None = None  # None: measured in this run by a matmul
    length_mix: list[Any] | None = None  # [[prompt tokens, count], ...]: ragged batches (above)
    sample_clocks: bool = True  # nvidia-smi samples the GPU's clocks and power through each window (gpu_clocks)

    def _batches(self, largest: int, dense_largest: int, named_only: bool = False) -> list[int]:
        """The batches to measure, ascending; `named_only`: only those named 'max' and 'dense_max'."""
        out = []
        for b in self.batch_sizes:
            if b == "max":
                out.append(largest)
            elif b == "dense_max":
                out.append(min(dense_largest, largest))
            elif named_only:
                continue
            elif b == "ladder":
                out.extend(1 << i for i in range(max(largest, 1).bit_length()) if 1 << i < largest)
            elif isinstance(b, int) and b > 0:
                out.append(b)
            else:
                raise ValueError(f"Invalid batch size {b!r} in task.batch_sizes: positive integers, 'max', "
                                 "'ladder' or 'dense_max'")
        return sorted(set(b for b in out if b > 0))

    def _generate_len(self) -> int:
        """Tokens generated per request: the window and a margin. Capacity (which batches
        fit) is still reckoned for ``output_len`` tokens, so a batch that is measured could
        also have generated all of them."""
        return min(self.output_len, self.warmup_steps + self.timed_steps + 16)

    def run(self, env: TaskEnv) -> dict[str, Any]:
        mix = LengthMix.parse(self.length_mix, self.context_length)
        if mix.ragged and self.hf_batches:
            raise ValueError("task.hf_batches times Hugging Face generate on prompts of task.context_length tokens "
                             "only; with a ragged task.length_mix leave it empty (task.hf_batches=[])")
        with env.engine() as llm:
            device, dtype = llm.device, llm.dtype
            longest = max(mix.pattern)
            if longest + self.output_len > llm.max_model_len:
                raise ValueError(f"prompt tokens + output_len = {longest + self.output_len} exceeds "
                                 f"max_model_len={llm.max_model_len}; raise engine.max_model_len")
            bw = self.bandwidth_gbps or roofline.measure_copy_bandwidth(device)
            rate = self.matmul_tflops or roofline.measure_matmul_tflops(device, dtype)
            cap = capacity.capacity_of(llm, self.context_length, self.output_len,
                                       mix.pattern if mix.ragged else None)
            search = capacity.max_batch(cap.fits, self.max_batch_limit)
            dense_largest = capacity.max_batch(cap.dense().fits, self.max_batch_limit).largest
            env.log({"roofline/bandwidth_gbps": bw, "roofline/matmul_tflops": rate,
                     "decode/max_batch": search.largest, "decode/first_unfit_batch": search.first_unfit,
                     "decode/dense_max_batch": dense_largest,
                     "decode/first_unfit_reason": cap.reason(search.first_unfit),
                     "decode/kv_pool_pages": cap.num_pages, "decode/pages_per_request": cap.pages_per_request,
                     "decode/kv_pool_narrow_pages": cap.narrow_tier,
                     "decode/prompt_tokens": self.context_length, "decode/output_tokens": self.output_len,
                     "decode/prefill": self.prefill, "decode/length_mix": mix.label()})
            gen = torch.Generator().manual_seed(env.seed)
            vocab = llm.model_config.vocab_size
            elem = torch.empty((), dtype=dtype).element_size()
            metrics: dict[str, Any] = {}
            rows: list[dict[str, Any]] = []
            started, last = time.perf_counter(), None
            # The budget bounds the ladder only: the lane's largest batch and vanilla's (the
            # comparisons the protocol asks for) are measured however long the ladder took.
            required = self._batches(search.largest, dense_largest, named_only=True)
            for batch in tqdm(self._batches(search.largest, dense_largest), desc="batch sizes"):
                if not cap.fits(batch):
                    env.log({f"decode/bs{batch}/status": f"does not fit: {cap.reason(batch)}"})
                    continue
                if self.time_budget_s is not None and last is not None and batch not in required:
                    predicted = last[1] * batch / last[0]  # a window's wall time grows ~ with the batch
                    if time.perf_counter() - started + predicted > self.time_budget_s:
                        env.log({f"decode/bs{batch}/status": f"skipped: predicted {predicted:.0f} s would overrun "
                                                             f"task.time_budget_s={self.time_budget_s}"})
                        continue
                lengths = mix.lengths(batch)
                prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]
                w = decode_window.measure(llm, prompts, self._generate_len(), self.warmup_steps,
                                          self.timed_steps, self.prefill, self.sample_clocks)
                mid = self.warmup_steps + self.timed_steps // 2  # tokens generated by mid-window
                reads = None if w.read_tokens_per_layer is None else (w.read_tokens_per_layer, w.metadata_bytes_read)
                if reads is None and mix.ragged:  # the estimate, request by request
                    reads = roofline.mean_reads(llm.model_config, llm.config, [n + mid for n in lengths])
                cost = roofline.decode_step_cost(llm.model_config, llm.config, elem, batch,
                                                 self.context_length + mid, reads)
                limit_s = cost.limit_s(bw, rate)
                m = {"output_tok_s": w.output_tok_s, "step_s": w.step_s, "window_s": w.window_s,
                     "ttft_s_mean": w.ttft_s_mean, "ttft_s_max": w.ttft_s_max, "tpot_s_mean": w.tpot_s_mean,
                     "e2e_output_tok_s": w.e2e_output_tok_s, "wall_s": w.wall_s, "preemptions": w.preemptions,
                     "pure_decode_steps": w.pure_decode_steps, "kv_tokens_mean": w.kv_tokens_mean,
                     "read_tokens_per_layer": w.read_tokens_per_layer, "metadata_bytes_read": w.metadata_bytes_read,
                     "step_s_median": w.step_s_median, "step_s_max": w.step_s_max, "slow_steps": w.slow_steps,
                     "bytes_per_step": cost.bytes, "flops_per_step": cost.flops, "limit_step_s": limit_s,
                     "limit_tok_s": batch / limit_s, "pct_of_limit": 100.0 * limit_s / w.step_s,
                     "prompt_tokens_mean": sum(lengths) / batch,
                     **{f"gpu_{k}": getattr(w.clocks, k, None) for k in gpu_clocks.FIELDS},
                     "status": "ok" if w.preemptions == 0 else "preempted"}
                step = {f"decode/bs{batch}/{k}": v for k, v in m.items()}
                metrics.update(step)
                env.log(step)
                env.sample({"batch": batch, **m})
                last = (batch, w.wall_s)
                rows.append({"batch": batch, **m})
            env.table("throughput/batches", rows)
            largest = f"decode/bs{search.largest}/output_tok_s"
            if largest in metrics:
                metrics["decode/max_batch_output_tok_s"] = metrics[largest]
            dense = get_spec(llm.config.sparse_method).family == "dense"
        if self.hf_batches and dense:
            metrics.update(self._hf_lane(env, device, dtype))
        return metrics

    def _hf_lane(self, env: TaskEnv, device, dtype) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for batch in self.hf_batches:
            r = hf_generate.measure(env.engine_kwargs, batch, self.context_length, self.hf_new_tokens, device,
                                    dtype, env.seed, warmup_steps=self.hf_warmup_steps,
                                    warmup_calls=self.hf_warmup_calls)
            m = {f"hf/bs{batch}/{k}": v for k, v in vars(r).items()}
            out.update(m)
            env.log(m)
        return out
