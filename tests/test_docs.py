"""The README and the docs site: the generated pages are current, the site builds strictly, and
what the pages name (files, modules, config keys, warnings) exists in the code."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def test_config_reference_is_current():
    gen = _tool("gen_config_reference")
    page = DOCS / "reference" / "config.md"
    assert page.is_file(), "docs/reference/config.md is missing: run python tools/gen_config_reference.py"
    assert page.read_text() == gen.render(), (
        "docs/reference/config.md is out of date with the config dataclasses: run "
        "python tools/gen_config_reference.py")


def test_config_reference_lists_every_key():
    import dataclasses
    import typing

    from tiderl.config import RunConfig

    def keys(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                yield from keys(t, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name

    text = (DOCS / "reference" / "config.md").read_text()
    missing = [k for k in keys(RunConfig) if f"| `{k}` |" not in text]
    assert not missing, f"keys missing from the reference: {missing}"


def test_field_docs_come_from_docstrings_and_comments():
    gen = _tool("gen_config_reference")
    from tiderl.control.config import ControllerConfig
    from tiderl.train.config import TrainerConfig

    docs = gen.field_docs(ControllerConfig)
    assert docs["groups_per_step"].doc.startswith("B_ideal")
    assert docs["steps"].doc == ""  # no docstring: nothing invented
    trainer = gen.field_docs(TrainerConfig)
    assert trainer["clip_low"].section.startswith("GRPO loss")  # `# --- GRPO loss ... ---`
    assert trainer["actor_devices"].section == ""


def test_results_page_is_current():
    gen = _tool("gen_results")
    records = gen.load()
    assert records, "no benchmark records in benchmarks/results/"
    for name, rec in records:
        for key in ("benchmark", "command", "machine", "date"):
            assert rec[key], f"benchmarks/results/{name}.json: empty {key!r}"
        assert rec["figures"], f"benchmarks/results/{name}.json: no figures"
    text = gen.render()
    for _, rec in records:
        assert rec["command"] in text
    page = DOCS / "results.md"
    assert page.is_file() and page.read_text() == text, (
        "docs/results.md is out of date with benchmarks/results/*.json: run "
        "python tools/gen_results.py")


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install mkdocs-material)")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    before = {p.name for p in ROOT.iterdir()}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert {p.name for p in ROOT.iterdir()} == before, "mkdocs wrote into the checkout"


def test_readme_starts_with_the_two_commands_and_stays_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"
    block = lines[lines.index("```bash") + 1:]
    block = block[:block.index("```")]
    assert block[0].startswith("pip install -e . && python -m tiderl.launch")
    assert block[1].startswith("pip install -e '.[test]' && python -m pytest")
    first_prose = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    assert lines[first_prose] == "```bash", "the two commands come first"


_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_readme_links_resolve():
    for target, _ in _LINK.findall(README.read_text()):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to missing {target}"


_PATH = re.compile(r"`((?:tiderl|benchmarks|configs|examples|tests|tools)/[\w./*-]*[\w/])`")
_MODULE = re.compile(r"(?:`|python -m )(tiderl(?:\.\w+)+)")


def _top_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _module_exists(dotted: str) -> bool:
    """`tiderl.a.b[.attr[.attr]]`: a module file, then a top-level name of it (a class or a
    function, whose own attributes are not checked further)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                rest = parts[n:]
                return not rest or rest[0] in _top_names(path) or (
                    path.name == "__init__.py" and rest[0] in path.read_text())
    return False


def test_named_files_and_modules_exist():
    bad = []
    for page in _pages():
        text = page.read_text()
        for p in _PATH.findall(text):
            if "*" in p or p.isupper() or "NAME" in p or "SCRIPT" in p:
                continue  # a pattern, not a path
            if not (ROOT / p).exists():
                bad.append(f"{page.relative_to(ROOT)}: {p}")
        for m in _MODULE.findall(text):
            if not _module_exists(m):
                bad.append(f"{page.relative_to(ROOT)}: {m}")
    assert not bad, "the docs name files or modules that do not exist:\n" + "\n".join(bad)


_SECTIONS = ("model", "cluster", "rollout", "trainer", "env", "controller", "distributed")
_KEY = re.compile(r"`(?:python -m tiderl\.launch [^`]*?)?((?:" + "|".join(_SECTIONS)
                  + r")\.[a-z_][\w.]*)")


def test_named_config_keys_exist():
    from tiderl.config import RunConfig
    from tiderl.configlib import to_dict

    tree = to_dict(RunConfig())

    def valid(key: str) -> bool:
        node = tree
        for part in key.rstrip(".").split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    bad = []
    for page in _pages():
        if page.name == "config.md":
            continue
        for key in _KEY.findall(page.read_text()):
            if key.startswith("model.safetensors"):  # a file name, not a key
                continue
            if not valid(key):
                bad.append(f"{page.relative_to(ROOT)}: {key}")
    assert not bad, "the docs name config keys that do not exist:\n" + "\n".join(bad)


def test_every_warning_is_on_the_troubleshooting_page():
    page = (DOCS / "troubleshooting.md").read_text()
    missing = []
    for path in sorted((ROOT / "tiderl").rglob("*.py")):
        n = len(re.findall(r"\blog\.warning\(", path.read_text()))
        rel = path.relative_to(ROOT).as_posix()
        if n and page.count(f"(`{rel}`)") < n:
            missing.append(f"{rel}: {n} log.warning calls, {page.count(f'(`{rel}`)')} on the page")
    assert not missing, ("warnings missing from docs/troubleshooting.md (one entry per "
                         "log.warning, naming its file):\n" + "\n".join(missing))
