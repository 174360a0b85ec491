"""Serve the fake Messages API: `python -m llm.testing [--port 8765] [--dialect anthropic|openai]`.

With no script, every request is answered by the offline demo model's rules, so a toolkit or an
app can be tried against the real SDK with `ANTHROPIC_BASE_URL=http://127.0.0.1:8765` and any key
(`--dialect openai`: the fake Chat Completions API, `OPENAI_BASE_URL=http://127.0.0.1:8765/v1`).
"""

from __future__ import annotations

import argparse
import threading

from llm.demo import DemoModel
from llm.testing.openai_server import FakeOpenAIServer
from llm.testing.openai_wire import openai_responder_from_model
from llm.testing.server import FakeAnthropicServer
from llm.testing.wire import responder_from_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llm.testing", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--dialect", choices=("anthropic", "openai"), default="anthropic")
    args = parser.parse_args(argv)
    server: FakeAnthropicServer | FakeOpenAIServer
    if args.dialect == "openai":
        server = FakeOpenAIServer(host=args.host, port=args.port).start()
        server.respond_with(openai_responder_from_model(DemoModel(latency=0)))
        what = "OpenAI Chat Completions"
    else:
        server = FakeAnthropicServer(host=args.host, port=args.port).start()
        server.respond_with(responder_from_model(DemoModel(latency=0)))
        what = "Anthropic Messages"
    print(f"fake {what} API on {server.base_url} (demo rules); Ctrl-C to stop", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


if __name__ == "__main__":
    main()
