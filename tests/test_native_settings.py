"""The native runtime's settings reader (ops/runtime/settings.cc): a value that does not parse
fails init() before any connection, naming the variable and the value; unset or empty keeps
the default. One process, one rank over TCP."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from harness import ROOT, launch_env

BAD_VALUES = [
    ("PERSEUS_FUSION_THRESHOLD", "64MB", "is not a non-negative number"),
    ("PERSEUS_FUSION_THRESHOLD", "1e30", "is not a count below"),
    ("PERSEUS_CYCLE_TIME", "-1", "is not a non-negative number"),
    ("PERSEUS_STALL_WARNING_SECS", "nan", "is not a non-negative number"),
    ("PERSEUS_STALL_SHUTDOWN_SECS", "5 min", "is not a non-negative number"),
    ("PERSEUS_CACHE_CAPACITY", "lots", "is not a non-negative number"),
    ("PERSEUS_HIERARCHICAL_ALLREDUCE", "yes", "is not one of auto, 0, 1"),
    ("PERSEUS_AUTOTUNE", "yes", "is not 0 or 1"),
    ("PERSEUS_AUTOTUNE_CYCLES_PER_SAMPLE", "0", "is not a count of at least 1"),
    ("PERSEUS_DEBUG_FAULT", "crash@1", "is not KIND@RANK with KIND one of internal"),
    ("PERSEUS_DEBUG_FAULT", "internal@x", "is not KIND@RANK"),
    ("PERSEUS_DEBUG_FAULT", "internal", "is not KIND@RANK"),
]

SCRIPT = textwrap.dedent("""
    import os
    import sys

    from perseus_legacy import _core
    from perseusrun import tcp_run

    address = [f"127.0.0.1:{tcp_run.free_local_ports(1)[0]}"]
    for line in sys.stdin.read().splitlines():
        name, value = line.split("\\t")
        os.environ[name] = value
        try:
            _core.init_tcp(0, address, 0, 1, 0, 1, "settings-secret-0123456789")
            print(f"ACCEPTED {name}={value!r}")
            _core.shutdown()
        except RuntimeError as exc:
            print(f"REFUSED {exc}")
        del os.environ[name]
    os.environ["PERSEUS_FUSION_THRESHOLD"] = ""  # empty: the default
    _core.init_tcp(0, address, 0, 1, 0, 1, "settings-secret-0123456789")
    print(f"DEFAULTS OK rank {_core.rank()} of {_core.size()}")
    _core.shutdown()
""")


def test_bad_values_fail_init_naming_the_variable_and_the_value():
    cases = "".join(f"{name}\t{value}\n" for name, value, _ in BAD_VALUES)
    env = launch_env()
    for name, _, _ in BAD_VALUES:
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], input=cases, cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout
    verdicts = [line for line in proc.stdout.splitlines()
                if line.startswith(("REFUSED", "ACCEPTED"))]
    assert len(verdicts) == len(BAD_VALUES), proc.stdout
    for (name, value, expected), verdict in zip(BAD_VALUES, verdicts):
        assert verdict.startswith(f'REFUSED perseus_legacy: {name}="{value}" {expected}'), (
            verdict)
    assert "DEFAULTS OK rank 0 of 1" in proc.stdout, proc.stdout
