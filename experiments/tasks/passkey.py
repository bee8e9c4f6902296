"""Passkey retrieval: a five-digit key hidden at a random depth in filler text.

Models without a tokenizer (shipped shapes with dummy weights) get the same task in token
space: random filler ids with a five-token key between marker tokens; the score is then
the fraction of key tokens the model produces (a pipeline check, ~0 for random weights).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from experiments.ruler.generator import generate_sample
from experiments.ruler.scoring import score_sample
from experiments.tasks.base import Task, TaskEnv
from experiments.tasks.generation import Prompt, run_prompts, summarize

_MARK, _QUERY, _FIRST_FILLER = 3, 4, 16


def token_passkey(vocab_size: int, length: int, seed: int, index: int) -> Prompt:
    rng = random.Random(f"passkey-ids-{seed}-{index}-{length}")
    key = [rng.randrange(_FIRST_FILLER, vocab_size) for _ in range(5)]
    needle = [_MARK, *key, _MARK]
    filler = [rng.randrange(_FIRST_FILLER, vocab_size) for _ in range(max(0, length - len(needle) - 2))]
    at = rng.randrange(len(filler) + 1)
    ids = filler[:at] + needle + filler[at:] + [_QUERY, _MARK]
    return Prompt("passkey", index, ids, [" ".join(map(str, key))], max_tokens=5,
                  meta={"depth": at / max(1, len(filler))})


@dataclass
class PasskeyTask(Task):
    name: str = "passkey"
    context_length: int = 1024
    num_samples: int = 4
    chat: bool = True
    chunk_size: int = 8

    def prompts(self, llm, seed: int) -> list[Prompt]:
        tok = llm.tokenizer
        if tok is None:
            return [token_passkey(llm.model_config.vocab_size, self.context_length, seed, i)
                    for i in range(self.num_samples)]
        out = []
        for i in tqdm(range(self.num_samples), desc="passkey samples", leave=False):
            s = generate_sample("passkey", tok, self.context_length, seed, i, self.chat)
            out.append(Prompt("passkey", i, s.prompt_ids, s.answers, s.max_tokens))
        return out

    def run(self, env: TaskEnv) -> dict[str, Any]:
        with env.engine() as llm:
            prompts = self.prompts(llm, env.seed)
            rows = run_prompts(llm, prompts, lambda p, o: score_sample(
                "passkey", o.text if llm.tokenizer is not None else " ".join(map(str, o.token_ids)), p.answers),
                env, "passkey", self.chunk_size)
        env.table("passkey/samples", rows)
        return summarize(rows, "passkey")
