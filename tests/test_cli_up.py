"""`flowmesh up` turns its flags into the mesh it starts (built here, not started)."""

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
