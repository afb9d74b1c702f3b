"""``slime-rc train`` does each thing once: one rollout correction per decoupled step (the samples the
correction keeps come from ``prepare_global_batch``'s result, not from a second correction of the global batch), the
configuration resolved once in the launcher and handed to the workers, the ``--custom-tis-function-path`` function
loaded once per process.  Counted by wrapping each function wherever a loaded module binds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3


def count_calls(function) -> list:
    """Wrap ``function`` in every loaded module that binds it (its own module, the package re-exports, the
    ``from x import f`` copies); each call appends to the returned list.  For a throwaway process only: nothing is
    restored."""
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is function:
                setattr(module, name, counted)
    return calls


def corrections_per_step(rank, world, mode):
    """``run_training`` in ``mode`` with rejection: the number of ``compute_rollout_correction`` calls of each
    step, and the metrics."""
    import slime_rc
    import slime_rc.demo.train.loop  # noqa: F401 - bind the function everywhere before wrapping it
    import slime_rc.megatron.loss  # noqa: F401
    from slime_rc import RolloutCorrectionConfig, parse_rejection_criteria
    from slime_rc.demo.train.loop import TrainSettings, run_training

    calls = count_calls(slime_rc.compute_rollout_correction)
    config = RolloutCorrectionConfig(mode=mode, is_level="token", is_batch_normalize=True,
                                     rs=parse_rejection_criteria("token", 1.05))
    settings = TrainSettings(num_steps=STEPS, prompts_per_step=8, group_size=4, micro_batches=2, logit_noise=0.3,
                             rollout_dtype="fp32")
    per_step, history = [], []

    def on_step(metrics):
        per_step.append(len(calls) - sum(per_step))
        history.append(metrics)
    run_training(settings, config, on_step)
    return per_step, history


def test_one_correction_per_decoupled_step():
    """Decoupled mode: the pre-step correction of the global batch is the only one; its keep mask is the one the
    group baselines use (rejection happened: kept_fraction < 1)."""
    (per_step, history), = run_distributed(corrections_per_step, 1, args=("decoupled",), timeout=300)
    assert per_step == [1] * STEPS, per_step
    assert all(0 < m["kept_fraction"] < 1 for m in history), [m["kept_fraction"] for m in history]
    assert all(m["rollout_corr/rollout_rs_masked_fraction"] > 0 for m in history)


def launch_counts(argv) -> dict:
    """``slime-rc train`` in this process (``--nproc 1``: the worker runs here too): how often the configuration
    was resolved and the TIS function loaded."""
    import slime_rc.config.arguments as arguments
    import slime_rc.demo.train.launch as launch
    import slime_rc.plugins as plugins

    resolutions = count_calls(arguments.resolve_args)
    loads = count_calls(plugins.load_function)
    code = launch.main(list(argv))
    return {"code": code, "resolutions": len(resolutions), "loads": len(loads)}


def _launch(args):
    script = f"import json, sys; from tests.demo.test_train_once import launch_counts; " \
             f"print('COUNTS', json.dumps(launch_counts({list(args)!r})))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COUNTS "))
    return json.loads(line[len("COUNTS "):]), proc.stdout


def test_launch_resolves_the_configuration_once_and_loads_the_tis_function_once(tmp_path):
    counts, out = _launch(["--nproc", "1", "--num-steps", "2", "--prompts-per-step", "4", "--group-size", "2",
                           "--use-tis", "--logit-noise", "0.5", "--custom-tis-function-path", "mis",
                           "--output-dir", str(tmp_path)])
    assert counts == {"code": 0, "resolutions": 1, "loads": 1}, counts
    assert "done: mean reward" in out
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and any(k.startswith("rollout_corr/tis_function/") for k in rows[0]), sorted(rows[0])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rollout_correction"]["is_level"] == "token" and config["sources"]["is_level"] == "--use-tis"


def test_spawned_workers_get_the_resolved_configuration_and_load_the_tis_function_there(tmp_path):
    """``--nproc 2``: the workers run with the launcher's configuration and load the function from its spec, once
    each (a function from a file has no importable name: it cannot be pickled to them).  The plugin file writes its
    process id each time it is executed: the launcher and the two workers, once each."""
    log = tmp_path / "loads.txt"
    plugin = tmp_path / "my_tis.py"
    plugin.write_text("import os\n"
                      "from custom_tis.mis import compute_mis_weights_with_cp\n"
                      f"with open({str(log)!r}, 'a') as f:\n"
                      "    f.write(f'{os.getpid()}\\n')\n\n\n"
                      "def weights(args, **kwargs):\n"
                      "    return compute_mis_weights_with_cp(args, **kwargs)\n")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--nproc", "2", "--num-steps", "1",
                           "--prompts-per-step", "4", "--group-size", "2", "--micro-batches", "2", "--use-tis",
                           "--custom-tis-function-path", f"{plugin}:weights", "--output-dir", str(run)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = log.read_text().split()
    assert len(pids) == 3 == len(set(pids)), pids
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and any(k.startswith("rollout_corr/tis_function/") for k in rows[0]), sorted(rows[0])
    config = json.loads((run / "config.json").read_text())
    assert config["rollout_correction"]["is_level"] == "token" and config["sources"]["is_level"] == "--use-tis"


def test_a_bad_tis_function_fails_the_launch():
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--custom-tis-function-path",
                           "no_such_module_xyz.fn"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "argument --custom-tis-function-path" in proc.stderr and "no_such_module_xyz" in proc.stderr
    assert "slime-rc train:" not in proc.stdout  # nothing started
