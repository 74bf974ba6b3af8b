"""Accept a Megatron checkpoint wherever an HF checkpoint is expected, by converting it first.

Training checkpoints (``runs/<run>/checkpoints/step_NNNNNN``) and the directories our converter
(``tools/convert_hf_to_megatron.py``) writes are marked with a ``megatron_darl.json`` file and
carry the model's tokenizer and HF config. The engines load Hugging Face directories only, so
such a directory is first converted back with ``tools/convert_megatron_to_hf.py`` into a
temporary directory the caller owns (and deletes). One without a tokenizer is refused in one line before the conversion: transformers would build
an empty tokenizer and every prompt would encode as nothing.

The converter is the one loader of such weights here: it verifies every file against the
checkpoint's ``checksums.json`` and the loaded weights for NaN/Inf
(``model_io.load_model_checkpoint``). A damaged checkpoint is refused by it, and
``resolve_hf_dir`` passes that on as one ``CheckpointDamaged`` line (a ``ValueError``: the user's
input, not a crash), so no benchmark is ever scored on zeroed or NaN weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_darl.checkpoint import CONVERT_TIMEOUT_S
from megatron_darl.checkpoint.model_io import METADATA_NAME, CheckpointDamaged, missing_tokenizer


def is_megatron_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a training checkpoint or a directory our HF->Megatron converter wrote."""
    return (Path(path) / METADATA_NAME).is_file()


def resolve_hf_dir(model: str | Path, tmp_dir: str | Path, converter: str | Path) -> Path:
    """``model`` itself if it is an HF directory, else its conversion into ``tmp_dir``/hf.

    Raises:
        FileNotFoundError: ``model`` does not exist, or the converter script is missing.
        CheckpointDamaged: the checkpoint's files or weights are damaged (one line naming them).
        ValueError: the checkpoint has no tokenizer (one line naming it).
        RuntimeError: the conversion failed otherwise (its output is in the message).
    """
    model = Path(model)
    if not model.is_dir():
        raise FileNotFoundError(f"--model {model}: no such checkpoint directory")
    if not is_megatron_checkpoint(model):
        return model
    if missing_tokenizer(model):
        raise ValueError(f"--model {missing_tokenizer(model)}, then pass the HF dir it writes to --model")
    converter = Path(converter)
    if not converter.is_file():
        raise FileNotFoundError(f"{model} is a Megatron checkpoint but converter {converter} is missing")
    out = Path(tmp_dir) / "hf"
    cmd = [sys.executable, str(converter), "--megatron-dir", str(model), "--out-dir", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"converting {model} did not end within {CONVERT_TIMEOUT_S:.0f} s ({' '.join(cmd)}): "
                           "a stalled filesystem?") from None
    refusal = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode != 0 and " is damaged: " in refusal:  # the loader's one line: a user's input
        raise CheckpointDamaged(f"--model {model}: refused: {refusal.split(': error: ', 1)[-1]}")
    if proc.returncode != 0:
        raise RuntimeError(f"converting {model} failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return out
