"""Smoke test of benchmarks/scaling.py: the emulated model and a short run of this product's
rows on emulated hosts (perseusrun/emulate.py). No timing is asserted: the machine is shared.

The model checks run anywhere; the launch needs root and iproute2 and is skipped without them,
with the reason. Horovod's and the parameter servers' rows need the peers and TF 2.15 venvs,
which `make test` does not build: they are left out here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import scaling_projection
from bench_common import scaling_model
from harness import ROOT, failure_summary, launch_env, needs_emulation

BENCHMARKS = ROOT / "benchmarks"


@pytest.mark.parametrize("model", [*scaling_model.MODELS, scaling_model.TINY])
def test_profile_times_add_up_to_the_step_and_keep_every_tensor(model):
    profile = scaling_model.load_profile(model)
    raw = json.loads((scaling_model.PROFILES / f"{model}.json").read_text())
    assert profile.forward_ms + profile.backward_ms == pytest.approx(raw["step_ms"])
    assert profile.backward_ms == pytest.approx(2 * profile.forward_ms)
    names = [t["name"] for layer in raw["layers"] for t in layer["tensors"]]
    assert [name for layer in profile.layers for name, _ in layer.tensors] == names


def test_projection_fits_the_reference_tcp_rows_within_5_percent_and_falls_with_hosts():
    rows = scaling_projection.load_rows(scaling_projection.REFERENCE)
    link = 125e6  # the reference run's 1 Gbit/s
    constants = scaling_projection.fit(rows, 1 / 25, link)
    checks = scaling_projection.predictions(rows, constants, 1 / 25, link,
                                            {scaling_projection.CALIBRATION_SYSTEM})
    assert len(checks) == 6, checks  # resnet101 and vgg16 on 2, 4 and 8 hosts
    for row, predicted, measured in checks:
        assert abs(predicted - measured) / measured < 0.05, (row, predicted, measured)
    projected = scaling_projection.project(constants, ["vgg16"], 25 * link)
    efficiencies = [p["efficiency"] for p in projected]
    assert efficiencies == sorted(efficiencies, reverse=True) and 0 < efficiencies[-1] < 1


def test_projection_adds_the_link_delay_to_each_step_of_the_algorithm_the_runtime_picks():
    constants = scaling_projection.Constants(efficiency=1.0, hop_ms=0.5)
    plain = scaling_projection.Cluster(8, 1, 125e6, byte_scale=1 / 25)
    delayed = dataclasses.replace(plain, delay_ms=2.0)
    name, before = scaling_projection.allreduce_ms(plain, constants, 64 << 10)
    assert name == "torus"  # the runtime's default policy, 8 ranks, 64 KiB
    # Rows of 2, columns of 4: 8 steps, 2 ms more each; and with 2.5 ms a step (a wide network,
    # from 1 ms) the torus's bytes cost 1.5 times the ring's instead of 1.1 (docs/design.md).
    wide_bytes_ms = (1.5 - 1.1) * 2 * 7 / 8 * (64 << 10) / 125e6 * 1e3
    assert scaling_projection.allreduce_ms(delayed, constants, 64 << 10) == \
        (name, pytest.approx(before + 2 * (1 + 3) * 2.0 + wide_bytes_ms))
    ring = dataclasses.replace(delayed, algorithm="ring")
    _, ring_plain = scaling_projection.allreduce_ms(dataclasses.replace(ring, delay_ms=0),
                                                    constants, 64 << 10)
    assert scaling_projection.allreduce_ms(ring, constants, 64 << 10) == \
        ("ring", pytest.approx(ring_plain + 2 * 7 * 2.0))  # 2(H-1) steps
    # A round adds two messages' delay for its negotiation on top.
    assert scaling_projection.round_ms(delayed, constants, 64 << 10, 3) == pytest.approx(
        scaling_projection.round_ms(plain, constants, 64 << 10, 3) + 2 * 2.0 + 8 * 2.0
        + wide_bytes_ms)
    # The stop agreement after each step: a round of one small table, carried by its
    # negotiation; without carried allreduces, recursive doubling after it.
    assert scaling_projection.agreement_ms(delayed, constants) == pytest.approx(
        scaling_projection.agreement_ms(plain, constants) + 2 * 2.0)
    uncarried = dataclasses.replace(plain, carried_bytes=0)
    assert scaling_projection.agreement_ms(
        dataclasses.replace(uncarried, delay_ms=2.0), constants) == pytest.approx(
        scaling_projection.agreement_ms(uncarried, constants) + 2 * 2.0 + 3 * 2.0)


def test_bounds_have_no_link_time_on_one_host_and_some_on_two():
    profile = scaling_model.load_profile("vgg16")
    one = scaling_model.step_bounds_ms(profile, 1, 1 / 25, 125e6)
    two = scaling_model.step_bounds_ms(profile, 2, 1 / 25, 125e6)
    assert one["comm_ms"] == 0 and one["compute_comm_ms"] == pytest.approx(one["compute_ms"])
    gradient_bytes = 4 * sum(profile.tensor_elements(1 / 25))
    assert two["comm_ms"] == pytest.approx(1e3 * gradient_bytes / 125e6)  # 2(n-1)/n = 1
    assert two["compute_ms"] <= two["compute_comm_ms"] <= two["compute_ms"] + two["comm_ms"]


def test_gradients_have_every_tensors_scaled_size():
    import tensorflow as tf

    profile = scaling_model.load_profile("tiny", step_scale=0.01)
    with tf.Graph().as_default():
        loss = scaling_model.build_loss(profile, 0.04, scaling_model.Wait("op"))
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        grads = [g for g, _ in optimizer.compute_gradients(loss)]
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            values = session.run(grads)
    # compute_gradients lists them in variable (forward) order; backprop makes them in reverse.
    assert [value.size for value in reversed(values)] == profile.tensor_elements(0.04)
    assert profile.tensor_elements(0.04) == [12760, 12000, 40, 8000]  # x 0.04, last first


@needs_emulation
def test_perseus_rows_produce_numbers_and_json_on_two_emulated_hosts_with_delayed_links(
        tmp_path):
    out_json = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(BENCHMARKS / "scaling.py"), "--models", "tiny", "--hosts", "2",
           "--systems", "run_config_tcp,sync_hook_mpi,alone,alone_sync", "--steps", "3",
           "--warmup", "2", "--step-scale", "0.5", "--timeout", "120", "--product-tf", "2.21",
           "--json", str(out_json), "--link-delay", "0.5", "--link-jitter", "0.1",
           "--chart", "none"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # scaling.py ends its launches and hosts
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"scaling.py timed out:\n{failure_summary(out)}\n{out}") from None
    assert proc.returncode == 0, f"{failure_summary(out)}\n{out}"
    rows = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert {(r["system"], r["hosts"]) for r in rows} == {
        (s, h) for s in ("run_config_tcp", "sync_hook_mpi", "alone", "alone_sync")
        for h in (1, 2)}
    for row in rows:
        for field in ("model", "system", "hosts", "ranks_per_host", "examples_per_s",
                      "efficiency", "compute_bound_examples_per_s",
                      "comm_bound_examples_per_s", "cpu_ms_per_step", "cpu_busy"):
            assert row[field] is not None, (field, row)
        assert row["examples_per_s"] > 0 and row["trainers"] == row["hosts"]
        assert (row["link_delay_ms"], row["link_jitter_ms"], row["link_loss_pct"]) == (
            0.5, 0.1, 0), row  # the user-space links, see perseusrun/emulate.py
        if row["hosts"] == 2:  # the runtime's counters: rounds and allreduces over the steps
            if row["system"] == "alone":
                assert row["collectives_per_step"] == 0, row
            elif row["system"] == "alone_sync":  # `alone` plus one barrier a step
                assert row["collectives_per_step"] == 1, row
            else:
                assert row["rounds_per_step"] >= 1 and row["collectives_per_step"] >= 1, row
    assert "| run_config_tcp | 2x1 |" in out and "| sync_hook_mpi | 2x1 |" in out
