"""The code blocks of the documentation (docs/**/*.md and README.md), extracted so the test suite
checks them.

  doc_blocks.py cpp DOCS_DIR OUT.cpp     every ```cpp block in one translation unit, which CMake
                                         compiles against the SDK, core, data, metrics and cli headers
                                         (target docs_cpp_blocks, CTest docs_cpp_blocks_compile)
  doc_blocks.py toml DOCS_DIR FULGUR     every ```toml block through `fulgur config check`
                                         (CTest docs_toml_blocks_check)
  doc_blocks.py run DOCS_DIR FULGUR      every ```bash block marked `<!-- check: run -->`, run with
                                         bash -euo pipefail in an empty folder, with the build's
                                         `fulgur` first on PATH (CTest docs_shell_blocks_run)

A block is checked whole unless the line just before its fence is a marker comment (invisible on
the site) that says otherwise:

  <!-- check: body(PARAMS) -->           C++ statements: compiled as the body of a function
                                         taking PARAMS, e.g. body(fulgur::Module& net)
  <!-- check: fragment REASON -->        not checked, with the reason (an excerpt with `...`, a
                                         TOML table meant to be merged into a whole config)
  <!-- check: run -->                    a shell block that the test runs (shell blocks are not
                                         run unless marked: most build, train or need a GPU)

A block that only includes a file (`--8<-- "examples/..."`) is not checked here: that file is
built and run by its own test (examples/third_party_plugin: third_party_plugin_against_installed_sdk).
C++ blocks at namespace scope are each wrapped in a namespace of their own, their #include lines
moved to the top, after a prelude of Fulgur's public headers and <torch/torch.h>; `#line`
directives make a compile error name the Markdown file and line.
"""
import os
import re
import subprocess
import sys
import tempfile
import tomllib

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([A-Za-z0-9_+-]*)(.*)$")
MARKER = re.compile(r"^\s*<!--\s*check:\s*(body|fragment|run)\s*(.*?)\s*-->\s*$")
PRELUDE = [
    "fulgur/plugin.h", "fulgur/plugin_options.h", "fulgur/module.h", "fulgur/data_module.h", "fulgur/trainer.h",
    "fulgur/config_builder.h", "fulgur/data.h", "fulgur/metrics.h", "fulgur/weights.h", "fulgur/blocks.h",
    "fulgur/cli.h", "fulgur/log.h", "torch/torch.h",
]


class Block:
    def __init__(self, path, line, lang, text, marker):
        self.path, self.line, self.lang, self.text, self.marker = path, line, lang, text, marker

    @property
    def where(self):
        return f"{self.path}:{self.line}"


def blocks(docs_dir):
    root = os.path.dirname(os.path.abspath(docs_dir))
    # The pages of the site, and README.md, the front page on the forge.
    pages = [os.path.join(root, "README.md")]
    for dirpath, _, files in sorted(os.walk(docs_dir)):
        pages += [os.path.join(dirpath, name) for name in sorted(files) if name.endswith(".md")]
    for path in pages:
        if os.path.exists(path):
            rel = os.path.relpath(path, root)
            lines = open(path, encoding="utf-8").read().split("\n")
            i = 0
            while i < len(lines):
                m = FENCE.match(lines[i])
                if not m:
                    i += 1
                    continue
                indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
                marker = None
                if i > 0 and MARKER.match(lines[i - 1]):
                    mm = MARKER.match(lines[i - 1])
                    marker = (mm.group(1), mm.group(2))
                start = i + 1
                j = start
                while j < len(lines) and not lines[j].strip().startswith(fence[:3]):
                    j += 1
                body = [l[len(indent):] if l.startswith(indent) else l for l in lines[start:j]]
                yield Block(rel, start + 1, lang, body, marker)
                i = j + 1


def is_include_only(b):
    text = [l for l in b.text if l.strip()]
    return bool(text) and all(l.strip().startswith("--8<--") for l in text)


def checked(b, lang, skipped):
    if b.lang != lang:
        return False
    if is_include_only(b):
        skipped.append(f"{b.where}: included from {' '.join(l.split('--8<--')[1].strip() for l in b.text if l.strip())}")
        return False
    if b.marker and b.marker[0] == "fragment":
        if not b.marker[1]:
            sys.exit(f"{b.where}: a `check: fragment` marker needs its reason")
        skipped.append(f"{b.where}: fragment ({b.marker[1]})")
        return False
    return True


