"""A round on a device: inputs, the forward context, CUDA graphs, the sampler, the device pools, the memory plan."""
