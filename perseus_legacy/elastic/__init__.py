"""`perseus_legacy.elastic` (`hvd.elastic`): Horovod's elastic training API on a fixed set of ranks.

A program written for elastic Horovod runs unchanged: `@hvd.elastic.run` gives every rank rank
0's state, then runs the training function; `state.commit()` keeps a copy in memory and
`state.restore()` returns to it. The ranks never change: no host is added or removed, and a
lost rank ends the job as it would without elastic (see perseus_legacy.elastic.state).
Keras callbacks and KerasState: perseus_legacy.keras.elastic.
"""

from perseus_legacy.elastic.state import (  # noqa: F401
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    run,
)
from perseus_legacy.elastic.tensorflow_state import (  # noqa: F401
    TensorFlowKerasState,
    TensorFlowState,
)
