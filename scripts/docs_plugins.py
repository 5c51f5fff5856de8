"""Writes the plugin reference pages of the docs site from `fulgur plugins describe --all --json`.

One page per built-in plugin (the plugins found in the build's plugin folder): its kind, name,
version, description and every option with its type, default and help, exactly the metadata
`fulgur plugins describe NAME` prints, read from the plugin files themselves, so the pages cannot
drift from the code. Also writes the staging mkdocs.yml: mkdocs.yml with docs_dir and site_dir
pointing at the staging copy and the site, and the generated pages added to the navigation.
Run by scripts/docs.sh.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import yaml  # PyYAML: a dependency of MkDocs

KIND_TITLES = {
    "accelerator": "Accelerators",
    "strategy": "Strategies",
    "precision": "Precisions",
    "logger": "Loggers",
    "profiler": "Profilers",
    "callback": "Callbacks",
    "model": "Models",
    "datamodule": "Data modules",
    "storage": "Storage",
}
# Where each kind is selected in the TOML.
KIND_TOML = {
    "accelerator": '[trainer] accelerator = "{name}"',
    "strategy": '[trainer] strategy = "{name}"',
    "precision": '[trainer] precision = "{name}"',
    "logger": '[[loggers]] name = "{name}"',
    "profiler": '[profiler] name = "{name}"',
    "callback": '[[callbacks]] name = "{name}"',
    "model": '[model] name = "{name}"',
    "datamodule": '[data] name = "{name}"',
    "storage": "{name}://bucket/key (a URL wherever a path goes)",
}
# The table that holds a plugin's options.
KIND_TABLE = {
    "accelerator": "`[accelerator]`",
    "strategy": "`[strategy]`",
    "precision": "`[precision]`",
    "logger": "its `[[loggers]]` entry",
    "profiler": "`[profiler]`",
    "callback": "its `[[callbacks]]` entry",
    "model": "`[model]`",
    "datamodule": "`[data]`",
    "storage": "`[storage]`, whose `name` selects it",
}


def code(text):
    """Text for a code span in a Markdown table cell: pipes escaped."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def cell(text):
    """Plain text in a Markdown table cell: pipes escaped, and <, > and & shown as they are
    (help texts say `<log_dir>`, which Markdown would take for an HTML tag)."""
    return code(str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))


def page_name(p):
    return f"{p['kind']}-{p['name']}.md"


def write_page(p, folder):
    if p.get("missing"):
        with open(os.path.join(folder, page_name(p)), "w") as f:
            f.write(f"# {p['name']} ({p['kind']})\n\nNot built in the build this site was made from: the `cuda` "
                    "accelerator is built when the torch wheel is a CUDA build. Its options are listed by "
                    f"`fulgur plugins describe {p['name']}` where it is built (see [GPUs](../../how-to/gpu.md)).\n")
        return
    lines = [
        f"# {p['name']} ({p['kind']})",
        "",
        cell(p["description"]),
        "",
        f"- Select it: `{KIND_TOML.get(p['kind'], '{name}').format(name=p['name'])}`",
        f"- Version {p['version']}, built against SDK {p['sdk']} (plugin ABI {p['abi']}, libtorch {p['libtorch']})",
        f"- Options go in {KIND_TABLE.get(p['kind'], 'its table')}; "
        f"`fulgur plugins describe {p['name']} --kind {p['kind']}` prints this page's data",
        "",
        "## Options",
        "",
    ]
    if not p["options"]:
        lines.append("None.")
    else:
        lines += ["| option | type | default | help |", "|---|---|---|---|"]
        for o in p["options"]:
            default = "(required)" if o["required"] else f"`{code(o['default'])}`"
            lines.append(f"| `{o['key']}` | {o['type']} | {default} | {cell(o['help'])} |")
    lines += ["", "*Generated at docs-build time from the plugin's metadata (ELF note); do not edit.*", ""]
    with open(os.path.join(folder, page_name(p)), "w") as f:
        f.write("\n".join(lines))


OPTION_LINE = re.compile(r"^  (\S+)\s+(\S+)\s+(\[[^\]]*\]|\"(?:[^\"\\\\]|\\\\.)*\"|\S+)\s+(.*)$")


