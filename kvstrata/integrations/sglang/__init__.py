"""SGLang integration: ``KVStrataHiCacheStorage`` (needs the ``sglang`` package).

``--enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name": "kvstrata", "module_path":
"kvstrata.integrations.sglang", "class_name": "KVStrataHiCacheStorage", "interface_v1": 1,
"disk_path": "/var/cache/kvstrata"}'``
"""

from .storage import KVStrataHiCacheStorage

__all__ = ["KVStrataHiCacheStorage"]
