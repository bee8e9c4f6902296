"""Fidelity against the dense reference (``vanilla``) on the same prompts.

The reference generates a greedy continuation of ``max_tokens`` tokens for each prompt;
the method is measured against it three ways.

Free running (the method's own decode path, its own tokens):
- ``fidelity/top1_agreement``: greedy continuations of both engines compared position by
  position.
- ``fidelity/prefix_match_tokens``: tokens before the first disagreement.

Prompt path (``LLM.prompt_logits`` over prompt + reference continuation: the PREFILL path,
so these see only prefill-side sparsity; a decode-side method such as Quest, OmniKV, H2O
or StreamingLLM scores near 0 KL here whatever its decode does):
- ``fidelity/kl_mean`` / ``fidelity/kl_max``: KL(reference || method) of the next-token
  distributions at the last ``kl_positions`` prompt positions and along the continuation,
  averaged per sample; the mean and the largest of those sample means.
- ``fidelity/teacher_forced_top1``: argmax agreement at the same positions.

Decode path (``LLM.teacher_forced`` along the reference's continuation, in both engines:
each prompt prefilled, then every continuation token fed in turn through the engine's
real decode path, so the method's selection, eviction and compression all run; rows
``i = 0 .. max_tokens - 1`` predict continuation token ``i``, row 0 at the prompt's last
position, the others at decode steps):
- ``fidelity/decode_kl_mean`` / ``fidelity/decode_kl_max``: KL(reference || method) of
  the next-token distributions at those rows, averaged per sample; the mean and the
  largest of those sample means.
- ``fidelity/decode_teacher_forced_top1``: share of those rows whose argmax agrees.
- ``fidelity/attention_output_rel_error``: at each of those rows and each layer, the
  attention output (the attention op's output before the o projection, all heads, float32)
  gives ``||a_method - a_ref||_2 / ||a_ref||_2``; the mean over rows and layers per sample,
  then the mean over samples (every sample has the same rows and layers, so this is the
  mean over samples, rows and layers). Per sample (``samples.jsonl``) also its largest
  value and its mean per layer.
- ``fidelity/reference_cached``: whether the reference's outputs came from
  ``reference_cache_dir`` (``reference_cache.py``: the same reference engine, task, prompts
  and engine source computed them in an earlier job) instead of a reference pass.
- ``fidelity/decode_preemptions``: times a teacher-forced request of either engine was
  prefilled again because the KV pool ran out (0 normally); the row after each came from
  a prefill rather than a decode step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from experiments.corpus import token_windows
from experiments.tasks.base import Task, TaskEnv
from experiments.tasks.reference_cache import ReferenceCache, reference_key, weights_identity


def kl_rows(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || method) per row of two ``[n, vocab]`` log-probability tensors -> ``[n]``."""
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


