"""Where recorded activation segments live (device, host, or recomputed) and the maps
that decide it: `offloader` (the device budget: placement and accounting), `placement`
(one recording's segments), `residency` (freed layers back for backward), `memory_model`
(the offloading map), `hedging` (load or recompute, per layer), `calibration` and
`profile` (measured on the device), `host_pool` and `copy_stream`."""
