"""What a rank of torch's distributed code imports, the costly part of its start: a process
that forks ranks imports these once, before any rank is forked (``gloo_ranks``, and the tests'
Ray workers). Plain names, so that reading them imports nothing."""

TORCH_PRELOADED = ("torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
                   "torch.distributed.checkpoint", "torch.distributed.pipelining")
