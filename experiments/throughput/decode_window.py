"""The decode-only window, through the engine's public API only.

``LLM.generate`` runs ``LLM.step`` in a loop; we time each step from outside (a wrapper on
this one instance, removed afterwards). From the outputs' TTFTs we find the step in which
the last request got its first token: every later step, until the first request ends, is
a pure decode step over the whole batch. Of those, ``warmup_steps`` are skipped and the
next ``timed_steps`` are timed from the end of one step to the end of another. Each step
ends with sampled tokens on the host: its own, or, with asynchronous scheduling (the
engine's default on CUDA), the previous step's, read while the device runs this one. So
in a run of steps the time between two step ends is one step of the device (or of the
host, where that is longer); nothing else synchronises inside the window.

Prefill is ``real`` (the engine prefills the prompts) or ``synthesized`` (the engine fills
the KV directly; needs ``LLM.generate(..., prefill="synthesized")``, which the engine does
not have yet). An engine fast path for the window can replace ``measure`` without
touching the task.
"""

from __future__ import annotations

import bisect
import inspect
import statistics
import time
from dataclasses import dataclass

import torch

from experiments.throughput import gpu_clocks

PREFILL_MODES = ("real", "synthesized")


@dataclass(frozen=True)
class WindowResult:
    batch: int
    prefill: str
    window_s: float
    timed_steps: int
    step_s: float
    output_tok_s: float
    ttft_s_mean: float
    ttft_s_max: float
    tpot_s_mean: float  # end to end: decode time / (output tokens - 1), per request
    e2e_output_tok_s: float  # all output tokens / wall time of the whole generate call
    wall_s: float
    preemptions: int
    pure_decode_steps: int  # how many all-batch decode steps the run had (>= warmup + timed)
    kv_tokens_mean: float | None
    read_tokens_per_layer: float | None = None  # per request, what the method's decode step reads
    metadata_bytes_read: float | None = None  # per request and step (page bounds, scores...)
    step_s_median: float | None = None  # of the timed steps, each from one step's end to the next's
    step_s_max: float | None = None
    slow_steps: int | None = None  # timed steps over 1.2x the median: pauses (host, GC), not the device's pace
    clocks: gpu_clocks.ClockSummary | None = None  # the GPU's clocks and power through the timed steps


def batch_reads(llm, batch: int) -> tuple[float, float] | None:
    """What one decode step reads per request, as the method runtime reports it: (KV tokens
    per layer, metadata bytes), averaged over the running requests; None unless all
    ``batch`` of them are decoding (the roofline's ``measured`` KV term)."""
    running = list(getattr(llm.scheduler, "running", ()))
    method = getattr(llm, "method", None)
    if len(running) != batch or not all(s.is_decoding for s in running) or method is None:
        return None
    mc = llm.model_config
    token_layer = 2 * mc.num_kv_heads * mc.head_dim * torch.empty((), dtype=llm.dtype).element_size()
    tokens = sum(sum(method.tokens_read(s)) for s in running) / (len(running) * mc.num_layers)
    meta = sum(method.metadata_bytes_read(s, token_layer) for s in running) / len(running)
    return tokens, meta


class _StepClock:
    """Times every step from outside. Before the first step in which the whole batch
    decodes, it asks the method runtime what one decode step reads per request
    (``tokens_read``, ``metadata_bytes_read``): the roofline's measured KV term."""

    def __init__(self, llm, batch: int) -> None:
        self.llm, self.batch, self.starts, self.ends = llm, batch, [], []
        self._step = llm.step
        self.read: tuple[float, float] | None = None

    def _sample_reads(self) -> None:
        self.read = batch_reads(self.llm, self.batch)

    def __enter__(self) -> "_StepClock":
        def timed_step() -> int:
            if self.read is None:
                self._sample_reads()
            self.starts.append(time.perf_counter())
            done = self._step()
            self.ends.append(time.perf_counter())
            return done

        self.llm.step = timed_step
        return self

    def __exit__(self, *exc) -> None:
        del self.llm.step  # back to the class method


