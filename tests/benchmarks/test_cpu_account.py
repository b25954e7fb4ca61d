"""CPU accounting per process of a tree (benchmarks/serving/cpu_account.py): real processes."""

import subprocess
import sys

from benchmarks.serving.cpu_account import CpuAccount

# Burns CPU for the given seconds, then waits to be killed (so its time can still be read).
BURN = "import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\n" \
       "print('done', flush=True)\ntime.sleep(60)\n"


def _spawn(tmp_path, name: str, seconds: float) -> subprocess.Popen:
    script = tmp_path / name
    script.write_text(BURN)
    return subprocess.Popen([sys.executable, str(script), str(seconds)], stdout=subprocess.PIPE, text=True)


def test_a_child_started_inside_the_block_is_charged_its_cpu_and_an_idle_one_nothing(tmp_path):
    children = [_spawn(tmp_path, "idle_child.py", 0.0)]
    try:
        assert children[0].stdout.readline().strip() == "done"  # its start-up CPU is spent before the block
        with CpuAccount() as account:
            children.append(_spawn(tmp_path, "busy_child.py", 0.4))
            assert children[1].stdout.readline().strip() == "done"
        busy_s = account.cpu_s["busy_child.py"]
        assert 0.4 <= busy_s < 0.4 + 1.0  # its burn plus Python's start-up
        assert account.cpu_s["idle_child.py"] < 0.05
        assert account.wall_s >= busy_s - 0.03  # one single-threaded process: a core at most (10 ms ticks)
        per_token = account.per_token_ms(100)
        assert per_token["busy_child.py"] == busy_s * 1e3 / 100
        assert abs(per_token["total"] - sum(account.cpu_s.values()) * 10) < 1e-9
        assert per_token["wall x cores"] >= per_token["busy_child.py"] * 0.5
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_labels_past_the_top_ones_are_summed_as_other():
    account = CpuAccount()
    account.cpu_s, account.wall_s = {"a": 0.3, "b": 0.2, "c": 0.1, "d": 0.05}, 1.0
    out = account.per_token_ms(10, top=2)
    assert list(out)[:3] == ["a", "b", "other"]
    assert abs(out["other"] - 15.0) < 1e-9 and abs(out["total"] - 65.0) < 1e-9
