"""benchmarks/step_costs.py on a few tiny runs: its timers see every step, draft pass and target
forward the engine makes, and its split of a step adds up."""

from __future__ import annotations

import pytest

import benchmarks.step_costs as bench


def test_each_row_accounts_for_its_steps_passes_and_tokens(capsys):
    rows = bench.main(["--batch", "2", "--ks", "0,2", "--num-prompts", "3", "--max-tokens", "6",
                       "--max-prompt-tokens", "40", "--threads", "1"])
    plain, drafted = rows
    assert [r["k"] for r in rows] == [0, 2] and plain["vs_plain"] == 1.0
    for r in rows:
        assert r["tokens"] == 3 * 6  # EOS ignored: every prompt gives max_tokens
        assert r["step_ms"] >= r["target_ms"] > 0 and r["other_ms"] >= 0
        assert r["per_token_ms"] == pytest.approx(1e3 * r["seconds"] / r["tokens"])
    assert plain["propose_ms"] is None and plain["passes_per_step"] == 0
    # Every decode step of a drafting sequence makes 2 draft passes; prefill-only steps make none.
    assert 0 < drafted["passes_per_step"] <= 2 and drafted["pass_ms"] > 0
    assert drafted["step_ms"] >= drafted["target_ms"] + drafted["propose_ms"] > drafted["pass_ms"]
    assert drafted["tokens_per_step"] > plain["tokens_per_step"]
    assert "per_token_ms" in capsys.readouterr().out


def test_the_plain_baseline_is_required():
    with pytest.raises(SystemExit):
        bench.main(["--ks", "2,4"])
