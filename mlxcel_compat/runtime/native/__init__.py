"""The native layer: the C sources of the CPU kernels, their build, and the C description of a model."""
