"""Model fingerprint: names the exact model (config, weights, tokenizer) a KV blob was made for."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_CACHE_FILE = ".inferscale-fingerprint.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                    "chat_template.jinja", "vocab.json", "merges.txt")


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _inputs(model_dir: Path) -> list[Path]:
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    files += [model_dir / name for name in _TOKENIZER_FILES if (model_dir / name).exists()]
    return files


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over the config, every weight file and the tokenizer files (cached by mtime/size)."""
    files = _inputs(Path(model_dir))
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    cache = Path(model_dir) / _CACHE_FILE
    try:
        cached = json.loads(cache.read_text())
        if cached["stamp"] == stamp:
            known: str = cached["fingerprint"]
            return known
    except (OSError, ValueError, KeyError):
        pass
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(_file_digest(path).encode())
    fingerprint = digest.hexdigest()
    try:
        cache.write_text(json.dumps({"stamp": stamp, "fingerprint": fingerprint}))
    except OSError:
        pass
    return fingerprint
