"""What a user sees: config errors that say what to do, the quiet console and ``--verbose``, the
converters' ``--help``, the progress plot, a smoke run dir of its own, the install's phases.

The log of a whole smoke run (no Megatron config dumps, no UserWarning lines) is checked on the
runs ``tests/distributed/test_loop_smoke.py`` already makes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import train
from launch.config import load_run_config

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _python(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_unknown_preset_keeps_hydras_list_and_suggests_the_nearest():
    proc = _python("-m", "launch.train", "algorithm=dral")
    assert proc.returncode == 2 and proc.stdout == ""
    err = proc.stderr
    assert "Could not find 'algorithm/dral'" in err and "did you mean algorithm=darl?" in err
    listed = re.findall(r"^\t(\w+)$", err, re.M)  # Hydra's "Available options in 'algorithm':"
    assert "Available options in 'algorithm'" in err and {"sync", "darl", "darl_nofilter"} <= set(listed)
    assert "Traceback" not in err and "Config search path" not in err


def test_unknown_key_says_so_and_suggests_the_key(capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(["--print-config", "loop.stepz=3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "loop.stepz: no such key in loop" in err and "did you mean loop.steps?" in err
    assert "+loop.stepz" not in err  # Hydra's "append with +" would be silently ignored by the schema
    with pytest.raises(SystemExit):
        train.main(["--print-config", "experimen=smoke"])
    assert "did you mean experiment?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--print-config", "loop.steps=many"])
    assert "loop.steps: Value 'many' of type 'str' could not be converted to Integer" in capsys.readouterr().err


def test_cfg_job_prints_the_config_and_unknown_flags_are_named(capsys):
    assert train.main(["--cfg", "job", "loop.steps=3"]) == 0
    assert re.search(r"^  steps: 3$", capsys.readouterr().out, re.M)
    assert train.main(["--cfg", "hydra"]) == 2
    assert "--print-config" in capsys.readouterr().err
    assert train.main(["--frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown option --frobnicate" in err and "--verbose" in err


def test_verbose_flag_is_the_config_key(capsys):
    assert train.main(["--print-config", "--verbose"]) == 0
    assert re.search(r"^  verbose: true$", capsys.readouterr().out, re.M)
    assert load_run_config([]).loop.verbose is False


_IMPORT_MEGATRON = """
import logging, sys
from launch.console import setup_logging
setup_logging("trainer0", verbose=sys.argv[1] == "1")
import megatron.core.optimizer  # warns at import: no Apex / Transformer Engine here
logging.getLogger("megatron.core.distributed").info("Params for bucket 1")
logging.getLogger("megatron_darl.loop").info("step 0 reward 0.5")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_console_hides_megatron_internals_unless_verbose(verbose):
    proc = _python("-c", _IMPORT_MEGATRON, str(int(verbose)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trainer0 INFO step 0 reward 0.5" in proc.stderr  # our own lines always
    assert ("UserWarning" in proc.stderr) is verbose
    assert ("Params for bucket 1" in proc.stderr) is verbose


@pytest.mark.parametrize("tool", ["convert_hf_to_megatron", "convert_megatron_to_hf"])
def test_converter_help_imports_no_torch_and_documents_every_flag(tool):
    code = (f"import sys\nfrom tools import {tool} as t\ntry:\n    t.parse_args(['--help'])\n"
            "except SystemExit:\n    pass\nprint('torch imported:', 'torch' in sys.modules)")
    proc = _python("-c", code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "torch imported: False" in proc.stdout  # the work is imported after parsing
    options = re.findall(r"^  (--[\w-]+)(.*)$", proc.stdout, re.M)
    assert len(options) >= 7
    helped = proc.stdout.split("options:", 1)[1]
    for flag, rest in options:  # a help text on the flag's line or the next one
        after = helped.split(flag, 1)[1].split("\n  -", 1)[0]
        assert re.search(r"[a-z]{3}", after.replace(flag.upper()[2:].replace("-", "_"), "")), flag
    assert "(default: 1)" in helped and "tools/" in proc.stdout.split("options:")[0]  # usage lines shown


def _history(steps: int) -> list[dict]:
    return [{"step": s, "reward_mean": 0.1 + 0.01 * s + 0.05 * (s % 3), "staleness_mean": 1.0,
             "selected_mean": 0.5, "selected_hist": [2.0, 1.0, 1.0, 0.0]} for s in range(steps)]


def test_progress_plot_has_a_title_a_smoothed_reward_and_legends_off_the_data(tmp_path):
    from megatron_darl.loop.plots import moving_average, plot_progress, progress_figure

    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    history = _history(40)
    path = plot_progress(history, tmp_path / "p.png", title="variant darl, run dir runs/x")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    fig = progress_figure(history, title="variant darl, run dir runs/x")
    assert fig._suptitle.get_text() == "variant darl, run dir runs/x"
    reward = fig.axes[0]
    raw, smooth = reward.get_lines()
    assert raw.get_alpha() < 1 and smooth.get_alpha() in (None, 1.0)
    assert list(smooth.get_ydata()) == pytest.approx(moving_average([r["reward_mean"] for r in history], 8))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        assert ax.get_ylabel() and ax.get_legend() is not None
        legend, area = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert legend.x0 >= area.x1  # beside the panel: it covers no data
    assert "step" in fig.axes[-1].get_xlabel()


def test_smoke_experiment_writes_a_fresh_run_dir():
    run_dir = load_run_config(["experiment=smoke"]).loop.run_dir
    assert re.fullmatch(r"runs/smoke_darl_\d{8}_\d{6}", run_dir), run_dir


def test_venv_install_says_what_each_phase_does(tmp_path):
    """launch/venv.sh against a stand-in interpreter that records its calls: one line as each
    phase starts and one with its seconds as it ends; pip itself runs quietly."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls"
    fake = venv / "bin" / "python"
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {calls}
case "$*" in
  "-c import torch") exit 1 ;;   # no torch yet: the install phase runs
  -c*) echo "Python 3.11.9, torch 2.13.0+cpu" ;;
esac
""")
    fake.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'PATH="{venv}/bin:$PATH"\n')
    script = f'source "{REPO}/launch/venv.sh" && darl_venv "[test]"'
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, env={**os.environ, "VENV": str(venv)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("[venv] installing torch==2.13.0") and lines[0].endswith("...")
    assert re.fullmatch(r"\[venv\] done in \d+ s: installing torch==2\.13\.0 .*", lines[1])
    assert lines[2].startswith("[venv] installing megatron_darl[test] and its dependencies")
    assert lines[-1] == "[venv] ready: " + str(venv) + " (Python 3.11.9, torch 2.13.0+cpu)"
    pip = [c for c in calls.read_text().splitlines() if c.startswith("-m pip install")]
    assert pip == ["-m pip install -q torch==2.13.0", "-m pip install -q -e .[test]"]
