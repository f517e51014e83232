#!/usr/bin/env python3
"""Print a Markdown (or JSON) report of the workspace's code shape.

Meant for comparing the tree before and after a restructuring; it reads files only
(no cargo, no build) and needs nothing beyond the Python 3 standard library.

    python3 scripts/code_metrics.py [PATH] [--json] [--file-limit N] [--fn-limit N]

PATH defaults to the repository root this script lives in.

What is measured
- Library crates: every directory `crates/*` with a Cargo.toml; binaries `bins/*`
  are reported separately; any other top-level directory with a Cargo.toml
  (examples/, benches/) is listed under "other workspace members".
- Library figures cover `src/**/*.rs` only, minus the contents of `#[cfg(test)]`
  items (e.g. `#[cfg(test)] mod tests { ... }`), which are counted as unit-test
  lines. A crate's own tests/, benches/ and examples/ count as test lines.
- "lines" are non-blank lines; "code lines" also drop comment-only lines. The
  file-size threshold uses physical lines (what an editor shows).
- Function length runs from the line of the `fn` keyword to the line of its
  matching closing brace, found by a small Rust-aware scanner that ignores
  comments (nested too), strings (raw, byte, C), and char literals (not lifetimes).
- Public root names: what a user reaches at the crate root, from lib.rs: items
  declared `pub` there, every name re-exported by `pub use` (groups expanded,
  `as` aliases honoured, globs counted separately), plus `#[macro_export]` macros
  from any library file (they land at the crate root). `pub mod`s are listed on
  their own: modules are navigation, not root items.
"""

import argparse
import bisect
import json
import re
import sys
from pathlib import Path

DEFAULT_FILE_LIMIT = 600
DEFAULT_FN_LIMIT = 120

# ---------------------------------------------------------------------------
# Lexing: blank out comments and literals, keeping every offset and newline.
# ---------------------------------------------------------------------------

RAW_STR_RE = re.compile(r'[bc]?r(#*)"')


def _is_ident_char(c):
    return c.isalnum() or c == "_"


