"""Online learning from served traffic (activation cache, losses, training slices,
optimizer and adapter versions, arbiter). Built by the online-learning issue; the
serving engine does not depend on it."""