def write_cpp(docs_dir, out):
    skipped, includes, parts = [], [], []
    count = 0
    for k, b in enumerate(blocks(docs_dir)):
        if not checked(b, "cpp", skipped):
            continue
        count += 1
        code = []
        for n, l in enumerate(b.text):
            if l.startswith("#include"):
                includes.append(l.strip())
                code.append("")  # keeps the line numbers
            else:
                code.append(l)
        abs_md = os.path.join(os.path.dirname(os.path.abspath(docs_dir)), b.path)
        if b.marker and b.marker[0] == "body":
            params = re.fullmatch(r"\((.*)\)", b.marker[1])
            if not params:
                sys.exit(f"{b.where}: write the marker as `check: body(PARAMS)`")
            parts.append(f"namespace docs_block_{k} {{\n[[maybe_unused]] void block({params.group(1)}) {{\n"
                         f'#line {b.line} "{abs_md}"\n' + "\n".join(code) + "\n}\n}\n")
        else:
            parts.append(f'namespace docs_block_{k} {{\n#line {b.line} "{abs_md}"\n' + "\n".join(code) + "\n}\n")
    seen = []
    for inc in [f"#include <{h}>" for h in PRELUDE] + includes:
        if inc not in seen:
            seen.append(inc)
    text = ("// Generated by tests/docs/doc_blocks.py from the ```cpp blocks of docs/: do not edit.\n"
            + "\n".join(seen) + "\n\n" + "\n".join(parts))
    if not os.path.exists(out) or open(out).read() != text:
        with open(out, "w") as f:
            f.write(text)
    print(f"docs: {count} C++ blocks in {out}; not compiled here: {len(skipped)}")
    for s in skipped:
        print(f"  {s}")


def check_toml(docs_dir, fulgur):
    skipped, failed, count = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for k, b in enumerate(blocks(docs_dir)):
            if not checked(b, "toml", skipped):
                continue
            count += 1
            path = os.path.join(tmp, f"block{k}.toml")
            with open(path, "w") as f:
                f.write("\n".join(b.text) + "\n")
            # A block that names its own plugin folders ([plugins] paths, e.g. "my_plugins") gets
            # them, empty: the rest of the block is still checked against the built-in plugins.
            try:
                with open(path, "rb") as f:
                    for folder in tomllib.load(f).get("plugins", {}).get("paths", []):
                        os.makedirs(os.path.join(tmp, folder), exist_ok=True)
            except tomllib.TOMLDecodeError:
                pass  # `fulgur config check` reports it, with the line
            r = subprocess.run([os.path.abspath(fulgur), "config", "check", path], capture_output=True, text=True, cwd=tmp)
            if r.returncode != 0:
                failed.append(f"{b.where}: `fulgur config check` failed:\n{r.stdout}{r.stderr}")
    print(f"docs: {count} TOML blocks checked with `fulgur config check`, {len(failed)} failed; "
          f"not checked: {len(skipped)}")
    for s in skipped:
        print(f"  {s}")
    for f in failed:
        print(f"FAILED {f}")
    return 1 if failed or count == 0 else 0


def run_shell(docs_dir, fulgur):
    failed, count = [], 0
    env = dict(os.environ, PATH=os.path.dirname(os.path.abspath(fulgur)) + os.pathsep + os.environ.get("PATH", ""))
    for b in blocks(docs_dir):
        if b.lang not in ("bash", "sh", "shell") or not b.marker or b.marker[0] != "run":
            continue
        count += 1
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(b.text)], capture_output=True, text=True,
                               cwd=tmp, env=env)
        if r.returncode != 0:
            failed.append(f"{b.where}: exit status {r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    print(f"docs: {count} shell blocks marked `check: run` ran, {len(failed)} failed")
    for f in failed:
        print(f"FAILED {f}")
    return 1 if failed or count == 0 else 0


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("cpp", "toml", "run"):
        sys.exit(__doc__)
    if sys.argv[1] == "cpp":
        write_cpp(sys.argv[2], sys.argv[3])
        return 0
    if sys.argv[1] == "run":
        return run_shell(sys.argv[2], sys.argv[3])
    return check_toml(sys.argv[2], sys.argv[3])


if __name__ == "__main__":
    sys.exit(main())
