"""How ranks split the work: the rank layout (dp_replicate × dp_shard × tp), the process groups and peer checks,
the Lightning strategies, FSDP2 sharding and loading from rank 0, and tensor parallelism from the model's plan.

Imports :mod:`lit_ppl.runtime` and :mod:`lit_ppl.config` (allowed values) only.
"""
