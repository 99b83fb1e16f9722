"""vLLM integration: ``KVStrataConnector`` (needs the ``vllm`` package).

Load it by module path::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStrataConnector",
        "kv_connector_module_path": "kvstrata.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"disk_path": "/var/cache/kvstrata"}}'
"""

from .connector import KVStrataConnector, KVStrataConnectorMetadata

__all__ = ["KVStrataConnector", "KVStrataConnectorMetadata"]
