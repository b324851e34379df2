"""Data parallelism: one run on several devices of a node (DDP and FSDP through
torch.distributed), a rank as the loop sees it, and the threads each process may use."""
