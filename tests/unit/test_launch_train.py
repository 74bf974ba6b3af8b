"""launch.train's process plan: devices per preset, torchrun-style env, argv; launch.trainer's env."""

import pytest

from launch.config import ClusterConfig, load_run_config
from launch.train import process_specs, resolve_devices
from launch.trainer import dist_env


@pytest.mark.parametrize("gpus, trainer, rollout", [(0, [], []), (1, [0], [0]), (2, [0], [1]), (4, [0], [1])])
def test_auto_devices(gpus, trainer, rollout):
    assert resolve_devices(ClusterConfig(), gpus) == (trainer, rollout)


def test_presets_pin_devices_and_refuse_missing_gpus():
    assert resolve_devices(ClusterConfig(trainer_devices=[], rollout_devices=[]), 2) == ([], [])
    with pytest.raises(ValueError, match="rollout_devices"):
        resolve_devices(load_run_config(["cluster=gpu2"]).cluster, 1)


def test_process_specs_env_and_argv(tmp_path):
    cfg = load_run_config(["cluster=gpu2", "cluster.trainer_ranks=2", "cluster.rollout_workers=2",
                           "algorithm.groups_per_step=8", f"loop.run_dir={tmp_path}",
                           "cluster.trainer_devices=[0,1]", "cluster.rollout_devices=[2,3]"])
    specs = process_specs(cfg, tmp_path / "run_config.yaml", num_gpus=4, base_env={"PATH": "/bin"})
    trainers = [s for s in specs if s.role == "trainer"]
    rollouts = [s for s in specs if s.role == "rollout"]
    assert [s.env["RANK"] for s in trainers] == ["0", "1"]
    assert all(s.env["WORLD_SIZE"] == "2" and s.env["CUDA_VISIBLE_DEVICES"] == "0,1" for s in trainers)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in rollouts] == ["2", "3"]
    assert rollouts[1].argv[-2:] == ["--worker-id", "1"] and "launch.rollout" in rollouts[1].argv
    assert trainers[0].log_path is None and trainers[1].log_path == tmp_path / "logs" / "trainer1.log"
    assert all(s.env["PATH"] == "/bin" for s in specs)
    cpu = process_specs(load_run_config(["cluster=cpu"]), tmp_path / "c.yaml", num_gpus=2, base_env={})
    assert all(s.env["CUDA_VISIBLE_DEVICES"] == "" for s in cpu)  # GPUs hidden: a CPU run


def test_dist_env_reads_torchrun_then_slurm():
    env = dist_env({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "99"})
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (3, 4, "h", 99)
    assert dist_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}).rank == 1
    with pytest.raises(ValueError, match="RANK"):
        dist_env({})


def test_help_lists_config_groups_and_presets(capsys):
    from launch import train

    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "algorithm" in out and "darl_nofilter" in out and "experiment" in out and "smoke" in out


def test_bad_override_is_one_line_naming_it(capsys):
    import pytest

    from launch import train

    for bad, needle in (("algorithm=nosuch", "algorithm/nosuch"), ("replay.k=-3", "replay.k")):
        with pytest.raises(SystemExit) as exc:
            train.main(["--print-config", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_slurm_job_ports_differ_between_jobs_and_stay_below_the_ephemeral_range():
    from launch.slurm import job_ports

    a, b = job_ports("1234"), job_ports("1235")
    assert a[1] == a[0] + 1 and set(a).isdisjoint(b) and job_ports("1234") == a  # a requeue keeps them
    assert all(20000 <= p < 30000 for p in a + b)


def test_run_secret_reaches_children_on_a_pipe_never_in_their_environment(tmp_path):
    from launch.config import save_run_config
    from launch.lifeline import RUN_SECRET, RUN_SECRET_FD, secret_pipe, with_run_secret

    cfg = load_run_config(["cluster=cpu", "transport.control.secret=s3cret", f"loop.run_dir={tmp_path}"])
    path = save_run_config(cfg, tmp_path / "run_config.yaml")
    assert "s3cret" not in path.read_text() and "s3cret" not in repr(cfg)
    assert path.stat().st_mode & 0o777 == 0o600  # it names the control store's port
    specs = process_specs(cfg, path, num_gpus=0, base_env={}, secret="s3cret")
    assert all(s.secret == "s3cret" and "s3cret" not in " ".join(s.argv) + repr(s) for s in specs)
    assert not any("s3cret" in v for s in specs for v in s.env.values())
    env = {RUN_SECRET_FD: str(secret_pipe("s3cret")), "OTHER": "1"}  # what Launcher._start hands over
    child = with_run_secret(load_run_config([], config_file=path), env)
    assert child.transport.control.secret == "s3cret" and env == {"OTHER": "1"}  # grandchildren never see it
    env = {RUN_SECRET: "by hand"}  # a process started by hand may still pass it in its environment
    assert with_run_secret(cfg, env).transport.control.secret == "by hand" and not env
