"""``LLM``: the engine's front door. ``generate`` loops ``step`` until every request ends."""

from __future__ import annotations

import gc
import time
from typing import Any, Sequence as Seq

import torch

from sparseengine.attention.provider import make_provider
from sparseengine.config import Config, ConfigError, resolve_device
from sparseengine.engine.cache_manager import CacheManager
from sparseengine.engine.cuda_graphs import DecodeGraphs, table_pages
from sparseengine.engine.inflight import NEEDS_TOKENS, PLACEHOLDER, Inflight
from sparseengine.engine.kv_cache import KVCache
from sparseengine.engine.model_runner import ModelRunner
from sparseengine.engine.outputs import RequestOutput
from sparseengine.engine.page_allocator import PageAllocator
from sparseengine.engine.pool_budget import pool_budget
from sparseengine.engine.pool_plan import PoolPlan, plan_for
from sparseengine.engine.scheduler import Scheduler, SchedulerConfig
from sparseengine.engine.sequence import Sequence, SequenceStatus
from sparseengine.engine.teacher_forcing import AttentionCapture, Forcing, TeacherForcedOutput, forced_requests
from sparseengine.kernels import cuda_linear, fused_ops, skinny_linear
from sparseengine.layers.sampler import Sampler
from sparseengine.method_registry import get_spec, resolve_prefill_policy
from sparseengine.methods.base import MethodStack
from sparseengine.models import loader
from sparseengine.models.llama import LlamaForCausalLM
from sparseengine.sampling_params import SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLM:
    def __init__(self, model: str = loader.EMBEDDED_MODEL, **kwargs: Any) -> None:
        self.config = cfg = Config.from_kwargs(model=model, **kwargs)
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but no CUDA device is available")
        self.dtype = _DTYPES.get(cfg.dtype) or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.source = loader.resolve(cfg.model, cfg.load_format)
        self.model_config = mc = self.source.model_config
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        torch.manual_seed(cfg.seed)
        self.model = self._build_model()
        self.tokenizer = loader.load_tokenizer(self.source)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.pool_plan = plan = self._plan_pool()
        self.allocator = PageAllocator(plan.num_pages, plan.narrow_pages)
        self.prefill_policy = resolve_prefill_policy(cfg)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            prefill_chunk_size=cfg.prefill_chunk_size, page_size=cfg.page_size,
            max_model_len=self.max_model_len, prefill_policy=self.prefill_policy,
            long_prefill_threshold=cfg.long_prefill_threshold), self.allocator)
        self.kv_cache = KVCache(mc, plan.num_pages, cfg.page_size, self.dtype, self.device,
                                narrow_layers=plan.narrow_layers, narrow_pages=plan.narrow_pages)
        self.cache = CacheManager(self.kv_cache, self.scheduler)
        self.provider = make_provider(cfg.attention_provider, self.device, cfg.decode_split_plan)
        self.method = get_spec(cfg.sparse_method).runtime(cfg, mc, self.cache)
        if cfg.prefill_sparse_method != "none":
            prefill = get_spec(cfg.prefill_sparse_method, "prefill").runtime(cfg, mc, self.cache)
            self.method = MethodStack(prefill, self.method)
        self.scheduler.narrow_bound = self.method.narrow_bound
        graphs = None
        if self.device.type == "cuda" and not cfg.enforce_eager and self.provider.supports_cuda_graphs:
            graphs = DecodeGraphs(self.model, self.kv_cache, self.provider, self.method, self.device,
                                  max_batch=cfg.max_num_seqs,
                                  max_pages=table_pages(self.method, self.max_model_len, cfg.page_size))
        self.runner = ModelRunner(self.model, self.kv_cache, self.provider, self.method, self.device,
                                  cfg.page_size, graphs)
        self.sampler = Sampler()
        self.async_scheduling = self.device.type == "cuda" if cfg.async_scheduling is None else cfg.async_scheduling
        self._inflight: Inflight | None = None  # the last step's tokens, not yet read
        self._forcing: Forcing | None = None  # during ``teacher_forced``: the tokens to feed
        self._closed = False

    # ---- construction ---------------------------------------------------------------
    def _build_model(self) -> LlamaForCausalLM:
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(self.model_config)
        finally:
            torch.set_default_dtype(default)
        if self.config.load_format == "dummy":
            loader.init_dummy(model, self.config.seed)
        else:
            loader.load_weights(model, self.source)
        model.rotary.inv_freq = model.rotary.inv_freq.float()
        if self.device.type == "cuda" and fused_ops.ROTARY_TABLE:  # a decode step gathers its cos/sin rows
            model.rotary.reserve(self.max_model_len, self.dtype)
        if self.device.type == "cuda" and skinny_linear.FOLD_NORMS and skinny_linear.ENGINE_MAX_ROWS > 0:
            model.fold_norms()  # the decode steps' linears apply the norms and residual adds
        gate_up = model.layers[0].mlp.gate_up_proj
        if (cuda_linear.GATED and cuda_linear.ENGINE and cuda_linear.fits(gate_up.weight, gate_up.bias)
                and cuda_linear.unavailable(self.device) is None):
            model.interleave_gate_up()  # the decode steps' gate_up applies the SiLU too
        return model.eval()

    def _plan_pool(self) -> PoolPlan:
        """The pool's pages (``num_kv_pages``, else as many as the memory budget holds) and,
        for a method with narrow layers (``kv_pool_tiers``), its two tiers (``pool_plan``)."""
        cfg, mc = self.config, self.model_config
        if cfg.num_kv_pages is not None:
            return PoolPlan(cfg.num_kv_pages, cfg.num_kv_pages)
        budget = pool_budget(self.model, cfg, mc, self.dtype, self.device, self.max_model_len)
        plan = plan_for(get_spec(cfg.sparse_method).runtime, cfg, mc, self.dtype, budget, self.max_model_len)
        if plan.num_pages < 1:
            raise ConfigError(f"No room for the KV pool: {budget / 2**30:.2f} GiB left for it; "
                              "raise kv_cache_memory or gpu_memory_utilization")
        return plan

    # ---- requests -------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int], chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ConfigError(f"model {self.source.name!r} has no tokenizer: pass token-id lists as prompts")
        if chat:
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                return_dict=False))
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 apply_chat_template: bool = False, use_tqdm: bool = False,
                 prefill: str = "real") -> list[RequestOutput]:
        """``prefill="synthesized"`` (decode benchmarks): skip the prompt's forward pass and
        fill the KV directly with random values at the lengths the method would hold after
        a real prefill; the prompt's last token stands in for the first output token."""
        if prefill not in ("real", "synthesized"):
            raise ConfigError(f"Invalid prefill={prefill!r}. Valid values: real, synthesized")
        if self._closed:
            raise RuntimeError("this LLM has been closed")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = []
        now = time.perf_counter()
        for prompt, p in zip(prompts, params):
            seq = Sequence(self._tokenize(prompt, apply_chat_template), p, self.model_config.num_layers,
                           arrival_time=now)
            seqs.append(seq)
            error = self.scheduler.validate(seq, self.method.cache_tokens_needed(seq.num_prompt_tokens))
            if error is not None:
                self.scheduler.finish(seq, "error", error=error)
            elif p.max_tokens == 0:
                self.scheduler.finish(seq, "length")
            elif prefill == "synthesized":
                self._synthesize(seq)
            else:
                self.scheduler.add(seq)
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm
            progress = tqdm(total=len(seqs), desc="generate")
        self._run_until_done(progress)
        return [self._output(seq, prompt) for seq, prompt in zip(seqs, prompts)]

    def _run_until_done(self, progress=None) -> None:
        """Step until every request has finished and the last tokens are read (``progress``:
        a tqdm bar counting finished requests, closed at the end)."""
        while self.scheduler.has_unfinished or self._inflight is not None:
            done = self.step()
            if progress is not None:
                progress.update(done)
        if progress is not None:
            progress.close()

    def kv_tokens_needed(self, prompt_tokens: int, output_tokens: int) -> int:
        """Cache slots one request needs at most (method-aware): its pages in the pool."""
        return self.method.max_cache_tokens(prompt_tokens, output_tokens)

    def narrow_tokens(self, prompt_tokens: int) -> int | None:
        """In a two-tier pool (``pool_plan``): the cache slots of a request with this prompt
        that stay in narrow pages once it is compressed (None: all of them, or one tier)."""
        if not self.pool_plan.tiered:
            return None
        return self.method.narrow_tokens(self.config, self.model_config, prompt_tokens)

    @torch.inference_mode()
    def _synthesize(self, seq: Sequence) -> None:
        lens = self.method.cache_lens_after_prefill(seq.num_prompt_tokens)
        need = -(-self.kv_tokens_needed(seq.num_prompt_tokens, seq.sampling_params.max_tokens)
                 // self.config.page_size)
        if not self.allocator.can_allocate(need):
            raise ConfigError(f"synthesized request needs {need} KV pages, {self.allocator.num_free} free "
                              f"of {self.allocator.num_pages}: the batch does not fit")
        seq.page_table = self.allocator.allocate(-(-max(lens) // self.config.page_size))
        pages = torch.tensor(seq.page_table, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.config.seed + seq.seq_id)
        for layer in range(self.model_config.num_layers):
            for cache in self.kv_cache.layer(layer):
                fill = torch.randn((len(seq.page_table), *cache.shape[1:]), generator=gen, device=self.device,
                                   dtype=cache.dtype)
                cache[pages] = fill
        seq.layer_lens = list(lens)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.output_token_ids.append(seq.prompt_token_ids[-1])
        seq.first_token_time = time.perf_counter()
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        self.method.init_synthetic(seq)

    def prompt_logits(self, prompts: Seq[str | list[int]], last: int | None = None) -> list[torch.Tensor]:
        """The float32 logits at every prompt position [n, vocab], computed by the engine's
        own (chunked, batched) prefill; with ``last``, at the last ``min(last, n)`` positions
        only (the LM head runs on those rows alone)."""
        if last is not None and (not isinstance(last, int) or isinstance(last, bool) or last < 1):
            raise ConfigError(f"Invalid last={last!r}: a number of positions >= 1, or None for all")
        seqs = []
        for prompt in prompts:
            ids = self._tokenize(prompt, False)
            seq = Sequence(ids, SamplingParams(temperature=0, max_tokens=1), self.model_config.num_layers,
                           prompt_logits=[], prompt_logits_from=0 if last is None else max(0, len(ids) - last))
            error = self.scheduler.validate(seq, self.method.cache_tokens_needed(seq.num_prompt_tokens))
            if error is not None:
                raise ConfigError(error)
            self.scheduler.add(seq)
            seqs.append(seq)
        self._run_until_done()
        return [torch.cat(s.prompt_logits) for s in seqs]

    def teacher_forced(self, prompts: Seq[str | list[int]], continuations: Seq[str | list[int]],
                       capture_attention: bool = False) -> list[TeacherForcedOutput]:
        """Prefill each prompt, then decode through the method's own decode path feeding its
        continuation's tokens instead of sampled ones: one ``TeacherForcedOutput`` per prompt,
        the float32 logits predicting each continuation token and, with ``capture_attention``,
        every layer's attention output there (those steps run eagerly). Bad input raises
        ConfigError before anything runs (``teacher_forcing.forced_requests``)."""
        if self._closed:
            raise RuntimeError("this LLM has been closed")
        seqs, conts = forced_requests(self, prompts, continuations)
        capture = AttentionCapture(self.model) if capture_attention else None
        self._forcing = forcing = Forcing(seqs, conts, capture)
        self.runner.capture = capture
        try:
            for seq in seqs:
                self.scheduler.add(seq)
            self._run_until_done()
        finally:
            self._forcing, self.runner.capture = None, None
            if capture is not None:
                capture.close()
        return [forcing.output(seq) for seq in seqs]

    def step(self) -> int:
        """One engine step; returns how many requests finished in it. With asynchronous
        scheduling (``async_scheduling``, on for CUDA by default) a step launches its
        forward pass, then reads and settles the previous step's tokens while the device
        runs, so the tokens a step samples appear in the requests at the next step (or
        when ``generate`` returns); a request that stopped on a token has run one more step,
        whose token is dropped."""
        batch = self.scheduler.schedule()
        for seq in batch.preempted + batch.failed:
            self.method.release(seq)
            self.cache.drop(seq)
        if batch.is_empty:
            if batch.failed or batch.preempted or self._inflight is not None:
                return len(batch.failed) + self._settle()
            raise RuntimeError("scheduler made no progress: no request fits in the KV pool")
        feed = None
        if self._inflight is not None:
            feed = self._inflight.feed(batch)
            if feed == NEEDS_TOKENS:  # e.g. a preempted request prefilled again: its tokens on the host
                self._inflight.read()
                feed = None
        sample_seqs, logits = self.runner.run(batch, feed)
        self.scheduler.advance(batch)
        self.method.finish_step(batch)
        tokens = None
        if sample_seqs and self._forcing is not None:
            tokens = self._forcing.tokens(sample_seqs, logits)  # teacher_forced: fed as if sampled
        elif sample_seqs:
            tokens = self.sampler.sample(logits, [s.sampling_params for s in sample_seqs],
                                         [s.seq_id for s in sample_seqs])
        finished = len(batch.failed) + self._settle()  # the previous step's tokens: the device is past them
        if tokens is not None:
            self._launch(sample_seqs, tokens)
            if not self.async_scheduling:
                finished += self._settle()
        return finished

    def sync(self) -> int:
        """Read the last step's sampled tokens into their requests now (asynchronous
        scheduling leaves them on the device until the next step); returns how many
        requests they finished."""
        return self._settle()

    def _launch(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """Give each request still running a placeholder for its token of this step; one
        that reaches its length limit with it finishes now (it is not scheduled again)."""
        kept = [(i, seq) for i, seq in enumerate(seqs) if not seq.is_finished]
        for _, seq in kept:
            seq.output_token_ids.append(PLACEHOLDER)
            if self._at_length_limit(seq):
                self._finish(seq, "length")
        self._inflight = Inflight([s for _, s in kept], [i for i, _ in kept], tokens)

    def _settle(self) -> int:
        """Read the in-flight tokens and finish the requests they end; returns how many."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return 0
        finished = 0
        now = time.perf_counter()
        for seq, tok in zip(inflight.seqs, inflight.read()):
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq, tok)
            if seq.is_finished:
                if seq.finish_reason == "length":  # by _launch, at its length limit: a stop token wins
                    seq.finish_reason, seq.finish_time = reason, now
                    finished += 1
            elif reason is not None:
                self._finish(seq, reason)
                seq.finish_time = now
                finished += 1
        return finished

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.kv_tokens_at_end = self.method.kv_tokens(seq)
        self.scheduler.finish(seq, reason)
        self.method.release(seq)
        self.cache.drop(seq)
        self.sampler.release(seq.seq_id)

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.sampling_params
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if any(s in text for s in p.stop):
                return "stop"
        if self._at_length_limit(seq):
            return "length"
        return None

    def _at_length_limit(self, seq: Sequence) -> bool:
        return len(seq.output_token_ids) >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len

    def _output(self, seq: Sequence, prompt) -> RequestOutput:
        text = ""
        if self.tokenizer is not None and seq.output_token_ids:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            for s in seq.sampling_params.stop:
                if s in text:
                    text = text[: text.index(s)]
        ttft = (seq.first_token_time - seq.arrival_time) if seq.first_token_time else None
        decode = (seq.finish_time - seq.first_token_time) if seq.finish_time and seq.first_token_time else 0.0
        return RequestOutput(
            request_id=seq.seq_id, prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(seq.prompt_token_ids), text=text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason or "error", error=seq.error,
            metrics={"prompt_tokens": seq.num_prompt_tokens, "output_tokens": len(seq.output_token_ids),
                     "ttft_s": ttft, "decode_s": decode, "preemptions": seq.num_preemptions,
                     "kv_tokens": getattr(seq, "kv_tokens_at_end", None)},
        )

    @property
    def peak_pages_used(self) -> int:
        return self.allocator.peak_used

    # ---- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inflight = None
        for name in ("runner", "method", "cache", "kv_cache", "model", "provider", "scheduler", "allocator"):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
