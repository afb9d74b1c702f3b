"""Nothing is lost: SIGTERM and Ctrl-C stop ``slime-rc train`` cleanly, no worker outlives the
launcher (even a SIGKILLed one), and a previous run's TensorBoard, wandb and dump files are guarded like its
``metrics.jsonl``.  Real runs of ``python -m slime_rc train`` and real signals; no mocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slime_rc.demo.train.launch import check_output_dir, previous_run_files, remove_previous_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 100000  # far more than a test waits for: the run is mid-way when the signal comes
SMALL = ["--prompts-per-step", "4", "--group-size", "2", "--micro-batches", "2"]
START_S = 180  # bound on the start-up (imports, spawning) on a loaded 2-core CI machine
STOP_S = 30  # bound on stopping: the run stops in a few seconds


class Run:
    """``python -m slime_rc train`` in its own session (so the test can play the terminal's Ctrl-C on its process
    group), stdout and stderr to files (a pipe nobody reads would block the run)."""

    def __init__(self, tmp_path, *args):
        self.out = tmp_path / "run"
        self.stdout, self.stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "slime_rc", "train", *SMALL, "--num-steps",
                                          str(STEPS), "--output-dir", str(self.out), *args],
                                         stdout=out, stderr=err, cwd=ROOT, start_new_session=True)

    def wait_for_lines(self, n: int = 1) -> None:
        """Until ``metrics.jsonl`` holds ``n`` complete lines."""
        path, deadline = self.out / "metrics.jsonl", time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr.read_text()[-3000:]
            if path.exists() and path.read_bytes().count(b"\n") >= n:
                return
            time.sleep(0.05)
        pytest.fail(f"no metrics line within {START_S} s: {self.stderr.read_text()[-3000:]}")

    def wait(self) -> float:
        """Seconds until the launcher exited (bounded)."""
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_S} s after the signal: {self.stderr.read_text()[-3000:]}")
        return time.monotonic() - t0

    def kill_all(self) -> None:
        """Clean-up whatever the test's outcome: the session's processes."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture
def runs():
    started = []
    yield lambda *a: started.append(Run(*a)) or started[-1]
    for run in started:
        run.kill_all()


