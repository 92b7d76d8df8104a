"""The project's layers, enforced: every import counted (module level or inside a function, where
a circle hides just as well), over plugins/llmops, tasks, docker, dags and scripts.

plugins/llmops's layers are its folders, bottom to top: core < infra < jobs < policy < stages <
airflow (LLMOPS_FOLDERS). A module's layer is the folder it sits in, so the tree a newcomer sees is
the rule the test reads: a module may import its own folder and the folders below it, never one
above, and nothing but __init__.py sits at plugins/llmops's top. On top of that: no import circle
anywhere (a circle inside one layer is still one a reader must hold in mind), no module using
another's `_private` name, `tasks` (the workload, run inside jobs) never imports `llmops` or
`airflow`, above `tasks` only its config schema and small helpers are imported, and neither
plugins/ nor dags/ imports torch or ray at module level (MWAA has neither). Team overrides travel
on the JobSpec, so the job layer knows nothing of teams.
"""

from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPS = ("plugins", "tasks", "docker", "dags", "scripts")

# plugins/llmops's folders, bottom to top; a folder's layer is "llmops.<folder>".
LLMOPS_FOLDERS = ("core", "infra", "jobs", "policy", "stages", "airflow")
RISE = " < ".join(f"{f}/" for f in LLMOPS_FOLDERS)

# The workload below them and the wiring above them: (layer, module prefixes), a module in the
# layer of its longest prefix. "tasks" names its package's __init__ only, so a new module
# without a layer is reported.
TASKS_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # the workload's config schema and small stdlib helpers: the only tasks the layers above use
    ("tasks.schema", ("tasks.configs", "tasks.common", "tasks.scaling")),
    # model code, the data pipeline, training, post-training and evaluation libraries
    ("tasks.library", ("tasks.model", "tasks.data", "tasks.train", "tasks.posttrain",
                       "tasks.eval")),
    # `python -m tasks.<stage>` and the container's entry
    ("tasks.entrypoints", ("tasks", "tasks.pretrain", "tasks.finetune", "tasks.distill",
                           "tasks.distill_cache", "tasks.evaluate", "tasks.sweep", "tasks.ladder",
                           "docker")),
]
WIRING = ("dags", ("dags", "scripts", "llmops_plugins"))  # wiring only: the top
ORDER = ([layer for layer, _ in TASKS_LAYERS] + [f"llmops.{f}" for f in LLMOPS_FOLDERS]
         + [WIRING[0]])
WORKLOAD = ("tasks", "docker")              # runs inside jobs: no llmops, no airflow
SCHEMA = "tasks.schema"                     # all that the layers above the workload take from it
HEAVY = ("torch", "ray")                    # not on MWAA: never at module level above the workload


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
    """A module's layer: its folder's under llmops, its longest prefix's in the workload, None
    when it has none (a module at plugins/llmops's top, a folder not in LLMOPS_FOLDERS, a new
    module of tasks not in TASKS_LAYERS)."""
    top, _, rest = module.partition(".")
    if top == "llmops":
        if not rest:                        # the package's __init__: the ground floor
            return f"llmops.{LLMOPS_FOLDERS[0]}"
        folder = rest.partition(".")[0]
        return f"llmops.{folder}" if folder in LLMOPS_FOLDERS else None
    if module in WIRING[1] or top in WIRING[1]:
        return WIRING[0]
    best, name = -1, None
    for layer, prefixes in TASKS_LAYERS:
        for p in prefixes:
            # "tasks" names its package's __init__ only, not every module in it
            inside = module.startswith(p + ".") and p != "tasks"
            if (module == p or inside) and len(p) > best:
                best, name = len(p), layer
    return name


def no_layer(module: str, where: str) -> str:
    if module.startswith("llmops."):
        if module.count(".") == 1 and Path(where).name != "__init__.py":
            return (f"{where} sits at plugins/llmops's top, outside the layer folders: move it "
                    f"into the folder of its layer ({RISE})")
        folder = module.split(".")[1]
        return (f"{where}: plugins/llmops/{folder}/ is not a layer: move its modules into the "
                f"folders {RISE}, or add it to LLMOPS_FOLDERS in tests/test_layers.py at its place")
    return f"{module} has no layer: add it to TASKS_LAYERS in tests/test_layers.py"


def folder_rule(mine: str, theirs: str) -> str:
    """What the importing module's folder may import, when both are llmops folders."""
    if not (mine.startswith("llmops.") and theirs.startswith("llmops.")):
        return ""
    folder = mine.removeprefix("llmops.")
    below = LLMOPS_FOLDERS[: LLMOPS_FOLDERS.index(folder) + 1]
    return (f": plugins/llmops/{folder}/ may import only {', '.join(f + '/' for f in below)} "
            f"(the folders rise {RISE})")


