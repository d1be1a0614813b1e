"""The import graph of the project's packages, read statically (``ast``; imports inside functions and under
``if TYPE_CHECKING`` count, nothing is executed), keeps the layering of issue 17:

    freescale (CLI)  ->  analysis  ->  loader  ->  balancer
                         trainer   ->  loader, balancer, cuda_ext

- ``balancer/`` (cost model, planners, their kernels) imports no other project package and no file reader;
- ``loader/`` imports nothing from ``trainer/``, ``analysis/`` or ``freescale/``;
- ``cuda_ext/`` (CUDA sources, their build, the ctypes bindings, the codec's reference) imports nothing from
  ``trainer/``: the transports built on it live in ``trainer/transport/``;
- no import cycle between top-level packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.source import parse

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("balancer", "loader", "analysis", "trainer", "cuda_ext", "freescale")
FILE_READERS = ("pyarrow", "pandas")  # pyarrow.parquet, pyarrow.csv, ... are under pyarrow


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, relative imports resolved; ``from m import a`` gives
    ``m`` and ``m.a`` (``a`` may be a submodule). String literals passed to ``importlib.import_module`` count."""
    tree = parse(path)
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = ".".join(filter(None, (base, node.module)))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.add(node.args[0].value)
    return found


def import_graph() -> dict[str, dict[str, set[str]]]:
    """{package: {file (relative to the root): absolute module names it imports}} over every .py file."""
    graph: dict[str, dict[str, set[str]]] = {}
    for package in PACKAGES:
        files = sorted((ROOT / package).rglob("*.py"))
        assert files, f"{package}/ has no .py files"
        graph[package] = {str(f.relative_to(ROOT)): imports_of(f) for f in files}
    return graph


GRAPH = import_graph()


def offending(package: str, forbidden: tuple[str, ...]) -> list[str]:
    """``file: module`` for every import in ``package`` of a module in (or under) ``forbidden``."""
    return sorted(f"{file}: {name}" for file, names in GRAPH[package].items() for name in names
                  if name.split(".")[0] in forbidden)


def package_edges() -> dict[str, set[str]]:
    """{package: the other project packages it imports}."""
    return {package: {name.split(".")[0] for names in files.values() for name in names
                      if name.split(".")[0] in PACKAGES and name.split(".")[0] != package}
            for package, files in GRAPH.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_the_known_imports():
    """The walk finds imports at module level, inside functions, and relative ones: a guard against a walk
    that finds nothing and so passes everything."""
    assert "balancer.plan" in GRAPH["balancer"]["balancer/__init__.py"]
    assert "analysis.report" in GRAPH["freescale"]["freescale/report.py"]  # imported inside make_report
    assert package_edges()["analysis"] >= {"balancer"}


def test_balancer_imports_no_other_project_package_and_no_file_reader():
    others = tuple(p for p in PACKAGES if p != "balancer")
    assert offending("balancer", others) == [], "balancer/ holds the cost model and the planners only"
    assert offending("balancer", FILE_READERS) == [], "balancer/ reads no files"


def test_loader_imports_nothing_above_it():
    assert offending("loader", ("trainer", "analysis", "freescale")) == []


def test_cuda_ext_imports_nothing_from_trainer():
    assert offending("cuda_ext", ("trainer",)) == [], "cuda_ext/ sits below the trainer's transports"


def test_only_the_binding_module_calls_into_the_cuda_library():
    """ctypes appears in cuda_ext/build.py (which loads the library) and cuda_ext/bindings.py only."""
    users = sorted(file for files in GRAPH.values() for file, names in files.items() if "ctypes" in names)
    assert users == ["cuda_ext/bindings.py", "cuda_ext/build.py"]


def test_no_import_cycle_between_packages():
    edges = package_edges()
    assert find_cycle(edges) is None, f"import cycle between packages: {' -> '.join(find_cycle(edges))}"


# loader/'s houses (issue 27): the data contract (loader/contract/) and the pure stages (loader/stages/) import
# neither Ray nor torch nor asyncio, nor any other house of the loader but the contract; the control plane
# (loader/control/) imports neither Ray nor torch; Ray is imported only by its shells (loader/backends/) and the
# Ray Train adapter; the top-level modules are the public face (SequenceLoader, its options, errors, adapters)
PLAIN_TOP = ("loader/config.py", "loader/spec.py", "loader/errors.py")  # options and errors: no Ray, no torch
RAY_SHELLS = ("loader/backends/ray_backend.py", "loader/backends/coordinator.py", "loader/backends/ray_readers.py",
              "loader/backends/reader.py", "loader/backends/telemetry.py", "loader/ray_train.py")


def _house(name: str) -> list[str]:
    files = [f for f in GRAPH["loader"] if f.startswith(f"loader/{name}/")]
    assert len(files) >= 4, f"loader/{name}/ holds {files}"
    return files


def _loader_imports(files: list[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{file}: {name}" for file in files for name in GRAPH["loader"][file]
                  if name.split(".")[0] in forbidden)


def test_the_contract_and_the_stages_import_neither_ray_nor_torch_nor_asyncio():
    files = _house("contract") + _house("stages") + list(PLAIN_TOP)
    assert _loader_imports(files, ("ray", "torch", "asyncio")) == []


def test_the_contract_and_the_stages_import_no_house_above_them():
    above = ("loader.control", "loader.backends", "loader.sequence", "loader.microbatch", "loader.torch",
             "loader.ray_train", "loader.device", "loader.inline")
    files = _house("contract") + _house("stages")
    found = sorted(f"{file}: {name}" for file in files for name in GRAPH["loader"][file]
                   if any(name == a or name.startswith(a + ".") for a in above))
    assert found == []
    contract = sorted(f"{file}: {name}" for file in _house("contract") for name in GRAPH["loader"][file]
                      if name.startswith("loader.stages"))
    assert contract == [], "the data contract is below the stages"


def test_every_loader_module_lives_in_a_house():
    houses = ("contract", "stages", "control", "backends", "sample_data")
    top = sorted(f for f in GRAPH["loader"] if f.count("/") == 1)
    assert top == sorted(["loader/__init__.py", *PLAIN_TOP, "loader/sequence.py", "loader/microbatch.py",
                          "loader/torch.py", "loader/ray_train.py", "loader/device.py", "loader/warm.py"])
    assert all(f.split("/")[1] in houses for f in GRAPH["loader"] if f.count("/") == 2)


def test_the_control_plane_imports_no_ray_and_no_torch():
    files = [f for f in GRAPH["loader"] if f.startswith("loader/control/")]
    assert "loader/control/service.py" in files and "loader/control/protocol.py" in files
    assert _loader_imports(files, ("ray", "torch")) == [], "loader/control/ is plain asyncio: both backends run it"


def test_only_the_ray_shells_import_ray():
    users = sorted(f for f, names in GRAPH["loader"].items() if any(n.split(".")[0] == "ray" for n in names))
    assert users == sorted(RAY_SHELLS)


def test_no_environment_read_below_the_public_face():
    """Only the CLI and loader's public face (SequenceLoader, the adapters) read the environment: what the
    houses below do is a function of their arguments."""
    below = [ROOT / f for house in ("contract", "stages", "control", "backends") for f in _house(house)]
    reads = sorted(f"{path.relative_to(ROOT)}: {node.attr if isinstance(node, ast.Attribute) else node.id}"
                   for path in below for node in ast.walk(parse(path))
                   if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"))
                   or (isinstance(node, ast.Name) and node.id in ("environ", "getenv")))
    assert reads == []
