"""The gRPC services of the mesh: thin adapters over the engine and text libraries."""
