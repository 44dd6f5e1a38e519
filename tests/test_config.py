"""Configuration: the TOML defaults, layering, and clear errors for bad keys."""

import tomllib

import pytest

from engine.config import DEFAULT_CONFIG_PATH, AlchemistConfig, load_config
from server.cli import build_parser, config_from_args


def test_default_toml_matches_dataclass_defaults():
    assert load_config() == AlchemistConfig()
    assert set(tomllib.loads(DEFAULT_CONFIG_PATH.read_text())) == {"model", "cache", "scheduler", "train", "arbiter", "server"}


def test_file_then_flags_override(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[scheduler]\nmax_num_seqs = 3\n[server]\nport = 9000\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--port", "9100", "--dtype", "bfloat16"])
    config = config_from_args(args)
    assert config.scheduler.max_num_seqs == 3
    assert config.server.port == 9100
    assert config.model.dtype == "bfloat16"


@pytest.mark.parametrize("text, fragment", [
    ("[schedulr]\nmax_num_seqs = 3\n", "unknown section"),
    ("[scheduler]\nmax_seqs = 3\n", "unknown key scheduler.max_seqs"),
    ("[scheduler]\nmax_num_seqs = 0\n", "positive integer"),
])
def test_bad_config_is_rejected(tmp_path, text, fragment):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=fragment):
        load_config(path)
