"""What live text costs a worker: CPU and Redis commands per model call, streamed or not.

    python -m bench.streaming [--redis-url redis://127.0.0.1:6379/0 | embedded] [--goals 10] [--rounds 2]
                              [--tokens 1000] [--pace 0.02]

Each call is an executor's request through the worker's metered model (`build_runtime`: the ledger's
reserve and settle around it), to the fake Messages API answering `--tokens` output tokens of text
(4 characters a token, sent as SSE deltas of 16 characters, one every `--pace` seconds when
streamed). Rows, each `--goals` calls at once (one goal each), `--rounds` times:

- streaming off: `complete(request)`, a plain HTTP reply (what `TASKLOOM_STREAM=false` runs);
- streaming on, nobody listening: as the executor calls (`LivePublisher.sink` first: nobody
  watches, so a plain call);
- streaming on, a listener on every goal (another connection subscribed to each goal's channel, in
  this orchestrating process; its deliveries are counted: the batches);
- for reference, streamed although nobody listens: what the stream itself costs the worker.

The calls run in a process of their own (`measure`), so that its CPU (`time.process_time`) is the
worker's alone: the fake API and the listener run here. Commands are `INFO commandstats` deltas
(the INFO itself taken out). Prints a table and the targets: streaming adds at most 10% CPU per
call, at most one command per batch, and nothing while nobody listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass

from arq import create_pool

from bench._harness import (
    DEFAULT_REDIS,
    REPO,
    Bench,
    bench_redis,
    command_counts,
    fake_worker_settings,
)
from bus.connection import redis_settings
from bus.live import LiveCall
from executor.loop import SYSTEM
from executor.registry import ToolRegistry
from llm.testing import FakeAnthropicServer, RecordedRequest, Reply, Script
from llm.types import Message, ModelRequest
from taskloom.workers import build_runtime, make_inner_model, make_ledger

TARGET_CPU = 1.10  # streamed CPU per call at most this times the plain call's
TARGET_COMMANDS_PER_BATCH = 1.0


@dataclass(frozen=True)
class Row:
    name: str
    calls: int
    cpu_ms_per_call: float
    commands_per_call: float
    publish_per_call: float
    pubsub_per_call: float  # PUBSUB CHANNELS, the listener check (Redis 6.2 counts every PUBSUB subcommand as `pubsub`)
    batches_per_call: float = 0.0  # messages the listener received


def answer_text(tokens: int) -> str:
    words = []
    i = 0
    while sum(len(w) + 1 for w in words) < tokens * 4:
        words.append(f"word{i % 1000:03d}")
        i += 1
    return " ".join(words)[: tokens * 4]


def request(goal_id: str) -> ModelRequest:
    text = f"Goal: write a long answer\nYour task (t1): write\nInstructions: Write the answer for {goal_id}."
    return ModelRequest(
        system=SYSTEM, messages=[Message.user(text)], max_tokens=2048, metadata={"goal_id": goal_id, "task_id": "t1"}
    )


# -- the worker's side (a process of its own) --------------------------------------------------------


async def measure(
    redis_url: str, base_url: str, prefix: str, goals: list[str], rounds: int, mode: str
) -> dict[str, float]:
    settings = fake_worker_settings(redis_url, base_url, prefix)
    redis = await create_pool(redis_settings(redis_url))
    inner = make_inner_model(settings)
    try:
        rt = build_runtime(settings, redis, inner, ToolRegistry())
        assert rt.live is not None
        ledger = make_ledger(settings, redis)
        warm = [f"warm-{uuid.uuid4().hex[:8]}" for _ in goals]
        for g in [*warm, *goals]:
            await ledger.open(g, 10**12, tenant="default")

        async def call(goal_id: str) -> None:
            model = rt.model_for(goal_id, "executor")
            if mode == "plain":
                await model.complete(request(goal_id))
                return
            assert rt.live is not None
            # As the executor's loop does (`LivePublisher.sink`: None while nobody watches), or,
            # `forced`, streamed whether or not anyone watches (what a stream itself costs).
            if mode == "forced":
                sink: LiveCall | None = rt.live.call(goal_id, "t1", 1, 0)
            else:
                sink = await rt.live.sink(goal_id, "t1", 1, 0)
            if sink is None:
                await model.complete(request(goal_id))
                return
            try:
                await model.complete(request(goal_id), on_text=sink)
            finally:
                await sink.close()

        await asyncio.gather(*(call(g) for g in warm))  # connections, imports, the SDK's first parse
        before = await command_counts(redis)
        t0 = time.process_time()
        for _ in range(rounds):
            await asyncio.gather(*(call(g) for g in goals))
        cpu = time.process_time() - t0
        delta = await command_counts(redis) - before
        delta["info"] = max(0, delta["info"] - 1)
        calls = len(goals) * rounds
        pubsub = delta["pubsub"] + delta["pubsub|numsub"] + delta["pubsub|channels"]
        return {
            "calls": calls,
            "cpu_ms_per_call": cpu * 1000 / calls,
            "commands_per_call": sum(delta.values()) / calls,
            "publish_per_call": delta["publish"] / calls,
            "pubsub_per_call": pubsub / calls,
        }
    finally:
        close = getattr(inner, "aclose", None)
        if close is not None:
            await close()
        await redis.aclose()


# -- the orchestrator: the fake API, the listener, the rows ---------------------------------------------


class Writer:
    def __init__(self, text: str, pace: float) -> None:
        self.text, self.pace = text, pace

    def __call__(self, req: RecordedRequest) -> Script:
        return Reply(content=[{"type": "text", "text": self.text}], pace=self.pace if req.body.get("stream") else 0.0)


async def row(bench: Bench, base_url: str, name: str, mode: str, goals: int, rounds: int, listen: bool) -> Row:
    ids = [f"g-{uuid.uuid4().hex[:12]}" for _ in range(goals)]
    received = 0
    listener = None
    pubsub = bench.redis.pubsub(ignore_subscribe_messages=True)
    if listen:
        await pubsub.subscribe(*(bench.keys.live(g) for g in ids))

        async def count() -> None:
            nonlocal received
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None and message.get("type") == "message":
                    received += 1

        listener = asyncio.create_task(count())
    args = [
        "-m", "bench.streaming", "measure", "--redis-url", bench.url, "--base-url", base_url,
        "--prefix", bench.prefix, "--rounds", str(rounds), "--mode", mode, "--goal-ids", ",".join(ids),
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(sys.executable, *args, cwd=REPO, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"bench.streaming measure exited with {proc.returncode}")
    await asyncio.sleep(0.5)  # the last deliveries
    if listener is not None:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    await pubsub.aclose()  # type: ignore[no-untyped-call]
    got = json.loads(out.decode().strip().splitlines()[-1])
    return Row(name=name, batches_per_call=received / got["calls"], **got)


def table(rows: list[Row], tokens: int, pace: float, where: str) -> str:
    plain, silent, heard, reference = rows
    lines = [
        f"bench.streaming: {tokens}-token answers ({tokens * 4} characters, SSE deltas of 16 every {pace:g} s), "
        f"{plain.calls} calls per row, Redis: {where}",
        "",
        "| row | CPU ms/call | Redis commands/call | PUBLISH/call | PUBSUB/call | batches/call |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.cpu_ms_per_call:.2f} | {r.commands_per_call:.2f} | {r.publish_per_call:.2f} | "
            f"{r.pubsub_per_call:.2f} | {r.batches_per_call:.1f} |"
        )
    # Live text's own commands: PUBLISH and PUBSUB NUMSUB (the rest is the call's, as streaming off,
    # plus redis-py's CLIENT SETINFO when the pool opens a connection for a concurrent send).
    extra = heard.publish_per_call + heard.pubsub_per_call
    per_batch = extra / heard.batches_per_call if heard.batches_per_call else float("inf")
    silent_extra = silent.commands_per_call - plain.commands_per_call
    cpu_silent = silent.cpu_ms_per_call / plain.cpu_ms_per_call - 1
    cpu_heard = heard.cpu_ms_per_call / plain.cpu_ms_per_call - 1
    publish_per_batch = heard.publish_per_call / heard.batches_per_call if heard.batches_per_call else float("inf")

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines += [
        "",
        "| target | measured | |",
        "| --- | --- | --- |",
        f"| streaming adds <= 10% worker CPU per call, nobody listening | {cpu_silent:+.1%} | "
        f"{verdict(cpu_silent <= TARGET_CPU - 1)} |",
        f"| streaming adds <= 10% worker CPU per call, a listener | {cpu_heard:+.1%} (streamed regardless of "
        f"listeners: {reference.cpu_ms_per_call / plain.cpu_ms_per_call - 1:+.1%}: the stream's reads, not the "
        f"publishing) | {verdict(cpu_heard <= TARGET_CPU - 1)} |",
        f"| <= 1 Redis command per batch, a listener | {publish_per_batch:.2f} PUBLISH per batch; with the "
        f"listener check, once per goal and process ({heard.pubsub_per_call:.2f} PUBSUB/call here), {per_batch:.3f}"
        f" | {verdict(publish_per_batch <= TARGET_COMMANDS_PER_BATCH)} |",
        f"| nothing while nobody listens | {silent.publish_per_call:.2f} PUBLISH/call and no stream; the check "
        f"before a call: {silent.pubsub_per_call:.2f} PUBSUB NUMSUB/call (at most one per goal per 0.25 s, as "
        f"a call starts; all commands {silent_extra:+.2f}/call) | "
        f"{verdict(silent.publish_per_call == 0)} (no PUBLISH) |",
    ]
    return "\n".join(lines)


async def run(url: str, goals: int, rounds: int, tokens: int, pace: float) -> str:
    async with bench_redis(url, "streaming") as bench:
        with FakeAnthropicServer() as fake:
            fake.respond_with(Writer(answer_text(tokens), pace))
            url, plan = (
                fake.base_url,
                [
                    ("streaming off", "plain", False),
                    ("streaming on, nobody listening", "stream", False),
                    ("streaming on, a listener per goal", "stream", True),
                    ("(streamed regardless, nobody listening)", "forced", False),
                ],
            )
            rows = [await row(bench, url, name, mode, goals, rounds, listen) for name, mode, listen in plan]
        return table(rows, tokens, pace, bench.where)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="run", choices=("run", "measure"))
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--goals", type=int, default=10, help="calls at once, one goal each")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1000, help="output tokens of each answer")
    parser.add_argument("--pace", type=float, default=0.02, help="seconds between 16-character deltas")
    # `measure` (the worker's process): where, and which goals.
    parser.add_argument("--base-url", default="")
    parser.add_argument("--prefix", default="")
    parser.add_argument("--mode", choices=("plain", "stream", "forced"), default="plain")
    parser.add_argument("--goal-ids", default="")
    args = parser.parse_args(argv)
    if args.what == "measure":
        ids = args.goal_ids.split(",")
        got = asyncio.run(measure(args.redis_url, args.base_url, args.prefix, ids, args.rounds, args.mode))
        print(json.dumps(got))
        return
    # `embedded`: a redis-server of this run's own, so that nobody else's commands are counted.
    url = "redis://127.0.0.1:1/0" if args.redis_url == "embedded" else args.redis_url
    print(asyncio.run(run(url, args.goals, args.rounds, args.tokens, args.pace)))


if __name__ == "__main__":
    main()
