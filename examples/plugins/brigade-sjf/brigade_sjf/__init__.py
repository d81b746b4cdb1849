"""Shortest-job-first scheduling for Brigade, shipped as an out-of-tree plugin."""

from brigade_sjf.scheduler import SjfOptions, SjfPolicy

__all__ = ["SjfOptions", "SjfPolicy"]
