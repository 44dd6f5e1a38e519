"""Where recorded activation segments live (device, host, or recomputed) and the maps
that decide it. Built by the offloader issue; nothing imports it yet."""
