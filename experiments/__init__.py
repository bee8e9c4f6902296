"""The SparseEngine research toolkit: tasks, records, loggers, aggregation and figures.

Everything here talks to the engine through its public API (``LLM``, ``SamplingParams``,
``Config``, ``method_registry``); ``run.py`` composes the Hydra config and runs one task.
"""
