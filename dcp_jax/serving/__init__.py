"""Serving: requests, the continuous-batching scheduler (host, plain Python), the model runner (pools and
step programs) and the engine that drives them. Importing this package loads no model code: import
`dcp_jax.serving.engine` or `dcp_jax.serving.runner` for the device side."""

from dcp_jax.serving.config import SchedulerConfig, ServingConfig
from dcp_jax.serving.request import Request, RequestState
from dcp_jax.serving.scheduler import NULL_PAGE, PrefillChunk, SchedulePlan, Scheduler

__all__ = ["NULL_PAGE", "PrefillChunk", "Request", "RequestState", "SchedulePlan", "Scheduler", "SchedulerConfig",
           "ServingConfig"]