def measure(llm, prompts: list[list[int]], output_len: int, warmup_steps: int, timed_steps: int,
            prefill: str = "real", sample_clocks: bool = True) -> WindowResult:
    """The window (module docstring); ``sample_clocks``: ``nvidia-smi`` samples the GPU's
    clocks and power beside it (`gpu_clocks`; nothing on a CPU)."""
    from sparseengine import ConfigError, SamplingParams

    if prefill not in PREFILL_MODES:
        raise ConfigError(f"Invalid prefill={prefill!r}. Valid values: {', '.join(PREFILL_MODES)}")
    kwargs = {}
    if prefill == "synthesized":
        if "prefill" not in inspect.signature(llm.generate).parameters:
            raise ConfigError("prefill='synthesized' needs LLM.generate(..., prefill='synthesized'), which this "
                              "engine does not have; use task.prefill=real")
        kwargs["prefill"] = "synthesized"
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    selector = gpu_clocks.gpu_selector(llm.device) if sample_clocks else None
    with gpu_clocks.ClockSampler(selector) as clocks, _StepClock(llm, len(prompts)) as clock:
        t_call = time.perf_counter()
        outputs = llm.generate(prompts, params, **kwargs)
        wall = time.perf_counter() - t_call
    errors = [o.error for o in outputs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(outputs)} requests failed: {errors[0]}")
    ttfts = [o.metrics["ttft_s"] for o in outputs]
    ends = clock.ends
    ready = t_call + max(ttfts)  # the last first token was sampled inside this step
    first_done = t_call + min(t + o.metrics["decode_s"] for t, o in zip(ttfts, outputs))
    k_ready = bisect.bisect_left(ends, ready)
    k_done = bisect.bisect_left(ends, first_done)  # the step in which the first request ended
    pure = max(0, k_done - k_ready)  # steps k_ready+1 .. k_done decode the whole batch
    need = warmup_steps + timed_steps
    if pure < need:
        raise RuntimeError(f"only {pure} decode steps over the whole batch of {len(prompts)}, the window needs "
                           f"{need} (warm-up {warmup_steps} + timed {timed_steps}): the first request ended before "
                           f"the last was prefilled; raise task.output_len (now {output_len})")
    t0, t1 = ends[k_ready + warmup_steps], ends[k_ready + warmup_steps + timed_steps]
    seconds = t1 - t0
    steps = sorted(b - a for a, b in zip(ends[k_ready + warmup_steps:k_ready + need],
                                         ends[k_ready + warmup_steps + 1:k_ready + need + 1]))
    median = steps[len(steps) // 2]
    out_tokens = sum(len(o.token_ids) for o in outputs)
    tpots = [o.metrics["decode_s"] / (len(o.token_ids) - 1) for o in outputs if len(o.token_ids) > 1]
    kv = [o.metrics["kv_tokens"] for o in outputs if o.metrics.get("kv_tokens") is not None]
    return WindowResult(
        batch=len(prompts), prefill=prefill, window_s=seconds, timed_steps=timed_steps,
        step_s=seconds / timed_steps, output_tok_s=len(prompts) * timed_steps / seconds,
        ttft_s_mean=statistics.fmean(ttfts), ttft_s_max=max(ttfts),
        tpot_s_mean=statistics.fmean(tpots) if tpots else float("nan"), e2e_output_tok_s=out_tokens / wall,
        wall_s=wall, preemptions=sum(o.metrics["preemptions"] for o in outputs), pure_decode_steps=pure,
        kv_tokens_mean=statistics.fmean(kv) if kv else None,
        read_tokens_per_layer=clock.read[0] if clock.read else None,
        metadata_bytes_read=clock.read[1] if clock.read else None, step_s_median=median, step_s_max=steps[-1],
        slow_steps=sum(t > 1.2 * median for t in steps), clocks=clocks.summary(t0, t1))
