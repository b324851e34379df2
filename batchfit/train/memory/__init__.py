"""Memory prediction: a training step on fake tensors, the CUDA caching allocator's model,
the GPUs planned for, and the budget a run is held to."""
