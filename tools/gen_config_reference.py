"""Generate docs/reference/config.md from the config dataclasses.

    python tools/gen_config_reference.py            # rewrite docs/reference/config.md
    python tools/gen_config_reference.py --check    # exit 1 if it is out of date

Starts from `tiderl.config.RunConfig` and walks the nested frozen dataclasses
(`dataclasses.fields` + `typing.get_type_hints`): every key in dotted form, its type, the
embedded default run's value (and the component's own default where a `base: components`
preset starts from another one), and its documentation. A field is documented by the string
literal right after it in the class body (an attribute docstring); comments on the field's
line or on the lines just above it are taken when there is no docstring, and `# --- Title ---`
comments in a class body start a subsection. Both are read from the source with `ast` and
`tokenize`, so nothing is imported beyond the config modules themselves (no JAX).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference" / "config.md"
REGENERATE = "python tools/gen_config_reference.py"

sys.path.insert(0, str(ROOT))

_SECTION = re.compile(r"^#\s*-{2,}\s*(.*?)\s*-*\s*$")


@dataclasses.dataclass
class FieldDoc:
    doc: str = ""
    section: str = ""


@cache
def _source(path: str) -> tuple[ast.Module, dict[int, str], list[str]]:
    text = Path(path).read_text()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
    return ast.parse(text), comments, text.splitlines()


def _class_node(tree: ast.Module, cls: type) -> ast.ClassDef:
    # Top-level classes by qualified name (Outer.Inner for nested ones).
    body: list[ast.stmt] = tree.body
    node = None
    for part in cls.__qualname__.split("."):
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            raise LookupError(f"class {cls.__qualname__} not found in {inspect.getsourcefile(cls)}")
        body = node.body
    assert node is not None
    return node


def field_docs(cls: type) -> dict[str, FieldDoc]:
    """Per field of `cls`: its documentation and the subsection it sits in."""
    path = inspect.getsourcefile(cls)
    assert path, cls
    tree, comments, lines = _source(path)
    node = _class_node(tree, cls)
    out: dict[str, FieldDoc] = {}
    section = ""
    prev_end = node.lineno
    body = node.body
    for i, stmt in enumerate(body):
        # Comment lines between the previous statement and this one: section titles, and the
        # block of comments right above the field (a blank line or code ends a block).
        lead: list[str] = []
        for ln in range(prev_end + 1, stmt.lineno):
            if ln in comments and lines[ln - 1].lstrip().startswith("#"):
                m = _SECTION.match(comments[ln].strip())
                if m:
                    section, lead = m.group(1), []
                else:
                    lead.append(comments[ln].lstrip("#").strip())
            else:
                lead = []
        prev_end = stmt.end_lineno or stmt.lineno
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        doc = ""
        nxt = body[i + 1] if i + 1 < len(body) else None
        if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            doc = inspect.cleandoc(nxt.value.value)
        else:
            trailing = comments.get(stmt.end_lineno or stmt.lineno, "")
            parts = [*lead, trailing.lstrip("#").strip()] if trailing else lead
            doc = " ".join(p for p in parts if p)
        out[name] = FieldDoc(doc=doc, section=section)
    return out


def type_name(t: typing.Any) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            inner = type_name(args[0])
            return f"list of {inner}" if inner.startswith("`") else f"list, each {inner}"
        return "list of " + ", ".join(type_name(a) for a in args)
    if isinstance(t, type):
        return f"`{t.__name__}`"
    return f"`{t}`"


def value(v: typing.Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


_CODE = re.compile(r"(`[^`]*`)")


def md_text(doc: str) -> str:
    """One table cell: paragraphs joined by line breaks, Markdown specials outside code spans
    escaped (docs mention `<run_dir>`, `*.safetensors`, `B×T×V`...)."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc) if p.strip()]
    out = []
    for p in paras:
        pieces = _CODE.split(p)
        for j in range(0, len(pieces), 2):
            s = pieces[j].replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;")
            s = s.replace(">", "&gt;")
            for ch in "*_[]|":
                s = s.replace(ch, "\\" + ch)
            pieces[j] = s
        out.append("".join(pieces))
    return "<br><br>".join(out)


def _get(d: dict[str, typing.Any], dotted: str) -> typing.Any:
    for part in dotted.split("."):
        d = d[part]
    return d


def _first_line(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def render() -> str:
    from tiderl.config import RunConfig, component_defaults
    from tiderl.configlib import to_dict

    run_defaults = to_dict(RunConfig())
    comp_defaults = component_defaults()
    blocks: list[str] = []
    count = 0

    def walk(cls: type, prefix: str, heading_doc: str) -> None:
        nonlocal count
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        rel = Path(inspect.getsourcefile(cls) or "").resolve().relative_to(ROOT)
        title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
        lines = [f"## {title}", ""]
        about = heading_doc or _first_line(cls.__doc__)
        if about:
            lines += [md_text(about), ""]
        lines += [f"`{cls.__name__}` in `{rel.as_posix()}`.", ""]
        nested: list[tuple[type, str, str]] = []
        section = None
        header = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        rows: list[str] = []

        def flush() -> None:
            if rows:
                lines.extend([*header, *rows, ""])
                rows.clear()

        for f in dataclasses.fields(cls):
            t = hints[f.name]
            fd = docs.get(f.name, FieldDoc())
            key = prefix + f.name
            if dataclasses.is_dataclass(t) and isinstance(t, type):
                nested.append((t, key + ".", fd.doc))
                rows.append(f"| `{key}` | section | | see [`{key}`](#{_anchor(key)}) |")
                continue
            if fd.section != (section or ""):
                flush()
                section = fd.section
                if section:
                    lines += [f"### {md_text(section)}", ""]
            d_run = _get(run_defaults, key)
            d_comp = _get(comp_defaults, key)
            default = f"`{value(d_run)}`"
            if d_comp != d_run:
                default += f"<br>(components: `{value(d_comp)}`)"
            rows.append(f"| `{key}` | {type_name(t)} | {default} | {md_text(fd.doc)} |")
            count += 1
        flush()
        blocks.append("\n".join(lines))
        for sub, sub_prefix, sub_doc in nested:
            walk(sub, sub_prefix, sub_doc)

    walk(RunConfig, "", "")
    head = f"""# Configuration reference

<!-- Generated by `{REGENERATE}` from the config dataclasses; do not edit by hand. -->

Every key of a run's config (`tiderl.config.RunConfig`), {count} in all, generated from the
dataclasses that define them. Set a key in a YAML preset (nested sections) or on the command
line as a dotted override, e.g. `python -m tiderl.launch trainer.lr=1e-4 env.options=[n=8]`;
values are YAML. `python -m tiderl.launch --print-config [overrides]` prints the resolved tree.

**default** is the value of the embedded default run (`python -m tiderl.launch` with no
preset, and every preset without a `base:` key). A preset that starts with `base: components`
(such as `configs/cpu-smoke.yaml`) starts from each component's own defaults instead; where
that value differs it is shown as *components*. With `model.checkpoint` or `model.init_from`,
the checkpoint sets every shape key of `model`.

Keep this page current with `{REGENERATE}` whenever a config field, its type, its default or
its docstring changes (`tests/test_docs.py` fails otherwise).
"""
    return head + "\n" + "\n\n".join(blocks) + "\n"


def _anchor(key: str) -> str:
    # MkDocs' toc slugify of a heading "`rollout.ctb`": lowercase, dots dropped.
    return re.sub(r"[^\w\- ]", "", key).strip().lower().replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
