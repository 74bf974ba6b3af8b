"""What a launch pays before its first step: the launcher before its children, a CPU trainer's imports.

A launch's children import torch, Megatron and the engine anyway; the launcher's own checks
(config, run dir, dataset, prompt lengths) must not, or every launch waits for those imports twice
over (about 4 s of a CPU launch's 5, measured, before the children started). The prompt-length check
reads a plain ``tokenizer.json`` through ``tokenizers`` alone, and must count exactly what HF's tokenizer
counts. A CPU trainer imports Megatron without the inductor its import-time compile wrappers pull in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from megatron_darl.data.builtin import build_builtin_tokenizer, builtin_prompts
from megatron_darl.data.config import CountdownTaskConfig
from megatron_darl.data.countdown import countdown_records
from megatron_darl.data.prompt_fit import FileTokenizer, prompt_tokenizer
from megatron_darl.data.templates import encode_prompt

REPO = Path(__file__).resolve().parents[2]

_UP_TO_THE_CHILDREN = """
import sys
import launch.procs, launch.train
class Spawned(Exception):
    pass
def run(self):
    raise Spawned([s.name for s in self.specs])
launch.procs.Launcher.run = run
try:
    launch.train.main(["loop.steps=2", "loop.run_dir=" + sys.argv[1]])
except Spawned as spawned:
    print("spawned", spawned.args[0])
print("heavy", sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "math_verify", "sympy",
                                                                 "megatron", "numpy"}))
"""


def test_the_launcher_reaches_its_children_without_torch_transformers_or_math_verify(tmp_path):
    out = subprocess.run([sys.executable, "-c", _UP_TO_THE_CHILDREN, str(tmp_path / "run")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert "spawned ['trainer 0', 'rollout 0']" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "heavy []" in out.stdout, out.stdout


def test_a_plain_tokenizer_json_counts_prompts_as_hf_does(tmp_path):
    build_builtin_tokenizer(tmp_path / "tok")
    light, hf = prompt_tokenizer(tmp_path / "tok"), AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert isinstance(light, FileTokenizer)
    records = builtin_prompts(200, seed=3) + countdown_records(CountdownTaskConfig(num_prompts=50))
    for record in records:
        assert encode_prompt(light, record.messages) == encode_prompt(hf, record.messages), record.prompt
    for text in ["answer: 12\n\n", "", "unknown ÿ characters é", "1 + 2 = ?"]:
        for special in (True, False):
            assert light(text, add_special_tokens=special)["input_ids"] == \
                hf(text, add_special_tokens=special)["input_ids"], (text, special)


def test_a_tokenizer_with_a_template_or_its_own_switches_goes_through_transformers(tmp_path):
    build_builtin_tokenizer(tmp_path / "tok")
    settings = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    variants = {
        "template": {**settings, "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                                  "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"},
        "bos switch": {**settings, "add_bos_token": False},
        "other class": {**settings, "tokenizer_class": "Qwen2Tokenizer"},
    }
    for name, config in variants.items():
        root = tmp_path / name.replace(" ", "_")
        shutil.copytree(tmp_path / "tok", root)
        (root / "tokenizer_config.json").write_text(json.dumps(config))
        assert not isinstance(prompt_tokenizer(root), FileTokenizer), name
    templated = prompt_tokenizer(tmp_path / "template")
    messages = [{"role": "user", "content": "1 + 2"}]
    assert encode_prompt(templated, messages) == \
        encode_prompt(AutoTokenizer.from_pretrained(str(tmp_path / "template")), messages)


_CPU_TRAINER_START = """
import sys, torch
from megatron_darl.trainer.parallel import init_single_process
real = torch.compile
ps = init_single_process()
from megatron.core import jit
print("inductor", "torch._inductor.compile_fx" in sys.modules, "restored", torch.compile is real,
      "fuser", jit.jit_fuser(len) is len, "world", ps.world_size)
"""


def test_a_cpu_trainer_imports_megatron_without_inductor():
    """Megatron's import-time ``torch.compile`` wrappers import inductor (2.5 s a CPU trainer process)
    for fusions a CPU run switches off: the trainer imports it with the wrapper a no-op, and
    ``torch.compile`` is itself again afterwards."""
    out = subprocess.run([sys.executable, "-c", _CPU_TRAINER_START], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert "inductor False restored True fuser True world 1" in out.stdout, out.stdout + out.stderr[-3000:]
