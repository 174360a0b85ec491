"""taskloom: AI agents run as a fleet of workers (planner, executors, critic) over Redis queues.

The public names an application needs are re-exported here.
"""

from bus.client import Client, GoalStatus, WaitTimeout
from bus.schemas import Goal, GoalRecord, GoalState, Plan, TaskSpec, Verdict
from executor.toolkit import Tool, ToolContext, Toolkit
from executor.toolkit import make_tool as tool

__all__ = [
    "Client",
    "Goal",
    "GoalRecord",
    "GoalState",
    "GoalStatus",
    "Plan",
    "TaskSpec",
    "Tool",
    "ToolContext",
    "Toolkit",
    "Verdict",
    "WaitTimeout",
    "tool",
]