def _state(pid: int):
    """The process's state letter (``/proc/PID/stat``); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _running(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")  # a zombie has exited (it waits only to be reaped)


def _descendants(pid: int):
    """Every live process below ``pid`` (``/proc``'s parent pids)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return [p for p in found if _running(p)]


def _workers(run: Run, n: int):
    """The ``n`` spawned workers of ``run`` (and whatever else the launcher started), once they are all up."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        procs = _descendants(run.proc.pid)
        workers = [p for p in procs if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        if len(workers) >= n:
            return procs
        time.sleep(0.05)
    pytest.fail(f"{n} workers did not start")


def _wait_gone(pids, within: float):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.05)
    return [(p, _state(p)) for p in pids if _running(p)]


def _complete_lines(run: Run):
    """metrics.jsonl: every line complete JSON (the file ends with a newline), steps 0, 1, ... in order."""
    data = (run.out / "metrics.jsonl").read_bytes()
    assert data.endswith(b"\n"), data[-200:]
    rows = [json.loads(line) for line in data.decode().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows))) and rows
    config = json.loads((run.out / "config.json").read_text())
    assert config["settings"]["num_steps"] == STEPS
    return rows


def _interrupted_line(run: Run, name: str, logged: int) -> str:
    """The one line on stderr that says where the run stopped; no traceback, no 'done:'."""
    err = run.stderr.read_text()
    assert "Traceback" not in err, err[-3000:]
    assert "done:" not in run.stdout.read_text()
    lines = [x for x in err.splitlines() if x.startswith("slime-rc train:")]
    assert len(lines) == 1, err[-3000:]
    # the signal may come while step `logged + 1` runs or just after its line: never a step not yet logged
    metrics = run.out / "metrics.jsonl"
    steps = ("steps 1-%d finished and are logged, each a complete line" % logged if logged > 1
             else "step 1 finished and is logged, a complete line")
    assert lines[0] == (f"slime-rc train: interrupted by {name} at step {logged + 1}/{STEPS}: {steps}, in {metrics}; "
                        f"to run again into {run.out} add --overwrite, or give a fresh --output-dir"), lines[0]
    return lines[0]


def test_sigterm_stops_a_run_cleanly_and_its_files_are_kept(tmp_path, runs):
    """SIGTERM (a scheduler's stop, `kill PID`): exit 143 within seconds, every metrics line whole, one line naming
    the step; the stopped run's directory is then a previous run's, refused to the next launch."""
    run = runs(tmp_path)
    run.wait_for_lines(1)
    run.proc.send_signal(signal.SIGTERM)
    took = run.wait()
    assert run.proc.returncode == 128 + signal.SIGTERM, (run.proc.returncode, run.stderr.read_text()[-3000:])
    rows = _complete_lines(run)
    _interrupted_line(run, "SIGTERM", len(rows))
    assert took < STOP_S

    before = {p.name: p.read_bytes() for p in run.out.iterdir()}
    again = subprocess.run([sys.executable, "-m", "slime_rc", "train", *SMALL, "--num-steps", "1", "--output-dir",
                            str(run.out)], capture_output=True, text=True, cwd=ROOT, timeout=START_S)
    assert again.returncode == 2, again.stderr[-3000:]
    assert f"--output-dir {run.out} already holds a previous run's metrics.jsonl and config.json;" in again.stderr
    assert {p.name: p.read_bytes() for p in run.out.iterdir()} == before


def test_ctrl_c_stops_a_run_cleanly_and_overwrite_replaces_every_file_of_it(tmp_path, runs):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it): exit 130, whole lines, one line.  Then
    --overwrite replaces all of the stopped run, TensorBoard event files and a --dump-logprobs dump included."""
    dump = tmp_path / "dump"
    run = runs(tmp_path, "--dump-logprobs", str(dump))
    run.wait_for_lines(2)
    os.killpg(run.proc.pid, signal.SIGINT)
    run.wait()
    assert run.proc.returncode == 128 + signal.SIGINT, (run.proc.returncode, run.stderr.read_text()[-3000:])
    rows = _complete_lines(run)
    _interrupted_line(run, "SIGINT (Ctrl-C)", len(rows))
    old_events = sorted(p.name for p in run.out.glob("events.out.tfevents.*"))
    old_dumps = sorted(p.name for p in dump.glob("step_*.jsonl"))
    assert len(old_dumps) >= len(rows) >= 2 and not list(dump.glob(".step_*"))  # dumps are atomic too
    (run.out / "notes.txt").write_text("mine\n")  # not a run's file: --overwrite leaves it

    again = subprocess.run([sys.executable, "-m", "slime_rc", "train", *SMALL, "--num-steps", "1", "--output-dir",
                            str(run.out), "--dump-logprobs", str(dump), "--overwrite"],
                           capture_output=True, text=True, cwd=ROOT, timeout=START_S)
    assert again.returncode == 0, again.stderr[-3000:]
    note = [x for x in again.stdout.splitlines() if x.startswith("note: --overwrite: removed")]
    assert len(note) == 1 and all(name in note[0] for name in ["metrics.jsonl", "config.json", *old_events,
                                                               *old_dumps]), again.stdout
    assert [json.loads(x)["step"] for x in (run.out / "metrics.jsonl").read_text().splitlines()] == [0]
    assert json.loads((run.out / "config.json").read_text())["settings"]["num_steps"] == 1
    new_events = sorted(p.name for p in run.out.glob("events.out.tfevents.*"))
    assert not set(new_events) & set(old_events)  # the old curves are gone, not mixed with the new
    assert sorted(p.name for p in dump.glob("step_*.jsonl")) == ["step_000000.jsonl"]
    assert (run.out / "notes.txt").read_text() == "mine\n"


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path, runs):
    """--nproc 2: SIGTERM to the launcher alone stops both workers (it sends them SIGTERM, SIGKILL after a grace);
    rank 0 closes metrics.jsonl on a whole line and says where; no process of the run is left."""
    run = runs(tmp_path, "--nproc", "2")
    procs = _workers(run, 2)
    run.wait_for_lines(1)
    run.proc.send_signal(signal.SIGTERM)
    run.wait()
    assert run.proc.returncode == 128 + signal.SIGTERM, (run.proc.returncode, run.stderr.read_text()[-3000:])
    assert _wait_gone(procs, 5) == []
    rows = _complete_lines(run)
    _interrupted_line(run, "SIGTERM", len(rows))


def test_workers_do_not_outlive_a_sigkilled_launcher(tmp_path, runs):
    """--nproc 2: the launcher SIGKILLed (no handler runs in it) -- its workers get SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and stop within seconds, rank 0 on a whole line; none runs on as an orphan."""
    run = runs(tmp_path, "--nproc", "2")
    procs = _workers(run, 2)
    run.wait_for_lines(1)
    run.proc.send_signal(signal.SIGKILL)
    run.wait()
    assert run.proc.returncode == -signal.SIGKILL
    assert _wait_gone(procs, 10) == [], [open(f"/proc/{p}/cmdline", "rb").read()[:200] for p in procs if _running(p)]
    rows = _complete_lines(run)
    _interrupted_line(run, "SIGTERM", len(rows))  # rank 0 still says where the run stopped


# ---------------------------------------------------------------------------------------------------------------
# a previous run's other files: TensorBoard, wandb, a --dump-logprobs dump
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("left, words", [
    ("events.out.tfevents.1795433217.host.123.0", "TensorBoard event file (events.out.tfevents.*)"),
    ("wandb/offline-run-20261123_120000-abc/run-abc.wandb", "wandb/ folder"),
])
def test_tensorboard_or_wandb_files_alone_make_a_previous_run(tmp_path, left, words):
    (tmp_path / left).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / left).write_bytes(b"curves")
    with pytest.raises(ValueError) as e:
        check_output_dir(str(tmp_path), overwrite=False)
    assert str(e.value) == (f"--output-dir {tmp_path} already holds a previous run's {words}; give a fresh "
                            f"--output-dir, or add --overwrite to replace them")
    check_output_dir(str(tmp_path), overwrite=True)
    assert (tmp_path / left).read_bytes() == b"curves"  # the check itself never removes anything


