"""Bad input: every ``slime-rc train`` launch value is checked
before anything starts, with one line naming the flag, the value and the fix (exit 2, no traceback); SGLang failures
are bounded (a connect timeout of seconds, a request timeout) and said in one line naming the URL and what came back.
Everything runs the real code: the CLI entry point in-process, and the SGLang client against real local sockets and
HTTP servers (no mock of the client)."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from slime_rc.cli import main
from slime_rc.demo.rollout.sglang_client import SGLangEngine, SGLangError, SGLangResponseError, check_sglang_url
from tests.local_http import LocalServer, answer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--micro-batches", "1"]
E = "slime-rc train: error: "


def _refused(capsys, argv, tmp_path=None):
    """``slime-rc train ARGV`` in-process: exit 2, exactly one ``slime-rc train: error:`` line on stderr, nothing on
    stdout (nothing started), nothing written; returns the line."""
    out_dir = tmp_path / "run" if tmp_path is not None else None
    code = main(["train", *argv] + (["--output-dir", str(out_dir)] if out_dir is not None else []))
    captured = capsys.readouterr()
    assert code == 2, (code, captured.err)
    assert "Traceback" not in captured.err and captured.out == "", captured
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(E), captured.err
    assert out_dir is None or not out_dir.exists()
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# finding 1: every launch value is validated at parse time (before: tracebacks from the workers, or silently ignored)
# ---------------------------------------------------------------------------------------------------------------

REFUSED = {
    # the reported ones
    ("--tensor-model-parallel-size", "0"):  # was: ZeroDivisionError in the launcher
        "--tensor-model-parallel-size 0: a parallel size is a number of ranks; give --tensor-model-parallel-size 1 "
        "or more (default 1)",
    ("--micro-batches", "0"):  # was: ZeroDivisionError in the worker
        "--micro-batches 0: a step needs at least one micro-batch; give --micro-batches 1 or more (default 4)",
    ("--group-size", "0"):
        "--group-size 0: each prompt needs at least one sample; give --group-size 1 or more (default 8)",
    ("--lr", "nan"):  # was: torch's 'Invalid learning rate: nan' traceback
        "--lr nan: the learning rate must be a finite number > 0; give e.g. --lr 0.003 (the default)",
    ("--nproc", "-1"):  # was: ran nothing, exit 0
        "--nproc -1: a run needs at least one process; give --nproc 1 or more (default 1)",
    ("--rollout-temperature", "-1"):
        "--rollout-temperature -1.0: the sampling temperature must be a finite number > 0 (the trainer divides its "
        "logits by it); give e.g. --rollout-temperature 1.0 (the default)",
    ("--rollout-temperature", "nan"):
        "--rollout-temperature nan: the sampling temperature must be a finite number > 0 (the trainer divides its "
        "logits by it); give e.g. --rollout-temperature 1.0 (the default)",
    ("--rollout-temperature", "0"):
        "--rollout-temperature 0.0: the sampling temperature must be a finite number > 0 (the trainer divides its "
        "logits by it); give e.g. --rollout-temperature 1.0 (the default)",
    ("--rollout-dtype", "fp8"):
        "--rollout-dtype fp8: not a rollout precision; give one of fp32, bf16, fp16 (default bf16)",
    ("--task", "add"):
        "--task add: not a task; give one of reverse, sort, copy (default copy)",
    ("--rollout-engine", "sglang", "--sglang-url", "localhost:30000"):  # was: 'unknown url type' traceback
        "--sglang-url 'localhost:30000' is not an http(s) URL; give --sglang-url http://host:port (SGLang's default "
        "port is 30000, e.g. http://127.0.0.1:30000)",
    # every other count, size, rate, choice and URL
    ("--pipeline-model-parallel-size", "-2"):
        "--pipeline-model-parallel-size -2: a parallel size is a number of ranks; give "
        "--pipeline-model-parallel-size 1 or more (default 1)",
    ("--context-parallel-size", "0"):
        "--context-parallel-size 0: a parallel size is a number of ranks; give --context-parallel-size 1 or more "
        "(default 1)",
    ("--virtual-pipeline-model-parallel-size", "0"):
        "--virtual-pipeline-model-parallel-size 0: virtual pipeline stages per rank must be 2 or more (with "
        "--pipeline-model-parallel-size 2 or more); give 2, or drop the flag",
    ("--virtual-pipeline-model-parallel-size", "2"):
        "--virtual-pipeline-model-parallel-size 2 needs --pipeline-model-parallel-size 2 or more (got 1); raise the "
        "pipeline size or drop the flag",
    ("--sequence-parallel",):
        "--sequence-parallel needs --tensor-model-parallel-size 2 or more (got 1): it splits activations over the "
        "tensor-parallel group; raise the tensor-parallel size or drop the flag",
    ("--tensor-model-parallel-size", "3", "--nproc", "3"):
        "--tensor-model-parallel-size 3: the model's 4 attention heads and 16-token vocabulary do not split over 3 "
        "ranks; give one of 1, 2, 4",
    ("--tensor-model-parallel-size", "2", "--nproc", "3"):
        "--nproc 3 is not a multiple of tp*pp*cp = 2; data parallel is nproc / (tp*pp*cp)",
    ("--nproc", "0"):
        "--nproc 0: a run needs at least one process; give --nproc 1 or more (default 1)",
    ("--nproc", "2"):  # TINY's one micro-batch cannot be split over two data-parallel ranks
        "--micro-batches 1: 1 micro-batches do not split over the 2 data-parallel ranks (--nproc 2 / tp*pp*cp 1); "
        "give a multiple of 2",
    ("--micro-batches", "3"):
        "--micro-batches 3: the global batch of 2 prompts x 2 samples = 4 does not split into 3 micro-batches; give "
        "a divisor of 4 (e.g. --micro-batches 2)",
    ("--pipeline-model-parallel-size", "2", "--num-layers", "3", "--nproc", "2"):
        "--num-layers 3: does not split over 2 pipeline stages (--pipeline-model-parallel-size 2); give a multiple "
        "of 2",
    ("--num-layers", "0"):
        "--num-layers 0: the model needs a layer; give --num-layers 1 or more (default 2)",
    ("--hidden-size", "6"):
        "--hidden-size 6: not a multiple of the model's 4 attention heads; give a multiple of 4 (default 64)",
    ("--hidden-size", "0"):
        "--hidden-size 0: the model needs a hidden size; give --hidden-size 1 or more (default 64)",
    ("--lr", "-0.1"):
        "--lr -0.1: the learning rate must be a finite number > 0; give e.g. --lr 0.003 (the default)",
    ("--lr", "inf"):
        "--lr inf: the learning rate must be a finite number > 0; give e.g. --lr 0.003 (the default)",
    ("--top-p", "0"):
        "--top-p 0.0: the nucleus mass must be a finite number in (0, 1]; give e.g. --top-p 1.0 (the default)",
    ("--top-p", "1.5"):
        "--top-p 1.5: the nucleus mass must be a finite number in (0, 1]; give e.g. --top-p 1.0 (the default)",
    ("--logit-noise", "nan"):
        "--logit-noise nan: the noise sigma must be a finite number >= 0; give e.g. --logit-noise 0.0 (the default)",
    ("--stale-steps", "-1"):
        "--stale-steps -1: a number of weight syncs; give --stale-steps 0 or more (default 0)",
    ("--digits", "0"):
        "--digits 0: a prompt needs at least one digit; give --digits 1 or more (default 3)",
    ("--prompts-per-step", "0"):
        "--prompts-per-step 0: a step needs at least one prompt; give --prompts-per-step 1 or more (default 32)",
    ("--seed", "-1"):
        "--seed -1: give a seed from 0 to 2147483647 (default 0)",
    ("--seed", "99999999999999999999"):  # was: 'Overflow when unpacking long long' in the worker
        "--seed 99999999999999999999: give a seed from 0 to 2147483647 (default 0)",
    ("--rollout-engine", "sglang"):
        "--rollout-engine sglang needs --sglang-url http://host:port",
    ("--rollout-engine", "sglang", "--sglang-url", "ftp://127.0.0.1:30000"):
        "--sglang-url 'ftp://127.0.0.1:30000' is not an http(s) URL; give --sglang-url http://host:port (SGLang's "
        "default port is 30000, e.g. http://127.0.0.1:30000)",
    ("--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:99999"):
        "--sglang-url 'http://127.0.0.1:99999' is not an http(s) URL (Port out of range 0-65535); give --sglang-url "
        "http://host:port (SGLang's default port is 30000, e.g. http://127.0.0.1:30000)",
    ("--rollout-engine", "sglang", "--sglang-url", "http://"):
        "--sglang-url 'http://' is not an http(s) URL; give --sglang-url http://host:port (SGLang's default port is "
        "30000, e.g. http://127.0.0.1:30000)",
    ("--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:30000/?x=1"):
        "--sglang-url 'http://127.0.0.1:30000/?x=1': give the server's base address only (no query, fragment, "
        "spaces or port 0); give --sglang-url http://host:port (SGLang's default port is 30000, e.g. "
        "http://127.0.0.1:30000)",
    ("--sglang-url", "127.0.0.1"):  # checked whenever given
        "--sglang-url '127.0.0.1' is not an http(s) URL; give --sglang-url http://host:port (SGLang's default port "
        "is 30000, e.g. http://127.0.0.1:30000)",
    ("--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:30000", "--sglang-timeout", "0"):
        "--sglang-timeout 0.0: seconds to wait for SGLang's answer must be a finite number > 0; give e.g. "
        "--sglang-timeout 60.0 (the default)",
}


@pytest.mark.parametrize("argv", list(REFUSED), ids=[" ".join(a) for a in REFUSED])
def test_a_bad_launch_value_is_one_line_naming_flag_value_and_fix(capsys, tmp_path, argv):
    assert _refused(capsys, [*TINY, *argv], tmp_path) == E + REFUSED[argv]


def test_the_interleaved_pipeline_on_gloo_needs_enough_micro_batches(capsys):
    if torch.cuda.is_available():
        pytest.skip("the limit is gloo's (no CUDA)")
    line = _refused(capsys, ["--nproc", "4", "--pipeline-model-parallel-size", "2",
                             "--virtual-pipeline-model-parallel-size", "2", "--num-layers", "4",
                             "--micro-batches", "4"])
    assert line == (E + "--micro-batches 4: the interleaved pipeline (--virtual-pipeline-model-parallel-size 2) on "
                    "gloo needs more than pp = 2 micro-batches per data-parallel rank (got 2); give --micro-batches "
                    "8 or more, a multiple of 2"), line


def test_a_dump_directory_that_is_a_file_is_refused(capsys, tmp_path):
    f = tmp_path / "dump.txt"
    f.write_text("")
    assert _refused(capsys, [*TINY, "--dump-logprobs", str(f)]) == (
        E + f"--dump-logprobs {f} is a file, not a directory; give a directory path")


def test_the_default_launch_values_and_the_edges_pass_the_checks():
    """The checks refuse only what no run can use: the defaults, the documented layouts and the boundary values
    pass."""
    from slime_rc import RolloutCorrectionConfig
    from slime_rc.demo.train.launch import check_layout
    from slime_rc.demo.train.loop import TrainSettings
    for s in (TrainSettings(), TrainSettings(tp=2, pp=2, sequence_parallel=True), TrainSettings(cp=4),
              TrainSettings(top_p=1.0, logit_noise=0.0, stale_steps=0, seed=0, digits=1, group_size=2,
                            prompts_per_step=1, micro_batches=2, vpp=1),
              TrainSettings(pp=2, vpp=2, num_layers=4, micro_batches=8),
              TrainSettings(rollout_engine="sglang", sglang_url="https://sglang.example.org:8443/prefix/")):
        s.check(RolloutCorrectionConfig())
    check_layout(TrainSettings(), nproc=1)
    check_layout(TrainSettings(tp=2, pp=2), nproc=4)
    check_layout(TrainSettings(cp=2), nproc=4)  # dp 2 splits the 4 micro-batches
    check_layout(TrainSettings(cp=2), nproc=1, world=4)  # torchrun: WORLD_SIZE, --nproc ignored
    with pytest.raises(ValueError, match="torchrun's WORLD_SIZE 3 is not a multiple of tp\\*pp\\*cp = 2"):
        check_layout(TrainSettings(tp=2), nproc=1, world=3)


def test_run_training_checks_the_values_too():
    """A caller of :func:`run_training` (no launcher) gets the same message, before any process group work."""
    from slime_rc import RolloutCorrectionConfig
    from slime_rc.demo.train.loop import TrainSettings, run_training
    with pytest.raises(ValueError, match=r"^--micro-batches 0: a step needs at least one micro-batch"):
        run_training(TrainSettings(micro_batches=0), RolloutCorrectionConfig())


# ---------------------------------------------------------------------------------------------------------------
# finding 2: --group-size 1 (every GRPO advantage 0, loss 0, no warning) is refused
# ---------------------------------------------------------------------------------------------------------------

def test_group_size_one_is_refused_because_every_grpo_advantage_would_be_zero(capsys, tmp_path):
    from slime_rc.demo.train.advantages import group_advantages
    # why: the trainer's one advantage estimator normalises each sample against its own group; a group of one has
    # no baseline -- every advantage is 0, whatever the rewards (what the run did silently before)
    assert torch.equal(group_advantages(torch.tensor([0.0, 1.5, 0.7]), 1), torch.zeros(3))
    line = _refused(capsys, ["--num-steps", "1", "--prompts-per-step", "2", "--micro-batches", "1",
                             "--group-size", "1"], tmp_path)
    assert line == (E + "--group-size 1: GRPO advantages compare each sample with the other samples of its prompt, "
                    "so with one sample per prompt every advantage is 0 and nothing is learned; give --group-size 2 "
                    "or more (default 8)"), line


# ---------------------------------------------------------------------------------------------------------------
# finding 3: SGLang failures are bounded and clear -- real sockets and HTTP servers
# ---------------------------------------------------------------------------------------------------------------

class _Server(LocalServer):
    """An HTTP server in a thread on a free port answering every POST with ``status``, ``body`` and
    ``content_type``."""

    def __init__(self, body: bytes, status: int = 200, content_type: str = "application/json"):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                answer(self, status, body, content_type)

            def log_message(self, *args):
                pass

        super().__init__(Handler)


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def _result(logprobs):
    return {"text": "", "meta_info": {"output_token_logprobs": [[lp, 4, None] for lp in logprobs],
                                      "finish_reason": {"type": "length"}}}


HTML = b"<!DOCTYPE html>\n<html><head><title>Welcome to nginx!</title></head>\n<body>It works</body></html>\n"
PROMPTS = [torch.tensor([1, 2]), torch.tensor([3, 4])]


def _generate(url, **kwargs):
    return SGLangEngine(url, timeout=kwargs.pop("timeout", 5), **kwargs).generate(PROMPTS, 2)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_an_html_page_is_said_to_be_no_json(capsys):
    with _Server(HTML, content_type="text/html") as srv:
        with pytest.raises(SGLangResponseError) as e:  # was: json.JSONDecodeError 'Expecting value: line 1 ...'
            _generate(srv.url)
    assert str(e.value) == (f"SGLang {srv.url}/generate: the answer is not JSON (text/html, {len(HTML)} bytes: "
                            f"'<!DOCTYPE html> <html><head><title>Welcome to nginx!</title></head> <body>It wor ...'); "
                            f"is {srv.url} an SGLang server?")
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)


def test_an_http_error_status_is_named_with_the_body_on_one_line():
    body = b'{"error": "model\nnot loaded"}'
    with _Server(body, status=500) as srv:
        with pytest.raises(SGLangError) as e:
            _generate(srv.url)
    assert str(e.value) == f'SGLang {srv.url}/generate: HTTP 500 Internal Server Error: {{"error": "model not loaded"}}'
    with _Server(b"", status=404) as srv:
        with pytest.raises(SGLangError, match=r"/generate: HTTP 404 Not Found: \(empty body\)$"):
            _generate(srv.url)


@pytest.mark.parametrize("answer,message", [
    ([_result([-0.5, -0.1])], "1 results for 2 prompts (one per prompt expected)"),
    ([], "0 results for 2 prompts (one per prompt expected)"),
    ("ok", "the answer is a JSON str, not a list of results for 2 prompts"),
    ([{"text": "12"}, {"text": "34"}], "result 0: no meta_info (keys ['text']); the server must answer /generate "
                                       "with return_logprob"),
    ([_result([-0.5, -0.1]), {"meta_info": {"finish_reason": {"type": "abort"}}}],
     "result 1: meta_info has no 'output_token_logprobs' (send \"return_logprob\": true)"),
    ([_result([-0.5, -0.1]), _result([-0.2, None])], "result 1: output_token_logprobs[1]: log-prob is null"),
])
def test_json_without_what_generate_returns_is_named(answer, message):
    with _Server(_json(answer)) as srv:
        with pytest.raises(SGLangResponseError) as e:
            _generate(srv.url)
    text = str(e.value)
    assert text.startswith(f"SGLang {srv.url}/generate: {message}"), text
    assert "\n" not in text


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_non_finite_log_prob_is_refused_naming_the_result_and_token(literal):
    body = _json([_result([-0.5, -0.1]), _result([-0.2, -0.25])]).replace(b"-0.25", literal, 1)
    assert literal in body
    with _Server(body) as srv:
        with pytest.raises(SGLangResponseError, match=r"/generate: result 1: output_token_logprobs\[1\].*not finite"):
            _generate(srv.url)


def test_a_good_answer_still_goes_through():
    with _Server(_json([_result([-0.5, -0.1]), _result([-0.2, -1.0])])) as srv:
        out = _generate(srv.url)
    assert [o["rollout_log_probs"].tolist() for o in out] == [[-0.5, pytest.approx(-0.1)],
                                                              [pytest.approx(-0.2), -1.0]]


def test_connection_refused_is_said_at_once():
    port = _closed_port()
    t0 = time.monotonic()
    with pytest.raises(SGLangError) as e:
        _generate(f"http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 3
    assert str(e.value) == (f"SGLang http://127.0.0.1:{port}/generate: connection refused: nothing listens at "
                            f"127.0.0.1:{port}; start the SGLang server or fix --sglang-url")


def test_a_server_that_accepts_and_never_answers_times_out_with_a_clear_message():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # the kernel accepts the connection; nobody ever reads or answers
    port = srv.getsockname()[1]
    try:
        t0 = time.monotonic()
        with pytest.raises(SGLangError) as e:  # was: a raw TimeoutError after the 60 s default
            _generate(f"http://127.0.0.1:{port}", timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 3
    finally:
        srv.close()
    assert str(e.value) == (f"SGLang http://127.0.0.1:{port}/generate: connected, but no answer within 0.5 s "
                            f"(--sglang-timeout): is the server overloaded or stuck?")


def test_a_connection_that_never_opens_fails_after_the_connect_timeout():
    """A host that drops the connection attempt: the connect timeout (5 s by default, here 0.5 s) bounds it,
    whatever the request timeout.  Simulated with a listening socket whose backlog is full (Linux then drops the
    SYNs)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fillers.append(c)
        probe = socket.socket()
        probe.settimeout(0.3)
        try:
            probe.connect(("127.0.0.1", port))
            pytest.skip("this platform completes connections past a full backlog")
        except (TimeoutError, BlockingIOError):
            pass
        finally:
            probe.close()
        t0 = time.monotonic()
        with pytest.raises(SGLangError) as e:
            _generate(f"http://127.0.0.1:{port}", timeout=60, connect_timeout=0.5)
        assert time.monotonic() - t0 < 3
    finally:
        for c in fillers:
            c.close()
        srv.close()
    assert str(e.value) == (f"SGLang http://127.0.0.1:{port}/generate: no connection within 0.5 s (connect "
                            f"timeout): is the server up and 127.0.0.1:{port} reachable from here?")


