"""Where recorded activation segments live (device, host, or recomputed) and the maps
that decide it: `offloader` (placement and accounting), `placement` (one recording's
segments), `memory_model` (the offloading map), `hedging` (load or recompute, per layer),
`calibration` and `profile` (measured on the device), `host_pool` and `copy_stream`."""
