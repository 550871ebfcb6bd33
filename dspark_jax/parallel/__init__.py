"""Tensor and data parallelism over jax.sharding.

- ``context``: the tensor-parallel axis a per-shard step is traced under, and its collectives;
- ``layers``: the row-parallel and vocabulary-parallel layers the models use (plain layers when
  no axis is set, so a single-device engine runs exactly the code it always did);
- ``mesh``: which devices an engine gets, checked at construction;
- ``sharding``: each parameter's layout and PartitionSpec, per-shard model structures;
- ``runtime``: ``Parallel``, what an engine asks of its devices (placement, per-shard steps);
- ``loading``: checkpoints read straight into their shards;
- ``host``: a step's replicated results read on the host, in one process or several;
- ``multihost``: several hosts, one engine spanning them (rank 0 leads, the others follow);
- ``host_replicas``: several hosts, data-parallel replicas spread over them behind rank 0.

docs/design.md ("Tensor and data parallelism") describes the layout.
"""