def test_the_client_defaults_are_seconds_not_minutes_and_bad_timeouts_are_refused():
    engine = SGLangEngine("http://127.0.0.1:30000")
    assert engine.connect_timeout == 5.0 and engine.timeout == 60.0
    for kwargs in (dict(timeout=0), dict(connect_timeout=float("nan")), dict(timeout=-1)):
        with pytest.raises(ValueError, match="must be a finite number of seconds > 0"):
            SGLangEngine("http://127.0.0.1:30000", **kwargs)
    with pytest.raises(ValueError, match=r"^url 'localhost:30000' is not an http\(s\) URL"):
        SGLangEngine("localhost:30000")
    assert check_sglang_url("https://h:1/p") == "https://h:1/p"


def _train(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "slime_rc", "train", *TINY, "--rollout-engine", "sglang", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def _one_error_line(proc) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith(E)]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "step " not in proc.stdout  # no step ran
    return lines[0]


def test_slime_rc_train_says_an_sglang_failure_in_one_line():
    """The whole launch: the run starts, its first rollout meets the server, the run ends with one line (exit 1:
    the launch was fine, the server failed it) -- before: a traceback (HTML: JSONDecodeError; no answer: a raw
    TimeoutError after a minute)."""
    with _Server(HTML, content_type="text/html") as srv:
        line = _one_error_line(_train("--sglang-url", srv.url))
    assert line.startswith(E + f"SGLang {srv.url}/generate: the answer is not JSON (text/html, "), line
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        line = _one_error_line(_train("--sglang-url", url, "--sglang-timeout", "1"))
    finally:
        silent.close()
    assert line == (E + f"SGLang {url}/generate: connected, but no answer within 1 s (--sglang-timeout): is the "
                    f"server overloaded or stuck?"), line
    assert time.monotonic() - t0 < 120
