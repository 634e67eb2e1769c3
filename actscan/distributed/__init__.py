"""Many processes, one report: torch.distributed + FSDP2 (docs/design.md, "Distributed runs").

`runtime` (the process group, failure protocol, each rank's inputs), `launch` (`--nproc`),
`build` (sharded builds), `fsdp` (FSDP2 wrapping, shard-wise filling, the sharded
backward), `merge` (the exact merge of the recorder's state), `telemetry` (memory and merge
time figures). Importing this package imports nothing else (torch is loaded by its
modules when a distributed run needs them).
"""
