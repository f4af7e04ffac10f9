"""Rules over the whole product code, checked by reading it (ast): nothing is trained here.

    python -m pytest tests/test_code_rules.py -q

Product code: the entry scripts and modules at the root (train*.py, data.py, model.py)
and utils/*.py; the device rules also cover benchmarks/*.py.

1. Every rank calls every collective. A collective (torch's, or one of the project's
   functions that runs one, found by following the calls) called in a branch taken on
   some ranks only (`if rank == 0:`, `if main:`, `if is_main_process():`, after
   `if rank != 0: return`) hangs the other ranks, or pairs them with the wrong collective.
2. Devices. torch.cuda.set_device is called in one place (utils/distributed_utils.use_device,
   or init_distributed_mode), and no device object is compared with ==/!=: a device
   compares by type *and* index, so torch.device("cuda") != torch.device("cuda:0"),
   and torch.cuda.set_device(torch.device("cuda")) raises. resolve_device returns an
   indexed device for that reason; both torch facts are asserted here too (they need no GPU).
3. Layering: no import cycles among the product modules, and utils/ imports only utils/ (never
   data.py, model.py or a script).
"""
import ast
import os
import re

import pytest
import torch

from conftest import REPO
from utils import distributed_utils as du
from utils.errors import UserError


def product_files(benchmarks=False):
    files = sorted(REPO.glob("*.py")) + sorted((REPO / "utils").glob("*.py"))
    if benchmarks:
        files += sorted((REPO / "benchmarks").glob("*.py"))
    return files


def module_name(path):
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def parse(path):
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def rel(path):
    return path.relative_to(REPO).as_posix()


# =========================================================================== 1. collectives

# torch.distributed functions every rank of the group must call (and the DDP constructor,
# which broadcasts rank 0's parameters).
TORCH_COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
    "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier", "new_group", "init_process_group", "destroy_process_group"})
DDP_CLASS = "DistributedDataParallel"

# The project's functions that run a collective: the derived set must hold at least these
# (kind "method": called as obj.name(), counted by the attribute name).
EXPECTED_COLLECTIVES = {
    ("function", n) for n in ("reduce_value", "reduce_min", "any_rank", "gather_objects", "broadcast_buffers",
                              "broadcast_object", "barrier", "reduce_sums", "verify_images",
                              "evaluate", "fit", "train_one_epoch")
} | {("method", "save"), ("method", "sync_bad_images")}

PRODUCT_MODULES = frozenset(module_name(f) for f in product_files()) | {"utils"}


def import_map(tree):
    """Local name -> the dotted name it stands for, from the module's imports (any depth)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    head = a.name.split(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def dotted(expr):
    """`a.b.c` -> ["a", "b", "c"]; None for anything that is not a plain chain of names."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return [expr.id] + parts[::-1]


def classify_call(call, imports):
    """What a call may run: ("torch", name) for a torch collective, ("function", name) for a
    project function, ("method", name) for obj.name(...), or None (anything outside the project)."""
    func = call.func
    chain = dotted(func)
    if chain and chain[0] in imports:
        full = ".".join([imports[chain[0]]] + chain[1:])
        owner, _, name = full.rpartition(".")
        if name == DDP_CLASS and owner.startswith("torch.nn.parallel"):
            return ("torch", name)
        if owner == "torch.distributed" and name in TORCH_COLLECTIVES:
            return ("torch", name)
        if owner in PRODUCT_MODULES:
            return ("function", name)
        return None  # torch.save, os.replace, np.random...: not the project's
    if isinstance(func, ast.Name):
        return ("function", func.id)  # defined in this module, or a parameter / local function
    if isinstance(func, ast.Attribute):
        return ("method", func.attr)  # saver.save(...), ds.sync_bad_images(), self.x.y(...)
    return None


