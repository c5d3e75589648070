"""The `flowmesh` command's pure parts: what `up` builds, what `status` prints."""

from __future__ import annotations

from client_sdk.cli import build_parser, up_mesh


def test_up_passes_state_dir_and_autoscale_to_the_broker() -> None:
    args = build_parser().parse_args(
        ["up", "--cpu-workers", "3", "--state-dir", "/tmp/s", "--autoscale", "--listen", ":7000"]
    )
    mesh = up_mesh(args, gpus=[])
    assert mesh.broker_args == ["--state-dir", "/tmp/s", "--autoscale", "1"]
    assert (mesh.cpu_workers, mesh.frontend_port, mesh.backend_port) == (3, 7000, 7001)
    plain = up_mesh(build_parser().parse_args(["up", "--cpu-workers", "1"]), gpus=[])
    assert plain.broker_args == []  # autoscale stays off unless asked for


def test_status_says_how_activations_travelled_only_when_some_did() -> None:
    from client_sdk.cli import format_status

    st = {
        "uptime_s": 3,
        "protocol": 1,
        "requests": 2,
        "completed": 2,
        "errors": 0,
        "queued": 0,
        "inflight_batches": 0,
        "workers": [],
        "partitioners": [],
        "models": [],
        "jobs": [],
        "direct_batches": 0,
        "activation_bytes_relayed": 0,
    }
    assert "stages over several workers" not in format_status(st)
    st.update(direct_batches=5, activation_bytes_relayed=3 << 20)
    line = format_status(st).splitlines()[1]
    assert line == "stages over several workers: 5 batches direct, 3.0 MiB of activations relayed"
