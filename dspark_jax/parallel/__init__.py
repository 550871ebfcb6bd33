"""Tensor and data parallelism over jax.sharding.

- ``context``: the tensor-parallel axis a per-shard step is traced under, and its collectives;
- ``layers``: the row-parallel and vocabulary-parallel layers the models use (plain layers when
  no axis is set, so a single-device engine runs exactly the code it always did);
- ``mesh``: which devices an engine gets, checked at construction;
- ``sharding``: each parameter's layout and PartitionSpec, per-shard model structures;
- ``engine``: ``Parallel``, what an engine asks of its devices (placement, per-shard steps).

docs/design.md ("Tensor and data parallelism") describes the layout.
"""
