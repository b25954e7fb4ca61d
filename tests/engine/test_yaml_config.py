"""``load_yaml``: a config file's errors name the file, the field path and the culprit."""

import pytest

from engine.args import EngineArgs
from engine.errors import ConfigError
from engine.yaml_config import load_yaml


def test_a_directory_given_as_the_config_file_is_called_a_directory(tmp_path):
    """It was "does not exist" (an operator trial, 2026-12-07)."""
    with pytest.raises(ConfigError, match=rf"config file '{tmp_path}' is a directory, not a YAML file"):
        load_yaml(tmp_path, EngineArgs)
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "nope.yaml", EngineArgs)


def test_yaml_unknown_field_names_path(tmp_path):
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("model: /x\nscheduler:\n  max_num_seqs: 4\n  max_num_seq: 5\n")
    with pytest.raises(ConfigError, match=r"max_num_seq.*\$\.scheduler"):
        load_yaml(cfg, EngineArgs)


@pytest.mark.parametrize("text, match", [
    # PyYAML keeps the last of two equal keys: the first scheduler section was silently dropped.
    ("model: /x\nscheduler:\n  max_num_seqs: 4\nscheduler:\n  max_waiting: 5\n",
     r"duplicate key 'scheduler'\n.*line 4, column 1"),
    ("model: /x\nscheduler:\n  max_num_seqs: 4\n  max_num_seqs: 5\n", r"duplicate key 'max_num_seqs'"),
    ("model: /x\n[1]: 2\n", "invalid YAML"),  # an unhashable key: a ConfigError, not a TypeError
    ("model: /x\nscheduler:\n  max_num_seqs: 0\n", r"max_num_seqs"),
    ("model: /x\nnum_speculative_tokens: 17\nspeculative_method: ngram\n", r"num_speculative_tokens"),
    ("model: /x\nspeculative_method: medusa\n", r"\$\.speculative_method"),
    ("", "the file is empty"),  # was msgspec's "Expected `object`, got `null`"
    ("# only a comment\n", "the file is empty"),
    # vLLM's rule: each running sequence needs at least one token of the step budget.
    ("model: /x\nscheduler:\n  max_num_seqs: 8\n  max_num_batched_tokens: 4\n",
     r"max_num_batched_tokens must be >= max_num_seqs \(8\), got 4"),
])
def test_bad_yaml_is_a_config_error_naming_the_culprit(tmp_path, text, match):
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_yaml(cfg, EngineArgs)
    cfg.write_text("model: /x\nscheduler:\n  max_num_seqs: 4\n")
    assert load_yaml(cfg, EngineArgs).scheduler.max_num_seqs == 4
