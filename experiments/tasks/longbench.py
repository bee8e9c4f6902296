"""LongBench: the official prompts, middle truncation to ``context_length`` and per-sub-task
metrics (score in percent under ``longbench/<subtask>/score``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from experiments.longbench import data, metrics
from experiments.tasks.base import Task, TaskEnv
from experiments.tasks.generation import Prompt, run_prompts, summarize


@dataclass
class LongBenchTask(Task):
    name: str = "longbench"
    context_length: int = 8192  # prompts longer than this are truncated in the middle
    num_samples: int = 8  # per subtask (the first N)
    subtasks: list[str] = field(default_factory=lambda: ["hotpotqa", "passage_retrieval_en"])
    data_dir: str | None = None  # None: $LONGBENCH_DIR or ~/.cache/sparseengine/longbench
    source: str = "jsonl"
    chat: bool = True
    chunk_size: int = 4

    def prompts(self, tokenizer) -> list[Prompt]:
        if tokenizer is None:
            raise ValueError("LongBench needs a model with a tokenizer")
        out = []
        for sub in self.subtasks:
            for i, row in enumerate(data.load_subtask(sub, self.data_dir, self.source, self.num_samples)):
                text = data.PROMPTS[sub].format(context=row["context"], input=row.get("input", ""))
                max_new = data.MAX_NEW_TOKENS[sub]
                budget = self.context_length - max_new - (32 if self.chat else 0)  # room for the template
                ids = data.truncate_middle(tokenizer.encode(text, add_special_tokens=False), budget)
                if self.chat and sub not in data.NO_CHAT:
                    text = tokenizer.decode(ids)
                    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                             add_generation_prompt=True, tokenize=True,
                                                             return_dict=False))
                out.append(Prompt(sub, i, ids, list(row["answers"]), max_new,
                                  meta={"all_classes": row.get("all_classes"), "length": row.get("length")}))
        return out

    def run(self, env: TaskEnv) -> dict[str, Any]:
        with env.engine() as llm:
            prompts = self.prompts(llm.tokenizer)
            rows = run_prompts(llm, prompts, lambda p, o: metrics.score(p.subtask, o.text, p.answers,
                                                                        p.meta.get("all_classes")),
                               env, "longbench", self.chunk_size)
        env.table("longbench/samples", rows)
        return summarize(rows, "longbench")
