"""The serving engine: continuous batching (schedule -> execute -> update) over a paged
KV cache, driving the model layer by layer. No HTTP and no training here."""
