"""ferrus.py carries no code that only tests use, and every exception raised while
handling another says whether that other one is its cause (``raise X from err``) or
noise (``from None``), so FERRUS_DEBUG tracebacks tell the truth."""

import ast
import functools
import os

FERRUS_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ferrus.py")

# Names other programs call although ferrus.py itself does not.
CALLED_FROM_OUTSIDE = {
    "BuildBackend",     # pyproject.toml's build-backend: pip calls its hooks
    # Git's worktree and integration plumbing for parallel tasks, until that runner calls it.
    "default_worktree_dir", "create_task_worktree", "remove_task_worktree",
    "list_task_worktrees", "prepare_integration", "fast_forward_target",
    # The far end of a place: the boot program sent there calls it by name (places.py).
    "place_side_main",
}


@functools.lru_cache(maxsize=None)
def module():
    with open(FERRUS_PY, encoding="utf-8") as handle:
        return ast.parse(handle.read())


def name_uses(tree):
    """(name, line) for every name used as a variable or an attribute."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            uses.append((node.id, node.lineno))
        elif isinstance(node, ast.Attribute):
            uses.append((node.attr, node.lineno))
    return uses


def test_every_top_level_function_and_class_is_used_by_ferrus_itself():
    tree = module()
    lines_using = {}
    for name, line in name_uses(tree):
        lines_using.setdefault(name, []).append(line)
    unused = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        if node.name in CALLED_FROM_OUTSIDE:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if all(start <= line <= node.end_lineno for line in lines_using.get(node.name, [])):
            unused.append("%s (line %d)" % (node.name, node.lineno))
    assert not unused, "defined but never used by ferrus.py: %s" % ", ".join(unused)


def test_no_attribute_is_only_ever_written():
    tree = module()
    written, read = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    written.setdefault(node.attr, node.lineno)
            else:
                read.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            read.add(node.value)            # getattr(obj, "name")
    never_read = sorted("%s (line %d)" % (name, line) for name, line in written.items()
                        if name not in read)
    assert not never_read, "attributes set but never read: %s" % ", ".join(never_read)


def raises_without_cause(tree):
    found = []

    def visit(node, handler):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                  ast.ClassDef)):
                visit(child, None)      # a function defined here raises later, elsewhere
                continue
            if isinstance(child, ast.ExceptHandler):
                for statement in child.body:
                    visit(ast.Module(body=[statement], type_ignores=[]), child)
                continue
            if (isinstance(child, ast.Raise) and handler is not None and child.exc is not None
                    and child.cause is None
                    and not (isinstance(child.exc, ast.Name) and child.exc.id == handler.name)):
                found.append(child.lineno)
            visit(child, handler)
    visit(tree, None)
    return found


def test_every_exception_raised_in_an_except_block_is_chained():
    lines = raises_without_cause(module())
    assert not lines, "raise ... from err (or from None) missing on lines %s" % lines


def test_the_chaining_check_sees_a_missing_cause():
    sample = ast.parse("try:\n    pass\nexcept OSError as err:\n    raise ValueError(err)\n"
                       "try:\n    pass\nexcept OSError as err:\n    raise\n"
                       "try:\n    pass\nexcept OSError as err:\n    raise err\n"
                       "try:\n    pass\nexcept OSError:\n    raise KeyError() from None\n")
    assert raises_without_cause(sample) == [4]
