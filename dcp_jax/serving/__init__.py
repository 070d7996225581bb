"""Serving on the host: requests, continuous-batching scheduler (device programs live elsewhere)."""

from dcp_jax.serving.request import Request, RequestState
from dcp_jax.serving.scheduler import NULL_PAGE, PrefillChunk, SchedulePlan, Scheduler, SchedulerConfig

__all__ = ["NULL_PAGE", "PrefillChunk", "Request", "RequestState", "SchedulePlan", "Scheduler", "SchedulerConfig"]
