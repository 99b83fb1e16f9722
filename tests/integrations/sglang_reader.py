"""Process B of the SGLang multi-process test: open the disk tier process A writes, prefetch the
given keys into a fresh host pool and print which loaded and a SHA-256 of each page's K/V."""

from __future__ import annotations

import json
import sys
from pathlib import Path


from sglang_host import HostPool
from test_sglang import _digest, host_indices, open_backend

disk, keys = Path(sys.argv[1]), json.loads(sys.argv[2])
pool = HostPool("page_first_direct", len(keys) + 1)
backend = open_backend(disk, pool)
loaded = backend.batch_get_v1(keys, host_indices(list(range(len(keys)))))
print(json.dumps({"loaded": loaded, "digests": [_digest(pool, i) for i in range(len(keys))]}))
backend.close()
