"""RULER (Hsieh et al., 2024): synthetic long-context tasks generated offline at any length,
scored with RULER's string-match metrics. One job runs every selected subtask."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from experiments.ruler.generator import RULER_TASKS, generate_sample
from experiments.ruler.scoring import score_sample
from experiments.tasks.base import Task, TaskEnv
from experiments.tasks.generation import Prompt, run_prompts, summarize


@dataclass
class RulerTask(Task):
    name: str = "ruler"
    context_length: int = 2048
    num_samples: int = 8  # per subtask
    subtasks: list[str] = field(default_factory=lambda: list(RULER_TASKS))
    chat: bool = True
    chunk_size: int = 8

    def __post_init__(self) -> None:
        bad = [s for s in self.subtasks if s not in RULER_TASKS]
        if bad:
            raise ValueError(f"Unknown RULER subtask(s) {bad}. Valid: {', '.join(RULER_TASKS)}")

    def prompts(self, tokenizer, seed: int) -> list[Prompt]:
        out = []
        jobs = [(t, i) for t in self.subtasks for i in range(self.num_samples)]
        for task, i in tqdm(jobs, desc="ruler samples", leave=False):
            s = generate_sample(task, tokenizer, self.context_length, seed, i, self.chat)
            out.append(Prompt(task, i, s.prompt_ids, s.answers, s.max_tokens))
        return out

    def run(self, env: TaskEnv) -> dict[str, Any]:
        with env.engine() as llm:
            prompts = self.prompts(llm.tokenizer, env.seed)
            rows = run_prompts(llm, prompts, lambda p, o: score_sample(p.subtask, o.text, p.answers), env,
                               "ruler", self.chunk_size)
        env.table("ruler/samples", rows)
        return summarize(rows, "ruler")
