"""The GLM-5 target and its MTP layer (PyTorch path; CPU and CUDA, fp32/bf16).

The package, config, layout, sizing and family import no torch (`info` reads the config alone):
the family imports the modules (decoder, layers, attention, sharding) when it builds a model."""
