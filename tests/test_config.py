"""Configuration: the TOML defaults, layering, and clear errors for bad keys."""

import dataclasses
import math
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
    args = build_parser().parse_args(["serve", "--config", str(path), "--port", "9100", "--dtype", "bfloat16",
                                      "--max-stored-responses", "0"])
    config = config_from_args(args)
    assert config.scheduler.max_num_seqs == 3
    assert config.server.port == 9100 and config.server.max_stored_responses == 0
    assert config.model.dtype == "bfloat16"


@pytest.mark.parametrize("text, fragment", [
    ("[schedulr]\nmax_num_seqs = 3\n", "unknown section"),
    ("[scheduler]\nmax_seqs = 3\n", "unknown key scheduler.max_seqs"),
    ("[scheduler]\nmax_num_seqs = 0\n", "positive integer"),
    ("[server]\nmax_stored_responses = -1\n", "server.max_stored_responses must be a non-negative integer"),
    # TOML has every type: a value of another one is a mistake, never taken as meant
    ("[server]\nport = \"8141\"\n", "server.port must be an integer, got '8141'"),
    ("[ledger]\nenabled = \"false\"\n", "ledger.enabled must be true or false"),
    ("[server]\napi_key = 123\n", "server.api_key must be a string"),
    ("[train]\ntarget_modules = \"q_proj\"\n", "train.target_modules must be a list"),
    ("[train]\nlearning_rate = \"1e-4\"\n", "train.learning_rate must be a number"),
    ("[model]\ndevice = \"gpu\"\n", "model.device must be auto, cpu, cuda or cuda:N"),
    ("[train\n", "Expected"),  # not TOML: said, with where
    ("[train]\nmode = \"dpo\"\neval_set = \"p.jsonl\"\neval_tolerance = inf\n", "must be finite"),
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


def test_an_alchemist_variable_that_is_no_configuration_is_said_to_be_ignored(caplog):
    """A stray `ALCHEMIST_*` variable is logged as ignored, and which variable the server
    reads for it; `ALCHEMIST_API_KEY` (compose.yaml's name on the host) too, where the key
    it stands for is set."""
    with caplog.at_level("WARNING"):
        config = load_config(environ={"ALCHEMIST_API_KEY": "sk-secret", "ALCHEMIST_SERVER_API_KEY": "sk-secret",
                                      "ALCHEMIST_CACHE": "/tmp/x", "ALCHEMIST_EXP_GAPS": "1",
                                      "ALCHEMIST_TRAINER_MODE": "dpo"})
    assert config.server.api_key == "sk-secret"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "ALCHEMIST_API_KEY" in said[0] and "ALCHEMIST_SERVER_API_KEY" in said[0]
    assert "`serve` refuses to start while that is unset" in said[0]  # (below: it is set here)
    assert "ALCHEMIST_TRAINER_MODE" in said[1] and said[1].endswith("and is ignored")


@pytest.mark.parametrize("name", ["ALCHEMIST_API_KEY", "ALCHEMIST_ADMIN_KEY"])
def test_a_key_in_a_variable_the_server_does_not_read_is_a_start_up_error_not_an_open_server(name):
    """`ALCHEMIST_API_KEY=sk-… alchemist serve` started a server that answered every route
    without a key, with a warning the operator may never read (a review of the
    configuration). `serve` is refused while the key it stands for is unset (a flag sets it
    too); a command that serves nothing (`alchemist profile`) is not."""
    from server.config import refuse_a_key_left_unset

    environ = {name: "sk-secret"}
    with pytest.raises(ValueError, match=f"{name} is set.*SERVER_"):
        refuse_a_key_left_unset(load_config(environ=environ), environ)
    key = name.removeprefix("ALCHEMIST_").lower()
    config = load_config(overrides={"server": {key: "sk-flag"}}, environ=environ)
    refuse_a_key_left_unset(config, environ)
    assert getattr(config.server, key) == "sk-flag"


def test_a_stray_key_variable_stops_serve_alone(monkeypatch, capsys):
    from server.cli import main

    monkeypatch.setenv("ALCHEMIST_API_KEY", "sk-secret")
    assert main(["serve", "--port", "8199"]) == 2
    assert "ALCHEMIST_API_KEY is set" in capsys.readouterr().err
    args = build_parser().parse_args(["profile", "--out", "/tmp/p.json"])
    assert config_from_args(args).server.api_key == ""  # (profile serves nothing: not refused)


def test_a_model_directory_that_cannot_be_read_is_a_one_line_start_up_error(tmp_path, capsys):
    from server.cli import main

    assert main(["serve", "--model", str(tmp_path / "no-such-model"), "--port", "8199"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("alchemist: start-up error:") and "Traceback" not in said


def test_the_log_level_is_taken_before_or_after_serve_and_a_wrong_one_is_an_argument_error(capsys):
    assert build_parser().parse_args(["--log-level", "warning", "serve"]).log_level == "WARNING"
    assert build_parser().parse_args(["serve", "--log-level", "debug"]).serve_log_level == "DEBUG"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "verbose", "serve"])
    assert "invalid choice" in capsys.readouterr().err


def test_replicas_on_a_model_directory_that_is_not_there_fail_before_the_group_forms(tmp_path, capsys):
    """Not restarted ten times over (each replica would fail on it the same way)."""
    from server.cli import main

    assert main(["serve", "--data-parallel-size", "2", "--device", "cpu", "--model", str(tmp_path / "nope")]) == 2
    assert "is no local directory" in capsys.readouterr().err


def test_the_model_is_taken_as_vllm_serve_takes_it_positional_or_flag_but_not_two_different_ones(tmp_path):
    """`vllm serve MODEL` and `--seed N` as a vLLM launch script has them (an outside pass:
    both were argument errors, and the server did not start)."""
    model = str(tmp_path / "model")
    assert config_from_args(build_parser().parse_args(["serve", model, "--port", "9100"])).model.model == model
    assert config_from_args(build_parser().parse_args(["serve", "--model", model, model])).model.model == model
    with pytest.raises(ValueError, match="given twice"):
        config_from_args(build_parser().parse_args(["serve", model, "--model", str(tmp_path / "other")]))
    assert config_from_args(build_parser().parse_args(["serve", "--seed", "7"])).model.seed == 7
    assert config_from_args(build_parser().parse_args(["serve"])).model.seed == -1
    with pytest.raises(ValueError, match="model.seed"):
        config_from_args(build_parser().parse_args(["serve", "--seed", "-2"]))


def test_lengths_take_vllms_suffixes(capsys):
    from server.cli import token_count

    assert [token_count(t) for t in ("4096", "4k", "25.6k", "32K", "1M", " 2k ")] == [4096, 4000, 25600, 32768,
                                                                                       1 << 20, 2000]
    args = build_parser().parse_args(["serve", "--max-model-len", "1K", "--max-num-batched-tokens", "2k"])
    assert (config_from_args(args).model.max_model_len, config_from_args(args).scheduler.max_num_batched_tokens) \
        == (1024, 2000)
    for wrong in ("1.5K", "lots", "4q"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--max-model-len", wrong])
    assert "is in thousands" in capsys.readouterr().err


def test_lora_modules_take_vllms_forms_and_one_adapter():
    def module(*values):
        return config_from_args(build_parser().parse_args(["serve", "--lora-modules", *values])).adapter.lora_module

    assert module("sql=/adapters/sql") == "sql=/adapters/sql"
    assert module('{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}') == "sql=/adapters/sql"
    with pytest.raises(ValueError, match="serves one adapter"):
        module("a=/x", "b=/y")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", '{"name": "sql"}'])


def test_a_gate_setting_from_any_layer_without_an_eval_set_is_refused(tmp_path):
    """`--eval-tolerance` without `--eval-set` was refused, but the same setting from a file
    or the environment started a server with no gate (a review of the configuration)."""
    with pytest.raises(ValueError, match="environment: train.eval_max_kl .* sets the eval gate"):
        load_config(environ={"ALCHEMIST_TRAIN_MODE": "dpo", "ALCHEMIST_TRAIN_EVAL_MAX_KL": "0.5"})
    config_file = tmp_path / "gate.toml"
    config_file.write_text('[train]\nmode = "dpo"\neval_tolerance = 0.1\n')
    with pytest.raises(ValueError, match="gate.toml: train.eval_tolerance"):
        load_config(config_file, environ={})
    with pytest.raises(ValueError, match="command line: train.eval_tolerance"):
        load_config(overrides={"train": {"mode": "dpo", "eval_tolerance": 0.2}}, environ={})
    assert load_config(config_file, {"train": {"eval_set": "held-out.jsonl"}}, environ={}).train.eval_tolerance == 0.1


@pytest.mark.parametrize("values, match", [({"learning_rate": math.inf}, "learning_rate must be positive and finite"),
                                           ({"target_modules": [1, 2]}, "target_modules must be a list of module"),
                                           ({"target_modules": "q_proj"}, "target_modules must be a list of module")])
def test_training_values_that_cannot_work_are_refused_naming_the_setting(values, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**values)


def test_a_target_module_that_names_no_layer_is_refused_not_dropped():
    """PEFT drops a name that matches nothing while another matches: `q_proj,foo` trained
    an adapter on q_proj alone, saying nothing."""
    from tests.conftest import make_training
    with pytest.raises(ValueError, match=r"train.target_modules: \[.foo.\] name no module"):
        make_training(TrainConfig(mode="cpt", lora_rank=4, target_modules=("q_proj", "foo")))


def test_settings_are_named_as_an_operator_writes_them_and_origins_as_a_browser_sends_them():
    """`ALCHEMIST_ADAPTER_KEEP=0` said "AdapterConfig.keep"; an origin with a trailing slash
    or no scheme never matches a browser's `Origin`, and CORS was silently off (a review of
    the configuration)."""
    with pytest.raises(ValueError, match=r"^adapter\.keep must be a positive integer"):
        load_config(environ={"ALCHEMIST_ADAPTER_KEEP": "0"})
    with pytest.raises(ValueError, match=r"^model\.max_model_len must be a positive integer"):
        load_config(overrides={"model": {"max_model_len": 0}}, environ={})
    for origins in (["app.example.com"], ["https://x.com/"], ["https://x.com/app"], ["nul"]):
        with pytest.raises(ValueError, match="server.allowed_origins must be origins as a browser sends them"):
            load_config(overrides={"server": {"allowed_origins": origins}}, environ={})
    config = load_config(overrides={"server": {"allowed_origins": ["https://x.com", "http://localhost:3000", "*",
                                                                   "HTTPS://App.Example", "null"]}}, environ={})
    assert config.server.allowed_origins == ("https://x.com", "http://localhost:3000", "*", "https://app.example",
                                             "null")


def test_an_activation_cache_that_holds_no_token_is_refused_at_start():
    """`train.cache_bytes = 2048` (MiB meant) started a server that recorded no prompt and
    never trained on one, saying "about 0 prompt tokens" at INFO (a review of the configuration)."""
    import torch

    from tests.conftest import tiny_model
    from trainer.cache_budget import recorded_bytes_per_token, size_cache
    model_config = tiny_model("llama").config
    per_token = recorded_bytes_per_token(model_config, torch.float32)
    with pytest.raises(ValueError, match=f"train.cache_bytes = {per_token - 1} holds no recorded prompt token"):
        size_cache(per_token - 1, torch.device("cpu"), model_config, torch.float32)
    assert size_cache(per_token, torch.device("cpu"), model_config, torch.float32).tokens == 1


def test_an_adapter_directory_or_profile_that_cannot_be_used_is_named_before_the_model_loads(tmp_path):
    """`--adapter-dir` naming a file said `[Errno 17] File exists` after the model loaded,
    naming no setting (a review of the configuration)."""
    from server.config import check_paths

    a_file = tmp_path / "afile"
    a_file.write_text("")
    cases = {str(a_file): "is no directory", str(a_file / "adapters"): "cannot be written"}
    for directory, said in cases.items():
        config = load_config(overrides={"train": {"mode": "dpo"}, "adapter": {"dir": directory}}, environ={})
        with pytest.raises(OSError, match=f"adapter.dir \\(--adapter-dir\\) .* {said}"):
            check_paths(config)
    check_paths(load_config(overrides={"train": {"mode": "dpo"}, "adapter": {"dir": str(tmp_path / "a" / "b")}},
                            environ={}))
    with pytest.raises(OSError, match="offload.profile .* is no file"):
        check_paths(load_config(overrides={"offload": {"profile": str(tmp_path / "missing.json")}}, environ={}))


def test_a_key_written_above_every_section_is_told_where_it_belongs(tmp_path):
    config_file = tmp_path / "flat.toml"
    config_file.write_text('mode = "dpo"\n')
    with pytest.raises(ValueError, match=r"mode is outside any section; it belongs under \[train\]"):
        load_config(config_file, environ={})


def test_a_length_in_the_environment_reads_as_the_flag_does():
    """`--max-model-len 4k` was taken and `ALCHEMIST_MODEL_MAX_MODEL_LEN=4k` refused."""
    config = load_config(environ={"ALCHEMIST_MODEL_MAX_MODEL_LEN": "2K", "ALCHEMIST_SCHEDULER_MAX_NUM_BATCHED_TOKENS":
                                  "4k"})
    assert (config.model.max_model_len, config.scheduler.max_num_batched_tokens) == (2048, 4000)
    with pytest.raises(ValueError, match="ALCHEMIST_MODEL_MAX_MODEL_LEN: '2.5K': a binary suffix"):
        load_config(environ={"ALCHEMIST_MODEL_MAX_MODEL_LEN": "2.5K"})


def test_target_modules_match_as_peft_matches_them():
    """A dotted suffix (`self_attn.q_proj`) is a name PEFT adapts: the check refused it (a
    review of this round's change)."""
    from tests.conftest import make_training
    training = make_training(TrainConfig(mode="cpt", lora_rank=4, target_modules=("self_attn.q_proj", "v_proj")))
    adapted = {name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1] for name, module in
               training.peft_model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"self_attn.q_proj", "self_attn.v_proj"}
    training.close()
