"""``ferrus.__all__`` is the public interface other programs may import: every name in
it exists, ``from ferrus import *`` gives exactly those names, and nothing that belongs
there (an operation, a config dataclass) is left out."""

import ast
import inspect
import os
import subprocess
import sys

import ferrus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_public_name_exists_once():
    assert len(ferrus.__all__) == len(set(ferrus.__all__))
    missing = [name for name in ferrus.__all__ if not hasattr(ferrus, name)]
    assert not missing


def test_star_import_gives_exactly_the_public_names():
    namespace = {}
    exec("from ferrus import *", namespace)
    namespace.pop("__builtins__")
    assert set(namespace) == set(ferrus.__all__)


def test_the_promised_names_are_public():
    promised = {"Store", "TaskState", "StateData", "main", "load_config", "Config",
                "serve_stdio", "FerrusError"}
    assert promised <= set(ferrus.__all__)


def test_every_operation_is_public():
    operations = {name for name, value in vars(ferrus).items()
                  if name.startswith("op_") and inspect.isfunction(value)}
    assert operations and operations <= set(ferrus.__all__), \
        sorted(operations - set(ferrus.__all__))


def test_every_config_dataclass_is_public():
    """Every dataclass src/ferrus/config.py defines is public."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "src", "ferrus", "config.py")
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    config_types = {node.name for node in tree.body if isinstance(node, ast.ClassDef)
                    and any("dataclass" in ast.unparse(d) for d in node.decorator_list)}
    assert {"Config", "ChecksConfig", "SessionsConfig"} <= config_types
    assert config_types <= set(ferrus.__all__), sorted(config_types - set(ferrus.__all__))


def test_the_docstring_says_the_rest_may_change():
    doc = " ".join(ferrus.__doc__.split())
    assert "``__all__``" in doc and "Everything else may change between versions" in doc


def test_another_program_drives_a_task_through_the_public_names(project):
    program = (
        "from ferrus import *\n"
        "import sys\n"
        "store = Store(sys.argv[1])\n"
        "config = load_config(sys.argv[1])\n"
        "outcome = op_create_task(store, HUMAN, 'say hello')\n"
        "status = op_status(store).data\n"
        "print(status['state'], config.limits.max_review_cycles,\n"
        "      store.read_state().state is TaskState.EXECUTING)\n"
        "try:\n"
        "    op_approve(store, HUMAN)\n"
        "except FerrusError as err:\n"
        "    print('refused:', err.message)\n")
    result = subprocess.run([sys.executable, "-c", program, str(project)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    first, refusal = result.stdout.splitlines()
    assert first == "Executing 3 True"
    assert refusal.startswith("refused: ")
