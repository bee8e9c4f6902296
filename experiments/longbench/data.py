"""LongBench data from a local JSONL file or a ``datasets`` cache; never a live download.

Expected layout: ``<data_dir>/<subtask>.jsonl`` with LongBench's fields (``input``,
``context``, ``answers``, ``all_classes``, ``length``), as in the official ``data.zip``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The official prompt templates and generation lengths (THUDM/LongBench config/*.json).
PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
MAX_NEW_TOKENS = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32,
                  "musique": 32, "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32,
                  "samsum": 128, "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64}
NO_CHAT = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}  # few-shot / code: raw prompts


def default_data_dir() -> Path:
    return Path(os.environ.get("LONGBENCH_DIR", Path.home() / ".cache" / "sparseengine" / "longbench"))


def load_subtask(subtask: str, data_dir: str | Path | None, source: str = "jsonl",
                 limit: int | None = None) -> list[dict[str, Any]]:
    if subtask not in PROMPTS:
        raise ValueError(f"Unknown LongBench subtask {subtask!r}. Valid: {', '.join(PROMPTS)}")
    if source == "jsonl":
        path = Path(data_dir or default_data_dir()) / f"{subtask}.jsonl"
        if not path.exists():
            raise FileNotFoundError(
                f"LongBench data for {subtask!r} not found: expected {path} (LongBench JSONL, one sample per "
                "line with input/context/answers). Unzip LongBench's data.zip there, set task.data_dir, "
                "or LONGBENCH_DIR")
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    elif source == "datasets":
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        import datasets

        try:
            ds = datasets.load_dataset("THUDM/LongBench", subtask, split="test", cache_dir=data_dir)
        except Exception as exc:
            raise FileNotFoundError(f"LongBench {subtask!r} is not in the datasets cache "
                                    f"{data_dir or '~/.cache/huggingface/datasets'} (offline): {exc}") from exc
        rows = [dict(r) for r in ds]
    else:
        raise ValueError(f"Invalid source={source!r}. Valid values: jsonl, datasets")
    return rows[:limit] if limit is not None else rows


def truncate_middle(ids: list[int], max_len: int) -> list[int]:
    """LongBench keeps the first and last halves of an over-long prompt."""
    if len(ids) <= max_len:
        return ids
    half = max_len // 2
    return ids[:half] + ids[len(ids) - (max_len - half):]
