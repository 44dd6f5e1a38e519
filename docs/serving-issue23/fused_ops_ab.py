"""The engine on the embedded model with its RMSNorms and attention modules fused
(engine/fused_norm.py, engine/fused_rope.py) and with the model's own, swapped back and
forth in one process, alternating, 8 greedy streams of 32 tokens: seconds per round and
whether the tokens are equal. Run from the repository root:

    .venv/bin/python docs/serving-issue23/fused_ops_ab.py
"""

import statistics
import time

from server.config import load_config
from engine.model_loader import load
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from bench.traces import synthetic_tokens
config = load_config(None)
model, tok, _ = load(config.model)
engine = LLMEngine.for_model(model, tok, config)
swapped = [(m, type(m), type(m).__mro__[1]) for m in model.modules() if type(m).__name__.startswith("Fused")]
res = {"fused": [], "own": []}; toks = {}
for r in range(8):
    for name in (("fused", "own") if r % 2 else ("own", "fused")):
        for module, fused_class, own_class in swapped:
            module.__class__ = fused_class if name == "fused" else own_class
        prompts = [synthetic_tokens(tok, 40 + i, i) for i in range(8)]
        s = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32))
        t = time.perf_counter() - s
        toks.setdefault(name, []).append(out)
        if r: res[name].append(t)
ratio = statistics.median(res["own"]) / statistics.median(res["fused"])
print({k: round(statistics.median(v), 3) for k, v in res.items()}, "own/fused", round(ratio, 3))
print("tokens equal", toks["fused"] == toks["own"])