def attention_rel_error(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """``||got - ref|| / ||ref||`` per (row, layer) of two ``[n, layers, heads * head_dim]``
    attention outputs -> ``[n, layers]``."""
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(torch.finfo(ref.dtype).tiny)


def sample_metrics(ref_tokens: list[int], tokens: list[int], ref_logp: torch.Tensor, logp: torch.Tensor,
                   ref_forced, forced) -> dict[str, Any]:
    """One prompt's record: free-running tokens, prompt-path log-probs and teacher-forced
    outputs (``TeacherForcedOutput``) of the reference and of the method."""
    n = min(len(ref_tokens), len(tokens))
    same = [x == y for x, y in zip(ref_tokens[:n], tokens[:n])]
    decode_kl = kl_rows(torch.log_softmax(ref_forced.logits, -1), torch.log_softmax(forced.logits, -1))
    err = attention_rel_error(ref_forced.attention, forced.attention)  # [rows, layers]
    return {"top1_agreement": sum(same) / max(1, n),
            "prefix_match_tokens": same.index(False) if False in same else n,
            "kl_mean": float(kl_rows(ref_logp, logp).mean()),
            "teacher_forced_top1": float((ref_logp.argmax(-1) == logp.argmax(-1)).float().mean()),
            "decode_kl_mean": float(decode_kl.mean()), "decode_kl_worst_row": float(decode_kl.max()),
            "decode_teacher_forced_top1": float((ref_forced.logits.argmax(-1) == forced.logits.argmax(-1))
                                                .float().mean()),
            "attention_output_rel_error": float(err.mean()),
            "attention_output_rel_error_max": float(err.max()),
            "attention_output_rel_error_per_layer": err.mean(0).tolist(),
            "decode_preemptions": ref_forced.preemptions + forced.preemptions}


@dataclass
class FidelityTask(Task):
    name: str = "fidelity"
    context_length: int = 1024
    num_samples: int = 4
    max_tokens: int = 32
    kl_positions: int = 64
    reference_method: str = "vanilla"
    text_path: str | None = None
    reference_cache_dir: str | None = None  # the reference pass kept here for the next job (None: not kept)

    def _pass(self, llm, windows: list[list[int]], conts: list[list[int]] | None, desc: str):
        """Free-running greedy outputs, the continuations to force (the reference's), the
        prompt-path log-probs and the teacher-forced decode outputs."""
        from sparseengine import SamplingParams

        outs = llm.generate(windows, SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True))
        conts = conts or [o.token_ids for o in outs]
        logps = []
        for w, c in tqdm(list(zip(windows, conts)), desc=desc, leave=False):
            keep = min(len(w) + len(c) - 1, self.kl_positions + len(c))
            logits = llm.prompt_logits([w + c], last=keep + 1)[0]  # the LM head on those rows only
            logps.append(torch.log_softmax(logits[:-1].float(), dim=-1))  # rows predicting known tokens
        forced = llm.teacher_forced(windows, conts, capture_attention=True)
        return [o.token_ids for o in outs], conts, logps, forced

    def _reference(self, ref, windows: list[list[int]]) -> tuple[tuple, bool]:
        """The reference pass's outputs, from the cache where it holds them; whether it did."""
        from sparseengine.engine.teacher_forcing import TeacherForcedOutput

        cache = ReferenceCache(self.reference_cache_dir)
        params = {k: v for k, v in self.params().items() if k != "reference_cache_dir"}
        key = reference_key(ref.config.to_dict(), params, windows, str(ref.device), weights_identity(ref.source.folder))
        entry = cache.load(key)
        if entry is None:
            out, conts, logps, forced = self._pass(ref, windows, None, "fidelity reference")
            cache.save(key, {"out": out, "conts": conts, "logps": logps,
                             "forced": [{"logits": f.logits, "attention": f.attention, "preemptions": f.preemptions}
                                        for f in forced]})
            return (out, conts, logps, forced), False
        forced = [TeacherForcedOutput(i, w, c, f["logits"], f["attention"], f["preemptions"])
                  for i, (w, c, f) in enumerate(zip(windows, entry["conts"], entry["forced"]))]
        return (entry["out"], entry["conts"], entry["logps"], forced), True

    def run(self, env: TaskEnv) -> dict[str, Any]:
        ref_kwargs = {"sparse_method": self.reference_method, "prefill_sparse_method": "none",
                      "prefill_policy": "auto"}
        with env.engine(**ref_kwargs) as ref:
            windows = token_windows(ref.tokenizer, ref.model_config.vocab_size, self.context_length,
                                    self.num_samples, env.seed, self.text_path)
            (ref_out, conts, ref_logps, ref_forced), cached = self._reference(ref, windows)
        with env.engine() as llm:
            out, _, logps, forced = self._pass(llm, windows, conts, "fidelity method")
        rows = []
        for i, outputs in enumerate(zip(ref_out, out, ref_logps, logps, ref_forced, forced)):
            rows.append({"index": i, **sample_metrics(*outputs)})
            env.sample(rows[-1])

        def mean(key: str) -> float:
            return statistics.fmean(r[key] for r in rows)

        metrics = {"fidelity/top1_agreement": mean("top1_agreement"),
                   "fidelity/prefix_match_tokens": mean("prefix_match_tokens"),
                   "fidelity/kl_mean": mean("kl_mean"), "fidelity/kl_max": max(r["kl_mean"] for r in rows),
                   "fidelity/teacher_forced_top1": mean("teacher_forced_top1"),
                   "fidelity/decode_kl_mean": mean("decode_kl_mean"),
                   "fidelity/decode_kl_max": max(r["decode_kl_mean"] for r in rows),
                   "fidelity/decode_teacher_forced_top1": mean("decode_teacher_forced_top1"),
                   "fidelity/attention_output_rel_error": mean("attention_output_rel_error"),
                   "fidelity/decode_preemptions": sum(r["decode_preemptions"] for r in rows),
                   "fidelity/num_samples": len(windows), "fidelity/reference_method": self.reference_method,
                   "fidelity/reference_cached": cached}
        env.log(metrics)
        return metrics