def _string_end(src, j):
    """Index just past the closing quote of a (non-raw) string whose body starts at j."""
    n = len(src)
    while j < n:
        c = src[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return n


def mask(src):
    """Return (code, nocomment), both the same length as src with newlines kept.

    code: comments and string/char literals replaced by spaces.
    nocomment: only comments replaced by spaces.
    """
    n = len(src)
    code = list(src)
    noc = list(src)

    def blank(buf, a, b):
        for k in range(a, b):
            if buf[k] != "\n":
                buf[k] = " "

    i = 0
    while i < n:
        c = src[i]
        if c == "/" and src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(code, i, j)
            blank(noc, i, j)
            i = j
            continue
        if c == "/" and src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth += 1
                    j += 2
                elif src.startswith("*/", j):
                    depth -= 1
                    j += 2
                else:
                    j += 1
            blank(code, i, j)
            blank(noc, i, j)
            i = j
            continue
        if c in "rbc" and (i == 0 or not _is_ident_char(src[i - 1])):
            m = RAW_STR_RE.match(src, i)
            if m:  # r"..", r#".."#, br#".."#, cr"..": no escapes, ends at `"` + same #s
                close = '"' + m.group(1)
                j = src.find(close, m.end())
                j = n if j < 0 else j + len(close)
                blank(code, i, j)
                i = j
                continue
            if c in "bc" and i + 1 < n and src[i + 1] == '"':  # b"..", c".."
                j = _string_end(src, i + 2)
                blank(code, i, j)
                i = j
                continue
        if c == '"':
            j = _string_end(src, i + 1)
            blank(code, i, j)
            i = j
            continue
        if c == "'":
            # '\n', '\'', '\u{..}': an escape is always a char literal.
            if i + 1 < n and src[i + 1] == "\\":
                k = src.find("'", i + 3)
                j = n if k < 0 else k + 1
                blank(code, i, j)
                i = j
                continue
            # 'x' (also b'x'): one char then a quote; otherwise a lifetime or label ('a).
            if i + 2 < n and src[i + 2] == "'" and src[i + 1] != "\n":
                blank(code, i, i + 3)
                i += 3
                continue
            i += 1
            continue
        i += 1
    return "".join(code), "".join(noc)


# ---------------------------------------------------------------------------
# Structure on the masked code.
# ---------------------------------------------------------------------------

OPEN = {"(": ")", "[": "]", "{": "}"}
CLOSE = {")", "]", "}"}


def match_close(code, pos):
    """Index of the bracket closing the one at pos (any of ([{), or len(code)."""
    depth = 0
    for j in range(pos, len(code)):
        c = code[j]
        if c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
            if depth == 0:
                return j
    return len(code)


SEMI_ONLY_KINDS = {"const", "static", "type", "use", "let"}
ITEM_WORDS_RE = re.compile(r"[A-Za-z_]\w*!?|\S")
QUALIFIERS = {"pub", "const", "async", "unsafe", "safe", "extern", "auto", "default"}
KINDS = {"fn", "mod", "struct", "enum", "union", "trait", "type", "const", "static",
         "use", "impl", "macro_rules!", "let", "crate"}


def item_kind(code, pos):
    """(kind, words) of the item starting at pos, kind None when unknown."""
    head = code[pos:pos + 400]
    words = ITEM_WORDS_RE.findall(head)
    k = 0
    while k < len(words):
        w = words[k]
        if w == "pub" and k + 1 < len(words) and words[k + 1] == "(":
            # pub(crate) / pub(in path): skip the parenthesised part
            close = words.index(")", k) if ")" in words[k:] else k + 1
            k = close + 1
            continue
        if w == "const":
            if k + 1 < len(words) and words[k + 1] in ("fn", "unsafe", "async", "extern"):
                k += 1  # `const fn`: a qualifier
                continue
            return "const", words
        if w in KINDS:
            return w, words
        if w in QUALIFIERS:
            k += 1
            continue
        return None, words
    return None, words


def item_end(code, pos):
    """Index just past the item (or statement) starting at pos."""
    kind, _ = item_kind(code, pos)
    semi_only = kind in SEMI_ONLY_KINDS
    depth = 0
    n = len(code)
    j = pos
    while j < n:
        c = code[j]
        if c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
            if depth <= 0 and c == "}" and not semi_only:
                return j + 1
            if depth < 0:  # ran out of the enclosing block
                return j
        elif c == ";" and depth == 0:
            return j + 1
        j += 1
    return n


CFG_TEST_RE = re.compile(
    r"#(!?)\[\s*cfg\s*\(\s*(?:test\s*\)|all\s*\((?:[^()]|\([^()]*\))*?\btest\b)")
ATTR_RE = re.compile(r"\s*#\s*\[")
MOD_DECL_RE = re.compile(r"(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+(?:r#)?(\w+)\s*;")


def skip_attrs(code, pos):
    """Position of the first non-attribute, non-blank char at or after pos."""
    while True:
        m = ATTR_RE.match(code, pos)
        if not m:
            break
        pos = match_close(code, m.end() - 1) + 1
    while pos < len(code) and code[pos].isspace():
        pos += 1
    return pos


def test_ranges(code):
    """([(start, end)] of #[cfg(test)] items, [names of out-of-line test modules], whole_file)."""
    ranges, ext_mods = [], []
    for m in CFG_TEST_RE.finditer(code):
        if m.group(1):  # #![cfg(test)]: the whole file
            return [(0, len(code))], [], True
        if any(a <= m.start() < b for a, b in ranges):
            continue
        attr_end = match_close(code, code.index("[", m.start())) + 1
        start = skip_attrs(code, attr_end)
        md = MOD_DECL_RE.match(code, start)
        if md:
            ext_mods.append(md.group(1))
        end = item_end(code, start)
        ranges.append((m.start(), end))
    return ranges, ext_mods, False


FN_RE = re.compile(r"\bfn\s+(?:r#)?([A-Za-z_]\w*)")
IMPL_RE = re.compile(r"\bimpl\b|\btrait\s+(?:r#)?([A-Za-z_]\w*)")


def body_open(code, pos):
    """From pos, the index of the `{` opening a body at bracket depth 0, or None at a `;`."""
    depth = 0
    for j in range(pos, len(code)):
        c = code[j]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth == 0 and c == "{":
            return j
        elif depth == 0 and c in ";}":
            return None
    return None


def _strip_angles(s):
    out, depth = [], 0
    for k, c in enumerate(s):
        if c == "<" and not (k and s[k - 1] == "-"):
            depth += 1
        elif c == ">" and not (k and s[k - 1] == "-") and depth:
            depth -= 1
        elif depth == 0:
            out.append(c)
    return "".join(out)


def impl_name(header):
    """Self type name of an impl header (the text between `impl` and `{`)."""
    h = header.strip()
    if h.startswith("<"):
        h = h[match_angle(h) + 1:]
    h = re.split(r"\bwhere\b", h)[0]
    flat = _strip_angles(h)
    parts = re.split(r"\bfor\b", flat)
    target = parts[-1] if len(parts) > 1 else parts[0]
    target = re.sub(r"^[\s&!]*(?:'\w+\s*)?(?:mut\s+|dyn\s+)*", "", target)
    m = re.match(r"\s*((?:\w+::)*\w+)", target)
    return m.group(1).split("::")[-1] if m else " ".join(target.split())[:30]


def match_angle(s):
    depth = 0
    for k, c in enumerate(s):
        if c == "<":
            depth += 1
        elif c == ">" and not (k and s[k - 1] == "-"):
            depth -= 1
            if depth == 0:
                return k
    return len(s) - 1


def impl_blocks(code):
    """[(start, end, name)] of impl and trait bodies."""
    blocks = []
    for m in IMPL_RE.finditer(code):
        if m.group(0).startswith("impl"):
            # an impl item, not `impl Trait` in a type: preceded by an item boundary
            k = m.start() - 1
            while k >= 0 and code[k].isspace():
                k -= 1
            prev_word = re.search(r"(\w+)\s*$", code[max(0, k - 20):k + 1])
            if not (k < 0 or code[k] in "{};]" or
                    (prev_word and prev_word.group(1) in ("unsafe", "default"))):
                continue
            open_ = body_open(code, m.end())
            if open_ is None:
                continue
            name = impl_name(code[m.end():open_])
        else:
            open_ = body_open(code, m.end())
            if open_ is None:
                continue
            name = m.group(1)
        blocks.append((open_, match_close(code, open_), name))
    return blocks


def functions(code, excluded):
    """[(qualified name, fn offset, body end offset)] of fn items with a body."""
    blocks = impl_blocks(code)
    out = []
    for m in FN_RE.finditer(code):
        if any(a <= m.start() < b for a, b in excluded):
            continue
        open_ = body_open(code, m.end())
        if open_ is None:  # declaration without a body (trait method, extern)
            continue
        end = match_close(code, open_)
        owner = None
        for a, b, name in blocks:
            if a < m.start() < b and (owner is None or a > owner[0]):
                owner = (a, name)
        qual = f"{owner[1]}::{m.group(1)}" if owner else m.group(1)
        out.append((qual, m.start(), end))
    return out


class LineMap:
    def __init__(self, text):
        self.starts = [0] + [k + 1 for k, c in enumerate(text) if c == "\n"]

    def line(self, pos):  # 1-based
        return bisect.bisect_right(self.starts, pos)


# ---------------------------------------------------------------------------
# Per-file analysis.
# ---------------------------------------------------------------------------

class SourceFile:
    def __init__(self, path, rel):
        self.path = path
        self.rel = rel
        self.src = path.read_text(encoding="utf-8", errors="replace")
        self.code, self.nocomment = mask(self.src)
        self.lines = LineMap(self.src)
        self.test_ranges, self.test_mods, self.all_test = test_ranges(self.code)
        raw_lines = self.src.split("\n")
        if raw_lines and raw_lines[-1] == "":
            raw_lines.pop()
        self.physical = len(raw_lines)
        noc_lines = self.nocomment.split("\n")
        test_lines = set()
        for a, b in self.test_ranges:
            test_lines.update(range(self.lines.line(a), self.lines.line(max(a, b - 1)) + 1))
        self.lib_lines = self.code_lines = self.unit_test_lines = 0
        for no, text in enumerate(raw_lines, 1):
            if not text.strip():
                continue
            if no in test_lines:
                self.unit_test_lines += 1
            else:
                self.lib_lines += 1
                if noc_lines[no - 1].strip():
                    self.code_lines += 1

    def functions(self):
        return [
            {"name": name, "file": self.rel, "line": self.lines.line(start),
             "length": self.lines.line(end) - self.lines.line(start) + 1}
            for name, start, end in functions(self.code, self.test_ranges)
        ]

    def exported_macros(self):
        names = []
        for m in re.finditer(r"#\s*\[\s*macro_export\b", self.code):
            if any(a <= m.start() < b for a, b in self.test_ranges):
                continue
            pos = skip_attrs(self.code, m.start())
            mm = re.match(r"macro_rules!\s*(\w+)", self.code[pos:])
            if mm:
                names.append(mm.group(1))
        return names


def nonblank(path):
    return sum(1 for line in path.read_text(encoding="utf-8", errors="replace")
               .splitlines() if line.strip())


def out_of_line_test_files(files):
    """Files that are test modules declared by `#[cfg(test)] mod x;` elsewhere."""
    tests = set()
    for f in files:
        for name in f.test_mods:
            base = f.path.parent
            if f.path.name not in ("lib.rs", "main.rs", "mod.rs"):
                base = base / f.path.stem
            for cand in (base / f"{name}.rs", base / name / "mod.rs"):
                tests.add(cand.resolve())
    # a test module's own submodules are tests too
    changed = True
    while changed:
        changed = False
        for f in files:
            p = f.path.resolve()
            if p in tests:
                continue
            for t in list(tests):
                tdir = t.parent if t.name == "mod.rs" else t.with_suffix("")
                if tdir in p.parents:
                    tests.add(p)
                    changed = True
                    break
    return tests


# ---------------------------------------------------------------------------
# Public root names of lib.rs.
# ---------------------------------------------------------------------------

USE_TOKEN_RE = re.compile(r"::|[A-Za-z_]\w*|\*|\{|\}|,")


def expand_use(text):
    """Leaves of a use tree: [(name or '*', full path string)]."""
    toks = USE_TOKEN_RE.findall(text)
    pos = 0

    def tree(prefix):
        nonlocal pos
        path = list(prefix)
        while pos < len(toks):
            t = toks[pos]
            if t == "::":
                pos += 1
            elif t == "{":
                pos += 1
                out = []
                while pos < len(toks) and toks[pos] != "}":
                    if toks[pos] == ",":
                        pos += 1
                        continue
                    out += tree(path)
                pos += 1
                return out
            elif t == "*":
                pos += 1
                return [("*", "::".join(path + ["*"]))]
            elif t in (",", "}"):
                break
            else:
                path.append(t)
                pos += 1
                if pos < len(toks) and toks[pos] == "as":
                    alias = toks[pos + 1] if pos + 1 < len(toks) else "_"
                    pos += 2
                    return [(alias, "::".join(path))]
        if len(path) == len(prefix):
            return []
        name = path[-1]
        if name == "self" and len(path) > 1:
            path = path[:-1]
            name = path[-1]
        return [(name, "::".join(path))]

    leaves = []
    while pos < len(toks):
        if toks[pos] == ",":
            pos += 1
            continue
        before = pos
        leaves += tree([])
        if pos == before:
            pos += 1
    return leaves


def root_items(lib):
    """Walk lib.rs's top-level items; return the public-surface summary."""
    code = lib.code
    names, globs, pub_mods = [], [], []
    pos, n = 0, len(code)
    attrs = []
    while pos < n:
        while pos < n and code[pos].isspace():
            pos += 1
        if pos >= n:
            break
        if code.startswith("#", pos):
            m = re.match(r"#\s*(!?)\s*\[", code[pos:])
            if m:
                close = match_close(code, pos + m.end() - 1)
                if not m.group(1):
                    attrs.append(code[pos + m.end():close])
                pos = close + 1
                continue
        end = item_end(code, pos)
        if end <= pos:
            end = pos + 1
        start, item, item_attrs, attrs = pos, code[pos:end], attrs, []
        pos = end
        if any(a <= start < b for a, b in lib.test_ranges):
            continue
        gated = any(re.match(r"\s*cfg\s*\(", a) for a in item_attrs)
        kind, words = item_kind(code, start)
        if not words or words[0] != "pub" or (len(words) > 1 and words[1] == "("):
            continue  # private or pub(crate)/pub(super)/pub(in ..)
        tag = " (cfg-gated)" if gated else ""
        if kind == "use":
            body = item.split("use", 1)[1].rstrip().rstrip(";")
            for name, path in expand_use(body):
                if name == "*":
                    globs.append(path + tag)
                elif name != "_":
                    names.append({"name": name + tag, "kind": "use", "from": path})
        elif kind in ("fn", "struct", "enum", "union", "trait", "type", "const",
                      "static", "mod", "crate"):
            k = words.index(kind)
            rest = [w for w in words[k + 1:] if w not in ("mut", "r")]
            if kind == "crate" and "as" in rest[:3]:  # pub extern crate foo as bar;
                name = rest[rest.index("as") + 1]
            else:
                name = next((w for w in rest if re.match(r"[A-Za-z_]\w*$", w)), "?")
            if kind == "mod":
                pub_mods.append(name + tag)
            else:
                names.append({"name": name + tag, "kind": kind, "from": "lib.rs"})
    return names, globs, pub_mods


# ---------------------------------------------------------------------------
# Crates.
# ---------------------------------------------------------------------------

def rs_files(directory):
    return sorted(p for p in directory.rglob("*.rs") if "target" not in p.parts)


def analyse_crate(root, crate_dir, file_limit, fn_limit, library):
    src_dir = crate_dir / "src"
    files = [SourceFile(p, str(p.relative_to(root))) for p in rs_files(src_dir)] \
        if src_dir.is_dir() else []
    test_files = out_of_line_test_files(files)
    lib_files = [f for f in files if f.path.resolve() not in test_files and not f.all_test]
    unit_tests = sum(f.unit_test_lines for f in lib_files) + sum(
        f.lib_lines + f.unit_test_lines for f in files if f not in lib_files)
    other_tests = sum(nonblank(p) for d in ("tests", "benches", "examples")
                      if (crate_dir / d).is_dir() for p in rs_files(crate_dir / d))
    fns = [fn for f in lib_files for fn in f.functions()]
    long_fns = sorted((fn for fn in fns if fn["length"] > fn_limit),
                      key=lambda fn: (-fn["length"], fn["file"], fn["line"]))
    big_files = sorted(
        ({"file": f.rel, "lines": f.physical, "nonblank_lib_lines": f.lib_lines}
         for f in lib_files if f.physical > file_limit),
        key=lambda r: (-r["lines"], r["file"]))
    info = {
        "name": crate_dir.name,
        "path": str(crate_dir.relative_to(root)),
        "lines": sum(f.lib_lines for f in lib_files),
        "code_lines": sum(f.code_lines for f in lib_files),
        "files": len(lib_files),
        "unit_test_lines": unit_tests,
        "test_dir_lines": other_tests,
        "functions": len(fns),
        "files_over_limit": big_files,
        "fns_over_limit": long_fns,
    }
    if library:
        lib = next((f for f in lib_files if f.path == src_dir / "lib.rs"), None)
        names, globs, pub_mods = root_items(lib) if lib else ([], [], [])
        for f in lib_files:
            for mac in f.exported_macros():
                names.append({"name": mac + "!", "kind": "macro_export", "from": f.rel})
        info.update({"root_names": names, "root_globs": globs, "pub_mods": pub_mods})
    return info


def discover(root):
    def members(parent):
        d = root / parent
        return sorted(p for p in d.iterdir() if (p / "Cargo.toml").is_file()) \
            if d.is_dir() else []
    others = sorted(p for p in root.iterdir()
                    if p.is_dir() and p.name not in ("crates", "bins", "target")
                    and not p.name.startswith(".") and (p / "Cargo.toml").is_file())
    return members("crates"), members("bins"), others


def analyse(root, file_limit, fn_limit):
    crates, bins, others = discover(root)
    libs = [analyse_crate(root, c, file_limit, fn_limit, True) for c in crates]
    binaries = [analyse_crate(root, b, file_limit, fn_limit, False) for b in bins]
    total = sum(c["lines"] for c in libs)
    for c in libs:
        c["share"] = c["lines"] / total if total else 0.0
    other = [{"name": o.name, "path": str(o.relative_to(root)),
              "files": len(rs_files(o)), "lines": sum(nonblank(p) for p in rs_files(o))}
             for o in others]
    return {"root": str(root), "file_limit": file_limit, "fn_limit": fn_limit,
            "library_total_lines": total, "crates": libs, "bins": binaries,
            "other_members": other}


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------

def table(headers, rows, align=None):
    align = align or ["l"] + ["r"] * (len(headers) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _code_tag(name):
    """`name` in code style, a trailing " (cfg-gated)" note kept outside the backticks."""
    base, sep, note = name.partition(" (")
    return f"`{base}`" + (f" ({note}" if sep else "")


def root_count(c):
    s = str(len(c["root_names"]))
    if c["root_globs"]:
        s += f" + {len(c['root_globs'])} glob"
    return s


def markdown(r):
    fl, fnl = r["file_limit"], r["fn_limit"]
    libs, bins = r["crates"], r["bins"]
    out = [f"# Code shape of `{r['root']}`", ""]
    out.append("Library crates: `crates/*/src/**/*.rs`, without `#[cfg(test)]` items. "
               "lines = non-blank lines; code = non-blank, non-comment lines; "
               "unit tests = non-blank lines of `#[cfg(test)]` items in src; "
               "tests/ = non-blank lines of the crate's tests/, benches/, examples/.")
    out.append("")

    out += ["## 1. Lines per crate", ""]
    rows = [[f"`{c['name']}`", c["lines"], f"{100 * c['share']:.1f}%", c["code_lines"],
             c["files"], c["unit_test_lines"], c["test_dir_lines"]] for c in libs]
    rows.append(["**total**", f"**{r['library_total_lines']}**", "100%",
                 sum(c["code_lines"] for c in libs), sum(c["files"] for c in libs),
                 sum(c["unit_test_lines"] for c in libs),
                 sum(c["test_dir_lines"] for c in libs)])
    out += [table(["crate", "lines", "share", "code", "files", "unit tests", "tests/"],
                  rows), ""]
    out += ["Binaries:", ""]
    rows = [[f"`{b['name']}`", b["lines"], b["code_lines"], b["files"],
             b["unit_test_lines"], b["test_dir_lines"]] for b in bins]
    rows.append(["**total**", sum(b["lines"] for b in bins),
                 sum(b["code_lines"] for b in bins), sum(b["files"] for b in bins),
                 sum(b["unit_test_lines"] for b in bins),
                 sum(b["test_dir_lines"] for b in bins)])
    out += [table(["binary", "lines", "code", "files", "unit tests", "tests/"], rows), ""]
    if r["other_members"]:
        out += ["Other workspace members (all `.rs` files, non-blank lines):", ""]
        out += [table(["member", "lines", "files"],
                      [[f"`{o['path']}/`", o["lines"], o["files"]]
                       for o in r["other_members"]]), ""]

    def big_files(group):
        rows = sorted((f for c in group for f in c["files_over_limit"]),
                      key=lambda f: (-f["lines"], f["file"]))
        if not rows:
            return ["(none)", ""]
        return [table(["file", "lines", "non-blank non-test"],
                      [[f"`{f['file']}`", f["lines"], f["nonblank_lib_lines"]]
                       for f in rows]), ""]

    out += [f"## 2. Library source files over {fl} lines", "",
            f"Physical lines (`wc -l`), whole file; {sum(len(c['files_over_limit']) for c in libs)} files.", ""]
    out += big_files(libs)
    out += [f"Binaries, files over {fl} lines:", ""] + big_files(bins)

    def long_fns(group):
        rows = sorted((fn for c in group for fn in c["fns_over_limit"]),
                      key=lambda fn: (-fn["length"], fn["file"], fn["line"]))
        if not rows:
            return ["(none)", ""]
        return [table(["function", "at", "lines"],
                      [[f"`{fn['name']}`", f"`{fn['file']}:{fn['line']}`", fn["length"]]
                       for fn in rows]), ""]

    out += [f"## 3. Functions over {fnl} lines in library sources", "",
            "Length from the `fn` line to its closing brace, inclusive; `Type::name` for "
            f"methods in impl/trait blocks; {sum(len(c['fns_over_limit']) for c in libs)} "
            f"of {sum(c['functions'] for c in libs)} functions.", ""]
    out += long_fns(libs)
    out += [f"Binaries, functions over {fnl} lines:", ""] + long_fns(bins)

    out += ["## 4. Public root names per crate", "",
            "Items declared `pub` in lib.rs, names re-exported by `pub use` in lib.rs "
            "(groups expanded, aliases honoured), and `#[macro_export]` macros; `pub mod`s "
            "listed separately and not counted. \"(cfg-gated)\" marks names behind a "
            "`#[cfg(...)]` attribute.", ""]
    out += [table(["crate", "root names", "pub mods"], align=["l", "r", "l"], rows=
                  [[f"`{c['name']}`", root_count(c),
                    ", ".join(_code_tag(m) for m in c["pub_mods"]) or "-"] for c in libs]), ""]
    for c in libs:
        if not (c["root_names"] or c["root_globs"] or c["pub_mods"]):
            continue
        out.append(f"- `{c['name']}` ({root_count(c)}): " + (", ".join(
            _code_tag(n['name']) + (f" [{n['kind']} in {n['from']}]"
                                if n["kind"] == "macro_export" else
                                f" [pub {n['kind']}]" if n["kind"] != "use" else "")
            for n in c["root_names"]) or "-"))
        for g in c["root_globs"]:
            out.append(f"  - glob: `pub use {g}` (names not expanded)")
    out.append("")

    out += ["## 5. Summary", ""]
    rows = [[f"`{c['name']}`", c["lines"], c["files"], len(c["files_over_limit"]),
             len(c["fns_over_limit"]), root_count(c), len(c["pub_mods"])] for c in libs]
    rows.append(["**total**", r["library_total_lines"], sum(c["files"] for c in libs),
                 sum(len(c["files_over_limit"]) for c in libs),
                 sum(len(c["fns_over_limit"]) for c in libs),
                 sum(len(c["root_names"]) for c in libs),
                 sum(len(c["pub_mods"]) for c in libs)])
    for b in bins:
        rows.append([f"`bins/{b['name']}`", b["lines"], b["files"],
                     len(b["files_over_limit"]), len(b["fns_over_limit"]), "-", "-"])
    out += [table(["crate", "lines", "files", f"files > {fl}", f"fns > {fnl}",
                   "public root names", "pub mods"], rows), ""]
    return "\n".join(out)


def main(argv=None):
    default_root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", nargs="?", default=str(default_root),
                    help="workspace root (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    ap.add_argument("--file-limit", type=int, default=DEFAULT_FILE_LIMIT,
                    help="report files with more physical lines (default %(default)s)")
    ap.add_argument("--fn-limit", type=int, default=DEFAULT_FN_LIMIT,
                    help="report functions with more lines (default %(default)s)")
    args = ap.parse_args(argv)
    root = Path(args.path).resolve()
    if not (root / "crates").is_dir() and not (root / "bins").is_dir():
        ap.error(f"{root}: no crates/ or bins/ directory")
    report = analyse(root, args.file_limit, args.fn_limit)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(markdown(report))


if __name__ == "__main__":
    main()
