"""The package's imports run one way: walking every import statement of src/paraseek (those inside functions too)
finds no circle between its modules, and inference and parallelism import neither training nor the planner."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "paraseek"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from a.b import c` names a.b.c when that is a module)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, nodes coloured grey while on the path)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "grey"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "grey":
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "black"
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and "paraseek.hardware.profile" in graph["paraseek.hardware.doctor"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    return seen


def test_the_engine_does_not_reach_into_the_planner_or_training():
    """The inference engine, its runner and its model (infer/engine.py, runner.py, model.py) import neither the
    planner nor the training package, not even through another module: serving does not depend on them."""
    graph = import_graph()
    for room in ("paraseek.infer.engine", "paraseek.infer.runner", "paraseek.infer.model"):
        reached = _reach(graph, room)
        assert not {m for m in reached if m.startswith(("paraseek.planner", "paraseek.train"))}, room


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported` for every import (inside functions too) of a module under paraseek.infer or
    paraseek.parallel of one under paraseek.train or paraseek.planner: those layers sit below training and planning,
    which import them, never the other way."""
    low, high = ("paraseek.infer", "paraseek.parallel"), ("paraseek.train", "paraseek.planner")

    def under(m: str, packages: tuple[str, ...]) -> bool:
        return any(m == p or m.startswith(p + ".") for p in packages)

    return sorted(f"{m} -> {n}" for m, imported in graph.items() if under(m, low)
                  for n in imported if under(n, high))


def test_inference_and_parallelism_import_neither_training_nor_the_planner():
    assert layer_violations(import_graph()) == []


def test_training_and_inference_start_their_ranks_through_the_one_launcher():
    """paraseek/launcher.py imports nothing of the package, so that inference can use it without training."""
    graph = import_graph()
    assert graph["paraseek.launcher"] == set()
    for user in ("paraseek.train.launch", "paraseek.infer.ranks", "paraseek.serve.cli"):
        assert "paraseek.launcher" in graph[user], user


def test_the_layer_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    (tmp_path / "paraseek" / "parallel").mkdir(parents=True)
    (tmp_path / "paraseek" / "planner").mkdir()
    for f in ("__init__.py", "parallel/__init__.py", "planner/__init__.py", "planner/memory.py"):
        (tmp_path / "paraseek" / f).write_text("")
    (tmp_path / "paraseek" / "parallel" / "pipeline.py").write_text(
        "def cut():\n    from paraseek.planner.memory import partition\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "paraseek")  # import_graph walks this package instead
    assert layer_violations(import_graph()) == ["paraseek.parallel.pipeline -> paraseek.planner.memory"]


def test_the_engine_commands_get_the_planners_kv_prediction_from_the_top_level_cli():
    """generate, serve and bench-infer print the planner's KV-pool prediction beside the measured pool; the function
    comes from paraseek/cli.py, which may import the planner (infer/build.py: build_engine)."""
    from paraseek.cli import _planned_kv_tokens, build_parser

    parser = build_parser()
    for command in ("generate", "serve", "bench-infer"):
        assert parser.parse_args([command, "tiny-moe"]).plan_kv_tokens is _planned_kv_tokens, command
