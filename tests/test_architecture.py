"""The house rules, read from the source: imports flow one way (no circle between the project's
modules), no private name (a leading underscore) is used outside its module, no function outside
the tests runs past 60 lines (40 in the algorithms and the math), each algorithm file stays under
400 (STYLE.md, habit 1), the whole config reaches only the loader, the resolver and the CLI, and
a variant's name is compared only where it is resolved."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "tasks", "runtime", "policy", "reward_model", "process_supervision", "iteration")
MAX_FUNCTION_LINES = 60
MAX_CORE_FUNCTION_LINES = 40  # policy/algorithms/ and policy/math/: the objective at a glance
MAX_ALGORITHM_LINES = 400
# Where the whole config may be passed: the loader and the memory plan (configs/), the resolver
# that turns it into objects once (iteration/resolve.py) and the command line (igrpo.py).
WHOLE_CONFIG_HOMES = ("configs", "iteration/resolve.py", "igrpo.py")
MAX_WHOLE_CONFIG_FUNCTIONS = 12


def _sources(*folders: str) -> list[Path]:
    files = [ROOT / "igrpo.py"] if not folders or "igrpo.py" in folders else []
    for folder in folders or (*PACKAGES, "scripts", "experiments", "bench", "tests"):
        if folder != "igrpo.py":
            files += sorted((ROOT / folder).rglob("*.py"))
    return files


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PROJECT = {_module_name(p) for p in _sources(*PACKAGES, "igrpo.py")}


def _resolve(name: str) -> str | None:
    """The project module `name` is, or lies in (a name inside a module: its module)."""
    while name:
        if name in PROJECT:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: Path) -> list[tuple[str, str, int]]:
    """(project module, imported name or '', line) of every import in `path`, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(m, "", node.lineno) for a in node.names if (m := _resolve(a.name))]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in PROJECT else node.module
                if _resolve(target):
                    out.append((_resolve(target), "" if target == full else alias.name,
                                node.lineno))
    return out


