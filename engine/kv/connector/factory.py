"""Connectors by the name --kv-transfer-config gives (vLLM's KVConnectorFactory)."""

from engine.kv.connector.base import KVConnectorRole, KVTransferConfig

# name -> module:class, imported only when used (the scheduler-only config check needs no gRPC)
CONNECTORS = {"KVStoreConnector": "engine.kv.connector.kvstore_connector:KVStoreConnector"}


def create_connector(config: KVTransferConfig, role: KVConnectorRole, **kwargs):
    import importlib  # noqa: PLC0415

    module, name = CONNECTORS[config.kv_connector].split(":")
    return getattr(importlib.import_module(module), name)(config, role, **kwargs)
