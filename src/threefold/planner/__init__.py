"""Cost model (memory, FLOPs, communication, pipeline bubble) and layout search: `threefold plan`."""

from .hardware import PRESETS as GPU_PRESETS, Gpu, load_gpu
from .memory import predict_memory, rank_memory
from .search import PlanResult, search
from .step_time import step_time
from .workload import Strategy, Workload, from_config

__all__ = ["GPU_PRESETS", "Gpu", "PlanResult", "Strategy", "Workload", "from_config", "load_gpu", "predict_memory",
           "rank_memory", "search", "step_time"]
