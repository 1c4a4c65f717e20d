"""The docker files: compose parses, every flag is one Flower 1.41's own parsers accept and
one the launcher's real processes (fedstale/launcher/deploy.py) also use. Docker does not
run here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

from fedstale.launcher.deploy import LocalDeployment, TlsFiles

DOCKER = Path(__file__).resolve().parent.parent / "docker"


def load(name: str) -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


def merged() -> dict[str, dict]:
    """compose.yml with compose.tls.yml over it (commands replaced, as compose does)."""
    base, tls = load("compose.yml")["services"], load("compose.tls.yml")["services"]
    return {name: {**base[name], **tls.get(name, {})} for name in base}


def flags(command: list[str]) -> set[str]:
    return {part for part in command if part.startswith("--")}


def launcher(tmp_path: Path, secure: bool) -> LocalDeployment:
    tls = TlsFiles(tmp_path / "ca.crt", tmp_path / "s.pem", tmp_path / "s.key") if secure else None
    keys = tmp_path / "keys" if secure else None
    # the compose demo's SuperNodes start Flower's own SuperExec (no warm one beside them)
    return LocalDeployment(
        tmp_path, 3, tls=tls, database=tmp_path / "db", auth_keys=keys, clientapp_exec="flower"
    )


@pytest.mark.parametrize("secure", [False, True])
def test_compose_flags_are_flowers_and_the_launchers(tmp_path: Path, secure: bool) -> None:
    services = merged() if secure else load("compose.yml")["services"]
    deployment = launcher(tmp_path, secure)
    superlink = services["superlink"]["command"]
    _parse_args_run_superlink().parse_args(superlink)  # exits on an unknown flag
    assert flags(superlink) == flags(deployment.superlink_command()[1:])
    nodes = sorted(name for name in services if name.startswith("supernode-"))
    assert len(nodes) == 3
    for index, name in enumerate(nodes):
        command = services[name]["command"]
        args = _parse_args_run_supernode().parse_args(command)
        assert flags(command) == flags(deployment.node_command(index, 9094)[1:])
        assert args.superlink == "superlink:8000"
        assert re.fullmatch(
            rf"partition-id={index} num-partitions=3 delay-seconds=[\d.]+", args.node_config
        )
        assert services[name]["build"]["args"]["ROLE"] == "supernode"
        assert services[name]["environment"]["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.1"
    assert services["superlink"]["build"]["args"]["ROLE"] == "superlink"


def test_dockerfile_builds_on_the_official_images_by_default_and_state_persists() -> None:
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{FLOWER_IMAGES\}/\$\{ROLE\}:\$\{FLWR_VERSION\}$", dockerfile, re.M)
    for default in ("FLWR_VERSION=1.41.0", "FLOWER_IMAGES=flwr", "TORCH=torch==2.13.0"):
        assert f"ARG {default}\n" in dockerfile, default
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu\n" in dockerfile
    compose = load("compose.yml")
    assert "superlink-state" in compose["volumes"]
    assert "superlink-state:/app/state" in compose["services"]["superlink"]["volumes"]
    assert "/app/state/state.db" in compose["services"]["superlink"]["command"]


def test_nothing_in_the_docker_files_refers_to_this_machine() -> None:
    """The stand-in images, local wheels and mirrors are the tests' build arguments only."""
    for path in DOCKER.iterdir():
        if path.suffix in {".yml", ".Dockerfile"} or path.name == "Dockerfile":
            text = path.read_text()
            for local in ("/opt/", "/work", "/tmp/", "localhost/", "flwr-standin", "/etc/pip"):
                assert local not in text, f"{path.name} names {local!r}"


def test_the_image_copies_every_package_the_wheel_installs() -> None:
    import tomllib

    pyproject = tomllib.loads((DOCKER.parent / "pyproject.toml").read_text())
    packages = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    dockerfile = (DOCKER / "Dockerfile").read_text()
    missing = [p for p in packages if not re.search(rf"^COPY {p} {p}$", dockerfile, re.M)]
    assert not missing, f"docker/Dockerfile does not copy {missing}: pip install . would fail"


def test_the_gpu_variant_reserves_a_gpu_per_supernode_and_builds_cuda_torch() -> None:
    """docker/compose.gpu.yml cannot run here (no GPU): its shape is what Docker's GPU
    support reads, and its images take PyPI's torch (CUDA), not the CPU index."""
    base, gpu = load("compose.yml")["services"], load("compose.gpu.yml")["services"]
    nodes = sorted(name for name in base if name.startswith("supernode-"))
    assert sorted(gpu) == nodes
    for name in nodes:
        service = gpu[name]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
        assert service["build"]["args"] == {"TORCH": "torch==2.13.0", "TORCH_INDEX": ""}
        assert service["image"] != base[name]["image"]
