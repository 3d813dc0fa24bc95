"""The layers of lib/ read from the imports alone: no circle, and no import of lib inside a function (one there
hides an order the layers should settle). A reader can then draw the layers; ``layers()`` does."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "lib")):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                found[name] = path
    return found


def imports(path: str, known: dict | None = None) -> tuple[set[str], set[str]]:
    """(lib modules imported at module level, lib modules imported inside a function or method); ``known`` None:
    every module imported, whosever."""
    top, inner = set(), set()

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                continue  # annotations only: no import at run time
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [f"{child.module}.{a.name}" if known is None or f"{child.module}.{a.name}" in known
                         else child.module for a in child.names]
            for name in names:
                if known is None or name in known:
                    (inner if nested else top).add(name)
            visit(child, nested)

    visit(ast.parse(open(path).read()), False)
    return top, inner


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    known = modules()
    top, inner = {}, {}
    for name, path in known.items():
        t, i = imports(path, known)
        # a package's own __init__ runs before its submodules: importing it is not an edge back
        top[name] = {m for m in t if m != name and not name.startswith(m + ".")}
        inner[name] = {m for m in i if m != name}
    return top, inner


def layers(edges: dict[str, set[str]]) -> list[list[str]]:
    """Modules by layer: each imports only modules of the layers below it. Raises on a circle, naming it."""
    placed: dict[str, int] = {}

    def level(name, path):
        if name in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(name):] + [name]))
        if name not in placed:
            placed[name] = 1 + max((level(d, path + [name]) for d in edges[name]), default=-1)
        return placed[name]

    for name in edges:
        level(name, [])
    out = [[] for _ in range(max(placed.values()) + 1)]
    for name, lv in placed.items():
        out[lv].append(name)
    return [sorted(x) for x in out]


def test_no_import_circle_in_lib():
    top, inner = graph()
    layers({name: top[name] | inner[name] for name in top})


def test_no_import_of_lib_inside_a_function():
    _, inner = graph()
    hidden = {name: deps for name, deps in inner.items() if deps}
    assert not hidden, hidden


def test_the_config_tree_and_the_pure_pieces_import_nothing_of_lib():
    top, inner = graph()
    for name in ("lib.config_trained", "lib.config_judge", "lib.config_env", "lib.config_agent", "lib.config_partial",
                 "lib.config_samples", "lib.protocol",
                 "lib.algos", "lib.logprobs", "lib.runfolder"):
        assert not top[name] | inner[name], (name, top[name] | inner[name])
    # the tree's root and its sections
    assert top["lib.config"] | inner["lib.config"] == {"lib.config_trained", "lib.config_judge", "lib.config_env",
                                                       "lib.config_agent", "lib.config_partial", "lib.config_samples"}


def test_the_config_root_stays_short():
    """The root keeps the tree's top, presets and parsing; sections grow in modules of their own."""
    with open(os.path.join(ROOT, "lib", "config.py")) as f:
        assert len(f.read().splitlines()) < 400


if __name__ == "__main__":
    t, i = graph()
    for number, names in enumerate(layers({n: t[n] | i[n] for n in t})):
        print(number, " ".join(n.removeprefix("lib.") for n in names))


def test_dynamo_is_imported_only_where_something_compiles():
    """torch._dynamo (and inductor with it) costs every process that imports it ~1 s of a core: no module of lib/
    and no script imports it at module level, so a rank that compiles nothing (actor.model.compile_layers off, the
    default) never does; lib/compiled.py imports it inside the function that compiles."""
    paths = list(modules().values()) + [os.path.join(ROOT, f) for f in ("train_grpo.py", "train_ppo.py")]
    found = {os.path.relpath(p, ROOT): sorted(n for n in imports(p)[0] if n.startswith(("torch._dynamo",
                                                                                        "torch._inductor")))
             for p in paths}
    assert not any(found.values()), {p: n for p, n in found.items() if n}
