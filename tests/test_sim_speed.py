"""The machine's speed between a profile's fit and the real runs it is validated against
(`tiderl.sim.speed`): a profile scaled to a slower machine, the factor from the probes, and
the probe itself (real compiled JAX)."""

import json

import pytest

from tiderl.sim.costs import load_profile


def test_a_scaled_profile_prices_every_operation_that_much_slower():
    p = load_profile("cpu-fitted")
    s = p.scaled(1.25)
    work = {"flops": 3e9, "hbm": 2e8}
    for name, op in p.ops.items():
        assert s.op(name)(**work) == pytest.approx(1.25 * op(**work)), name
    assert s.host["lock_wait_s"] == pytest.approx(1.25 * p.host["lock_wait_s"])
    assert s.host["capacity"] == p.host["capacity"]  # cores are a ratio, not a time
    assert p.scaled(1.0).ops == p.ops
    with pytest.raises(ValueError, match="speed factor 0 must be positive"):
        p.scaled(0)


def test_the_factor_is_the_runs_median_probe_over_the_calibrations():
    from tiderl.sim.speed import speed_factor

    notes = {"speed_probe": {"seconds": 0.010}}
    assert speed_factor(notes, [0.012, 0.013, 0.011, 0.014, 0.0125]) == pytest.approx(1.25)
    assert speed_factor({}, [0.012]) is None  # a profile fitted before the probe
    assert speed_factor(notes, []) is None  # runs recorded before the probe
    assert speed_factor(notes, [0.0, None]) is None


def test_a_slower_machine_simulates_a_slower_job(tmp_path):
    """The pressure job, whose engine sets the pace (env latency at 2 ms): 1.5x the costs is
    nearly 1.5x the wall time (the env's injected latencies do not scale)."""
    from tiderl.sim.validate import run_config, simulate

    fast = simulate(run_config("sync", 2, 0, str(tmp_path / "a"), "pressure"), "cpu-fitted",
                    charge_cpu=False)
    slow = simulate(run_config("sync", 2, 0, str(tmp_path / "b"), "pressure"), "cpu-fitted",
                    charge_cpu=False, speed=1.5)
    assert 1.3 * fast["summary"]["wall_s"] < slow["summary"]["wall_s"] \
        < 1.5 * fast["summary"]["wall_s"] + 1e-6


def test_reused_runs_carry_their_probes_into_the_comparison(tmp_path, capsys):
    """`--reuse-real` on saved runs with probes: the simulated side is priced at the runs'
    speed, and the factor is reported."""
    import yaml

    from tiderl.sim import validate
    from tiderl.sim.costs import PROFILES

    d = yaml.safe_load((PROFILES / "cpu-fitted.yaml").read_text())
    d.setdefault("notes", {})["speed_probe"] = {"seconds": 0.010}
    prof = tmp_path / "prof.yaml"
    prof.write_text(yaml.safe_dump(d))
    runs = tmp_path / "runs"
    runs.mkdir()
    for mode in validate.MODES:  # one simulated run per mode stands in for a real one
        cfg = validate.run_config(mode, 2, 0, str(tmp_path / mode))
        r = validate.simulate(cfg, "cpu-fitted", charge_cpu=False)
        r.update(real_s=1.0, trace={}, probe_s=[0.012, 0.013])
        validate.save_real(r, runs / f"{mode}-0.json")
    assert validate.main(["--steps", "2", "--seeds", "1", "--reuse-real", "--real-dir",
                          str(runs), "--profile", str(prof.with_suffix(""))]) == 0
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert head["speed_factor"] == pytest.approx(1.25)
    assert validate.main(["--steps", "2", "--seeds", "1", "--reuse-real", "--real-dir",
                          str(runs), "--profile", str(prof.with_suffix("")),
                          "--no-speed"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["speed_factor"] is None


def test_the_probe_times_one_fixed_microbatch():
    from tiderl.config import load_config
    from tiderl.sim.calibrate import VALIDATION_OVERRIDES
    from tiderl.sim.speed import SpeedProbe

    # The test process's JAX has the suite's 8 fake devices already.
    probe = SpeedProbe(load_config(None, VALIDATION_OVERRIDES + [
        "run_dir=/tmp/t-probe", "cluster.fake_cpu_devices=8"]))
    try:
        assert probe.mb.tokens_bt.shape == (16, 128) and probe.mb.n_seqs == 21
        assert 0 < probe(calls=3) < 5.0
    finally:
        probe.close()


def test_the_calibration_fits_every_sample_at_one_speed():
    """A sample timed while the machine ran slow counts at the median probe's speed."""
    from tiderl.sim.calibrate import at_one_speed, speed_note

    eng = {"samples": {"prefill": [([{}], 0.004, {"probe_s": 0.010}),
                                   ([{}], 0.006, {"probe_s": 0.015})]}}
    tr = {"samples": {"ref_forward": [([{}], 0.020, {"probe_s": 0.020}),
                                      ([{}], 0.010, {})]}}  # not probed: kept as timed
    probes = at_one_speed(eng, tr)
    assert sorted(probes) == [0.010, 0.015, 0.020]
    assert [y for _, y, _ in eng["samples"]["prefill"]] == pytest.approx([0.006, 0.006])
    assert [y for _, y, _ in tr["samples"]["ref_forward"]] == pytest.approx([0.015, 0.010])
    assert speed_note(probes)["seconds"] == 0.015
    assert at_one_speed({"samples": {"decode": [([{}], 0.001, {})]}}) == []
