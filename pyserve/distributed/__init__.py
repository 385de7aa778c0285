"""Tensor parallelism's groundwork: the model split over ranks that run every step together over
`torch.distributed` (gloo on CPU, NCCL on CUDA). `shard` says which part of each weight a rank
holds; `group` holds the collectives; `messages` what rank 0 tells the others. Starting the
ranks is the engine's (`pyserve.engine.rank_launch`, `pyserve.engine.rank_main`)."""
