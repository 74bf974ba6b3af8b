"""Bad input to the Slurm scripts fails at once with one line naming the knob; the layout rules.

The submissions are real (the launcher's checks run inside the allocation, before any job step
or torch import); the layout tests call ``launch.slurm_layout`` directly.
"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from launch.slurm_layout import RENAMED, Knobs, plan_layout
from slurm_jobs import CPU_OPTS, REPO, job_env, sbatch, wait_state

pytestmark = pytest.mark.slurm
SCRIPT = "slurm/qwen3_4b_darl.sbatch"


@pytest.mark.parametrize("knobs, message", [
    ({"MODEL_PATH": "/nonexistent/Qwen3-4B"}, "MODEL_PATH=/nonexistent/Qwen3-4B: no such directory"),
    ({"MODEL": "qwen3_4b"}, "MODEL=qwen3_4b needs MODEL_PATH="),
    ({"MODEL": "tiny", "TRAINER_NODES": "3"},
     "TRAINER_NODES=3 + ROLLOUT_NODES=1 must equal the allocation's 2 node(s)"),
    ({"MODEL": "tiny", "TRAIN_NODES": "1"}, "TRAIN_NODES is now TRAINER_NODES: set TRAINER_NODES=1"),
    ({"MODEL": "tiny", "TP": "two"}, "TP='two' is not an integer"),
    pytest.param({"MODEL": "tiny", "ROLLOUT": "vllm"},
                 "engine.backend=vllm: vLLM is not installed for", id="vllm-missing",
                 marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                                          reason="vLLM is installed here")),
])
def test_bad_knob_fails_the_job_with_one_line(slurm_cluster, tmp_path, knobs, message):
    env = job_env(slurm_cluster, OUTPUT_DIR=str(tmp_path / "run"), **knobs)
    out = tmp_path / "job.out"
    job = sbatch(slurm_cluster, SCRIPT, ["experiment=smoke"], env, ["--nodes=2", *CPU_OPTS, f"--output={out}"])
    info = wait_state(slurm_cluster, job, timeout=60, output=out)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0"
    errors = [line for line in out.read_text().splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], out.read_text()
    assert not (tmp_path / "run" / "run_config.yaml").exists()


def test_reserved_override_names_the_knob(slurm_cluster, tmp_path):
    env = job_env(slurm_cluster, MODEL="tiny", OUTPUT_DIR=str(tmp_path / "run"))
    out = tmp_path / "job.out"
    job = sbatch(slurm_cluster, SCRIPT, ["parallel.tp=2"], env, ["--nodes=2", *CPU_OPTS, f"--output={out}"])
    assert wait_state(slurm_cluster, job, timeout=60, output=out)["JobState"] == "FAILED"
    assert "parallel.tp is set by the Slurm launcher; use TP" in out.read_text()


def test_scaling_study_rejects_a_bad_node_list(slurm_cluster, tmp_path):
    env = job_env(slurm_cluster, NODES_LIST="1 two", STUDY_DIR=str(tmp_path / "s"))
    res = subprocess.run(["bash", "slurm/scaling_study.sh"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == "scaling_study.sh: error: NODES_LIST entry 'two' is not a positive integer"


def _knobs(**env) -> Knobs:
    return Knobs.from_env({"OUTPUT_DIR": "/tmp/run", **env})


def test_layout_gpu_nodes_split_between_trainer_and_engines():
    lay = plan_layout(_knobs(GPUS_PER_NODE="8", TP="2", ROLLOUT_TP="2"), ["a", "b", "c", "d"],
                      batch_host="a", cpus_on_node=64)
    assert lay.trainer_nodes == ["a", "b"] and lay.trainer_ranks == 16 and lay.trainer_gpus_per_node == 8
    assert lay.worker_nodes == ["c"] * 4 + ["d"] * 4 and lay.worker_gpus == 2
    assert (lay.trainer_cpus_per_task, lay.worker_cpus_per_task, lay.threads) == (8, 16, 8)


def test_layout_one_node_shares_it():
    lay = plan_layout(_knobs(GPUS_PER_NODE="8"), ["a"], batch_host="a", cpus_on_node=32)
    assert lay.colocated and lay.trainer_ranks == 4 and lay.worker_nodes == ["a"] * 4
    cpu = plan_layout(_knobs(), ["n1"], batch_host="n1", cpus_on_node=2)
    assert cpu.colocated and (cpu.trainer_ranks, cpu.workers, cpu.threads) == (1, 1, 1)


def test_layout_errors_name_the_knob():
    with pytest.raises(ValueError, match=r"TP=3 x PP=1 must divide the 8 trainer rank"):
        plan_layout(_knobs(GPUS_PER_NODE="8", TP="3"), ["a", "b"], cpus_on_node=64)
    with pytest.raises(ValueError, match=r"ROLLOUT_TP=3 must divide the 8 rollout GPU"):
        plan_layout(_knobs(GPUS_PER_NODE="8", ROLLOUT_TP="3"), ["a", "b"], cpus_on_node=64)
    with pytest.raises(ValueError, match=r"needs 2 CPUs per node but the allocation has 1"):
        plan_layout(_knobs(), ["a"], cpus_on_node=1)
    with pytest.raises(ValueError, match=r"ROLLOUT='sglang': use hf or vllm"):
        _knobs(ROLLOUT="sglang")


def test_vllm_is_the_engine_on_gpu_nodes_and_hf_stays_a_choice():
    assert _knobs(GPUS_PER_NODE="8").rollout == "vllm"
    assert _knobs(GPUS_PER_NODE="8", ROLLOUT="hf").rollout == "hf"
    assert _knobs().rollout == "hf"  # a CPU run: vLLM needs GPUs


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_a_name_outside_the_vocabulary_fails_with_one_line_naming_the_knob(old, new):
    with pytest.raises(ValueError) as err:
        _knobs(**{old: "1"})
    assert str(err.value) == f"{old} is now {new}: set {new}=1 (and unset {old})"


def test_the_knobs_speak_the_help_vocabulary():
    """Group knobs are the groups ``--help`` lists; the split knobs are ``cluster.*``'s two sides."""
    from launch.train import config_groups

    assert {"model", "algorithm", "data", "rollout", "trainer"} <= set(config_groups())
    lay = plan_layout(_knobs(GPUS_PER_NODE="4", TRAINER_NODES="2", ROLLOUT_NODES="1", ROLLOUT="hf"),
                      ["a", "b", "c"], batch_host="a", cpus_on_node=16)
    assert {k.split("_")[0] for k in lay.shell_values()} == {"TRAINER", "ROLLOUT", "THREADS"}


