"""Deployment files checked against the code: every dashboard query names a metric a real
server exports; compose, Prometheus, Grafana provisioning and the Dockerfile agree with
each other and with the configuration keys. (No Docker engine here: these are the checks
that need none.)"""

import json
import re
from pathlib import Path

import yaml
from fastapi.testclient import TestClient

from trainer.config import AdapterConfig, TrainConfig

from server.config import config_from_env
from tests.servers import TINY_NAME, tiny_app

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "configs" / "grafana" / "dashboards" / "alchemist.json"
COMPOSE = REPO / "compose.yaml"


def exported_metric_names(tmp_path) -> set[str]:
    """Sample names in /metrics of a server with training, adapter saving, the ledger and
    the eval gate on, after a request (so labelled series exist)."""
    text = exported_metrics_text(tmp_path)
    return {re.split(r"[{ ]", line)[0] for line in text.splitlines() if line and not line.startswith("#")}


def exported_metrics_text(tmp_path) -> str:
    """/metrics of that server, as text."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    probes = tmp_path / "probes.jsonl"
    probes.write_text('{"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon."}\n')
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4, eval_set=str(probes)),
                   adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "hi"}]})
        return client.get("/metrics").text


def dashboard_panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_every_dashboard_query_names_an_exported_metric(tmp_path):
    exported = exported_metric_names(tmp_path)
    queried = set()
    for panel in dashboard_panels():
        for target in panel["targets"]:
            queried |= set(re.findall(r"alchemist:[a-z0-9_]+", target["expr"]))
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
    # and the dashboard covers what the issue lists
    for needed in ("time_to_first_token_seconds_bucket", "request_time_per_output_token_seconds_bucket",
                   "num_requests_waiting", "train_tokens_total", "train_loss", "adapter_version",
                   "activation_cache_bytes", "num_preemptions_total", "train_preemptions_total"):
        assert f"alchemist:{needed}" in queried, needed


# counters of what every data-parallel replica applies alike (one rollback, one skipped step: each
# replica counts it): summed over `engine` they read N times the events
EVERY_REPLICAS = ("adapter_rollbacks_total", "skipped_steps_total")


def test_the_dashboard_counts_each_event_once_under_replicas_and_says_its_units():
    """An outside pass with Prometheus under `-dp 2`: one rollback read as two a panel's
    `sum` (the API said one); the reload-wait share summed past 100%, the loss was the
    worst replica's where `/v1/adapters` averages."""
    for panel in dashboard_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for name in EVERY_REPLICAS:
                if f"alchemist:{name}" in expr:
                    assert expr.startswith("max"), expr
            if "alchemist:reload_wait_seconds_total" in expr or "alchemist:train_loss" in expr:
                assert expr.startswith("avg"), expr
        rates = [t["expr"] for t in panel["targets"]]
        if all(e.startswith("sum") and "(rate(" in e and " / " not in e and "_seconds" not in e for e in rates):
            # a count per second says so (an outside pass: four such panels read as plain counts)
            assert panel["fieldConfig"]["defaults"].get("unit") in ("ops", "reqps", "suffix: /s", "suffix: tok/s"), \
                (panel["title"], panel["fieldConfig"]["defaults"].get("unit"))


def test_exported_metrics_have_help_texts_and_units(tmp_path):
    app = tiny_app(train=TrainConfig(mode="cpt", lora_rank=4))
    with TestClient(app) as client:
        text = client.get("/metrics").text
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    assert helps
    for name, help_text in helps.items():
        assert len(help_text) > 15, name
        if name.endswith("_seconds") or name.endswith("_bytes"):
            assert re.search(r"seconds|bytes|Bytes", help_text), (name, help_text)


def test_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    for panel in dashboard_panels():
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert 'instance=~"$instance"' in target["expr"], target["expr"]


