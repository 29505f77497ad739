"""A task of an `srun` step without MPI that holds its rank's TCP port as init() would, until
every other holder of the test holds its own: two steps started together on one node.

    slurm_port_holder.py DIRECTORY HOLDERS

Reads its settings from the step's variables (perseus_shared.slurm, as init() does, with the
node's port reservation), listens on its address's port, writes DIRECTORY/<job>.<step>.<rank>,
waits (bounded) until HOLDERS such files exist, then prints `HELD job J step S port P`.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from perseus_shared import slurm

WAIT_SECONDS = 60


def main() -> None:
    directory, holders = Path(sys.argv[1]), int(sys.argv[2])
    settings = slurm.slurm_tcp_settings(os.environ)
    rank = int(settings["PERSEUS_TCP_RANK"])
    port = int(settings["PERSEUS_TCP_ADDRESSES"].split(",")[rank].rsplit(":", 1)[1])
    with socket.socket() as listener:
        listener.bind(("", port))  # what the TCP transport does at init()
        listener.listen(1)
        job, step = os.environ["SLURM_JOB_ID"], os.environ["SLURM_STEP_ID"]
        (directory / f"{job}.{step}.{rank}").write_text(str(port))
        deadline = time.monotonic() + WAIT_SECONDS
        while len(list(directory.iterdir())) < holders:
            if time.monotonic() > deadline:
                sys.exit(f"job {job} step {step}: the other holders did not come within "
                         f"{WAIT_SECONDS} s")
            time.sleep(0.05)
        print(f"HELD job {job} step {step} port {port}", flush=True)


if __name__ == "__main__":
    main()
