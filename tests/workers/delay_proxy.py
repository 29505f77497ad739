"""A TCP proxy that delays what its clients send: a rank's slow link to another rank.

    delay_proxy.py LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_SECONDS

Every connection to LISTEN is relayed to TARGET; bytes from the client reach the target
DELAY_SECONDS late (in order), bytes back are relayed at once. Prints `PROXY READY` once it
listens; runs until its stdin closes.
"""

from __future__ import annotations

import asyncio
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    try:
        while data := await reader.read(65536):
            if delay:
                loop.call_later(delay, writer.write, data)
            else:
                writer.write(data)
                await writer.drain()
        if delay:
            await asyncio.sleep(delay)  # the delayed bytes go out before the end of the stream
        writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


async def main() -> None:
    listen, target, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    target_host, target_port = target.rsplit(":", 1)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target_host, int(target_port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer, delay), pipe(up_reader, writer, 0.0))

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(relay, host, int(port))
    print("PROXY READY", flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    await stdin.read()  # until the test closes our stdin
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
