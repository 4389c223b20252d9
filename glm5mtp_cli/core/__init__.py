"""What the engine and the model families both need, below both: the family interface and registry,
element types by name, the cached-state views a forward reads, host ints onto the device, the
sync-free flag and the tensor-parallel primitives. Nothing here imports the engine or a family."""