def test_a_previous_dump_is_refused_unless_overwrite(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "README").write_text("mine\n")
    check_output_dir(None, overwrite=False, dump_dir=str(dump))  # no step files: not a dump
    for step in range(3):
        (dump / f"step_{step:06d}.jsonl").write_text("{}\n")
    with pytest.raises(ValueError) as e:
        check_output_dir(None, overwrite=False, dump_dir=str(dump))
    assert str(e.value) == (f"--dump-logprobs {dump} already holds a previous dump (3 step_NNNNNN.jsonl files); "
                            f"give a fresh --dump-logprobs directory, or add --overwrite to replace them")
    check_output_dir(None, overwrite=True, dump_dir=str(dump))


def test_overwrite_removes_the_previous_runs_files_and_nothing_else(tmp_path):
    out, dump = tmp_path / "run", tmp_path / "dump"
    for name in ["metrics.jsonl", "config.json", "events.out.tfevents.1.host.1.0", "events.out.tfevents.2.host.2.0",
                 "wandb/latest-run/run-x.wandb", "notes.txt", "plots/curves.png"]:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    for name in ["step_000000.jsonl", "step_000001.jsonl", "README"]:
        dump.mkdir(exist_ok=True)
        (dump / name).write_text("x")
    removed = remove_previous_run(str(out), str(dump))
    assert sorted(os.path.relpath(p, tmp_path) for p in removed) == sorted(
        ["run/metrics.jsonl", "run/config.json", "run/events.out.tfevents.1.host.1.0",
         "run/events.out.tfevents.2.host.2.0", "run/wandb", "dump/step_000000.jsonl", "dump/step_000001.jsonl"])
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "dump/README", "run/notes.txt", "run/plots/curves.png"]
    assert previous_run_files(str(out)) == []
    check_output_dir(str(out), overwrite=False, dump_dir=str(dump))  # a fresh directory now
