"""Helpers shared by the tests (and the benchmarks that reuse them): ranks and nodes on one machine (``nodes``),
the model zoo built from configs (``zoo``), the local two-node Slurm cluster (``slurm_cluster``), in-process runs
(``runs``), each sweep job's own peak memory (``peak``)."""
