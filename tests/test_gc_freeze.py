"""Start-up objects out of the garbage collector's full passes (server/gc_freeze.py)."""

import gc

import uvicorn

from server.config import AlchemistConfig
from server.gc_freeze import freeze_startup_objects


def test_freezing_leaves_full_collections_only_what_came_after():
    kept = [[i] for i in range(20_000)]  # containers the collector tracks, as a loaded model's
    try:
        frozen = freeze_startup_objects()
        # what it returns is the collector's count then: other threads (earlier tests') may
        # free frozen objects before the next line, so the count is not compared again
        assert frozen >= len(kept)
        tracked_ids = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
        assert not any(id(item) in tracked_ids for item in kept)  # no pass visits them
        later = [[i] for i in range(10)]
        assert any(o is later[0] for generation in range(3) for o in gc.get_objects(generation))
        assert kept[123] == [123]  # frozen, not freed
    finally:
        gc.unfreeze()


def test_the_server_freezes_once_built(monkeypatch):
    from server import serve

    seen = []

    def started(server, *args, **kwargs):  # uvicorn's run, as far as the freeze goes
        seen.append(gc.get_freeze_count())
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", started)
    try:
        serve.run(object(), AlchemistConfig())
        assert seen and seen[0] > 0
    finally:
        gc.unfreeze()
