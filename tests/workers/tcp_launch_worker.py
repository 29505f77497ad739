"""A rank for `perseusrun --tcp` launcher tests; imports nothing heavy.

    tcp_launch_worker.py echo          prints its rank, the rank count and the job secret
    tcp_launch_worker.py fail RANK N   exits with code N on rank RANK; the others wait forever
    tcp_launch_worker.py hang          waits forever
"""

import os
import sys
import threading

rank = os.environ.get("PERSEUS_TCP_RANK", "?")
mode = sys.argv[1]
if mode == "echo":
    addresses = os.environ.get("PERSEUS_TCP_ADDRESSES", "").split(",")
    print(f"rank={rank} size={len(addresses)} controller={os.environ.get('PERSEUS_CONTROLLER')} "
          f"secret={os.environ.get('PERSEUS_SECRET')} mpi={'OMPI_COMM_WORLD_SIZE' in os.environ}",
          flush=True)
elif mode == "fail" and rank == sys.argv[2]:
    sys.exit(int(sys.argv[3]))
elif mode in ("fail", "hang"):
    threading.Event().wait()
else:
    sys.exit(f"unknown mode {mode!r}")
