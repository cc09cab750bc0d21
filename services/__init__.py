"""The gRPC services of the mesh: thin adapters over the engine and text libraries."""

# The mesh's plug-ins (the kvstore connector, the remote sampler) registered with the engine's factories, for every
# service that builds an engine; torch-free.
import mesh  # noqa: F401