def defined_functions(tree):
    """[(kind, name, node)]: methods directly in a class body, every other def a function.
    A class whose __init__ runs a collective makes constructing it one: ("function", ClassName)."""
    out = []

    def visit(node, in_class=None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, in_class=child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append(("method" if in_class else "function", child.name, child))
                if in_class and child.name == "__init__":
                    out.append(("function", in_class, child))
                visit(child)
            else:
                visit(child, in_class)
    visit(tree)
    return out


def derive_collectives(files):
    """Every (kind, name) of a product function that calls a collective, directly or through
    other product functions (fixpoint). Nested defs count towards the function that holds them.

    Methods go by their name alone, so PIL's img.save() counts like Checkpointer's saver.save()
    (a writer that saves a PIL image would be derived so). It errs one way only: a call
    flagged under a rank guard that is no collective is renamed or moved, never let through."""
    bodies = []
    for f in files:
        tree = parse(f)
        imports = import_map(tree)
        for kind, name, node in defined_functions(tree):
            calls = {classify_call(c, imports) for c in ast.walk(node) if isinstance(c, ast.Call)} - {None}
            bodies.append(((kind, name), calls))
    found = set()
    changed = True
    while changed:
        changed = False
        for key, calls in bodies:
            if key not in found and any(c[0] == "torch" or c in found for c in calls):
                found.add(key)
                changed = True
    return found


@pytest.fixture(scope="module")
def collectives():
    return derive_collectives(product_files())


RANK_NAME = re.compile(r"rank|^(main|is_main|is_main_process|is_master|master)$")


def is_rank_test(expr):
    """Does the condition depend on which rank runs it? (rank == 0, self.rank, local_rank >= n,
    main, is_main_process()...). Names only: the string "__main__" is no rank test."""
    for node in ast.walk(expr):
        ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if ident and RANK_NAME.search(ident):
            return True
    return False


def leaves_block(block):
    """The block ends the enclosing block for the ranks that enter it (return/raise/...)."""
    if not block:
        return False
    last = block[-1]
    if isinstance(last, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
        return True
    return isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and \
        (dotted(last.value.func) or [""])[-1] in ("exit", "_exit")


def rank_guarded_nodes(tree):
    """The AST nodes that run on some ranks only."""
    guarded = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_rank_test(node.test):
            guarded += node.body + node.orelse
        elif isinstance(node, ast.IfExp) and is_rank_test(node.test):
            guarded += [node.body, node.orelse]
        elif isinstance(node, ast.BoolOp):  # `main and saver.save()`
            for i, value in enumerate(node.values[:-1]):
                if is_rank_test(value):
                    guarded += node.values[i + 1:]
                    break
        for field in ("body", "orelse", "finalbody"):  # `if rank != 0: return` guards what follows
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                if isinstance(stmt, ast.If) and is_rank_test(stmt.test) and \
                        (leaves_block(stmt.body) or leaves_block(stmt.orelse)):
                    guarded += block[i + 1:]
                    break
    return guarded


def collectives_under_rank_guard(source, collectives, filename="<src>"):
    """[(line, name)] for each collective called where only some ranks get."""
    tree = ast.parse(source, filename)
    imports = import_map(tree)
    found = set()
    for branch in rank_guarded_nodes(tree):
        for sub in ast.walk(branch):
            if isinstance(sub, ast.Call):
                kind = classify_call(sub, imports)
                if kind and (kind[0] == "torch" or kind in collectives):
                    found.add((sub.lineno, kind[1]))
    return sorted(found)


def test_project_collectives_are_derived_from_the_code(collectives):
    """The functions that run a collective are found by following the calls from torch's own,
    so a new helper that all-reduces is covered by the rank-guard check without being listed."""
    missing = EXPECTED_COLLECTIVES - collectives
    assert not missing, f"not derived as running a collective: {sorted(missing)}"
    # Rank checks and plain helpers are not collectives (a false positive would flag every `if main:`).
    for harmless in ("is_main_process", "get_rank", "get_world_size", "save_checkpoint", "atomic_save",
                     "make_state", "resume_command", "remove_stale_temps", "read_launch_env"):
        assert ("function", harmless) not in collectives, harmless


def test_no_collective_under_a_rank_guard(collectives):
    files = product_files()
    assert len(files) >= 8
    bad = {rel(f): hits for f in files
           if (hits := collectives_under_rank_guard(f.read_text(encoding="utf-8"), collectives, str(f)))}
    assert not bad, f"collectives called on some ranks only: {bad}"


def test_rank_guard_check_catches_the_classic_mistakes(collectives):
    broken = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from utils.distributed_utils import barrier, is_main_process, reduce_value\n"
        "if rank == 0:\n"
        "    saver.save(epoch + 1, global_step, best_acc)\n"             # 5: Checkpointer.save
        "if is_main_process():\n"
        "    saver.save(epoch, step, best, is_best=True)\n"                # 7
        "    total = reduce_value(total)\n"                               # 8
        "    ds.sync_bad_images()\n"                                       # 9
        "if main:\n"
        "    saver.save(epoch, step, best)\n"                              # 11: fit's `main = rank == 0`
        "x = y if rank == 0 else barrier()\n"                              # 12
        "main and dist.all_reduce(t)\n"                                    # 13
        "def f(dist_info):\n"
        "    if dist_info.rank != 0:\n"
        "        return\n"
        "    val = evaluate(model, loader, device, 5)\n"                   # 17
        "if main:\n"
        "    torch.save(state, path)\n"                                    # not a collective
        "    print(saver)\n"
        "if __name__ == '__main__':\n"
        "    fit(cfg)\n"                                                   # every rank runs this
    )
    assert collectives_under_rank_guard(broken, collectives) == [
        (5, "save"), (7, "save"), (8, "reduce_value"), (9, "sync_bad_images"), (11, "save"), (12, "barrier"),
        (13, "all_reduce"), (17, "evaluate")]


# =========================================================================== 2. devices

SET_DEVICE_HOME = ("utils/distributed_utils.py", {"use_device", "init_distributed_mode"})


def set_device_uses(path):
    """[(line, enclosing top-level function)] of each mention of set_device (a call or an alias)."""
    out = []
    for top in parse(path).body:
        owner = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None
        for node in ast.walk(top):
            ident = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if ident == "set_device":
                out.append((node.lineno, owner))
    return out


def test_set_device_only_in_use_device():
    """One place makes a device current: use_device(resolve_device(...)), which only ever gets an
    indexed device. A script calling torch.cuda.set_device itself skips that guarantee."""
    stray, home = [], []
    for f in product_files(benchmarks=True):
        for line, owner in set_device_uses(f):
            ok = rel(f) == SET_DEVICE_HOME[0] and owner in SET_DEVICE_HOME[1]
            (home if ok else stray).append(f"{rel(f)}:{line} (in {owner})")
    assert home, "use_device no longer calls torch.cuda.set_device: the check would be vacuous"
    assert not stray, f"torch.cuda.set_device outside utils/distributed_utils.use_device: {stray}"


def is_device_expr(expr):
    """x.device, torch.device(...), and the names device, dev, *_device."""
    if isinstance(expr, ast.Call):
        expr = expr.func
    if isinstance(expr, ast.Attribute):
        return expr.attr == "device"
    if isinstance(expr, ast.Name):
        return expr.id in ("device", "dev") or expr.id.endswith("_device")
    return False


def device_comparisons(source, filename="<src>"):
    """[(line, text)] of ==/!= (and in/not in) comparisons with a device object as an operand."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.Eq, ast.NotEq)) and (is_device_expr(left) or is_device_expr(right)) or \
                    isinstance(op, (ast.In, ast.NotIn)) and is_device_expr(left):
                found.append((node.lineno, ast.unparse(node)))
                break
            left = right
    return found


def test_no_device_compared_with_eq():
    """Compare device.type (and .index when it matters), never devices: "cuda" and "cuda:0" are
    the same GPU, and unequal. A check like `if x.device != device: move` then fires every step."""
    assert torch.device("cuda") != torch.device("cuda:0")   # why the rule exists; no GPU needed
    assert torch.device("cuda").index is None
    bad = {rel(f): hits for f in product_files(benchmarks=True)
           if (hits := device_comparisons(f.read_text(encoding="utf-8"), str(f)))}
    assert not bad, f"device objects compared with ==/!= (compare .type / .index): {bad}"
    # The check sees the forms that bite, and leaves .type / .index comparisons alone.
    broken = ("if images.device != device: pass\n"
              "same = torch.device('cuda') == dev\n"
              "ok = x.device.type == 'cuda' and x.device.index == local_device.index\n"
              "if out_device == torch.device('cpu'): pass\n"
              "if x.device in devices: pass\n")
    assert [line for line, _ in device_comparisons(broken)] == [1, 2, 4, 5]


def test_set_device_refuses_a_device_without_index():
    """torch's own check, before any CUDA call: so it holds on a machine without a GPU too."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))


@pytest.fixture
def two_fake_gpus(monkeypatch):
    # Faked because this test runs without a GPU: resolve_device only asks torch whether CUDA
    # is there and how many devices it sees; nothing here touches a GPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_resolve_device_returns_indexed_cuda_devices(two_fake_gpus):
    from torch.cuda._utils import _get_device_index  # what torch.cuda.set_device runs on its argument
    for requested, index in (("auto", 0), ("cuda", 0), ("cuda:0", 0), ("cuda:1", 1)):
        d = du.resolve_device(requested)
        assert (d.type, d.index) == ("cuda", index), (requested, d)
        assert d == torch.device("cuda", index)
        assert _get_device_index(d) == index  # set_device would accept it (no `optional`)
    assert du.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match=r"torch sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        du.resolve_device("cuda:2")
    for bad in ("mps", "bogus"):
        with pytest.raises(UserError, match=f"--device '{bad}' is not a device"):
            du.resolve_device(bad)


# =========================================================================== 3. layering

# Every .py below the root except these folders (and hidden ones): the product and its tools.
SKIP = {"tests", "benchmarks", ".venv", "venv", "runs", "data", ".git"}


def graph_modules():
    out = {}
    for dirpath, dirnames, filenames in os.walk(REPO):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and
                             not (os.path.samefile(dirpath, REPO) and d in SKIP))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("."):
                path = REPO / os.path.relpath(os.path.join(dirpath, name), REPO)
                out[module_name(path)] = path
    return out


