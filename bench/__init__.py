"""`alchemist bench …`: each benchmark a module, measuring a ratio side by side in one run.

`bench serving`, `structured`, `training`, `staleness`, `recording`, `colocate`, `offload`
and `soak` are the commands, and `profile` one of its own;
`traces` (synthetic workloads), `report` (ratios, percentiles, JSON, plots) and `launch`
(a real server in a subprocess) are what they share. Library packages hold no benchmark.
"""
