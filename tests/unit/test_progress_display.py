"""What a user sees of a run's steps: the bar names the variant run, the log counts steps from 1
as the checkpoints do, and a step that received no new sample reads as such (never reward 0) in
the bar, the log and progress.png."""

import logging

from megatron_darl.loop.config import LoopConfig
from megatron_darl.loop.metrics import MetricsLogger
from megatron_darl.loop.plots import progress_figure

FED = {"reward_mean": 0.5, "staleness_mean": 1.0, "samples_received": 8.0, "samples_selected": 8.0,
       "selected_mean": 1.0, "selected_hist": [1.0, 1.0], "trainer_tokens_per_s": 10.0}
EMPTY = {"reward_mean": 0.0, "staleness_mean": 0.0, "samples_received": 0.0, "samples_selected": 8.0,
         "selected_mean": 2.0, "selected_hist": [0.0, 0.0, 2.0], "trainer_tokens_per_s": 10.0}


def test_log_lines_count_from_one_and_say_no_new_samples(tmp_path, caplog):
    cfg = LoopConfig(steps=3, run_dir=str(tmp_path), progress_bar=False, tensorboard=False, plot=False)
    logger = MetricsLogger(cfg, {"algorithm": {"variant": "decoupled"}})
    with caplog.at_level(logging.INFO, logger="megatron_darl.loop.metrics"):
        for step, rec in enumerate((FED, EMPTY, FED)):
            logger.log(step, rec)
    logger.close()
    lines = [r.getMessage() for r in caplog.records if " step " in r.getMessage()]
    assert [ln.split(" reward")[0] for ln in lines] == ["decoupled step 1/3", "decoupled step 2/3",
                                                         "decoupled step 3/3"]
    assert "reward 0.500" in lines[0] and "no new samples" in lines[1] and "0.000" not in lines[1]


def test_bar_names_the_variant_and_marks_an_empty_step(tmp_path):
    cfg = LoopConfig(steps=2, run_dir=str(tmp_path), progress_bar=True, tensorboard=False, plot=False)
    logger = MetricsLogger(cfg, {"algorithm": {"variant": "sync"}})
    assert logger._bar.desc.startswith("sync")
    logger.log(0, EMPTY)
    assert "reward=-  (no new samples)" in logger._bar.postfix and "0.000" not in logger._bar.postfix
    logger.log(1, FED)
    assert "reward=0.500" in logger._bar.postfix
    logger.close()


def test_plot_leaves_empty_steps_out_of_the_reward_and_marks_them():
    history = [{"step": i, **(EMPTY if i == 2 else FED)} for i in range(4)]
    fig = progress_figure(history)
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert list(lines["each step"].get_xdata()) == [1, 2, 4]  # steps from 1; step 3 had no sample
    assert 0.0 not in list(lines["each step"].get_ydata())
    assert list(lines["no new samples"].get_xdata()) == [3]
    arriving = {ln.get_label(): ln for ln in fig.axes[1].get_lines()}["arriving samples"]
    assert list(arriving.get_xdata()) == [1, 2, 4]
