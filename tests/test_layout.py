"""The package's layout holds what docs/architecture.md's map says (its "Where to find things").

The map names every folder of the package with what it may import; these tests read the map and
the code's imports (every import statement, the function-local and ``TYPE_CHECKING`` ones
included) and fail where they disagree, so neither can drift from the other. They also hold the
layout's other rules: no import circles, no module reaching into another's private names, C
sources named only by the native layer, no module past the size a reader takes in at once, and
the answers the map gives a newcomer pointing at the real thing.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "mlxcel_compat"
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
# Declarative tables, exempt from the size rule (the issue that set the rule names them).
TABLES = frozenset({"settings.py", "request_fields.py", "chat/builtin_templates.py"})
MAX_LINES = 600
NATIVE = "runtime/native/"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=1)
def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports, wherever the import stands."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("mlxcel_compat"):
                resolved = resolve(target)
                if resolved and resolved != name:
                    found.add(resolved)
    return found


@lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(path, modules) for name, path in modules.items()}


@lru_cache(maxsize=1)
def room_map() -> dict[str, frozenset[str]]:
    """The map's rows: a room (``runtime/``, ``settings.py``) -> the rooms it may import."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("### The rooms"):]
    section = section[: section.index("\n### ", 4)]
    rooms: dict[str, frozenset[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        allowed = frozenset({"anything"}) if cells[2].startswith("anything") else frozenset(re.findall(r"`([^`]+)`", cells[2]))
        for room in re.findall(r"`([^`]+)`", cells[0]):
            rooms[room] = allowed
    return rooms


def room_of(module: str) -> str:
    """The map's room holding ``module``: its deepest folder named in the map, else its file."""
    path = package_modules()[module].relative_to(PACKAGE).as_posix()
    folders = sorted((room for room in room_map() if room.endswith("/")), key=len, reverse=True)
    return next((folder for folder in folders if path.startswith(folder)), path)


def test_the_map_names_every_folder_and_root_module() -> None:
    rooms = room_map()
    folders = {path.parent.relative_to(PACKAGE).as_posix() + "/" for path in PACKAGE.rglob("*.py")} - {"./"}
    # A folder inside a room belongs to it (engine/sampling/ to engine/), unless the map names it.
    top = {folder for folder in folders if not any(folder != other and folder.startswith(other) for other in rooms)}
    missing = sorted(folder for folder in top if folder not in rooms)
    assert not missing, f"folders the map in docs/architecture.md does not name: {missing}"
    root_files = sorted(path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py")
    missing = [name for name in root_files if name not in rooms]
    assert not missing, f"root modules the map does not name: {missing}"
    assert "webui/" in rooms  # static files, but a room of the package all the same


def test_rooms_import_only_what_the_map_allows() -> None:
    rooms = room_map()
    wrong = []
    for source, targets in import_graph().items():
        if source == "mlxcel_compat":
            continue
        here = room_of(source)
        allowed = rooms[here]
        if "anything" in allowed:
            continue
        for target in targets:
            there = "__init__.py" if target == "mlxcel_compat" else room_of(target)
            if there != here and there not in allowed and there != "__init__.py":
                wrong.append(f"{source} -> {target} ({here} may import {sorted(allowed) or 'nothing of the package'})")
    assert not wrong, "imports the map does not allow:\n" + "\n".join(sorted(wrong))


def test_no_import_circles() -> None:
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def private_names_reached(path: Path, modules: dict[str, Path]) -> list[str]:
    """``from m import _x`` and ``m._x`` (``m`` bound to a package module) in the file at ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    own = module_name(path) if path.is_relative_to(PACKAGE) else None
    bound: dict[str, str] = {}  # local name -> package module it names
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlxcel_compat") and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    bound[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__") and node.module != own:
                    found.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__") and bound[node.value.id] != own):
            found.append(f"{node.value.id}.{node.attr} ({bound[node.value.id]})")
    return found


def test_no_module_or_test_reaches_into_another_modules_private_names() -> None:
    modules = package_modules()
    files = list(PACKAGE.rglob("*.py")) + list((REPO_ROOT / "tests").rglob("*.py")) + list((REPO_ROOT / "scripts").glob("*.py"))
    reached = {str(path.relative_to(REPO_ROOT)): names for path in files if (names := private_names_reached(path, modules))}
    assert not reached, f"private names used from outside their module: {reached}"


def test_only_the_native_layer_names_c_sources() -> None:
    sources = {path.name for path in (PACKAGE / NATIVE).glob("*.[ch]")}
    assert sources, "the native layer holds the C sources"
    assert not [path for path in PACKAGE.rglob("*.[ch]") if not path.relative_to(PACKAGE).as_posix().startswith(NATIVE)]
    pattern = re.compile(r"\b(" + "|".join(re.escape(name) for name in sorted(sources)) + r")\b")
    naming = sorted(f"{path.relative_to(PACKAGE)}: {match}"
                    for path in PACKAGE.rglob("*.py") if not path.relative_to(PACKAGE).as_posix().startswith(NATIVE)
                    for match in sorted(set(pattern.findall(path.read_text()))))
    assert not naming, f"modules outside {NATIVE} naming a C source: {naming}"


@pytest.mark.parametrize("suffix", ["py", "c"])
def test_no_module_is_over_the_size_a_reader_takes_in(suffix: str) -> None:
    too_long = {}
    for path in PACKAGE.rglob(f"*.{suffix}"):
        relative = path.relative_to(PACKAGE).as_posix()
        lines = len(path.read_text().splitlines())
        if relative not in TABLES and lines > MAX_LINES:
            too_long[relative] = lines
    assert not too_long, f"modules over {MAX_LINES} lines (split them along their jobs): {too_long}"


@lru_cache(maxsize=1)
def newcomer_answers() -> dict[str, str]:
    """The map's "A newcomer's three questions": question -> the answer's text."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("### A newcomer's questions"):]
    section = section[: section.index("\n#", 4)]
    answers = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].endswith("?"):
            answers[cells[0]] = cells[1]
    return answers


def answer_path(question: str) -> Path:
    answer = newcomer_answers()[question]
    named = re.findall(r"`([\w/]+\.(?:py|c))`", answer)
    assert named, f"the answer to {question!r} names no file: {answer}"
    path = PACKAGE / named[0]
    assert path.is_file(), f"the answer to {question!r} names {named[0]}, which does not exist"
    return path


def test_where_a_gguf_architecture_goes() -> None:
    from mlxcel_compat.gguf.architectures import ARCHITECTURES

    import importlib

    path = answer_path("Where does a GGUF architecture go?")
    assert path.name == "architectures.py" and "ARCHITECTURES" in path.read_text()
    # Every served architecture is a row of that table, the ones the loader names included.
    assert {"llama", "qwen2", "qwen3", "gemma3", "lfm2"} <= set(ARCHITECTURES)
    # The modules the answer names hold the rows, and every one of their rows is in the table.
    kinds = re.findall(r"`gguf/(arch_\w+)\.py`", newcomer_answers()["Where does a GGUF architecture go?"])
    assert {"arch_core", "arch_dense", "arch_moe", "arch_hybrid"} <= set(kinds)
    for kind in kinds:
        if kind == "arch_spec":
            continue
        rows = importlib.import_module(f"mlxcel_compat.gguf.{kind}").SPECS
        assert all(ARCHITECTURES[row.gguf_arch] is row for row in rows), kind
    on_disk = {path.stem for path in (PACKAGE / "gguf").glob("arch_*.py")} - {"arch_spec"}
    assert on_disk <= set(kinds), f"row modules the answer does not name: {sorted(on_disk - set(kinds))}"


def test_where_the_q4_k_decode_kernel_is() -> None:
    path = answer_path("Where is the Q4_K decode kernel?")
    assert path.relative_to(PACKAGE).as_posix().startswith(NATIVE)
    function = re.search(r"`(\w+)`", newcomer_answers()["Where is the Q4_K decode kernel?"].split(":", 1)[-1])
    assert function, "the answer names the kernel's function"
    assert re.search(rf"\b{function.group(1)}\s*\(", path.read_text()), f"{function.group(1)} is not defined in {path.name}"
    assert "q4_k" in function.group(1).lower()


def test_where_a_sampler_goes() -> None:
    path = answer_path("Where does a sampler go?")
    text = path.read_text()
    # The module holds llama.cpp's samplers by name, the table the chain walks.
    for name in ("top_k", "top_p", "min_p", "typ_p", "xtc", "temperature"):
        assert re.search(rf"[\"']{name}[\"']", text), f"{path.name} does not register the {name} sampler"
