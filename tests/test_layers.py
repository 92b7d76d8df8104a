"""The project's layers, written down and enforced: every import counted (module level or inside
a function, where a circle hides just as well), over plugins/llmops, tasks, docker, dags and
scripts.

A module may import its own layer and the layers below it, never one above. On top of that:
no import circle anywhere (a circle inside one layer is still one a reader must hold in mind),
no module using another's `_private` name, `tasks` (the workload, run inside jobs) never imports
`llmops` or `airflow`, and above `tasks` only its config schema and small helpers are imported.
Team overrides travel on the JobSpec, so the job layer knows nothing of teams.

A new module must be given a layer below; the first test says which one is missing.
"""

from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPS = ("plugins/llmops", "tasks", "docker", "dags", "scripts")

# Bottom to top: (layer, module prefixes). A module belongs to the layer of its longest prefix.
# The packages "tasks" and "llmops" name their __init__ only, so a new module gets a layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # the workload's config schema and small stdlib helpers: the only tasks the layers above use
    ("tasks.schema", ("tasks.configs", "tasks.common", "tasks.scaling")),
    # model code, the data pipeline, training, post-training and evaluation libraries
    ("tasks.library", ("tasks.model", "tasks.data", "tasks.train", "tasks.posttrain", "tasks.eval")),
    # `python -m tasks.<stage>` and the container's entry
    ("tasks.entrypoints", ("tasks", "tasks.pretrain", "tasks.finetune", "tasks.distill",
                           "tasks.distill_cache", "tasks.evaluate", "tasks.sweep", "tasks.ladder",
                           "docker")),
    ("llmops.core", ("llmops", "llmops.core")),
    ("llmops.infra", ("llmops.infra",)),
    ("llmops.jobs", ("llmops.jobs",)),
    ("llmops.policy", ("llmops.policy",)),
    ("llmops.stages", ("llmops.stages",)),
    ("llmops.airflow", ("llmops.airflow",)),
    # wiring only
    ("dags", ("dags", "scripts")),
]
WORKLOAD = ("tasks", "docker")              # runs inside jobs: no llmops, no airflow
SCHEMA = "tasks.schema"                     # all that the layers above the workload take from it


def module_name(rel: str) -> str:
    rel = rel.removeprefix("plugins/")[: -len(".py")].removesuffix("/__init__")
    return rel.replace("/", ".")


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for top in TOPS:
        for d, _, files in os.walk(root / top):
            for f in files:
                if f.endswith(".py"):
                    path = Path(d) / f
                    found[module_name(path.relative_to(root).as_posix())] = path
    return found


def layer_of(module: str) -> str | None:
    best, name = -1, None
    for layer, prefixes in LAYERS:
        for p in prefixes:
            # "tasks" and "llmops" name their package's __init__ only, not every module in it
            inside = module.startswith(p + ".") and p not in ("tasks", "llmops")
            if (module == p or inside) and len(p) > best:
                best, name = len(p), layer
    return name


def imports(path: Path, module: str, known: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(project module imported, name imported from it or "", line) for every import in the file,
    and (third-party top-level package, "", line) for the others."""
    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((resolve(alias.name) or alias.name.split(".")[0], "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:           # a submodule: `from llmops import tracking`
                    out.append((full, "", node.lineno))
                else:
                    out.append((resolve(base) or base.split(".")[0], alias.name, node.lineno))
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def problems(root: Path) -> list[str]:
    """Every breach of the rules above in the checkout at `root`, one line each."""
    known = modules(root)
    order = [layer for layer, _ in LAYERS]
    found, edges = [], {}
    for module, path in sorted(known.items()):
        mine = layer_of(module)
        if mine is None:
            found.append(f"{module} has no layer: add it to LAYERS in tests/test_layers.py")
            continue
        where = f"{path.relative_to(root).as_posix()}"
        workload = module.split(".")[0] in WORKLOAD
        for target, name, line in imports(path, module, known):
            if workload and target.split(".")[0] in ("llmops", "airflow"):
                found.append(f"{where}:{line}: {module} (run inside jobs) imports {target}")
                continue
            if target not in known or target == module:
                continue
            edges.setdefault(module, set()).add(target)
            if name.startswith("_") and not name.startswith("__"):
                found.append(f"{where}:{line}: {module} imports {target}.{name}, a private name")
            theirs = layer_of(target)
            if theirs is None:
                continue
            if order.index(theirs) > order.index(mine):
                found.append(f"{where}:{line}: {module} ({mine}) imports {target} ({theirs}), "
                             "a layer above it")
            elif not workload and theirs.startswith("tasks.") and theirs != SCHEMA:
                found.append(f"{where}:{line}: {module} ({mine}) imports {target} ({theirs}): "
                             f"above the workload only {SCHEMA} may be used")
    for comp in circles(edges):
        found.append(f"import circle of {len(comp)}: {', '.join(comp)}")
    return found


def test_the_checkout_keeps_its_layers():
    assert problems(REPO) == []


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_an_upward_import_a_circle_and_a_private_name_are_caught(tmp_path):
    root = write(tmp_path, {
        "plugins/llmops/__init__.py": "",
        "plugins/llmops/core/settings.py": """
            def home():
                from llmops.stages import lifecycle  # upward, hidden in a function
                return lifecycle
            """,
        "plugins/llmops/stages/lifecycle.py": "from llmops.core import settings\nfrom llmops.policy.teams import _under\n",
        "plugins/llmops/policy/teams.py": "def _under(): pass\n",
        "tasks/__init__.py": "",
        "tasks/configs.py": "",
    })
    found = problems(root)
    assert "plugins/llmops/core/settings.py:3: llmops.core.settings (llmops.core) imports llmops.stages.lifecycle " \
           "(llmops.stages), a layer above it" in found
    assert "import circle of 2: llmops.core.settings, llmops.stages.lifecycle" in found
    assert "plugins/llmops/stages/lifecycle.py:2: llmops.stages.lifecycle imports llmops.policy.teams._under, a private " \
           "name" in found
    assert len(found) == 3, found


def test_the_workload_stays_free_of_airflow_and_the_plugins_use_only_its_schema(tmp_path):
    root = write(tmp_path, {
        "plugins/llmops/__init__.py": "",
        "plugins/llmops/stages/lifecycle.py": "from tasks.configs import LifecycleConfig\n"
                                       "from tasks.data import prep\n",
        "tasks/__init__.py": "",
        "tasks/configs.py": "",
        "tasks/data/__init__.py": "",
        "tasks/data/prep.py": "def main():\n    import airflow\n    from llmops.stages import lifecycle\n",
        "tasks/newthing.py": "",
    })
    found = problems(root)
    assert found == [
        "plugins/llmops/stages/lifecycle.py:2: llmops.stages.lifecycle (llmops.stages) imports tasks.data.prep "
        "(tasks.library): above the workload only tasks.schema may be used",
        "tasks/data/prep.py:2: tasks.data.prep (run inside jobs) imports airflow",
        "tasks/data/prep.py:3: tasks.data.prep (run inside jobs) imports llmops.stages.lifecycle",
        "tasks.newthing has no layer: add it to LAYERS in tests/test_layers.py",
    ]
