"""Connectors by the name --kv-transfer-config gives (vLLM's KVConnectorFactory)."""

import importlib

from engine.kv.connector.base import KVConnectorBase, KVConnectorRole, KVTransferConfig
from engine.kv.layout import KVLayout

# name -> module:class, imported only when used. The engine's own connectors are here; a package one floor up
# registers its own by module path (register_connector), so the engine never names it.
CONNECTORS = {
    "SharedStorageConnector": "engine.kv.connector.shared_storage_connector:SharedStorageConnector",
}


def register_connector(name: str, module_path: str, class_name: str) -> None:
    """vLLM's KVConnectorFactory.register_connector: a connector known by name from now on in this process."""
    CONNECTORS[name] = f"{module_path}:{class_name}"


def get_connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    """A registered connector by name; otherwise the class of that name in kv_connector_module_path."""
    if config.kv_connector in CONNECTORS:
        module_path, name = CONNECTORS[config.kv_connector].split(":")
        return getattr(importlib.import_module(module_path), name)
    path = config.kv_connector_module_path
    try:
        module = importlib.import_module(path)
    except ImportError as e:
        raise ValueError(f"kv_connector_module_path {path!r} cannot be imported: {e}") from None
    cls = getattr(module, config.kv_connector, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"kv_connector {config.kv_connector!r} is no KVConnectorBase subclass in the module {path!r}.")
    return cls


def create_connector(
    config: KVTransferConfig, role: KVConnectorRole, layouts: list[KVLayout], **kwargs
) -> KVConnectorBase:
    """layouts: one per KV cache group."""
    return get_connector_class(config)(config, role, layouts, **kwargs)
