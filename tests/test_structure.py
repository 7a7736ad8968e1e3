"""The package's shape: layers that import only downward, no import circle, every name imported
from its home, a design page that lists every module, and tests that mirror the package."""

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ktm

KTM = Path(ktm.__file__).parent
REPO = KTM.parent
# the layers, bottom up: a module may import its own layer and the layers below it, never a layer
# above it nor another layer of the same rank (docs/design.md draws the same map)
RANK = {"errors": 0, "util": 1, "core": 2, "readers": 3, "decode": 3, "llamacpp": 3, "vllm": 3,
        "model": 4, "tasks": 4, "compressors": 5, "evaluation": 6, "training": 7, "serving": 8,
        "bench": 9, "cli": 10}
TOP_MODULES = {"__init__.py", "errors.py", "model.py"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(KTM.rglob("*.py"))}


def layer(module: str) -> str:
    return module.split(".")[1] if module != "ktm" else "ktm"


def imports_of(module: str) -> set[str]:
    """Every ktm module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("ktm.")}


def defined_names(module: str) -> set[str]:
    """The names a module binds itself (classes, functions, assignments), not those it imports."""
    names = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def test_the_top_level_holds_only_the_layers():
    top = {p.name for p in KTM.iterdir() if p.suffix == ".py"}
    folders = {p.name for p in KTM.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert top == TOP_MODULES
    assert folders | {"errors", "model"} == set(RANK)


@pytest.mark.parametrize("module", [m for m in MODULES if m != "ktm"])
def test_a_module_imports_only_its_own_layer_and_those_below(module):
    mine = layer(module)
    upward = {m for m in imports_of(module)
              if layer(m) != mine and RANK[layer(m)] >= RANK[mine]}
    assert upward == set(), f"{module} ({mine}, rank {RANK[mine]}) imports {sorted(upward)}"


def test_no_import_circle():
    graph = {m: {i for i in imports_of(m) if i in MODULES} for m in MODULES}
    done, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_every_name_is_imported_from_its_home():
    """No compatibility re-exports: ``from ktm.x import name`` finds ``name`` defined in ``ktm.x``
    (the top-level ``ktm`` alone serves the public API by lazy lookup)."""
    files = [*KTM.rglob("*.py"), *(REPO / "tests").rglob("*.py"), *(REPO / "results").rglob("*.py")]
    wrong = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.startswith("ktm.")):
                continue
            assert node.module in MODULES, f"{path}:{node.lineno}: no module {node.module}"
            home = defined_names(node.module)
            wrong += [f"{path.relative_to(REPO)}:{node.lineno}: {a.name} from {node.module}"
                      for a in node.names
                      if a.name not in home and f"{node.module}.{a.name}" not in MODULES]
    assert wrong == []


def test_the_design_page_lists_every_module_once():
    page = (REPO / "docs" / "design.md").read_text()
    listed = re.findall(r"^\| `([\w/]+\.py)` \|", page, flags=re.M)
    paths = sorted(str(p.relative_to(KTM)) for p in KTM.rglob("*.py"))
    assert sorted(listed) == paths


def test_the_tests_mirror_the_package():
    tests = REPO / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= set(RANK) and folders, folders
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files of one name: pytest imports one"


@pytest.mark.slow  # starts a Python process
def test_report_help_does_not_import_torch():
    code = ("import sys\nfrom ktm.cli.main import main\ntry:\n    main(['report', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "results" in out.stdout  # the help text was printed
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.slow  # starts a Python process
def test_public_names_load_lazily_from_their_homes():
    code = ("import sys, ktm\nprint('torch' in sys.modules)\n"
            "from ktm import KTMModel, PretrainConfig, TrainConfig, pretrain, train\n"
            "from ktm.training.pretrain import pretrain as p\nfrom ktm.training.train import train"
            " as t\nprint(train is t, pretrain is p, KTMModel.__module__, TrainConfig.__module__,"
            " PretrainConfig.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True", "ktm.model", "ktm.training.config",
                                  "ktm.training.pretrain"]
    assert set(ktm.__all__) - {"__version__"} <= set(dir(ktm))


@pytest.mark.slow  # starts a Python process
def test_python_m_ktm_cli_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "ktm.cli", "--help"], capture_output=True,
                         text=True, check=True)
    assert "usage: ktm" in out.stdout


# where a backend may be named: the runtimes themselves, the one place that picks one
# (KTMModel.use_backend), the flags that build a backend's settings, and the benchmark, which
# builds the runtimes it compares and labels its rows with them
NAMES_BACKENDS = {"ktm.model", "ktm.cli.args", "ktm.serving.config", "ktm.bench.bench",
                  "ktm.bench.config", "ktm.bench.runners"}
RUNTIME_HOMES = ("ktm.decode.runtime", "ktm.llamacpp.", "ktm.vllm.")
BACKENDS = {"torch", "llamacpp", "vllm"}
RUNTIME_CLASSES = {"TorchRuntime", "LlamaCppRuntime", "VLLMRuntime", "VLLMEngine", "VLLMServer"}


def backend_checks(module: str) -> list[str]:
    """Comparisons with a backend's name, ``runtime is (not) None`` tests and isinstance checks
    of a runtime class in a module, as 'line: code'."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            values = [v for c in sides
                      for v in (c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c])]
            named = any(isinstance(v, ast.Constant) and v.value in BACKENDS for v in values)
            is_none = (any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
                       and "runtime" in ast.unparse(node.left))
            if named or is_none:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
              and any(getattr(n, "id", None) in RUNTIME_CLASSES for n in ast.walk(node))):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("module", [m for m in MODULES if m not in NAMES_BACKENDS
                                    and not m.startswith(RUNTIME_HOMES)])
