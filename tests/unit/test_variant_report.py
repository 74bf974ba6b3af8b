"""``tools/variant_report.py`` on records built here: the staleness sweep (case x max staleness,
sync's eta-0 value as the reference row) is what the study's verdict is read from, so its cells
are checked against the runs they summarize; a one-staleness record gets no sweep; a record of
a study cut short names the runs it lacks; the page is its own list of records (a new one goes
first, a rerun redraws the same page, a record gone missing is named)."""

from __future__ import annotations

import json
import statistics

import pytest

from tools import variant_report


def _stat(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "of": len(values)}


def _case(variant: str, eta: int, finals: list[float]) -> dict:
    runs = [{"seed": i, "final_accuracy": f, "train": [{"staleness_mean": 0.5, "selected_hist": [3.0, 1.0]}],
             "curve": [[0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [10, 1280.0, 5.0, f, 1280.0, f, f / 2]]}
            for i, f in enumerate(finals)]
    none = {"mean": None, "std": None, "n": 0, "of": len(finals)}
    return {"variant": variant, "max_staleness": eta, "runs": runs, "final_accuracy": _stat(finals),
            "samples_to_target": none, "wall_seconds": _stat([10.0] * len(finals)),
            "staleness_mean": _stat([0.5] * len(finals)), "initial_accuracy": _stat([0.0] * len(finals)),
            "train_reward_last": _stat(finals)}


def _record(cases: list[dict]) -> dict:
    return {"benchmark": "variant_study", "device": "cpu", "date": "2026-11-25T13:00:00+00:00",
            "commit": "0123456789abcdef",
            "config": {"target": 0.5, "size": "tiny", "steps": 10, "metric": "greedy", "eval_samples": 4},
            "metrics": {f"{c['variant']}_eta{c['max_staleness']}": c for c in cases}}


def test_the_sweep_table_puts_each_case_under_its_staleness_beside_sync(tmp_path):
    record = _record([_case("sync", 0, [0.08, 0.09, 0.07]), _case("darl", 4, [0.02, 0.04, 0.03]),
                      _case("async", 1, [0.06, 0.08, 0.07]), _case("async", 4, [0.01, 0.05, 0.03]),
                      _case("darl", 1, [0.10, 0.08, 0.09])])
    rows = variant_report.sweep_table(record).splitlines()
    assert rows[0] == "| case | max staleness 1 | max staleness 4 |"
    assert rows[2] == "| sync (eta 0) | 0.080 ± 0.010 | 0.080 ± 0.010 |"
    assert rows[3] == "| async | 0.070 ± 0.010 | 0.030 ± 0.020 |"  # the study's case order, not the alphabet's
    assert rows[4] == "| darl | 0.090 ± 0.010 | 0.030 ± 0.010 |"
    sampled = variant_report.sweep_table(record, 6).splitlines()  # the sampled column: half, here
    assert sampled[2] == "| sync (eta 0) | 0.040 ± 0.005 | 0.040 ± 0.005 |"
    assert sampled[3] == "| async | 0.035 ± 0.005 | 0.015 ± 0.010 |"

    path = tmp_path / "variant_study_cpu_x.json"
    path.write_text(json.dumps(record))
    doc = tmp_path / "results.md"
    doc.write_text(f"# R\n\nby hand\n\n{variant_report.BEGIN}\nold\n{variant_report.END}\n")
    text = variant_report.render([path], doc)
    assert "by hand" in text and "\nold\n" not in text and "| darl | 0.090 ± 0.010 | 0.030 ± 0.010 |" in text
    assert (tmp_path / "img" / "variant_study_cpu_x_sweep.png").stat().st_size > 0
    assert "![variant_study sweep](img/variant_study_cpu_x_sweep.png)" in text
    assert "| darl | 0.045 ± 0.005 | 0.015 ± 0.005 |" in text  # the sampled sweep follows the greedy one


def test_samples_to_three_quarters_of_syncs_gain_read_from_each_runs_curve():
    """The target is 3/4 of sync's mean gain; a run counts at its first evaluation at or above it,
    a run that never reaches it is left out of the mean and counted in 'reached'."""
    sync, darl = _case("sync", 0, [0.08, 0.08]), _case("darl", 8, [0.07, 0.02])
    for c in (sync, darl):  # start 0.02, then a middle evaluation at 640 samples
        for run in c["runs"]:
            f = run["curve"][-1][3]
            run["curve"] = [[0, 0.0, 0.0, 0.02, 0.0, 0.02, 0.0], [5, 640.0, 2.0, f - 0.01, 0, f - 0.01, 0],
                            [10, 1280.0, 5.0, f, 0, f, 0]]
        c["initial_accuracy"] = _stat([0.02] * len(c["runs"]))
    record = _record([sync, darl])
    target = variant_report.sync_gain_target(record)
    assert target == pytest.approx(0.02 + 0.75 * 0.06)  # 0.065
    assert variant_report.samples_to(sync, target) == {"mean": 640.0, "std": 0.0, "n": 2, "of": 2}
    assert variant_report.samples_to(darl, target) == {"mean": 1280.0, "std": 0.0, "n": 1, "of": 2}
    rows = variant_report.accuracy_table(record).splitlines()
    assert "samples to 0.065 (3/4 of sync's gain) | reached |" in rows[0]
    assert "samples to 0.5" not in rows[0]  # no run reached the study's own target: no column
    assert "| 1280 | 1/2 |" in rows[3]
    flat = _record([_case("sync", 0, [0.0, 0.0]), _case("darl", 8, [0.1, 0.1])])
    assert variant_report.sync_gain_target(flat) is None  # sync gained nothing: no such target
    assert "3/4" not in variant_report.accuracy_table(flat)


def test_the_final_accuracy_carries_a_95_percent_t_interval_over_seeds():
    """Five seeds 0.10..0.18: mean 0.14, sd sqrt(0.001), half-width t(0.975, 4) = 2.776 times
    sd / sqrt(5) = 0.0393 (a normal quantile would give 0.0277, a wrong df 0.0351 or 0.0453)."""
    ci = variant_report.t_interval([0.10, 0.12, 0.14, 0.16, 0.18, None])
    assert (ci["n"], ci["of"]) == (5, 6) and ci["mean"] == pytest.approx(0.14)
    assert ci["half"] == pytest.approx(2.776 * 0.001 ** 0.5 / 5 ** 0.5, rel=1e-9)
    assert (ci["lo"], ci["hi"]) == (pytest.approx(0.14 - 0.039259, abs=1e-6), pytest.approx(0.14 + 0.039259, abs=1e-6))
    assert variant_report.t_interval([0.0, 1.0])["half"] == pytest.approx(12.706 * 0.5)  # df 1
    assert variant_report.t_interval([0.3])["half"] is None  # one seed: no interval
    many = [0.0, 1.0] * 20 + [0.5]  # df 40: 1.96 + 2.4 / 40 = 2.02 (exact 2.021)
    got = variant_report.t_interval(many)
    assert got["half"] / (statistics.stdev(many) / len(many) ** 0.5) == pytest.approx(2.021, abs=0.002)

    record = _record([_case("sync", 0, [0.20, 0.20]), _case("darl_keta", 8, [0.10, 0.12, 0.14, 0.16, 0.18])])
    record["metrics"]["darl_keta_eta8"]["window_k"] = 9
    rows = variant_report.accuracy_table(record).splitlines()
    assert rows[0].startswith("| case | max staleness | K | seeds | test acc. start | test acc. final [95% CI] |")
    # the gap to sync pairs seeds 0 and 1 (sync has no seed 2-4): -0.10, -0.08, t(0.975, 1) = 12.706
    assert rows[3].startswith("| darl_k9 | 8 | 9 | 5 | 0.000 ± 0.000 | 0.140 [0.101, 0.179] | "
                              "-0.090 [-0.217, +0.037] (2 of 5 paired) |")


def test_the_gap_to_sync_pairs_the_runs_of_one_seed_and_one_warm_start():
    """Seeds far apart (0.10-0.30) and a case 0.02-0.04 under sync in each: the paired interval
    excludes 0 where the two cases' own intervals overlap widely. A run whose seed has no sync
    run, or whose block fitted another warm start, pairs with nothing."""
    sync = _case("sync", 0, [0.20, 0.10, 0.30, 0.25])
    case = _case("async", 8, [0.17, 0.08, 0.26, 0.5, 0.9])
    for r in sync["runs"] + case["runs"]:
        r["warmstart"] = "task-a:fit1"
    case["runs"][3]["warmstart"] = "task-a:fit2"  # seed 3's block on another machine
    case["runs"][4]["seed"] = 7
    gap = variant_report.paired_gap(case, sync)
    assert (gap["n"], gap["of"], gap["mean"]) == (3, 5, pytest.approx(-0.03))
    assert gap["half"] == pytest.approx(4.303 * 0.01 / 3 ** 0.5, rel=1e-6) and gap["hi"] < 0
    assert variant_report.t_interval([0.20, 0.10, 0.30])["half"] > 0.2  # unpaired: 0.248 each side
    row = variant_report.accuracy_table(_record([sync, case])).splitlines()[3]
    assert "| -0.030 [-0.055, -0.005] (3 of 5 paired) |" in row
    assert variant_report.paired_gap(case, None)["mean"] is None


def test_a_missing_cell_reads_as_a_dash_and_one_staleness_has_no_sweep(tmp_path):
    record = _record([_case("sync", 0, [0.08, 0.09]), _case("async", 1, [0.06, 0.08]),
                      _case("darl_twice", 8, [0.05, 0.07])])
    assert "| darl_twice | - | 0.060 ± 0.014 |" in variant_report.sweep_table(record)
    single = _record([_case("sync", 0, [0.08]), _case("async", 8, [0.05])])
    assert variant_report.sweep(single, tmp_path / "r.json", tmp_path / "results.md") == ""
    assert not (tmp_path / "img" / "r_sweep.png").exists()


def test_a_record_of_a_study_cut_short_names_the_runs_it_lacks(tmp_path):
    record = _record([_case("sync", 0, [0.08, 0.09]), _case("darl_twice", 8, [0.05, 0.07])])
    record["config"]["left_out"] = ["darl_eta8_s0", "darl_eta8_s1"]
    text = variant_report.section(record, tmp_path / "r.json", tmp_path / "r.png", tmp_path / "results.md")
    assert "Not finished, so not in the record: darl_eta8_s0, darl_eta8_s1.\n" in text
    record["config"].pop("left_out")
    assert "Not finished" not in variant_report.section(record, tmp_path / "r.json", tmp_path / "r.png",
                                                        tmp_path / "results.md")


def test_the_page_keeps_the_records_it_shows_and_puts_a_new_one_first(tmp_path):
    results, doc = tmp_path / "results", tmp_path / "docs" / "results.md"
    results.mkdir()
    doc.parent.mkdir()
    doc.write_text(f"# Results\n\nwritten by hand\n\n{variant_report.BEGIN}\n{variant_report.END}\n\ntail\n")
    names = []
    for i, final in enumerate([0.08, 0.09, 0.10]):
        names.append(f"variant_study_cpu_2026112{i}T000000.json")
        (results / names[-1]).write_text(json.dumps(_record([_case("sync", 0, [final, final])])))
    argv = ["--doc", str(doc), "--results", str(results)]
    variant_report.main([str(results / names[0]), str(results / names[1]), *argv])
    variant_report.main([str(results / names[2]), *argv])  # a new study: first, the others kept
    assert variant_report.shown(doc, results) == [results / n for n in (names[2], names[0], names[1])]
    before = doc.read_text()
    variant_report.main(argv)  # a plain rerun redraws the same page
    assert doc.read_text() == before and "written by hand" in before and before.endswith("tail\n")
    variant_report.main([str(results / names[1]), "--only", *argv])
    assert variant_report.shown(doc, results) == [results / names[1]]
    (results / names[1]).unlink()  # a record the page shows is gone: say which, change nothing
    with pytest.raises(SystemExit, match=names[1]):
        variant_report.main(argv)
    assert names[1] in doc.read_text()


def test_a_case_is_apart_from_sync_only_where_both_accuracies_put_it_there():
    """Greedy 0.02-0.04 under sync in each of three seeds; sampled (``curve`` column 6) 0.02-0.03
    under in one case, scattered around sync's in another: only the first is "below"."""
    sync = _case("sync", 0, [0.20, 0.10, 0.30])
    both = _case("async", 8, [0.17, 0.08, 0.26])
    greedy_only = _case("decoupled", 8, [0.17, 0.08, 0.26])
    for case, sampled in ((sync, [0.10, 0.05, 0.15]), (both, [0.08, 0.025, 0.12]), (greedy_only, [0.14, 0.02, 0.15])):
        for run, value in zip(case["runs"], sampled):
            run["curve"][-1][6] = value
    gaps = [variant_report.paired_gap(both, sync), variant_report.paired_gap(both, sync, variant_report.SAMPLED)]
    assert gaps[1]["mean"] == pytest.approx(-0.025) and gaps[1]["hi"] < 0
    assert variant_report.apart(gaps) == "below"
    mixed = [variant_report.paired_gap(greedy_only, sync), variant_report.paired_gap(greedy_only, sync, 6)]
    assert mixed[0]["hi"] < 0 < mixed[1]["hi"] and variant_report.apart(mixed) == "-"
    assert variant_report.apart([{**gaps[0], "lo": 0.01, "hi": 0.05}, {**gaps[1], "lo": 0.01, "hi": 0.02}]) == "above"
    assert variant_report.apart([gaps[0], {"mean": -0.02, "half": None}]) == "-"  # one pair: no interval
    rows = variant_report.accuracy_table(_record([sync, both, greedy_only])).splitlines()
    assert "| sampled vs sync, paired [95% CI] | apart from sync (both) |" in rows[0]
    assert rows[2].split(" | ")[5:8] == ["-", "-", "-"]  # sync's own row
    assert rows[3].startswith("| async |") and "| -0.025 [" in rows[3] and "| below |" in rows[3]
    assert rows[4].startswith("| decoupled |") and rows[4].split(" | ")[7] == "-"
    greedy_only_record = _record([sync, both])
    del greedy_only_record["config"]["eval_samples"]  # no sampled accuracy: no such columns
    assert "apart from sync" not in variant_report.accuracy_table(greedy_only_record)
