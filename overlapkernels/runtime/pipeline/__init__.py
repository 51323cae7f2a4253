"""Pipeline parallelism: schedules as action lists, a simulator, a renderer and an executor."""
from .render import render
from .messages import PipelineTimeout
from .runner import PipelineRunner
from .schedule import KINDS, Action, Schedule, make_schedule
from .simulate import ScheduleError, SimResult, simulate, validate
from .weight_grad import WeightGradStore, enable_zero_bubble, splits_weight_grad

__all__ = ["make_schedule", "Action", "Schedule", "KINDS", "validate", "simulate", "SimResult", "ScheduleError",
           "render", "PipelineRunner", "PipelineTimeout", "WeightGradStore", "enable_zero_bubble",
           "splits_weight_grad"]
