"""How much faster the DPO reuse job can be than the recompute job, by their arithmetic.

`alchemist bench training --mode dpo` compares two jobs on one entry (trainer/methods.py):

- reuse: the two responses forwarded as one batch against the recorded prompt's K/V, their
  backward, then the prompt's backward from its recording;
- recompute (the separate trainer): prompt + chosen and prompt + rejected forwarded as a
  batch, then their backward — the prompt twice, as TRL's DPOTrainer runs it;

each with the base model's reference log-probs (`--dpo-reference base`, no grad: for reuse
the server's pack, the prompt once and both responses against its K/V; for the separate
trainer TRL's, its batch of both whole sequences again) or none (`served`).
The base weights are frozen, so a backward through a linear layer costs one GEMM (the
input's gradient) plus the LoRA's rank-r products; attention's backward costs twice its
forward. Counting the GEMMs' and attention's floating-point operations gives the ratio
a job's time would have if every FLOP took the same time: the ceiling of the measured
speedup on a machine bound by its arithmetic (a CPU at these sizes; a GPU only once the
host keeps up). Run from the repository root:

    .venv/bin/python docs/training-issue24/dpo_flop_ceiling.py [config.json ...]

(no argument: the embedded model, and the GPU benchmarks' Llama-3.1-8B shape).
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rank: int = 8

    @classmethod
    def of(cls, path: Path) -> "Shape":
        config = json.loads(path.read_text())
        return cls(path.parent.name, config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
                   config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"]),
                   config["vocab_size"])

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linear_flops(self, rows: int) -> float:
        """Every decoder layer's linear layers over `rows` tokens (forward, or the input's
        gradient in backward), with the LoRA's two rank-r products per layer."""
        kv = self.kv_heads * self.head_dim
        shapes = [(self.hidden, self.hidden), (self.hidden, kv), (self.hidden, kv), (self.hidden, self.hidden),
                  (self.hidden, self.intermediate), (self.hidden, self.intermediate), (self.intermediate, self.hidden)]
        per_row = sum(2 * i * o + 2 * self.rank * (i + o) for i, o in shapes)
        return float(rows * per_row * self.layers)

    def attention_flops(self, pairs: int) -> float:
        """Forward attention over `pairs` (query, key) pairs in every layer: QKᵀ and PV."""
        return float(4 * pairs * self.head_dim * self.heads * self.layers)

    def head_flops(self, rows: int) -> float:
        return float(2 * rows * self.hidden * self.vocab)


def causal_pairs(length: int, prefix: int = 0) -> int:
    """(query, key) pairs of `length` new tokens attending causally after `prefix` keys."""
    return length * prefix + length * (length + 1) // 2


def dpo_jobs(shape: Shape, prompt: int, response: int, reference: str) -> dict[str, float]:
    """FLOPs of each job on one entry: a prompt of `prompt` tokens, two responses of
    `response` tokens each (the first token of each is scored by the prompt's last row)."""
    suffix_rows, suffix_pairs = 2 * (response - 1), 2 * causal_pairs(response - 1, prompt)
    full_rows, full_pairs = 2 * (prompt + response), 2 * causal_pairs(prompt + response)
    scored = 2 * response  # rows through the head: each response's tokens
    reuse = (shape.linear_flops(suffix_rows) * 2 + shape.attention_flops(suffix_pairs) * 3  # forward, backward
             + shape.linear_flops(prompt) + shape.attention_flops(causal_pairs(prompt)) * 2  # the prompt's backward
             + shape.head_flops(scored) * 2)
    recompute = (shape.linear_flops(full_rows) * 2 + shape.attention_flops(full_pairs) * 3
                 + shape.head_flops(scored) * 2)
    if reference == "base":  # a forward without grad: the server's pack / TRL's batch
        reuse += (shape.linear_flops(prompt + suffix_rows) + shape.attention_flops(causal_pairs(prompt) + suffix_pairs)
                  + shape.head_flops(scored))
        recompute += shape.linear_flops(full_rows) + shape.attention_flops(full_pairs) + shape.head_flops(scored)
    return {"reuse": reuse, "recompute": recompute}


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]]
    if not paths:
        from engine.model_loader import embedded_model_dir
        paths = [embedded_model_dir() / "config.json", ROOT / "configs/models/llama-3.1-8b/config.json"]
    print("| model | trained tokens (prompt + 2 responses) | reference | reuse GFLOP | recompute GFLOP | ceiling |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for path in paths:
        shape = Shape.of(path)
        for tokens in (512, 1024, 2048):
            for reference in ("base", "served"):
                jobs = dpo_jobs(shape, tokens // 2, tokens // 4, reference)
                print(f"| {shape.name} | {tokens} ({tokens // 2} + 2 × {tokens // 4}) | {reference} | "
                      f"{jobs['reuse'] / 1e9:,.0f} | {jobs['recompute'] / 1e9:,.0f} | "
                      f"{jobs['recompute'] / jobs['reuse']:.2f}x |")


if __name__ == "__main__":
    main()
