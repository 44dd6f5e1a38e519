"""An experiment's instrument, loaded into every Python process started with this
directory on PYTHONPATH (`sitecustomize`); nothing is patched unless
`ALCHEMIST_STEP_TIMES=1`: then the server logs each engine step's wall-clock start, length
and kind, rewriting `$ALCHEMIST_STEP_TIMES_DIR/steps-PID.json` every 3 s
(docs/training-issue24/decode_step_servers.py reads it)."""
import os

if os.environ.get("ALCHEMIST_STEP_TIMES") == "1":
    import json
    import threading
    import time

    import engine.async_engine as async_engine

    bridge = next(v for v in vars(async_engine).values() if isinstance(v, type) and hasattr(v, "_engine_item"))
    steps = []
    engine_item = bridge._engine_item

    def timed_item(self, messages):
        started = time.time()
        out = engine_item(self, messages)
        kind = getattr(out[2], "kind", "none") if out[2] is not None else "none"
        steps.append((started, time.time() - started, kind))
        return out

    def write_every_3_s():
        path = os.path.join(os.environ.get("ALCHEMIST_STEP_TIMES_DIR", "/tmp"), f"steps-{os.getpid()}.json")
        while True:
            time.sleep(3)
            with open(path, "w") as out:
                json.dump(steps, out)

    bridge._engine_item = timed_item
    threading.Thread(target=write_every_3_s, daemon=True).start()