def test_only_the_runtimes_and_the_one_picker_ask_which_backend_runs(module):
    """The decode loop, the serving engine, scoring and the rest call the model's runtime and
    never ask which it is; what differs is said by the runtime's attributes."""
    assert backend_checks(module) == []


def runtime_probes(module: str) -> list[str]:
    """``hasattr`` / ``getattr`` calls whose object is a runtime, as 'line: code'."""
    return [f"{node.lineno}: {ast.unparse(node)}"
            for node in ast.walk(ast.parse(MODULES[module].read_text()))
            if isinstance(node, ast.Call) and node.args
            and getattr(node.func, "id", None) in ("hasattr", "getattr")
            and "runtime" in ast.unparse(node.args[0])]


@pytest.mark.parametrize("module", list(MODULES))
def test_no_caller_probes_a_runtime_for_a_feature(module):
    """What a runtime offers is declared by the contract (``ktm.decode.runtime.Runtime``) and read
    as it is: a feature one runtime lacks is a flag or a value there, not a missing attribute."""
    assert runtime_probes(module) == []


def set_on_self(cls) -> set[str]:
    """The attributes the ``__init__`` of ``cls`` and of its ktm ancestors assign on ``self``."""
    names = set()
    for c in cls.__mro__:
        init = vars(c).get("__init__")
        if init is None or not c.__module__.startswith("ktm."):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            names |= {n.attr for t in targets for n in ast.walk(t)
                      if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "self"}
    return names


def test_every_runtime_has_what_the_contract_declares():
    from ktm.decode.runtime import Runtime, TorchRuntime
    from ktm.llamacpp.runtime import LlamaCppRuntime
    from ktm.vllm.runtime import VLLMRuntime

    members = {n for n in vars(Runtime) if not n.startswith("_")} | set(Runtime.__annotations__)
    for runtime in (TorchRuntime, LlamaCppRuntime, VLLMRuntime):
        missing = {n for n in members if not hasattr(runtime, n)} - set_on_self(runtime)
        assert missing == set(), runtime.__name__


@pytest.mark.slow  # starts a process
def test_ruff_finds_nothing():
    """The lint the project claims (pyproject's [tool.ruff]), run with the test command."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "ktm", "tests", "results"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_model_class_keeps_to_what_a_user_calls():
    """KTMModel's own public members stay few (20 at most: its weights, tokenizer facts, prompt
    encoding, forward and where it runs): the rest of what the layers need lives in their
    modules (``ktm.core.levels``, ``ktm.core.checkpoint.model_record``, ``ktm.model``'s
    functions)."""
    from ktm.model import KTMModel

    own = [n for n in vars(KTMModel) if not n.startswith("_")]
    assert len(own) <= 20, own


LONGEST_FUNCTION = 80  # lines, from ``def`` to the last line, docstring included


def test_no_function_is_longer_than_a_screen():
    """One job per function: none in ``ktm/`` over 80 lines (split it where it does two)."""
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_only_the_model_sets_its_runtime():
    """A model's runtime is its own: others build one for it (``RuntimeSpec.build``) and hand
    it to what runs it (``infer_once(..., runtime=...)``), never swap the model's."""
    swaps = [f"{name}:{node.lineno}: {ast.unparse(node)}"
             for name, path in MODULES.items()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
             for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
             if isinstance(target, ast.Attribute) and target.attr == "runtime"
             and not (name == "ktm.model" and ast.unparse(target.value) == "self")
             and ast.unparse(target.value) != "self"]
    assert swaps == []
