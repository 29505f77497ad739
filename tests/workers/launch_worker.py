"""A rank for the launcher tests; imports nothing heavy, so launches take a fraction of a second.

    launch_worker.py echo          prints its rank, the test variables and the job secret
    launch_worker.py fail RANK N   exits with code N on rank RANK, 0 elsewhere
    launch_worker.py hang          prints `ready pid=P`, then waits forever
"""

import os
import sys
import threading

rank = os.environ.get("OMPI_COMM_WORLD_RANK", "?")
mode = sys.argv[1]
if mode == "echo":
    print(f"rank={rank} size={os.environ.get('OMPI_COMM_WORLD_SIZE')} "
          f"given={os.environ.get('LAUNCH_TEST_GIVEN')} "
          f"forwarded={os.environ.get('LAUNCH_TEST_FORWARDED')} "
          f"perseus={os.environ.get('PERSEUS_LAUNCH_TEST')} "
          f"secret={os.environ.get('PERSEUS_SECRET')}", flush=True)
elif mode == "fail":
    sys.exit(int(sys.argv[3]) if rank == sys.argv[2] else 0)
elif mode == "hang":
    # One write: unbuffered print() writes the newline separately, and two ranks sharing the
    # launcher's stdout could interleave their lines.
    sys.stdout.write(f"ready pid={os.getpid()}\n")
    sys.stdout.flush()
    threading.Event().wait()
else:
    sys.exit(f"unknown mode {mode!r}")
