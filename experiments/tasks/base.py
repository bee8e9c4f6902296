"""What every task gets (``TaskEnv``) and is (``Task``): one job runs one task once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from experiments.records import append_sample


@dataclass
class TaskEnv:
    """The job's handle on the engine config and the record. Tasks build engines here so
    every engine a job creates is made from the same resolved config."""

    engine_kwargs: dict[str, Any]
    seed: int
    job_dir: Path | None
    log: Callable[[dict[str, Any]], None]  # merge metrics into the record, as soon as measured
    table: Callable[[str, list[dict[str, Any]]], None] = lambda name, rows: None

    def engine(self, **overrides: Any):
        """An engine from the job's config; which implementation runs each attention op
        (``provider.ops()``) and whether it schedules asynchronously (the config's ``None``
        resolved) go into the record at once."""
        from sparseengine import LLM
        from sparseengine.kernels import cuda_linear

        llm = LLM(**{**self.engine_kwargs, **overrides})
        method_kernels = llm.method.kernels(llm.device, llm.provider)
        self.log({"attention/provider": llm.provider.name,
                  **{f"attention/ops/{op}": impl for op, impl in llm.provider.ops().items()},
                  "engine/async_scheduling": llm.async_scheduling,
                  "engine/decode_linears": cuda_linear.engine_linears(llm.model, llm.device),
                  **{f"engine/method_kernels/{op}": impl for op, impl in method_kernels.items()}})
        return llm

    def sample(self, row: dict[str, Any]) -> None:
        """One per-sample line in the job folder's ``samples.jsonl`` (kept on a crash)."""
        if self.job_dir is not None:
            append_sample(self.job_dir / "samples.jsonl", row)


@dataclass
class Task:
    name: str = "task"
    context_length: int = 1024
    num_samples: int = 4

    def run(self, env: TaskEnv) -> dict[str, Any]:
        """Run, calling ``env.log`` as metrics arrive; return the final metrics."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
