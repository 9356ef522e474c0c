"""kv_transfer tests: UCX stays on loopback, whatever the machine's network devices."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
