"""TF1-style Keras sets its session with `tf.keras.backend.set_session` after `import
perseus_legacy` (tf_compat supplies it where the v2 backend lacks it), and trains in it.

tests/workers/keras_session.py pins each rank's GPU through a ConfigProto given to
`K.set_session(tf.compat.v1.Session(config=config))`, then compiles and fits in the graph: on 2
ranks (perseusrun, TF 2.21) the weights equal one plain process's on the global batch, and the
same plain program runs on TF 2.16 (whose perseus_legacy op library is not built here: no
collectives) to the same weights. Each process itself checks that Keras trained in the session it
set, with its config.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
from harness import ROOT, available, finish, python_for, run_ranks, start

WORKER = "tests/workers/keras_session.py"
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT = 240


def plain(version: str, out: Path) -> dict:
    out.mkdir()
    [(code, text)] = finish([start(version, [ROOT / WORKER, out, "plain"])], TIMEOUT)
    assert code == 0, text[-6000:]
    assert "[plain] trained in the session it set" in text, text[-6000:]
    assert "keras sessions: supplied: tf.keras.backend.set_session/get_session" in text, text
    return dict(np.load(out / "plain.npz"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("keras_session")
    (root / "ranks").mkdir()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        ranks = pool.submit(run_ranks, 2, WORKER, root / "ranks", "rank", timeout=TIMEOUT)
        main = pool.submit(plain, "main", root / "main")
        tf216 = pool.submit(plain, "tf216", root / "tf216") if available("tf216") else None
        return {"ranks": (ranks.result(), root / "ranks"), "main": main.result(),
                "tf216": tf216.result() if tf216 is not None else None}


def test_keras_session_set_with_set_session_trains_2_ranks_like_one_process(runs):
    done, out = runs["ranks"]
    for rank in range(2):
        assert f"[rank{rank}] trained in the session it set" in done.stdout, done.stdout[-6000:]
    values = [dict(np.load(out / f"rank{rank}.npz")) for rank in range(2)]
    for name, expected in runs["main"].items():
        np.testing.assert_array_equal(values[1][name], values[0][name], err_msg=name)
        np.testing.assert_allclose(values[0][name], expected, rtol=RTOL, atol=ATOL, err_msg=name)


def test_keras_set_session_and_get_session_work_on_tf216(runs):
    python_for("tf216")  # skips, or fails under CI, without the venv
    for name, expected in runs["main"].items():
        np.testing.assert_allclose(runs["tf216"][name], expected, rtol=RTOL, atol=ATOL,
                                   err_msg=name)