def test_imports_flow_one_way():
    """The project's modules form no import circle (lazy imports inside functions count)."""
    graph = {_module_name(p): {m for m, _, _ in _imports(p)} - {_module_name(p)}
             for p in _sources(*PACKAGES, "igrpo.py")}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, [" -> ".join(c) for c in circles]


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    here = _module_name(path)
    modules = {}  # local name -> the project module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _resolve(alias.name) == alias.name:
                    modules[alias.asname or alias.name.split(".")[0]] = \
                        alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in PROJECT:
                    modules[alias.asname or alias.name] = full
                elif _resolve(node.module) and alias.name.startswith("_") \
                        and node.module != here:
                    found.append(f"{path.name}:{node.lineno}: from {node.module} import "
                                 f"{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name) \
                and node.value.id in modules and modules[node.value.id] != here:
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_used_outside_its_module():
    """A leading underscore means private to its module: no file imports one from another
    project module or reads one through a module it imported (tests, scripts and benchmarks
    included)."""
    assert [use for path in _sources() for use in _private_uses(path)] == []


def test_functions_and_algorithm_files_stay_short():
    long = []
    for path in _sources(*PACKAGES, "igrpo.py", "scripts", "experiments", "bench"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}: {node.name} ({lines} lines)")
    assert long == []
    algorithms = sorted((ROOT / "policy" / "algorithms").glob("*.py"))
    assert {p.stem for p in algorithms} >= {"grpo", "ppo", "tppo", "offline_rft", "sft"}
    sizes = {p.name: len(p.read_text().splitlines()) for p in algorithms}
    assert max(sizes.values()) <= MAX_ALGORITHM_LINES, sizes


def test_no_algorithm_imports_another():
    """Algorithms are siblings: each imports policy/sampling.py, the critic, the math and the
    engines."""
    algorithms = {p.stem for p in (ROOT / "policy" / "algorithms").glob("*.py")} - {"__init__"}
    for name in algorithms:
        path = ROOT / "policy" / "algorithms" / f"{name}.py"
        siblings = {m for m, _, _ in _imports(path)} & {f"policy.algorithms.{a}"
                                                        for a in algorithms - {name}}
        assert not siblings, (name, siblings)


def _core_function_lengths() -> list[str]:
    long = []
    for folder in ("policy/algorithms", "policy/math"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_CORE_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}: {node.name} ({lines} lines)")
    return long


def test_the_algorithms_and_the_math_read_at_a_glance():
    """No function in policy/algorithms/ or policy/math/ runs past 40 lines."""
    assert _core_function_lengths() == []


def _takes_the_whole_config(node) -> bool:
    """A parameter named `cfg`, or annotated with the schema's `Config` or `DictConfig`."""
    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    return any(a.arg == "cfg" or (isinstance(a.annotation, ast.Name)
                                  and a.annotation.id in ("Config", "DictConfig"))
               or (isinstance(a.annotation, ast.Constant)
                   and a.annotation.value in ("Config", "DictConfig")) for a in args)


def test_the_whole_config_reaches_only_the_loader_the_resolver_and_the_cli():
    """At most 12 functions take the whole config, all in configs/, iteration/resolve.py and
    igrpo.py: everything else takes typed objects (policy/stage.py, reward_model/train.py's
    RMSpec, iteration/resolve.py's Resolved) or explicit arguments."""
    found = []
    for path in _sources(*PACKAGES, "igrpo.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and _takes_the_whole_config(node):
                found.append(f"{path.relative_to(ROOT)}: {node.name}")
    outside = [f for f in found if not f.startswith(WHOLE_CONFIG_HOMES)]
    assert outside == [] and len(found) <= MAX_WHOLE_CONFIG_FUNCTIONS, found


# The values of the variants iteration/resolve.py turns into objects: a loop that compares one
# of these strings is dispatching on the config again.
VARIANTS = {"process", "outcome", "rft", "grpo", "r1", "dr_grpo", "dapo", "gpg", "cispo", "c3po",
            "gspo", "gspo_token", "ppo", "t_ppo", "dpo", "online_dpo", "offline_rft", "sum",
            "min", "anchored", "hf", "vllm", "rule", "step_oracle", "rm", "token_classification"}
# Where they may be compared: the resolver, and the loader's checks of allowed combinations.
VARIANT_HOMES = ("iteration/resolve.py", "configs/loader.py", "configs/memory.py")


def _variant_comparisons(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                values = [side] if isinstance(side, ast.Constant) else \
                    list(side.elts) if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else []
                if any(isinstance(v, ast.Constant) and v.value in VARIANTS for v in values) \
                        and isinstance(node.left, (ast.Attribute, ast.Name, ast.Constant)):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_a_variant_is_compared_only_where_it_is_resolved():
    """`policy.supervision == "process"`, `policy.algorithm == "ppo"`, `rollout.backend ==
    "vllm"` and their kind are decided once, in the resolver (and checked for allowed
    combinations by the loader); the loops read the object or flag it made."""
    found = [hit for path in _sources(*PACKAGES, "igrpo.py")
             if not str(path.relative_to(ROOT)).startswith(VARIANT_HOMES)
             for hit in _variant_comparisons(path)]
    assert found == []


def _seed_arithmetic(path: Path) -> list[str]:
    """`seed * 7_919 + 11` and the like: a seed derived by hand from a name holding `seed`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            sides = (node.left, node.right)
            named = [s for s in sides if isinstance(s, (ast.Name, ast.Attribute))
                     and "seed" in (s.id if isinstance(s, ast.Name) else s.attr)]
            if named and any(isinstance(s, ast.Constant) and isinstance(s.value, int)
                             for s in sides):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_seed_is_derived_in_one_place():
    """Random streams come from `runtime.seeds.derive_seed(run_seed, purpose, *key)` (or a
    hash of a named key: `chunk_seed`, `seed_unit`), never from a seed times a constant."""
    found = [hit for path in _sources(*PACKAGES, "igrpo.py")
             if path.relative_to(ROOT) != Path("runtime/seeds.py")
             for hit in _seed_arithmetic(path)]
    assert found == []


def _sample_calls_without_rollout_key(path: Path) -> list[str]:
    """Calls of a step sampler (`make_sample(...)(questions, key)` or its name) whose key is not
    `rollout_key(...)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or len(node.args) != 2:
            continue
        made = isinstance(node.func, ast.Call) \
            and getattr(node.func.func, "id", "") == "make_sample"
        named = isinstance(node.func, ast.Name) and node.func.id == "sample"
        key = node.args[1]
        if (made or named) and not (isinstance(key, ast.Call)
                                    and getattr(key.func, "id", "") == "rollout_key"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_algorithm_keys_its_rollouts_one_way():
    """GRPO, DPO, PPO and PPO's value pretraining seed a step's rollouts from one key,
    `policy.sampling.rollout_key(sampling seed, step, round)`, not each its own tuple."""
    files = _sources("policy")
    assert sum("rollout_key(" in p.read_text() for p in files) >= 5  # the convention and 4 users
    assert [hit for path in files for hit in _sample_calls_without_rollout_key(path)] == []