def module_level_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(top-level package, line) of the imports run when the module is imported: its body, the
    bodies of its classes and of its if/try/with blocks, but not functions nor
    `if TYPE_CHECKING`."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            out += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module.split(".")[0], node.lineno))
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif isinstance(node, (ast.ClassDef, ast.If, ast.Try, ast.With, ast.For, ast.While)):
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
            if isinstance(node, ast.Try):
                todo += [s for handler in node.handlers for s in handler.body]
    return out


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
    found, edges = [], {}
    for module, path in sorted(known.items()):
        where = f"{path.relative_to(root).as_posix()}"
        mine = layer_of(module)
        if mine is None:
            found.append(no_layer(module, where))
            continue
        workload = module.split(".")[0] in WORKLOAD
        if not workload:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            found += [f"{where}:{line}: {module} imports {package} at module level: MWAA has no "
                      f"{package}; import it inside the function that needs it"
                      for package, line in module_level_imports(tree) if package in HEAVY]
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
            if ORDER.index(theirs) > ORDER.index(mine):
                found.append(f"{where}:{line}: {module} ({mine}) imports {target} ({theirs}), "
                             f"a layer above it{folder_rule(mine, theirs)}")
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
        "plugins/llmops/core/__init__.py": "",
        "plugins/llmops/core/settings.py": """
            def home():
                from llmops.stages import lifecycle  # upward, hidden in a function
                return lifecycle
            """,
        "plugins/llmops/stages/lifecycle.py": "from llmops.core import settings\n"
                                              "from llmops.policy.teams import _under\n",
        "plugins/llmops/policy/teams.py": "def _under(): pass\n",
        "tasks/__init__.py": "",
        "tasks/configs.py": "",
    })
    found = problems(root)
    assert "plugins/llmops/core/settings.py:3: llmops.core.settings (llmops.core) imports " \
           "llmops.stages.lifecycle (llmops.stages), a layer above it: plugins/llmops/core/ may " \
           "import only core/ (the folders rise core/ < infra/ < jobs/ < policy/ < stages/ < " \
           "airflow/)" in found
    assert "import circle of 2: llmops.core.settings, llmops.stages.lifecycle" in found
    assert "plugins/llmops/stages/lifecycle.py:2: llmops.stages.lifecycle imports " \
           "llmops.policy.teams._under, a private name" in found
    assert len(found) == 3, found


def test_the_folder_a_module_sits_in_is_its_layer(tmp_path):
    """The same import is fine or an upward one by the folders alone: jobs/ may use infra/, but
    a backend that reached up into policy/ (a team's quota, say) breaks the folder rule, and a
    module dropped at plugins/llmops's top or in a folder that is no layer has no place."""
    root = write(tmp_path, {
        "plugins/llmops/__init__.py": "",
        "plugins/llmops/infra/quota.py": "",
        "plugins/llmops/policy/quota.py": "",
        "plugins/llmops/jobs/backends/toy/toy_backend.py": "from llmops.infra import quota\n"
                                                         "from llmops.policy.quota import LIMIT\n",
        "plugins/llmops/airflow/page.py": "from llmops.policy import quota\nimport torch\n"
                                          "def plot():\n    import ray\n",
        "plugins/llmops/helpers.py": "",
        "plugins/llmops/misc/__init__.py": "",
        "tasks/__init__.py": "",
    })
    assert problems(root) == [
        "plugins/llmops/airflow/page.py:2: llmops.airflow.page imports torch at module level: "
        "MWAA has no torch; import it inside the function that needs it",
        "plugins/llmops/helpers.py sits at plugins/llmops's top, outside the layer folders: move "
        "it into the folder of its layer (core/ < infra/ < jobs/ < policy/ < stages/ < airflow/)",
        "plugins/llmops/jobs/backends/toy/toy_backend.py:2: llmops.jobs.backends.toy.toy_backend "
        "(llmops.jobs) imports llmops.policy.quota (llmops.policy), a layer above it: "
        "plugins/llmops/jobs/ may import only core/, infra/, jobs/ (the folders rise core/ < "
        "infra/ < jobs/ < policy/ < stages/ < airflow/)",
        "plugins/llmops/misc/__init__.py: plugins/llmops/misc/ is not a layer: move its modules "
        "into the folders core/ < infra/ < jobs/ < policy/ < stages/ < airflow/, or add it to "
        "LLMOPS_FOLDERS in tests/test_layers.py at its place",
    ]


def test_the_workload_stays_free_of_airflow_and_the_plugins_use_only_its_schema(tmp_path):
    root = write(tmp_path, {
        "plugins/llmops/__init__.py": "",
        "plugins/llmops/stages/lifecycle.py": "from tasks.configs import LifecycleConfig\n"
                                              "from tasks.data import prep\n",
        "tasks/__init__.py": "",
        "tasks/configs.py": "",
        "tasks/data/__init__.py": "",
        "tasks/data/prep.py": "def main():\n    import airflow\n"
                              "    from llmops.stages import lifecycle\n",
        "tasks/newthing.py": "",
    })
    found = problems(root)
    assert found == [
        "plugins/llmops/stages/lifecycle.py:2: llmops.stages.lifecycle (llmops.stages) imports "
        "tasks.data.prep (tasks.library): above the workload only tasks.schema may be used",
        "tasks/data/prep.py:2: tasks.data.prep (run inside jobs) imports airflow",
        "tasks/data/prep.py:3: tasks.data.prep (run inside jobs) imports llmops.stages.lifecycle",
        "tasks.newthing has no layer: add it to TASKS_LAYERS in tests/test_layers.py",
    ]
