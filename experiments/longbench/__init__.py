"""LongBench (Bai et al., 2023): local data, the official prompts and per-sub-task metrics."""