def write_trainer_page(fulgur, folder):
    """reference/trainer.md: the [trainer] keys as `fulgur fit --help` prints them (the core's schema)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "empty.toml")
        open(config, "w").close()
        text = subprocess.run([fulgur, "fit", "--config", config, "--help"], check=True, capture_output=True,
                              text=True).stdout
    lines = text.split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith("[trainer] options"))
    rows = []
    for l in lines[start + 1:]:
        if not l.strip():
            break
        m = OPTION_LINE.match(l)
        if not m:
            sys.exit(f"docs_plugins.py: cannot read this line of `fulgur fit --help`: {l!r}")
        key, type_, default, help_ = m.groups()
        rows.append(f"| `{key}` | {type_} | `{code(default)}` | {cell(help_)} |")
    page = ["# [trainer] options", "",
            "Every key of the `[trainer]` table (Lightning's `Trainer` arguments, see",
            "[coming from Lightning](../lightning.md)): also flags, `--trainer.KEY=VALUE`, and",
            "`fulgur::ConfigBuilder` setters in code (see [configure a run](../how-to/configuration.md)).", "",
            "| key | type | default | help |", "|---|---|---|---|", *rows, "",
            "*Generated at docs-build time from `fulgur fit --help`; do not edit.*", ""]
    with open(os.path.join(folder, "trainer.md"), "w") as f:
        f.write("\n".join(page))
    return len(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fulgur", required=True)
    ap.add_argument("--plugin-dir", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--staging", required=True)
    ap.add_argument("--site", required=True)
    a = ap.parse_args()

    # The built-in plugins are those plugins/CMakeLists.txt declares with fulgur_builtin_plugin (the
    # plugin folder also holds the examples' plugins, which are not built-ins).
    cmake = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plugins", "CMakeLists.txt")
    builtin = re.findall(r"^\s*fulgur_builtin_plugin\((\w+)\s+([\w.-]+)", open(cmake).read(), re.M)
    if not builtin:
        sys.exit(f"docs_plugins.py: no fulgur_builtin_plugin(...) found in {cmake}")
    out = subprocess.run([a.fulgur, "plugins", "describe", "--all", "--json"], check=True, capture_output=True,
                         text=True).stdout
    plugin_dir = os.path.realpath(a.plugin_dir)
    found = {(p["kind"], p["name"]): p for p in json.loads(out)
             if os.path.realpath(p["file"]).startswith(plugin_dir + os.sep)}
    plugins = []
    for kind, name in builtin:
        if (kind, name) in found:
            plugins.append(found[(kind, name)])
        elif kind == "accelerator" and name == "cuda":
            # Built only when the torch wheel is a CUDA build: the page says so instead of vanishing.
            plugins.append({"kind": kind, "name": name, "missing": True})
        else:
            sys.exit(f"docs_plugins.py: built-in {kind} '{name}' is not in {plugin_dir}: build the plugins first")
    order = list(KIND_TITLES)
    plugins.sort(key=lambda p: (order.index(p["kind"]) if p["kind"] in order else len(order), p["name"]))

    folder = os.path.join(a.staging, "docs", "reference", "plugins")
    os.makedirs(folder, exist_ok=True)
    index = [
        "# Built-in plugins",
        "",
        "Every plugin shipped with Fulgur, by kind. Each page lists the plugin's options with their types,",
        "defaults and help, generated when the site is built from the same metadata that",
        "`fulgur plugins describe NAME` prints (see [the plugin door](../../concepts/plugins.md)).",
        "",
    ]
    nav = {}
    for p in plugins:
        write_page(p, folder)
        nav.setdefault(p["kind"], []).append({p["name"]: f"reference/plugins/{page_name(p)}"})
    for kind in nav:
        index += [f"## {KIND_TITLES.get(kind, kind)}", "", "| name | description |", "|---|---|"]
        index += [f"| [{p['name']}]({page_name(p)}) | {cell(p.get('description', '(not in this build)'))} |"
                  for p in plugins if p["kind"] == kind]
        index.append("")
    with open(os.path.join(folder, "index.md"), "w") as f:
        f.write("\n".join(index))

    keys = write_trainer_page(a.fulgur, os.path.join(a.staging, "docs", "reference"))

    with open(a.config) as f:
        config = yaml.safe_load(f)
    root = os.path.dirname(os.path.abspath(a.config))
    config["docs_dir"] = os.path.join(os.path.abspath(a.staging), "docs")
    config["site_dir"] = os.path.abspath(a.site)
    for ext in config.get("markdown_extensions", []):
        if isinstance(ext, dict) and "pymdownx.snippets" in ext:
            ext["pymdownx.snippets"]["base_path"] = [root]
    generated = ["reference/plugins/index.md"] + [{KIND_TITLES.get(k, k): v} for k, v in nav.items()]

    def replace(items):
        for i, item in enumerate(items):
            if isinstance(item, dict):
                for key, value in item.items():
                    if value == "reference/plugins/index.md":
                        items[i] = {key: generated}
                    elif isinstance(value, list):
                        replace(value)

    replace(config["nav"])
    with open(os.path.join(a.staging, "mkdocs.yml"), "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    print(f"docs: {len(plugins)} plugin pages, {keys} [trainer] keys")


if __name__ == "__main__":
    main()
