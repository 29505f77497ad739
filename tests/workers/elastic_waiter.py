"""An elastic worker without TensorFlow: joins the driver's first round, says so, then waits
(until something ends it). For tests of the driver and of its workers' lifetime
(tests/test_elastic_driver.py); run by `perseusrun --tcp --min-np ...`.

    elastic_waiter.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_elastic_client() -> ModuleType:
    """perseus_legacy/common/elastic_client.py on its own: it is framework-free, but importing it
    through its package imports TensorFlow (seconds per process)."""
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location(
        "elastic_client_alone", ROOT / "perseus_legacy" / "common" / "elastic_client.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import perseus_env

    client = load_elastic_client()
    place = client.join(perseus_env.read("PERSEUS_SECRET") or "")
    print(json.dumps({"what": "joined", "pid": os.getpid(), "rank": place.rank,
                      "size": place.size}), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
