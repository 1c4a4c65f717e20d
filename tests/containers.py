"""Real containers for the tests: a runtime (podman with a containers.conf of the tests' own,
or Docker), a Debian base image made locally and kept between runs, local stand-ins of
Flower's superlink/supernode images, fedstale's images built from docker/Dockerfile with the
stand-ins and a local torch wheel chosen by build arguments, and compose projects torn down
by label (containers, pods, network, volumes), with what is left checked; a killed
session's projects are torn down by the next."""

from __future__ import annotations

import concurrent.futures
import configparser
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests import timing
from tests.flower_procs import alive

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
BASE_IMAGE = "localhost/fedstale-base:bookworm"
STANDIN = "localhost/flwr-standin"
FLWR_VERSION = "1.41.0"
PYTHON_TAG = "cp311"  # bookworm's python3, the stand-ins' and so the images' Python
# Measured on a quiet 2-core box (2026-12-07): mmdebstrap made the base in 29 s (made once
# per machine, then kept: `ensure_base`); the stand-ins and fedstale's two images took 239 s
# in all, 289 s with the base. Each timeout is many times that, for a busy machine and a
# slow mirror, and every build runs at normal priority: under `nice -n 19` a busy machine
# starved the base past its 900 s.
BASE_TIMEOUT = 900
BUILD_TIMEOUT = 900  # one image
# The sandboxes these tests run in refuse the default rlimits; some refuse crun's cgroup
# set-up too (hybrid cgroups), where runc with cgroupfs works.
CONTAINERS_CONFS = (
    "[containers]\ndefault_ulimits = []\n",
    '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n',
)


