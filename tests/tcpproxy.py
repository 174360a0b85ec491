"""A TCP proxy on loopback that can cut the connections through it, for network-fault tests.

    with TcpProxy(target_port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"   # give this to the process to cut off
        proxy.cut()    # reset every connection (RST) and refuse new ones
        proxy.heal()   # accept again

It runs its own event loop in a daemon thread, so a test may call it from any thread (the fake
model server's responder included).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.refusing = False
        self.cuts = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="tcpproxy")
        self._server: asyncio.Server | None = None

    def start(self) -> TcpProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop
        ).result(10)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def cut(self) -> None:
        """Reset every connection through the proxy and refuse new ones until `heal`."""
        asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(10)

    def heal(self) -> None:
        self.refusing = False

    def close(self) -> None:
        async def shutdown() -> None:
            await self._cut()
            if self._server is not None:
                self._server.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    async def _cut(self) -> None:
        self.refusing = True
        self.cuts += 1
        for writer in list(self._writers):
            writer.transport.abort()  # RST, as a dropped link or a restarted middlebox does
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self._writers.discard(writer)
        self._writers.discard(up_writer)
