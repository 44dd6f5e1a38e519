"""What a cancel scope costs around each send of a stream: an awaited no-op 100,000 times,
bare, in `anyio.move_on_after(None)` (what sse-starlette puts around every send) and in
`anyio.move_on_after(60)` (with a deadline, as `send_timeout` sets); microseconds per send."""

import asyncio
import time

import anyio


async def no_op() -> None:
    pass


async def main(n: int = 100_000) -> None:
    started = time.perf_counter()
    for _ in range(n):
        await no_op()
    print(f"bare {(time.perf_counter() - started) / n * 1e6:.2f} us")
    for deadline in (None, 60):
        started = time.perf_counter()
        for _ in range(n):
            with anyio.move_on_after(deadline):
                await no_op()
        print(f"move_on_after({deadline}) {(time.perf_counter() - started) / n * 1e6:.2f} us")


if __name__ == "__main__":
    asyncio.run(main())
