"""kvstrata's tiers inside other serving engines (optional extras).

- :mod:`kvstrata.integrations.vllm`: ``KVStrataConnector``, a vLLM ``KVConnectorBase_V1``
  (``--kv-transfer-config '{"kv_connector": "KVStrataConnector",
  "kv_connector_module_path": "kvstrata.integrations.vllm", ...}'``).
- :mod:`kvstrata.integrations.sglang`: ``KVStrataHiCacheStorage``, an SGLang ``HiCacheStorage``
  backend (``--hicache-storage-backend dynamic``).

Both store kvstrata records (self-describing, checksummed, per-group codecs) in kvstrata's tiers
through :class:`~kvstrata.integrations.store.PageStore`. This package imports neither engine at
the top level: ``kvstrata.integrations.vllm`` needs ``vllm`` and ``kvstrata.integrations.sglang``
needs ``sglang``; core kvstrata never imports either. See ``docs/integrations.md``.
"""

from .config import StoreConfig
from .store import PageStore

__all__ = ["PageStore", "StoreConfig"]
