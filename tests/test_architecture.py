"""The layers of docs/architecture.md, read from the source: which package may import which,
at module level or inside a function, and no probing of a strategy's attributes by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "strategies", "server_app", "client_app", "launcher", "bench")
# What each package may import from this repository (besides itself).
ALLOWED = {
    "common": set(),
    "strategies": {"common"},
    "server_app": {"common", "strategies"},
    "client_app": {"common", "strategies"},
    "launcher": {"common", "strategies", "server_app", "client_app"},
    "bench": {"common", "strategies", "server_app", "client_app", "launcher"},
}
# Flower's API is for the apps and the launcher; the rules and the shared layer stay plain,
# except the one wire adapter that both apps share.
FLOWER_ALLOWED = {"server_app", "client_app", "launcher", "bench", "fedstale/common/records.py"}


def layer_of(module: str) -> str:
    """`fedstale.server_app.engine` -> `server_app`; any other module -> its top-level name."""
    parts = module.split(".")
    return parts[1] if parts[0] == "fedstale" and len(parts) > 1 else parts[0]


def imports_of(path: Path) -> set[str]:
    """The layers (or other top-level names) of every module `path` imports, anywhere in
    the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {layer_of(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(layer_of(node.module))
    return names


def sources(package: str) -> list[Path]:
    folder = ROOT / package if package == "bench" else ROOT / "fedstale" / package
    return sorted(folder.rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_each_layer_imports_only_the_layers_below_it(package: str) -> None:
    wrong = {}
    for path in sources(package):
        own = imports_of(path) & set(PACKAGES) - {package}
        if own - ALLOWED[package]:
            wrong[str(path.relative_to(ROOT))] = sorted(own - ALLOWED[package])
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}: {wrong}"


@pytest.mark.parametrize("package", ["common", "strategies"])
def test_the_rules_and_the_shared_layer_do_not_use_flower(package: str) -> None:
    users = [
        str(path.relative_to(ROOT))
        for path in sources(package)
        if "flwr" in imports_of(path) and str(path.relative_to(ROOT)) not in FLOWER_ALLOWED
    ]
    assert not users


def test_the_apps_never_import_each_other_or_the_launcher() -> None:
    for app, others in (
        ("server_app", {"client_app", "launcher"}),
        ("client_app", {"server_app", "launcher"}),
    ):
        for path in sources(app):
            assert not imports_of(path) & others, f"{path.relative_to(ROOT)} imports {others}"


def probes_a_strategy(node: ast.AST) -> bool:
    """getattr / hasattr on something named like a strategy: a binding by name."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return False
    if node.func.id not in ("getattr", "hasattr") or not node.args:
        return False
    return "strategy" in ast.unparse(node.args[0])


def test_the_engine_and_the_setup_never_probe_a_strategy_by_name() -> None:
    probes = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sources("server_app")
        for node in ast.walk(ast.parse(path.read_text()))
        if probes_a_strategy(node)
    ]
    assert not probes


FEATURE_WORDS = ("privacy", "secure", "secagg", "central_dp", "dp_", "exchange", "topology")


def feature_names(source: str) -> set[str]:
    """Names, attributes and imported modules in `source` that name a feature."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        words = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, ast.ImportFrom):
            words = [node.module or "", *(alias.name for alias in node.names)]
        elif isinstance(node, ast.FunctionDef):
            words = [node.name]
        found |= {w for w in words if any(f in w.lower() for f in FEATURE_WORDS)}
    return found


def test_the_engine_names_no_stage_and_the_stages_import_nothing_above_them() -> None:
    """The engine calls one pipeline of stages whether a feature is on or off: it names no
    feature (no attribute, branch or import of one); the stages' room imports, of the server
    app, only itself and the transport's reply type (no arrow back up)."""
    for part in ("engine", "dispatch", "intake", "tasks", "federation"):
        source = (ROOT / "fedstale" / "server_app" / f"{part}.py").read_text()
        assert feature_names(source) == set(), part
    room = ROOT / "fedstale" / "server_app" / "stages"
    assert {p.stem for p in room.glob("*.py")} >= {"pipeline", "central_dp", "secure"}
    for path in room.glob("*.py"):
        for module in module_imports(path):
            if module.startswith("fedstale.server_app"):
                allowed = ("fedstale.server_app.stages", "fedstale.server_app.transport")
                assert module.startswith(allowed), (path.name, module)


def test_the_engine_is_a_short_loop_with_few_arguments() -> None:
    """docs/architecture.md: the engine keeps time, tasks and the Grid; sending tasks and
    taking replies in are its parts' (dispatch.py, intake.py). At most 25 methods (properties
    included) and 6 constructor arguments."""
    tree = ast.parse((ROOT / "fedstale" / "server_app" / "engine.py").read_text())
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    methods = [n for n in engine.body if isinstance(n, ast.FunctionDef)]
    (init,) = [m for m in methods if m.name == "__init__"]
    arguments = [a.arg for a in init.args.args + init.args.kwonlyargs if a.arg != "self"]
    assert len(methods) <= 25, [m.name for m in methods]
    assert len(arguments) <= 6, arguments


def whole_config_parameters(source: str) -> list[str]:
    """The functions of `source` with a parameter annotated with the whole `RunConfig` (a
    handler whose type names it is not one)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for argument in arguments:
                annotation = ast.unparse(argument.annotation) if argument.annotation else ""
                if annotation.split("|")[0].strip() in ("RunConfig", "'RunConfig'"):
                    found.append(f"{node.name}({argument.arg})")
    return found


def test_at_most_40_signatures_take_the_whole_run_config() -> None:
    """docs/architecture.md, "Who reads a key": a component takes its section or its typed
    view (`RuleSettings`, `ClientSettings`), not the whole config; 141 signature lines took
    it before, 35 now."""
    taking = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "fedstale").rglob("*.py"))
        for name in whole_config_parameters(path.read_text())
    ]
    assert len(taking) <= 40, taking


def test_the_config_counter_counts_parameters_not_handlers() -> None:
    source = (
        "def a(run: RunConfig, b: int) -> None: ...\n"
        "def c(x, run: RunConfig | None = None): ...\n"
        "def d(h: Handler[RunConfig], s: RunSettings): ...\n"
    )
    assert whole_config_parameters(source) == ["a(run)", "c(run)"]


def test_the_feature_finder_finds_a_feature() -> None:
    source = "from fedstale.server_app.stages.secure import X\nself.privacy.clip(u)\n"
    assert feature_names(source) == {"fedstale.server_app.stages.secure", "privacy"}


def test_the_checker_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "def f():\n    from fedstale.server_app.engine import Engine\n    return Engine\n"
    )
    assert imports_of(source) == {"server_app"}
    probe = ast.parse("getattr(self.strategy, 'bind_x', None)").body[0]
    assert isinstance(probe, ast.Expr) and probes_a_strategy(probe.value)


def module_imports(path: Path) -> set[str]:
    """The fedstale modules `path` imports, anywhere in the file (TYPE_CHECKING included):
    `from fedstale.x import y` counts as fedstale.x.y where that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("fedstale.")}


def module_graph() -> dict[str, set[str]]:
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in (ROOT / "fedstale").rglob("*.py")
    }
    return {name: module_imports(path) & set(modules) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected set of modules larger than one (DFS)."""
    found, done = [], set()
    for start in sorted(graph):
        stack, on_path = [(start, iter(sorted(graph[start])))], [start]
        while stack:
            node, following = stack[-1]
            nxt = next(following, None)
            if nxt is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif nxt in on_path:
                found.append([*on_path[on_path.index(nxt) :], nxt])
            elif nxt not in done:
                stack.append((nxt, iter(sorted(graph[nxt]))))
                on_path.append(nxt)
    return found


def test_no_module_of_fedstale_imports_itself_back() -> None:
    """Not even for type checking; a package's __init__ counts as a module."""
    found = cycles(module_graph())
    assert not found, found[:3]


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_the_door_and_the_strategy_base_grow_no_further() -> None:
    """What one rule owns lives in that rule or in a capability it declares, not in the
    hooks every door implements nor in the base every rule inherits (17 door hooks and 15
    public members of the base when issue 49 was filed; 17 and 14 now)."""
    from fedstale.server_app.lifecycle import Door
    from fedstale.strategies.base import Strategy

    hooks = [n for n, v in vars(Door).items() if callable(v) and not n.startswith("_")]
    members = [n for n in dir(Strategy) if not n.startswith("_")]
    assert len(hooks) <= 17, hooks
    assert len(members) <= 14, members


def test_the_launcher_and_the_rules_load_without_torch() -> None:
    """torch is imported where a run needs it: `fedstale --help`, `compare` and `deploy`, and
    any tool reading the rule registry, start in 0.55 s instead of 1.9 s here."""
    import subprocess
    import sys

    code = (
        "import sys, fedstale.launcher.cli, fedstale.strategies.registry as r; "
        "r.declarations(); r.client_rules(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sklearn')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# Flower's public API; anything else of Flower's is internal and may move in any release.
FLOWER_PUBLIC = ("flwr.app", "flwr.serverapp", "flwr.clientapp")
FLOWER_COMMON_PUBLIC = set(__import__("flwr.common", fromlist=["__all__"]).__all__)
INTERNALS_MODULE = ROOT / "fedstale" / "launcher" / "flower_internals.py"


def flower_internals_used(path: Path) -> list[str]:
    """The Flower modules (and `flwr.common` names outside its `__all__`) `path` imports,
    or names as a string (an import_module), that are not Flower's public API."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [node.module]
            if node.module == "flwr.common":
                found += [
                    f"flwr.common.{a.name}"
                    for a in node.names
                    if a.name not in FLOWER_COMMON_PUBLIC
                ]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            modules = (
                [node.value] if node.value.startswith("flwr.") and " " not in node.value else []
            )
        else:
            continue
        for module in modules:
            public = module == "flwr.common" or any(
                module == p or module.startswith(p + ".") for p in FLOWER_PUBLIC
            )
            if (module == "flwr" or module.startswith("flwr.")) and not public:
                found.append(module)
    return found


def test_only_the_launchers_internals_module_uses_flowers_internals() -> None:
    wrong = {}
    for path in sorted((ROOT / "fedstale").rglob("*.py")):
        if path != INTERNALS_MODULE and flower_internals_used(path):
            wrong[str(path.relative_to(ROOT))] = flower_internals_used(path)
    assert not wrong, f"Flower internals outside {INTERNALS_MODULE.name}: {wrong}"
    assert flower_internals_used(INTERNALS_MODULE)  # the check sees its string names


def test_the_internals_check_sees_every_kind_of_use(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import flwr.supercore.utils\n"
        "from flwr.common.constant import ErrorCode\n"
        "from flwr.common import Context, log_internal_thing\n"
        "from flwr.app import Message\n"
        "NAME = 'flwr.cli.constant'\n"
    )
    assert flower_internals_used(probe) == [
        "flwr.supercore.utils",
        "flwr.common.constant",
        "flwr.common.log_internal_thing",
        "flwr.cli.constant",
    ]


def test_every_internal_the_launcher_names_is_in_the_installed_flower() -> None:
    from fedstale.launcher import flower_internals

    assert flower_internals.missing() == []


def test_a_moved_internal_is_one_line_naming_flowers_version() -> None:
    from fedstale.common.config import ConfigError
    from fedstale.launcher.flower_internals import Internal, flower_version

    gone = Internal("flwr.cli.constant", "NO_SUCH_NAME", "the local SuperLink's port")
    with pytest.raises(ConfigError) as caught:
        gone.load()
    line = str(caught.value)
    assert "\n" not in line and f"Flower {flower_version()} has no flwr.cli." in line
    assert "install flwr>=1.41.0,<1.43" in line