def test_compose_prometheus_and_grafana_provisioning_agree():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"alchemist", "prometheus", "grafana"} <= set(services)
    for service in services.values():  # every file mounted from the repository exists
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), source
    scrape = yaml.safe_load((REPO / "configs/grafana/prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["alchemist:8000"] and "8000:8000" in services["alchemist"]["ports"]
    datasource = yaml.safe_load((REPO / "configs/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((REPO / "configs/grafana/provisioning/dashboards/alchemist.yml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert f"./configs/grafana/dashboards:{dashboards_path}:ro" in services["grafana"]["volumes"]
    # the server's environment names real configuration keys
    environment = {k: "1" if "BYTES" in k else "x" for k in services["alchemist"]["environment"]}
    environment["ALCHEMIST_TRAIN_MODE"] = "dpo"
    layer = config_from_env(environment)
    assert layer["server"].keys() == {"api_key", "admin_key"} and layer["adapter"]["dir"]
    assert services["alchemist"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_dockerfile_runs_non_root_with_a_healthcheck_on_health():
    text = (REPO / "Dockerfile").read_text()
    base = re.search(r"^FROM pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda", text, re.M)
    # the base image's torch is the one installed: it must satisfy pyproject.toml's range, whose floor is
    # what transformers 5 needs (below 2.6 it disables PyTorch, and the build's model conversion fails)
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text())
    assert base and floor and tuple(map(int, base.groups())) >= tuple(map(int, floor.groups())) >= (2, 6)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0")
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    healthcheck = re.search(r"^HEALTHCHECK (.*?)\n(?=\S)", text, re.M | re.S).group(1).replace("\\\n", "")
    assert "os.environ.get('ALCHEMIST_SERVER_PORT', '8000')" in healthcheck and "127.0.0.1:{port}/health" in healthcheck
    for source in re.findall(r"^COPY (\S+)", text, re.M):
        assert (REPO / source).exists(), source
    # the address comes from the environment, so that ALCHEMIST_SERVER_PORT or a TOML's can move it (a flag in
    # the entrypoint overrode both: a review of the configuration)
    assert json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1)) == ["alchemist", "serve"]
    settings = dict(re.findall(r"\b(ALCHEMIST_[A-Z_]+)=(\S+)", text))
    assert (settings["ALCHEMIST_SERVER_HOST"], settings["ALCHEMIST_SERVER_PORT"]) == ("0.0.0.0", "8000")
    for name, value in settings.items():  # config variables it sets are real keys, of their type
        if name != "ALCHEMIST_CACHE" and not value.startswith("sk-"):
            config_from_env({name: value})


def test_readme_documents_gpu_deployment():
    text = (REPO / "README.md").read_text()
    assert "docker compose up" in text and "--gpus all" in text and "--api-key" in text


def test_the_metrics_reference_lists_every_metric_the_server_exports(tmp_path):
    """docs/metrics.md, with each metric's type, labels and help text (an outside pass found
    23 exported metrics no document named; a review, three rows edited apart from the code)."""
    table = re.findall(r"^\| `([^`]+)` \| (\w+) \| ([^|]*) \|", (REPO / "docs" / "metrics.md").read_text(),
                       re.MULTILINE)
    documented = {name for name, _, _ in table}
    exported = {name for name in exported_metric_names(tmp_path) if name.startswith("alchemist:")}
    text = exported_metrics_text(tmp_path / "again")
    for name, kind, labels in table:
        assert f"# TYPE {name} {kind}" in text, name
        series = re.findall(rf"^{re.escape(name)}(?:_bucket|_count|_sum)?{{([^}}]*)}}", text, re.MULTILINE)
        keys = {key for labelled in series for key in re.findall(r'(\w+)="', labelled)} - {"le", "quantile"}
        assert keys == ({key.strip() for key in labels.split(",")} - {"—", ""}), name
    for name, description in re.findall(r"^\| `([^`]+)` \| \w+ \| [^|]* \| (.*) \|$",
                                        (REPO / "docs" / "metrics.md").read_text(), re.MULTILINE):
        assert f"# HELP {name} {description}\n" in text, name  # the page's words are the help text's

    def family(sample: str) -> str | None:
        for suffix in ("", "_bucket", "_count", "_sum", "_created"):
            if suffix == "" or sample.endswith(suffix):
                name = sample[:len(sample) - len(suffix)] if suffix else sample
                if name in documented:
                    return name
        return None

    assert sorted(name for name in exported if family(name) is None) == []  # exported, not documented
    assert sorted(documented - {family(name) for name in exported}) == []  # documented, not exported
