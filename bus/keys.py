"""Every Redis key, stream, queue name and job id taskloom uses, under one prefix.

Two deployments sharing one Redis differ only in their prefix, so everything they write must be
named here. Where a key is derived from another inside a Lua script or a store method (a task's hash
is `tasks(goal) + ":" + task_id`, its id set `tasks(goal) + ":ids"`), the method here says so.
"""

from __future__ import annotations

import os.path
from dataclasses import dataclass

from arq.constants import health_check_key_suffix, in_progress_key_prefix, job_key_prefix, result_key_prefix

ROLES = ("planner", "executor", "critic")

# arq's own keys of a job, named by arq (`arq.constants`) and read here only: the job (its payload),
# its result, and the mark of a job a worker runs. tests/test_arq_internals.py checks them against
# what arq writes.
ARQ_JOB = job_key_prefix
ARQ_RESULT = result_key_prefix
ARQ_IN_PROGRESS = in_progress_key_prefix
# What every key arq keeps for a job starts with ("arq:" in arq 0.28): key prefixes, compared as
# strings (not paths).
ARQ_PREFIX = os.path.commonprefix([ARQ_JOB, ARQ_RESULT, ARQ_IN_PROGRESS])  # noqa: RUF071


def arq_job(job_id: str) -> str:
    return f"{ARQ_JOB}{job_id}"


def arq_result(job_id: str) -> str:
    return f"{ARQ_RESULT}{job_id}"


def arq_in_progress(job_id: str) -> str:
    return f"{ARQ_IN_PROGRESS}{job_id}"


