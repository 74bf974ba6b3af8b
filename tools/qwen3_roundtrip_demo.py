"""Qwen3 round trip on a tiny random model: HF -> Megatron (TP2 x PP2) -> logits -> HF.

The quick start's job until the D-ARL training loop lands: it shows on any CPU machine that the
Megatron model *is* the Hugging Face model. It builds a tiny random Qwen3 with the built-in
task's tokenizer, converts it with ``tools/convert_hf_to_megatron.py`` at TP2 x PP2, runs the
Megatron checkpoint on four gloo processes and compares its logits with transformers, then
converts it back with ``tools/convert_megatron_to_hf.py`` and compares every tensor bitwise.

    python tools/qwen3_roundtrip_demo.py [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOLERANCE = 1e-4  # fp32 max abs logit difference accepted


def make_tiny_policy(out_dir: Path) -> torch.nn.Module:
    """A random ~1M-parameter Qwen3 with the built-in tokenizer, saved in HF format."""
    import transformers

    from megatron_darl.data.builtin import build_builtin_tokenizer

    tokenizer = build_builtin_tokenizer(out_dir)
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_theta": 1e6}, rms_norm_eps=1e-6, tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(str(out_dir))
    return model


def _logits_worker(rank: int, world_size: int, ckpt: str, ids_path: str, out_path: str) -> None:
    from megatron_darl.models.qwen3.logits import forward_logits
    from megatron_darl.models.qwen3.model import build_qwen3_model
    from megatron_darl.checkpoint import model_io as ckio
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel

    ps = init_parallel(ParallelConfig(tp=2, pp=2, timeout_s=300))
    meta = ckio.read_metadata(ckpt)
    model = build_qwen3_model(meta.hf_config, ps, attention="sdpa",
                              padded_vocab=meta.padded_vocab_size)
    ckio.load_model_checkpoint(model, ckpt)
    logits = forward_logits(model, torch.load(ids_path), ps)
    if logits is not None and ps.tp_rank == 0:
        torch.save(logits, out_path)


def _run_tool(name: str, *args: str) -> None:
    cmd = [sys.executable, str(REPO / "tools" / name), *args]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, timeout=1800)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default=None, help="where models go (default: a temp dir)")
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="darl_demo_"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    hf_dir, mg_dir, back_dir = work / "hf", work / "megatron_tp2pp2", work / "hf_back"
    print(f"[demo] tiny random Qwen3 -> {hf_dir}")
    hf_model = make_tiny_policy(hf_dir)
    _run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--out-dir", str(mg_dir),
              "--tp", "2", "--pp", "2", "--force")
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.save(ids, work / "ids.pt")
    from megatron_darl.trainer.parallel import run_local_gloo

    print("[demo] Megatron logits at TP2 x PP2 on 4 gloo processes")
    run_local_gloo(_logits_worker, 4, args=(str(mg_dir), str(work / "ids.pt"), str(work / "logits.pt")),
                   timeout_s=600)
    with torch.no_grad():
        ref = hf_model(ids).logits.float()
    diff = float((torch.load(work / "logits.pt") - ref).abs().max())
    _run_tool("convert_megatron_to_hf.py", "--megatron-dir", str(mg_dir), "--out-dir", str(back_dir),
              "--force")
    from safetensors.torch import load_file

    back = {}
    for f in sorted(back_dir.glob("*.safetensors")):
        back.update(load_file(str(f)))
    original = hf_model.state_dict()
    same = all(torch.equal(back[k], original[k]) for k in back) and set(back) <= set(original)
    print(f"[demo] max |logits(Megatron TP2xPP2) - logits(HF)| = {diff:.2e} (tolerance {TOLERANCE})")
    print(f"[demo] HF -> Megatron -> HF tensors bitwise identical: {same} ({len(back)} tensors)")
    print(f"[demo] done in {time.time() - start:.0f}s; files under {work}")
    return 0 if diff <= TOLERANCE and same else 1


if __name__ == "__main__":
    sys.exit(main())
