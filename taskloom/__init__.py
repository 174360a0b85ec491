"""taskloom: AI agents run as a fleet of workers (planner, executors, critic) over Redis queues.

The public names an application needs are re-exported here.
"""

from bus.client import GoalStatus, WaitTimeout
from bus.schemas import Goal, GoalRecord, GoalState, Plan, TaskSpec, Verdict
from executor.toolkit import Tool, ToolContext, Toolkit
from executor.toolkit import make_tool as tool
from taskloom.client import Client
from taskloom.settings import SettingsError

__all__ = [
    "Client",
    "Goal",
    "GoalRecord",
    "GoalState",
    "GoalStatus",
    "Plan",
    "SettingsError",
    "TaskSpec",
    "Tool",
    "ToolContext",
    "Toolkit",
    "Verdict",
    "WaitTimeout",
    "tool",
]
