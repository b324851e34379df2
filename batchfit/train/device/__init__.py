"""Facts about a device, the base every wing of train/ may use: the GPU table, the device a
run's memory is planned for, the caching allocator's settings, cuDNN's workspaces, and byte
sizes as people write them."""
