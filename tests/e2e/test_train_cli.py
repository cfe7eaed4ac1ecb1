import json
import socket

import pytest

from tests.e2e.cli import threefold

QUICK = ["--model", "tiny", "--steps", "3", "--global-batch", "4", "--seq-len", "16", "--no-progress"]


# the launch, but anything that picks a port before binding it is handed one a listening socket already holds
# (taken between the choice and the bind, as another launch or test world can): without --port the launcher's
# rendezvous store must bind a free port itself (127.0.0.1:0), with no window to lose it in
HELD_PORT = ("import socket, sys\n"
             "import threefold.launch.local as local\n"
             "held = socket.socket(); held.bind(('127.0.0.1', 0)); held.listen()\n"
             "local.free_port = lambda: held.getsockname()[1]\n"
             "from threefold.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")


def test_train_on_two_local_processes(tmp_path):
    run = threefold("train", "--nproc", "2", *QUICK, "--data", "stdlib", "--out", str(tmp_path), script=HELD_PORT)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr", "tokens", "tokens_per_s", "step_time_s"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    assert set(rows[0]["mem"]) == {"params", "grads", "optimizer", "activations", "peak"}
    assert rows[0]["comm"]["dp"]["all_reduce"] > 0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert (tmp_path / "config.toml").exists()


@pytest.mark.parametrize("args, message", [
    (["--nproc", "4", "--tp", "3"], "parallel: layout dp=auto x tp=3 x pp=1 does not match the world size 4"),
    (["--set", "model.colour=red"], "model.colour: unknown key"),
    (["--steps", "many"], "train.steps: expected int, got 'many'"),
    (["--data", "/no/such/corpus"], "data.source: path '/no/such/corpus' does not exist"),
    (["--config", "/no/such.toml"], "--config: file '/no/such.toml' does not exist"),
    (["--precision", "fp4"], "precision.compute: 'fp4' is not one of auto, fp32, bf16, fp16, fp8"),
])
def test_user_mistakes_exit_2_with_one_line(args, message, tmp_path):
    run = threefold("train", *QUICK, "--out", str(tmp_path), *args)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], run.stderr
    assert "Traceback" not in run.stderr


def test_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = threefold("train", "--nproc", "2", "--port", str(port), *QUICK, "--out", str(tmp_path))
    assert run.returncode == 2
    assert f"port {port} is already in use" in run.stderr and "Traceback" not in run.stderr


def test_a_failing_rank_stops_the_others_and_is_named(tmp_path):
    run = threefold("train", "--nproc", "2", *QUICK, "--out", str(tmp_path), "--set", "fault.rank=1",
                    "--set", "fault.step=2")
    assert run.returncode == 1
    assert "threefold: rank 1 failed (exit code 1): RuntimeError: injected fault on rank 1 at step 2" in run.stderr
    assert "ranks 0 were stopped after rank 1 failed" in run.stderr
    assert f"threefold: full log: {tmp_path / 'logs' / 'rank-1.log'}" in run.stderr
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert len(lines) == 3 and "Traceback" not in run.stderr, run.stdout + run.stderr  # only threefold's lines
    log = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "Traceback" in log and "RuntimeError: injected fault on rank 1 at step 2" in log  # the whole story
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # step 1 finished, step 2 never did


def test_a_garbled_manifest_under_nproc_is_one_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{garbage")
    run = threefold("train", "--nproc", "2", *QUICK, "--out", str(tmp_path / "run"), "--resume", str(ckpt))
    assert run.returncode == 2
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert len(lines) == 2, run.stdout + run.stderr  # the reason (rank 0), then the error once
    assert "manifest.json: not a valid JSON manifest" in lines[0]
    assert lines[1] == f"threefold: error: checkpoint {ckpt} failed verification (the reason is printed above)"


def test_single_process_without_launcher(tmp_path):
    run = threefold("train", *QUICK, "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    done, files = run.stderr.strip().splitlines()[-2:]  # the summary, also with --no-progress
    assert done.startswith("threefold: done: 3 steps, loss ") and "tokens/s" in done and "peak memory" in done
    assert files == f"threefold: files in {tmp_path}: metrics.jsonl, loss.png, throughput.png, memory.png"

