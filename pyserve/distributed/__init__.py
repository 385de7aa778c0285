"""Tensor parallelism: the model split over ranks that run every step together over
`torch.distributed` (gloo on CPU, NCCL on CUDA). Rank 0 is the serving process; `launch`
starts the others (`rank_main`); `shard` says which part of each weight a rank holds; `group`
holds the collectives."""