@dataclass(frozen=True)
class Keys:
    prefix: str = "taskloom:"
    planner_queue_name: str = "planner"
    executor_queue_name: str = "executor"
    critic_queue_name: str = "critic"

    # -- queues (arq sorted sets) -------------------------------------------------------------
    def queue(self, role: str) -> str:
        name = {
            "planner": self.planner_queue_name,
            "executor": self.executor_queue_name,
            "critic": self.critic_queue_name,
        }.get(role)
        if name is None:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        return f"{self.prefix}queue:{name}"

    def health_check(self, role: str) -> str:
        """arq's health-check key of the role's queue (every worker of the role overwrites it)."""
        return f"{self.queue(role)}{health_check_key_suffix}"

    def wake(self, role: str) -> str:
        """Stream the role's idle workers block on: one entry per enqueued job wakes them."""
        return f"{self.queue(role)}:wake"

    def workers(self, role: str) -> str:
        """Sorted set of the role's worker processes (`host:pid`) by heartbeat expiry."""
        return f"{self.queue(role)}:workers"

    # -- job ids: deterministic, so enqueueing the same step twice is a no-op in arq -------------
    def job_id(self, kind: str, *parts: str | int) -> str:
        return ":".join([f"{self.prefix}job", kind, *(str(p) for p in parts)])

    def patterns(self) -> tuple[str, str]:
        """SCAN patterns of every key under this prefix: ours, and arq's keys of our jobs (whose ids
        start with the prefix)."""
        return f"{self.prefix}*", f"{ARQ_PREFIX}*{self.prefix}*"

    # -- goals --------------------------------------------------------------------------------
    def goal(self, goal_id: str) -> str:
        return f"{self.prefix}goal:{goal_id}"

    def tasks(self, goal_id: str) -> str:
        """Prefix of a goal's task records: one hash per task at `<this>:<task id>` (state, attempt,
        plan version...), and the set of the goal's task ids at `<this>:ids` (so `ids` is a reserved
        task id)."""
        return f"{self.prefix}goal:{goal_id}:tasks"

    def task(self, goal_id: str, task_id: str) -> str:
        """Hash of one task record (a Lua script derives it as `task_prefix(goal) .. task_id`)."""
        return f"{self.task_prefix(goal_id)}{task_id}"

    def task_prefix(self, goal_id: str) -> str:
        return f"{self.tasks(goal_id)}:"

    def task_ids(self, goal_id: str) -> str:
        """Set of the goal's task ids."""
        return f"{self.tasks(goal_id)}:ids"

    def plan(self, goal_id: str, version: int) -> str:
        return f"{self.prefix}goal:{goal_id}:plan:{version}"

    def results(self, goal_id: str) -> str:
        """Hash: `result_field(task_id, attempt)` -> TaskResult JSON."""
        return f"{self.prefix}goal:{goal_id}:results"

    def syntheses(self, goal_id: str) -> str:
        """Hash: `<plan version>:<attempts key>` -> FinalVerdict JSON (bus.synthesis)."""
        return f"{self.prefix}goal:{goal_id}:syntheses"

    @staticmethod
    def result_field(task_id: str, attempt: int) -> str:
        """A result's field in `results(goal)`: `task_id:attempt`."""
        return f"{task_id}:{attempt}"

    def goal_events(self, goal_id: str) -> str:
        return f"{self.prefix}goal:{goal_id}:events"

    def live(self, goal_id: str) -> str:
        """Pub/Sub channel of the goal's live text (bus.live): a channel, never a key; nothing stored."""
        return f"{self.prefix}live:{goal_id}"

    def goal_index(self) -> str:
        """Sorted set of every goal id by submission time (for listing)."""
        return f"{self.prefix}goals"

    def submitted_index(self) -> str:
        """Sorted set of goals not yet picked up by a planner, by submission time. The store's scripts
        keep it; no reader uses it (the supervisor, planner.supervise, works from `active_index`).
        Kept because dropping it would change the key layout that every running deployment shares."""
        return f"{self.prefix}goals:submitted"

    def active_index(self) -> str:
        """Sorted set of every non-terminal goal by the time it last made progress (supervisor)."""
        return f"{self.prefix}goals:active"

    def drivers(self, goal_id: str) -> str:
        """Hash: slot (`goal` or `task:<id>`) -> id of the last job enqueued for it (supervisor)."""
        return f"{self.prefix}goal:{goal_id}:drivers"

    def provider_trouble(self, goal_id: str) -> str:
        """A provider-trouble clock kept outside the books, as data written by older workers may hold
        (the clock is the ledger field `trouble_since`); resuming a goal deletes it, so that no stale
        clock outlives the resume."""
        return f"{self.prefix}goal:{goal_id}:provider-trouble"

    def job_errors(self, job_id: str) -> str:
        """Counter of a job's unexpected errors (bus.retry bounds them; provider trouble is separate)."""
        return f"{job_id}:errors"

    def side_effects(self, goal_id: str, task_id: str) -> str:
        """Hash: `tool:args digest` -> the side-effecting call's record, across the task's attempts."""
        return f"{self.prefix}goal:{goal_id}:effects:{task_id}"

    def approvals_pending(self) -> str:
        """Sorted set of `goal_id call_id` awaiting a decision, by request time (the approvals inbox)."""
        return f"{self.prefix}approvals:pending"

    def api_endpoints(self) -> str:
        """Sorted set of running API processes' console URLs by heartbeat expiry (ms)."""
        return f"{self.prefix}api:endpoints"

    def global_events(self) -> str:
        return f"{self.prefix}events"

    def ledger(self, goal_id: str) -> str:
        return f"{self.prefix}goal:{goal_id}:ledger"

    def breaker(self, model: str) -> str:
        """Hash: a model's fleet-wide circuit breaker (failures in the window, open until) (bus.breaker)."""
        return f"{self.prefix}breaker:{model}"

    # -- token ledger ---------------------------------------------------------------------------
    def ledger_open(self) -> str:
        """Hash: open reservation id -> its record (every goal's, so any reserve can sweep them)."""
        return f"{self.prefix}ledger:open"

    def ledger_expiry(self) -> str:
        """Sorted set: open reservation id by expiry time."""
        return f"{self.prefix}ledger:expiry"

    def pool(self, name: str) -> str:
        """A parent budget pool (per tenant, per day) that goals draw from; the ledger's scripts derive
        the same key as `pool_prefix() .. name`."""
        return f"{self.pool_prefix()}{name}"

    def pool_prefix(self) -> str:
        return f"{self.prefix}pool:"

    # -- tenants ---------------------------------------------------------------------------------
    def tenant(self, name: str) -> str:
        """Hash: the tenant's pool settings (period, budget_tokens, budget_micro, max_running).
        The reserve script derives `<this>:periods` (sorted set of the tenant's period pool names by
        first use); each period's books are the pool `tenant:<name>:<period label>`."""
        return f"{self.prefix}tenant:{name}"

    def tenant_periods(self, name: str) -> str:
        return f"{self.tenant(name)}:periods"

    def tenant_grants(self, name: str) -> str:
        """Set: the books of the tenant's goals that hold a grant of one of its period pools (the
        scripts derive it as `<tenant>:grants`)."""
        return f"{self.tenant(name)}:grants"

    def tenant_running(self, name: str) -> str:
        """Sorted set: the tenant's running task attempts (`goal/task`) by slot expiry."""
        return f"{self.tenant(name)}:running"

    def tenants(self) -> str:
        """Set of every tenant name that has settings."""
        return f"{self.prefix}tenants"

    # -- fleet-wide rate limits ------------------------------------------------------------------
    def ratelimit(self, model: str) -> str:
        """Hash: the model's token buckets (requests, input and output tokens) and penalty state;
        `<this>:queue` is the sorted set of waiting calls in fair order."""
        return f"{self.prefix}ratelimit:{model}"

    def ratelimit_queue(self, model: str) -> str:
        return f"{self.ratelimit(model)}:queue"

    # -- executor checkpoints, leases and approvals --------------------------------------------
    def attempt(self, goal_id: str, task_id: str, attempt: int) -> str:
        """Base of one task attempt's keys: `:steps` (list), `:pending` (hash), `:lease` (hash)."""
        return f"{self.prefix}goal:{goal_id}:attempt:{task_id}:{attempt}"

    def attempt_lease(self, goal_id: str, task_id: str, attempt: int) -> str:
        """Hash: epoch, holder, expires_ms, started_ms of the attempt's lease (bus.attempts)."""
        return f"{self.attempt(goal_id, task_id, attempt)}:lease"

    def attempt_steps(self, goal_id: str, task_id: str, attempt: int) -> str:
        """List of the attempt's completed StepRecord JSON, in order."""
        return f"{self.attempt(goal_id, task_id, attempt)}:steps"

    def attempt_pending(self, goal_id: str, task_id: str, attempt: int) -> str:
        """Hash: the step in progress (`turn`, `started:<call>`, `result:<call>`)."""
        return f"{self.attempt(goal_id, task_id, attempt)}:pending"

    def leases(self) -> str:
        """Sorted set of running attempts (`lease_member`) by lease expiry; the executors' watchdog
        reads it."""
        return f"{self.prefix}leases"

    @staticmethod
    def lease_member(goal_id: str, task_id: str, attempt: int) -> str:
        """An attempt's member in `leases()`: `goal|task|attempt`."""
        return f"{goal_id}|{task_id}|{attempt}"

    @staticmethod
    def parse_lease_member(member: str) -> tuple[str, str, int]:
        goal_id, task_id, attempt = member.split("|")
        return goal_id, task_id, int(attempt)

    def approvals(self, goal_id: str) -> str:
        """Hash: tool call id -> decision (`approved` or `denied:<reason>`, see bus.approvals)."""
        return f"{self.prefix}goal:{goal_id}:approvals"

    def approval_requests(self, goal_id: str) -> str:
        """Hash: tool call id -> ApprovalRequest JSON (bus.approvals)."""
        return f"{self.prefix}goal:{goal_id}:approval-requests"
