"""`perseus_legacy.elastic` (`hvd.elastic`): Horovod's elastic training API.

A program written for elastic Horovod runs unchanged: `@hvd.elastic.run` gives every rank rank
0's state, then runs the training function; `state.commit()` keeps a copy in memory and
`state.restore()` returns to it. Under `perseusrun --tcp` in elastic mode a lost rank, or hosts
added or removed, re-form the group and the function runs again (perseus_legacy.elastic.state);
otherwise the ranks never change and a lost rank ends the job.
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
