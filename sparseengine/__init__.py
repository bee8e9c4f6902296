"""SparseEngine: a sparse-first inference engine for long-context LLMs."""

from sparseengine.config import Config, ConfigError
from sparseengine.engine.llm_engine import LLM
from sparseengine.engine.outputs import RequestOutput
from sparseengine.engine.teacher_forcing import TeacherForcedOutput
from sparseengine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "Config", "ConfigError", "RequestOutput", "TeacherForcedOutput"]
__version__ = "0.1.0"
