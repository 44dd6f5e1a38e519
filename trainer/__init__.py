"""Online learning from served traffic: the LoRA adapter, the activation cache, the
losses and their reuse/recompute jobs cut into slices, the optimizer and adapter
versions. The serving engine does not import it; the trainer plugs into the engine as
its prefill recorder and into the arbiter as its training work."""