def import_edges(mods):
    graph = {m: set() for m in mods}
    relative = []
    for m, path in mods.items():
        for node in ast.walk(parse(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                relative.append(f"{m}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph, relative


def find_cycles(graph):
    cycles, done = [], set()

    def visit(node, stack):
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cycle = stack[stack.index(nxt):] + [nxt]
                if frozenset(cycle) not in done:
                    done.add(frozenset(cycle))
                    cycles.append(" -> ".join(cycle))
            elif len(stack) < 12:
                visit(nxt, stack + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    return cycles


def test_imports_have_no_cycles_and_utils_is_the_ground_floor():
    mods = graph_modules()
    graph, relative = import_edges(mods)
    assert {"train", "data", "model", "engine", "run", "utils.distributed_utils"} <= mods.keys()
    assert "run" in graph["train"] and "engine" in graph["run"] and "utils.distributed_utils" in graph["data"]  # seen
    assert not relative, f"relative imports (the check reads absolute ones only): {relative}"
    assert not find_cycles(graph), f"import cycles: {find_cycles(graph)}"
    upward = sorted(f"{m} imports {n}" for m in graph for n in graph[m]
                    if (m == "utils" or m.startswith("utils.")) and not (n == "utils" or n.startswith("utils.")))
    assert not upward, f"utils/ must not import data.py, model.py or the scripts: {upward}"
