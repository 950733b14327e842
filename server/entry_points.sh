# Sourced by the GPU-host serving scripts: `register_entry_points DIR` makes
# this checkout importable (PYTHONPATH) and visible to vLLM as its plugin
# (a dist-info in DIR declaring the package's entry points), without pip or
# network. Needs $REPO (the checkout) and $PY.
register_entry_points() {
  export PYTHONPATH="$REPO:$1${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" - "$1" <<'PYEOF'
import importlib.metadata as md, pathlib, sys, tomllib
if any(e.name == "echo_vllm" and e.value.startswith("echo_vllm.")
       for e in md.entry_points(group="vllm.general_plugins")):
    sys.exit(0)  # installed already (its code is shadowed by this checkout on PYTHONPATH)
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"echo_vllm-{project['version']}.dist-info"
info.mkdir(parents=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
lines = ["[console_scripts]"] + [f"{k} = {v}" for k, v in project.get("scripts", {}).items()]
for group, entries in project.get("entry-points", {}).items():
    lines += ["", f"[{group}]"] + [f"{k} = {v}" for k, v in entries.items()]
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
PYEOF
}
