"""Accept a Megatron checkpoint wherever an HF checkpoint is expected, by converting it first.

Our converter (``tools/convert_hf_to_megatron.py``) marks the Megatron directories it writes
with a ``megatron_darl.json`` file. The engines load Hugging Face directories only, so such a
directory is first converted back with ``tools/convert_megatron_to_hf.py`` into a temporary
directory the caller owns (and deletes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MEGATRON_MARKER = "megatron_darl.json"  # written by tools/convert_hf_to_megatron.py


def is_megatron_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a directory our HF->Megatron converter wrote."""
    return (Path(path) / MEGATRON_MARKER).is_file()


def resolve_hf_dir(model: str | Path, tmp_dir: str | Path, converter: str | Path) -> Path:
    """``model`` itself if it is an HF directory, else its conversion into ``tmp_dir``/hf.

    Raises:
        FileNotFoundError: ``model`` does not exist, or the converter script is missing.
        RuntimeError: the conversion failed (its output is in the message).
    """
    model = Path(model)
    if not model.is_dir():
        raise FileNotFoundError(f"--model {model}: no such checkpoint directory")
    if not is_megatron_checkpoint(model):
        return model
    converter = Path(converter)
    if not converter.is_file():
        raise FileNotFoundError(f"{model} is a Megatron checkpoint but converter {converter} is missing")
    out = Path(tmp_dir) / "hf"
    cmd = [sys.executable, str(converter), "--megatron-dir", str(model), "--out-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"converting {model} failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return out
