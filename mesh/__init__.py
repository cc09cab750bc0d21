"""The mesh's wire floor, between services/ and engine/: the gRPC clients that plug into the engine (the remote
sampler, the kvstore connector), the wire code each shares with its service, and the mesh's gRPC policy.

Importing it registers its plug-ins with the engine's factories by module path; the engine never imports it.
"""

from engine.kv.connector.factory import register_connector
from engine.sample.factory import register_remote_sampler

register_connector("KVStoreConnector", "mesh.kvstore.connector", "KVStoreConnector")
register_remote_sampler("mesh.sampler.remote", "RemoteSampler")
