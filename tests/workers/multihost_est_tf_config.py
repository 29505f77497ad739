"""tests/workers/est_tf_config.py with a global batch that 3 ranks divide (chief + 2 workers).

Usage: as est_tf_config.py (the reference too, so that both train on the same batches).
"""

from __future__ import annotations

import est_tf_config

if __name__ == "__main__":
    est_tf_config.GLOBAL_BATCH = 12  # 16 in est_tf_config: 2 ranks divide it, 3 do not
    est_tf_config.main()