def test_cluster_overrides_are_the_reserved_keys(monkeypatch):
    import launch.slurm as ls

    monkeypatch.setattr(ls, "node_addr", lambda name: f"addr-{name}")
    monkeypatch.setattr(ls, "kill_wait_s", lambda: 30)
    knobs = _knobs(GPUS_PER_NODE="8", ROLLOUT_NODES="0", TRAINER_GPUS_PER_NODE="6", PP="2")
    lay = plan_layout(knobs, ["a", "b"], batch_host="a", cpus_on_node=64)
    over = dict(o.split("=", 1) for o in ls.cluster_overrides(knobs, lay, "1234"))
    assert set(ls.RESERVED) == set(over)  # every key the launcher sets is refused from the user
    with pytest.raises(ValueError, match="loop.resume is set by the Slurm launcher; use RESUME"):
        ls.check_user_overrides(["experiment=smoke", "loop.resume=false"])
    assert (over["cluster.trainer_ranks"], over["cluster.rollout_workers"], over["parallel.pp"]) == ("12", "4", "2")
    assert over["cluster.master_addr"] == over["transport.control.host"] == "'addr-a'"


def test_a_second_job_on_a_busy_output_dir_is_refused_naming_the_job(slurm_cluster, warm_policy, tmp_path):
    """Two jobs on one OUTPUT_DIR (``--oversubscribe``: they run at once): the second fails with
    exit 2 and one line naming the first job, before it writes anything there."""
    from slurm_jobs import metrics, wait_for

    run = tmp_path / "run"
    env = job_env(slurm_cluster, MODEL="tiny", OUTPUT_DIR=str(run))
    opts = ["--nodes=1", "--oversubscribe", "--cpus-per-task=2", *CPU_OPTS]
    first = sbatch(slurm_cluster, SCRIPT, ["experiment=smoke", "loop.steps=200"], env,
                   [*opts, f"--output={tmp_path / 'first.out'}"])
    wait_for(lambda: len(metrics(run)) >= 1, 150, "a logged step of the first job")
    config = (run / "run_config.yaml").read_bytes()
    out = tmp_path / "second.out"
    second = sbatch(slurm_cluster, SCRIPT, ["experiment=smoke", "loop.steps=3"], env, [*opts, f"--output={out}"])
    info = wait_state(slurm_cluster, second, timeout=90, output=out)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", out.read_text()
    errors = [line for line in out.read_text().splitlines() if "error" in line]
    assert len(errors) == 1 and "OUTPUT_DIR=" in errors[0] and "is in use by another run" in errors[0], errors
    assert f"Slurm job {first}," in errors[0]
    assert (run / "run_config.yaml").read_bytes() == config
    assert [d.name for d in (run / "logs").iterdir() if d.name.startswith("job")] == [f"job{first}_0"]
    slurm_cluster.run(["scancel", str(first)])
