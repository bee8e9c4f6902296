"""Perplexity of natural text, from the engine's own prompt logits (``LLM.prompt_logits``).

These logits come from the prefill path, so they show prefill-side sparsity
(``prefill_sparse_method``); decode-side methods act after prefill and need a teacher-forced
decode hook in the engine to be measured here (see the toolkit report).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from experiments.corpus import STDLIB_CORPUS, token_windows
from experiments.tasks.base import Task, TaskEnv


@dataclass
class PerplexityTask(Task):
    name: str = "perplexity"
    context_length: int = 1024
    num_samples: int = 4
    text_path: str | None = None
    skip_first: int = 0  # positions excluded from the loss (e.g. the dense prefix)

    def run(self, env: TaskEnv) -> dict[str, Any]:
        nll_sum, count = 0.0, 0
        with env.engine() as llm:
            windows = token_windows(llm.tokenizer, llm.model_config.vocab_size, self.context_length,
                                    self.num_samples, env.seed, self.text_path)
            for i, ids in enumerate(tqdm(windows, desc="perplexity")):
                logits = llm.prompt_logits([ids])[0]  # [n, vocab], row t predicts token t + 1
                logp = torch.log_softmax(logits[:-1].float(), dim=-1)
                target = torch.tensor(ids[1:])
                nll = -logp.gather(1, target[:, None])[:, 0][self.skip_first:]
                nll_sum += float(nll.sum())
                count += nll.numel()
                env.sample({"index": i, "nll_mean": float(nll.mean()), "tokens": nll.numel()})
                env.log({"perplexity/ppl": math.exp(nll_sum / count), "perplexity/nll_mean": nll_sum / count,
                         "perplexity/tokens": count, "perplexity/num_samples": i + 1,
                         "perplexity/corpus": self.text_path or (STDLIB_CORPUS if llm.tokenizer else "random-ids")})
        return {"perplexity/ppl": math.exp(nll_sum / count), "perplexity/nll_mean": nll_sum / count}
