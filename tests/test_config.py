"""Configuration: the TOML defaults, layering, and clear errors for bad keys."""

import dataclasses
import tomllib

import pytest

from server.config import DEFAULT_CONFIG_PATH, AlchemistConfig, load_config
from server.cli import build_parser, config_from_args
from trainer.config import TrainConfig


def test_default_toml_matches_dataclass_defaults():
    assert load_config(environ={}) == AlchemistConfig()
    toml = tomllib.loads(DEFAULT_CONFIG_PATH.read_text())
    sections = {f.name: f.default_factory() for f in dataclasses.fields(AlchemistConfig)}
    assert set(toml) == set(sections)
    for name, section in sections.items():  # every key is documented in the file
        assert set(toml[name]) == {f.name for f in dataclasses.fields(section)}, name


def test_environment_layers_between_file_and_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[server]\nport = 9000\n[train]\nmode = \"cpt\"\n")
    environ = {"ALCHEMIST_SERVER_PORT": "9200", "ALCHEMIST_SERVER_API_KEY": "sk-env", "ALCHEMIST_TRAIN_MODE": "dpo",
               "ALCHEMIST_TRAIN_TARGET_MODULES": "q_proj, v_proj", "ALCHEMIST_TRAIN_MERGED_SERVING": "false",
               "ALCHEMIST_CACHE": "/not/config", "OTHER": "x"}
    config = load_config(path, {"server": {"port": 9300}}, environ=environ)
    assert config.server.port == 9300  # the flag wins over the environment
    assert config.server.api_key == "sk-env" and config.train.mode == "dpo"  # the environment over the file
    assert config.train.target_modules == ("q_proj", "v_proj") and config.train.merged_serving is False
    assert "sk-env" not in repr(config)  # keys stay out of logs


@pytest.mark.parametrize("environ, message", [
    ({"ALCHEMIST_TRAIN_MODDE": "dpo"}, "unknown variable ALCHEMIST_TRAIN_MODDE"),
    ({"ALCHEMIST_SERVER_PORT": "eighty"}, "not a valid int"),
    ({"ALCHEMIST_TRAIN_MERGED_SERVING": "maybe"}, "not a valid bool"),
])
def test_bad_environment_variables_are_errors(environ, message):
    with pytest.raises(ValueError, match=message):
        load_config(environ=environ)


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


def test_max_staleness_by_the_learning_rate():
    """-1 (the default): recordings up to 8 versions stale train on them at learning rates
    up to 3e-4, 1 version above, where stale gradients learnt much less (BENCHMARKS.md)."""
    assert TrainConfig().max_staleness == 8
    assert TrainConfig(learning_rate=1e-3).max_staleness == 1
    assert TrainConfig(learning_rate=1e-3, max_staleness=3).max_staleness == 3
    assert TrainConfig(max_staleness=0).max_staleness == 0
    with pytest.raises(ValueError, match="max_staleness"):
        TrainConfig(max_staleness=-2)
