"""`alchemist bench …`: each benchmark a module, measuring a ratio side by side in one run.

`serving`, `training`, `offload`, `colocate`, `soak` and `profile` are the commands;
`traces` (synthetic workloads), `report` (ratios, percentiles, JSON, plots) and `launch`
(a real server in a subprocess) are what they share. Library packages hold no benchmark.
"""