def _run(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@dataclass
class Runtime:
    """A container engine that has started a container here, and its compose command."""

    engine: str  # podman or docker
    compose: list[str]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return _run([self.engine, *args], self.env, timeout)

    def check(self, *args: str, timeout: float = 120) -> str:
        result = self(*args, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{self.engine} {' '.join(args)}: {result.stderr[-2000:]}")
        return result.stdout

    def has_image(self, name: str) -> bool:
        return self("image", "inspect", name).returncode == 0


def _compose_command(engine: str) -> list[str] | None:
    if engine == "docker":
        found = _run(["docker", "compose", "version"], dict(os.environ), 30).returncode == 0
        return ["docker", "compose"] if found else None
    venv_tool = Path(sys.executable).parent / "podman-compose"
    tool = str(venv_tool) if venv_tool.exists() else shutil.which("podman-compose")
    return [tool] if tool else None


def find_runtime(workdir: Path) -> Runtime | str:
    """The first engine that starts a container from the base image (made if missing), or
    one line on what is missing."""
    missing = []
    for engine in ("podman", "docker"):
        if shutil.which(engine) is None:
            missing.append(f"no {engine}")
            continue
        if engine == "docker" and _run(["docker", "info"], dict(os.environ), 60).returncode:
            missing.append("a docker client without a daemon")
            continue
        compose = _compose_command(engine)
        if compose is None:
            missing.append(
                f"{engine} without {'docker compose' if engine == 'docker' else 'podman-compose'}"
            )
            continue
        for index, conf in enumerate(CONTAINERS_CONFS if engine == "podman" else ("",)):
            runtime = Runtime(engine, compose)
            if conf:
                path = workdir / f"containers-{index}.conf"
                path.write_text(conf)
                runtime.env["CONTAINERS_CONF"] = str(path)
            problem = ensure_base(runtime, workdir)
            if problem:
                missing.append(problem)
                break
            started = runtime("run", "--rm", BASE_IMAGE, "true", timeout=120)
            if started.returncode == 0:
                return runtime
            missing.append(f"{engine} cannot start a container: {started.stderr.strip()[-200:]}")
    return "no container runtime can start a container here: " + "; ".join(missing)


def debian_mirror() -> str:
    """The Debian mirror named in this machine's apt sources (deb.debian.org otherwise)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    texts = [sources.read_text()] if sources.is_file() else []
    legacy = Path("/etc/apt/sources.list")
    texts += [legacy.read_text()] if legacy.is_file() else []
    for text in texts:
        found = re.search(r"(?:URIs:\s*|^deb\s+)(\S+/debian)/?\s", text, re.M)
        if found:
            return found.group(1)
    return "http://deb.debian.org/debian"


def ensure_base(runtime: Runtime, workdir: Path) -> str:
    """The base image: kept from an earlier run on this machine, else made with mmdebstrap
    from the apt mirror and imported. '' when it exists, else what is missing."""
    if runtime.has_image(BASE_IMAGE):
        return ""
    if shutil.which("mmdebstrap") is None:
        return f"no {BASE_IMAGE} and no mmdebstrap to make it (make tools installs it)"
    tarball = workdir / "base.tar"
    packages = "python3,python3-venv,python3-pip,ca-certificates"
    command = ["mmdebstrap", "--variant=apt", f"--include={packages}", "bookworm", str(tarball)]
    # at normal priority: under `nice -n 19` a busy machine starved it past any timeout
    made = _run([*command, debian_mirror()], dict(os.environ), BASE_TIMEOUT)
    if made.returncode != 0:
        return f"mmdebstrap failed: {made.stderr.strip()[-300:]}"
    runtime.check("import", str(tarball), BASE_IMAGE, timeout=300)
    tarball.unlink()
    return ""


def torch_wheel() -> Path | None:
    """The CPU torch wheel in pip's find-links directory, if this machine keeps one."""
    folders = [os.environ.get("PIP_FIND_LINKS", "")]
    for path in ("/etc/pip.conf", Path.home() / ".config/pip/pip.conf"):
        parser = configparser.ConfigParser()
        parser.read(path)
        folders.append(parser.get("global", "find-links", fallback=""))
    for folder in filter(None, " ".join(folders).split()):
        for wheel in sorted(Path(folder).glob(f"torch-2.13.0*-{PYTHON_TAG}-*x86_64.whl")):
            return wheel
    return None


def build_args(runtime: Runtime) -> tuple[list[str], dict[str, str]]:
    """Mounts and build arguments for docker/Dockerfile on the local stand-ins: the local
    torch wheel where this machine has one (podman mounts it; Docker builds cannot, so they
    use PyTorch's CPU index, the Dockerfile's default)."""
    mounts = ["-v", "/etc/ssl/certs:/etc/ssl/certs:ro"] if runtime.engine == "podman" else []
    args = {"FLOWER_IMAGES": STANDIN}
    wheel = torch_wheel() if runtime.engine == "podman" else None
    if wheel is not None:
        mounts += ["-v", f"{wheel.parent}:{wheel.parent}:ro"]
        args |= {"TORCH": str(wheel), "TORCH_INDEX": ""}
    return mounts, args


def build(
    runtime: Runtime, mounts: list[str], dockerfile: Path, context: Path, tag: str, **args: str
) -> None:
    flags = [flag for key, value in args.items() for flag in ("--build-arg", f"{key}={value}")]
    command = [runtime.engine, "build", "--network", "host", *mounts, "-f", str(dockerfile)]
    before = image_id(runtime, tag)
    built = _run([*command, *flags, "-t", tag, str(context)], runtime.env, BUILD_TIMEOUT)
    if built.returncode != 0:
        raise RuntimeError(f"building {tag}: {built.stderr[-3000:]}")
    if before and before != image_id(runtime, tag):
        # The tag moved: the image it named before (a checkout's earlier build, about 2 GB)
        # would be left untagged, one per run of the suite from a new clone, until the disk
        # is full. Removed unless a container still uses it.
        runtime("rmi", before)


def image_id(runtime: Runtime, name: str) -> str:
    """The id of the image `name` names; "" when there is none."""
    found = runtime("image", "inspect", "--format", "{{.Id}}", name)
    return found.stdout.strip() if found.returncode == 0 else ""


def build_images(runtime: Runtime) -> dict[str, str]:
    """The stand-ins (cached layers make a rebuild seconds) and fedstale's two images; the
    environment compose needs to find them (the build arguments it would use)."""
    mounts, args = build_args(runtime)
    with tempfile.TemporaryDirectory(prefix="standin-") as empty:
        for role in ("superlink", "supernode"):
            build(
                runtime, mounts, DOCKER / "standin.Dockerfile", Path(empty),
                f"{STANDIN}/{role}:{FLWR_VERSION}", ROLE=role, BASE=BASE_IMAGE,
            )  # fmt: skip
    for role in ("superlink", "supernode"):
        tag = f"fedstale-{role}:0.1.0"
        build(runtime, mounts, DOCKER / "Dockerfile", ROOT, tag, ROLE=role, **args)
    return args


def image_size(runtime: Runtime, name: str) -> int:
    return int(runtime.check("image", "inspect", "--format", "{{.Size}}", name).strip())


@dataclass
class Compose:
    """One compose project of docker/ files, named so that teardown finds all it made."""

    runtime: Runtime
    name: str
    files: list[str]
    env: dict[str, str]
    folder: Path = DOCKER  # where the files are

    def command(self, *args: str) -> list[str]:
        files = [flag for name in self.files for flag in ("-f", str(self.folder / name))]
        return [*self.runtime.compose, "-p", self.name, *files, *args]

    def __call__(self, *args: str, timeout: float = 300) -> str:
        result = _run(self.command(*args), {**self.runtime.env, **self.env}, timeout)
        if result.returncode != 0:
            raise RuntimeError(f"compose {' '.join(args)}: {result.stderr[-3000:]}")
        return result.stdout + result.stderr

    def containers(self, service: str = "") -> list[str]:
        labels = [f"label=com.docker.compose.project={self.name}"]
        labels += [f"label=com.docker.compose.service={service}"] if service else []
        filters = [flag for label in labels for flag in ("--filter", label)]
        out = self.runtime.check("ps", "-a", "-q", *filters)
        return out.split()

    def logs(self, service: str) -> str:
        printed = [self.runtime("logs", container) for container in self.containers(service)]
        return "".join(result.stdout + result.stderr for result in printed)

    def kill(self, service: str) -> None:
        for container in self.containers(service):
            self.runtime.check("kill", container)

    def leftovers(self) -> list[str]:
        """Containers, pods, networks and volumes of this project still present."""
        found = [f"container {c}" for c in self.containers()]
        for kind in ("network", "volume") + (("pod",) if self.runtime.engine == "podman" else ()):
            listed = self.runtime.check(kind, "ls", "--format", "{{.Name}}").split()
            found += [f"{kind} {n}" for n in listed if self.name in n]
        return found

    def teardown(self) -> list[str]:
        """`down -v`, then anything left removed by id; what had to be removed that way."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self("down", "-v", "-t", "5", timeout=180)
        left = self.leftovers()
        for container in self.containers():
            self.runtime("rm", "-f", "-t", "0", container)
        for item in left:
            kind, name = item.split(" ", 1)
            if kind != "container":
                self.runtime(kind, "rm", "-f", name)
        return left


PROJECT = re.compile(r"fedstale-test-(\d+)-[0-9a-f]{8}")  # the pid of the process that made it


def project_name() -> str:
    """A compose project's name, carrying the pid of the test process that makes it."""
    return f"fedstale-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def sweep_abandoned(runtime: Runtime) -> list[str]:
    """Tear down the test projects whose process is gone: a session killed outright (SIGKILL,
    the machine's session ending) cannot tear down its own, and its SuperLink and SuperNodes
    would run on beside every later test. A project of a live process (a suite running beside
    this one) is left alone (so is a reused pid's, on the safe side). Returns the
    projects torn down."""
    names = runtime.check(
        "ps", "-a", "--format", '{{index .Labels "com.docker.compose.project"}}'
    ).split()
    for kind in ("network", "volume"):
        names += runtime.check(kind, "ls", "--format", "{{.Name}}").split()
    projects = {found.group(0): int(found.group(1)) for n in names if (found := PROJECT.match(n))}
    abandoned = sorted(name for name, pid in projects.items() if not alive(pid))
    for name in abandoned:
        Compose(runtime, name, ["compose.yml"], {}).teardown()
    return abandoned


@dataclass
class Prepared:
    """What `prepare` found: the runtime (or why there is none), the images' sizes and the
    seconds it took."""

    runtime: Runtime | None = None
    skip: str = ""
    sizes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def prepare(workdir: Path) -> Prepared:
    """A runtime, the base image, the stand-ins and fedstale's images; one build at a time
    on the machine (the images are the machine's: two sessions or workers share them)."""
    started = time.monotonic()
    with (Path(tempfile.gettempdir()) / "fedstale-images.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _prepare(workdir, started)


def _prepare(workdir: Path, started: float) -> Prepared:
    found = find_runtime(workdir)
    if isinstance(found, str):
        return Prepared(skip=found)
    build_images(found)
    names = ("fedstale-superlink:0.1.0", "fedstale-supernode:0.1.0")
    sizes = {name: image_size(found, name) for name in names}
    return Prepared(found, sizes=sizes, seconds=time.monotonic() - started)


_PREBUILD: concurrent.futures.Future[Prepared] | None = None


def prebuild(workdir: Path) -> None:
    """Start `prepare` in a thread of its own (once per session): the container tests run
    last and find their images built while the rest of the suite ran."""
    global _PREBUILD
    if _PREBUILD is None:
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="images")
        _PREBUILD = pool.submit(prepare, workdir)
        pool.shutdown(wait=False)


def prepared(workdir: Path) -> Prepared:
    """The prebuild's result (started now if it was not), its errors raised here."""
    prebuild(workdir)
    assert _PREBUILD is not None
    with timing.one_time("the container images"):
        return _PREBUILD.result(timeout=timing.left())
