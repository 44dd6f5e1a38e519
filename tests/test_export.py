"""`alchemist feedback export`: the ledger's labels as JSONL in TRL's dataset formats, loaded
with `datasets` and checked with TRL's own format helpers, from a real server's ledger
(DPO texts and indices over HTTP) and from a ledger holding every kind of label."""

import copy
import json
import os
import subprocess
import time

import pytest
from datasets import load_dataset
from fastapi.testclient import TestClient
from trl.data_utils import is_conversational, maybe_apply_chat_template

from server.cli import main
from tests.servers import TINY_NAME, tiny_app
from tests.tiny import tiny_tokenizer
from trainer.config import AdapterConfig, TrainConfig
from trainer.export import ExportError, export_rows, parse_since, write_jsonl
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE, ChoiceRecord, LabelRecord, RequestRecord, read_ledger

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def export(tmp_path, capsys, *flags) -> list[dict]:
    out = tmp_path / f"export-{len(list(tmp_path.glob('export-*')))}.jsonl"
    returned = main(["feedback", "export", "--adapter-dir", str(tmp_path), "--out", str(out), *flags])
    said = capsys.readouterr().err
    if returned == 1:  # no rows: nothing written (an empty file is no dataset `datasets` loads)
        assert "no rows" in said and not out.exists()
        return []
    assert returned == 0 and "rows to" in said
    return list(load_dataset("json", data_files=str(out), split="train"))


def test_a_dpo_servers_feedback_exports_as_trl_preference_and_unpaired_datasets(tmp_path, capsys):
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        base = {"model": TINY_NAME, "max_tokens": 4, "temperature": 1.0, "seed": 1, "messages": MESSAGES}
        texts_id = client.post("/v1/chat/completions", json=base).json()["id"]
        pair = client.post("/v1/chat/completions", json={**base, "n": 2, "ignore_eos": True}).json()
        served = [c["message"]["content"] for c in pair["choices"]]
        assert client.post("/v1/feedback", json={"id": texts_id, "chosen": "Paris."}).status_code == 200
        r = client.post("/v1/feedback", json={"id": pair["id"], "chosen_index": 1, "rejected_index": 0})
        assert r.status_code == 200, r.text
    preference = export(tmp_path, capsys, "--format", "preference")
    assert len(preference) == 2 and all(is_conversational(row) for row in preference)
    assert preference[0]["prompt"] == MESSAGES and preference[0]["chosen"] == [
        {"role": "assistant", "content": "Paris."}]
    assert [preference[1]["chosen"][0]["content"], preference[1]["rejected"][0]["content"]] == served[::-1]
    tokenizer = tiny_tokenizer()
    for row in preference:  # TRL renders the rows as DPOTrainer does
        rendered = maybe_apply_chat_template(row, tokenizer)
        assert set(rendered) == {"prompt", "chosen", "rejected"} and "France" in rendered["prompt"]
    unpaired = export(tmp_path, capsys, "--format", "unpaired")
    assert [row["label"] for row in unpaired] == [True, False, True, False]
    assert export(tmp_path, capsys, "--format", "preference", "--since", "2999-01-01") == []
    assert main(["feedback", "export", "--adapter-dir", str(tmp_path), "--format", "prompt-completion"]) == 1
    assert "none with rows in this format" in capsys.readouterr().err  # a DPO server served no CPT rows


def _ledger_with_every_kind(root) -> None:
    ledger = Ledger(root / LEDGER_FILE)
    now = time.time()
    group = [ChoiceRecord(i, [10 + i], f"answer {i}", [-0.5]) for i in range(3)]
    for request_id, method, prompt in (("g", "grpo", MESSAGES), ("c", "cpt", MESSAGES), ("q", "dpo", MESSAGES),
                                       ("t", "dpo", "The capital of France is")):
        ledger.record_request(RequestRecord(request_id, now, 0, method, [1, 2, 3], prompt))
        ledger.record_finished(request_id, group if request_id == "g" else group[:1], False)
    ledger.commit_label("g", LabelRecord("rewards", "reward_function", rewards=[1.0, 0.0, 0.5]))
    ledger.commit_label("q", LabelRecord("preference", chosen="Lyon.", choice_index=0, chosen_token_ids=[5],
                                         rejected_token_ids=[10]))
    ledger.record_fate("q", "quarantined", reason="eval_gate")
    ledger.commit_label("t", LabelRecord("preference", chosen=" Paris.", choice_index=0, chosen_token_ids=[5],
                                         rejected_token_ids=[10]))
    ledger.close()


def test_every_kind_of_label_exports_in_its_format_and_styles_are_never_mixed(tmp_path, capsys):
    _ledger_with_every_kind(tmp_path)
    rows = read_ledger(tmp_path / LEDGER_FILE)
    with pytest.raises(ExportError, match="--style"):
        export_rows(rows, "preference")  # chat and text requests: one style per file
    preference = export(tmp_path, capsys, "--format", "preference", "--style", "conversational")
    assert [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in preference] == [
        ("answer 0", "answer 1"), ("answer 0", "answer 2")]  # the group's best against each worse sample
    unpaired = export(tmp_path, capsys, "--format", "unpaired", "--style", "conversational")
    assert [(r["completion"][0]["content"], r["label"]) for r in unpaired] == [("answer 0", True),
                                                                              ("answer 1", False)]
    completions = export(tmp_path, capsys, "--format", "prompt-completion", "--style", "conversational")
    assert [(r["completion"][0]["content"], r["reward"], r["group_id"]) for r in completions] == [
        ("answer 0", None, None), ("answer 0", 1.0, "g"), ("answer 1", 0.0, "g"),
        ("answer 2", 0.5, "g")]  # CPT's, then the group's: its samples grouped by their request's id
    assert export(tmp_path, capsys, "--format", "language-modeling", "--style", "conversational") == [
        {"messages": MESSAGES}]  # what the CPT request trained on: its prompt
    quarantined = export(tmp_path, capsys, "--format", "preference", "--style", "conversational",
                         "--include-quarantined")
    assert ("Lyon.", "answer 0") in [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in quarantined]
    # marked, on every row: one schema for `datasets`, and one filter to leave them out again
    assert sorted((r["chosen"][0]["content"], r["quarantined"]) for r in quarantined) == [
        ("Lyon.", True), ("answer 0", False), ("answer 0", False)], quarantined
    assert all("quarantined" not in r for r in preference)
    standard = export(tmp_path, capsys, "--format", "preference", "--style", "standard")
    assert standard == [{"prompt": "The capital of France is", "chosen": " Paris.", "rejected": "answer 0"}]
    assert not is_conversational(standard[0])


def test_a_cpt_servers_prompts_export_as_trl_language_modeling_rows(tmp_path, capsys):
    """CPT trains on each request's prompt (an outside pass: `prompt-completion` rows hold
    what it served, not what it trained on). `language-modeling` rows hold the prompt, as
    `messages` (chat) or `text`; TRL renders a chat row as the served prompt less the
    generation prompt that opens the answer."""
    app = tiny_app(train=TrainConfig(mode="cpt", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        body = {"model": TINY_NAME, "max_tokens": 2}
        assert client.post("/v1/chat/completions", json={**body, "messages": MESSAGES}).status_code == 200
        assert client.post("/v1/completions", json={**body, "prompt": "Once upon a time"}).status_code == 200
        client.app.state.alchemist.training.ledger.flush()
    chat = export(tmp_path, capsys, "--format", "language-modeling", "--style", "conversational")
    assert chat == [{"messages": MESSAGES}] and is_conversational(chat[0])
    assert export(tmp_path, capsys, "--format", "language-modeling", "--style", "standard") == [
        {"text": "Once upon a time"}]
    tokenizer = tiny_tokenizer()
    rendered = tokenizer(maybe_apply_chat_template(chat[0], tokenizer)["text"], add_special_tokens=False).input_ids
    served = read_ledger(tmp_path / LEDGER_FILE)[0].request.prompt_token_ids
    assert len(rendered) < len(served) and served[:len(rendered)] == rendered


def test_bad_export_arguments_get_a_clear_error(tmp_path, capsys):
    assert main(["feedback", "export", "--adapter-dir", str(tmp_path)]) == 2
    assert "no feedback ledger" in capsys.readouterr().err
    with pytest.raises(ExportError, match="ISO-8601"):
        parse_since("last tuesday")
    assert parse_since("1970-01-02") == 86400.0
    json.dumps(parse_since("2026-11-24T09:30:00+01:00"))


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.mark.parametrize("native", [False, True])
def test_a_request_that_offered_tools_exports_them_as_trl_renders_them(tmp_path, capsys, native):
    """The tools a chat request offered were rendered into its prompt: a template with a
    tool section gets them as TRL's `tools` column, one without gets the messages the
    fallback tool prompt rendered; either way TRL renders the served prompt from the row."""
    tokenizer = copy.deepcopy(tiny_tokenizer())  # the shared one stays as it is
    if native:  # the tiny template, with a tool section as Qwen's has
        tokenizer.chat_template = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n"
                                   "{% endif %}" + tokenizer.chat_template)
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)),
                   max_model_len=1024, tokenizer=tokenizer)  # the tool prompt is long
    with TestClient(app) as client:
        body = {"model": TINY_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
        with_tools = client.post("/v1/chat/completions", json={**body, "tools": [WEATHER]}).json()["id"]
        plain = client.post("/v1/chat/completions", json=body).json()["id"]
        for completion in (with_tools, plain):
            assert client.post("/v1/feedback", json={"id": completion, "chosen": "Sunny."}).status_code == 200
        client.app.state.alchemist.training.ledger.flush()
        served = client.post("/tokenize", json={"model": TINY_NAME, "messages": body["messages"],
                                                "tools": [WEATHER]}).json()["tokens"]
    rows = export(tmp_path, capsys, "--format", "preference")
    tools = [json.loads(row["tools"]) if row.get("tools") else None for row in rows]
    assert tools == ([[WEATHER], None] if native else [None, None])
    rendered = maybe_apply_chat_template({"prompt": rows[0]["prompt"], "chosen": rows[0]["chosen"],
                                          "rejected": rows[0]["rejected"]}, tokenizer, tools=tools[0])
    assert tokenizer(rendered["prompt"], add_special_tokens=False)["input_ids"] == served


def test_chat_template_kwargs_export_as_trls_column_of_that_name(tmp_path, capsys):
    """What a request gave its chat template (vLLM's `chat_template_kwargs`) goes with its
    row, and TRL hands it to the template: every row renders the prompt that was served."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = ("{% if terse is defined and terse %}<|im_start|>system\nBe terse.<|im_end|>\n"
                               "{% endif %}" + tokenizer.chat_template)
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)),
                   tokenizer=tokenizer)
    served = []
    with TestClient(app) as client:
        for extra in ({"chat_template_kwargs": {"terse": True}}, {}):
            body = {"model": TINY_NAME, "messages": MESSAGES, **extra}
            completion = client.post("/v1/chat/completions", json={**body, "max_tokens": 4}).json()["id"]
            assert client.post("/v1/feedback", json={"id": completion, "chosen": "Paris."}).status_code == 200
            served.append(client.post("/tokenize", json=body).json()["tokens"])
        client.app.state.alchemist.training.ledger.flush()
    assert served[0] != served[1]
    rows = export(tmp_path, capsys, "--format", "preference")
    assert [row["chat_template_kwargs"] for row in rows] == [{"terse": True}, {}]
    for row, tokens in zip(rows, served):
        rendered = maybe_apply_chat_template(row, tokenizer)
        assert tokenizer(rendered["prompt"], add_special_tokens=False)["input_ids"] == tokens


def test_content_parts_and_the_developer_role_export_as_the_template_was_given_them(tmp_path, capsys):
    """A request written with content parts, the developer role and the SDK's extra fields
    exports the messages the chat template was given (text, system), so that TRL renders
    the served prompt; a plain request exports the client's own messages."""
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)))
    parts = [{"type": "text", "text": "Answer briefly."}, {"type": "text", "text": "Be polite."}]
    messages = [{"role": "developer", "content": parts},
                {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]},
                {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": []},
                {"role": "user", "content": "And of Italy?"}]
    with TestClient(app) as client:
        served = client.post("/tokenize", json={"model": TINY_NAME, "messages": messages}).json()["tokens"]
        for chat_messages in (messages, MESSAGES):
            completion = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 4,
                                                                   "messages": chat_messages}).json()["id"]
            assert client.post("/v1/feedback", json={"id": completion, "chosen": "Rome."}).status_code == 200
        client.app.state.alchemist.training.ledger.flush()
    rows = export(tmp_path, capsys, "--format", "preference")
    assert rows[0]["prompt"][:2] == [{"role": "system", "content": "Answer briefly.\nBe polite."},  # as vLLM joins
                                     {"role": "user", "content": "Capital of France?"}]
    assert rows[1]["prompt"] == MESSAGES
    tokenizer = tiny_tokenizer()
    rendered = maybe_apply_chat_template({key: rows[0][key] for key in ("prompt", "chosen", "rejected")}, tokenizer)
    assert tokenizer(rendered["prompt"], add_special_tokens=False)["input_ids"] == served


def test_a_ledger_written_before_requests_kept_their_tools_is_read_and_extended(tmp_path):
    import sqlite3

    path = tmp_path / LEDGER_FILE
    Ledger(path).close()
    conn = sqlite3.connect(path)
    for column in ("tools", "chat_template_kwargs", "generation_prompt"):  # as an older server wrote it
        conn.execute(f"ALTER TABLE requests DROP COLUMN {column}")
    conn.execute("INSERT INTO requests (id, served_at, adapter_version, method, prompt, prompt_token_ids) "
                 "VALUES ('old', 1.0, 0, 'dpo', '\"Hi\"', '[1]')")
    conn.commit()
    conn.close()
    assert [(row.request.id, row.request.tools) for row in read_ledger(path)] == [("old", None)]
    ledger = Ledger(path)  # the writer adds the columns
    ledger.record_request(RequestRecord("new", 2.0, 0, "dpo", [1], MESSAGES, [WEATHER], {"terse": True}, False))
    ledger.close()
    assert [(row.request.id, row.request.tools, row.request.chat_template_kwargs, row.request.generation_prompt)
            for row in read_ledger(path)] == [("old", None, None, True), ("new", [WEATHER], {"terse": True}, False)]


def test_an_export_interrupted_midway_leaves_the_file_that_was_there(tmp_path):
    """The rows go to a temporary file renamed into place once whole: an export that dies
    midway (here: a row it cannot write; an outside pass killed one with -9) leaves the
    previous dataset, loadable, and no half line."""
    out = tmp_path / "prefs.jsonl"
    write_jsonl(out, [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    out.chmod(0o600)  # users' prompts: the replacement keeps the mode
    write_jsonl(out, [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    assert out.stat().st_mode & 0o777 == 0o600
    with pytest.raises(TypeError):
        write_jsonl(out, [{"prompt": "x", "chosen": "y", "rejected": "z"}, {"prompt": {"not", "json"}}])
    assert list(load_dataset("json", data_files=str(out), split="train")) == [
        {"prompt": "a", "chosen": "b", "rejected": "c"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefs.jsonl"]
    fifo = tmp_path / "pipe"  # `--out /dev/stdout` or `>(gzip …)`: written through, not replaced
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    write_jsonl(fifo, [{"prompt": "p"}])
    assert reader.communicate(timeout=30)[0] == b'{"prompt": "p"}\n' and fifo.exists() and not fifo.is_file()


def test_answers_cut_by_max_tokens_are_counted_and_left_out_on_request(tmp_path, capsys):
    """TRL ends each exported completion with the end of turn, so an answer max_tokens cut
    short teaches to stop mid-answer (an outside pass): the export says how many rows hold
    one, and `--drop-truncated` leaves them out."""
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        for max_tokens, label in ((3, {"chosen": "A better answer."}), (3, {"chosen": "Yes.", "rejected": "No."})):
            r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": max_tokens,
                                                          "ignore_eos": True, "messages": MESSAGES})
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert client.post("/v1/feedback", json={"id": r.json()["id"], **label}).status_code == 200
        client.app.state.alchemist.training.ledger.flush()
    assert [c.finish_reason for row in read_ledger(tmp_path / LEDGER_FILE) for c in row.choices] == ["length"] * 2
    for flags, rows, said in (((), 2, "written"), (("--drop-truncated",), 1, "left out")):
        out = tmp_path / f"cut-{len(flags)}.jsonl"
        assert main(["feedback", "export", "--adapter-dir", str(tmp_path), "--out", str(out), *flags]) == 0
        assert f"1 rows hold a served answer cut short (by max_tokens, a stop the client gave, or a disconnect): " \
            f"{said}" in capsys.readouterr().err
        exported = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(exported) == rows and exported[-1]["chosen"][0]["content"] == "Yes."



def test_an_export_whose_rows_drop_truncated_left_out_says_so(tmp_path, capsys):
    """A review: it said "1 requests, none with rows in this format: DPO labels … export as
    preference" of a DPO label exported as preference rows."""
    _ledger(tmp_path, [("cut", "dpo", MESSAGES, [ChoiceRecord(0, [10], "Lyo", None, "length")], LABEL)])
    out = tmp_path / "none.jsonl"
    assert main(["feedback", "export", "--adapter-dir", str(tmp_path), "--drop-truncated", "--out", str(out)]) == 1
    said = capsys.readouterr().err
    assert "1 rows hold a served answer cut short" in said and "left out (--drop-truncated)" in said
    assert "none with rows in this format" not in said and not out.exists()


def test_an_answer_a_clients_stop_ended_is_counted_as_cut_short(tmp_path, capsys):
    """An answer that a client's `stop` string or `stop_token_ids` ended (an outside pass):
    the model did not end its turn there, and the stop string is not in the text, so TRL's
    end of turn after it teaches what the server never trained on. The ledger keeps the
    stop (vLLM's `stop_reason`); the export counts such rows as cut short."""
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)))
    base = {"model": TINY_NAME, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "messages": MESSAGES}
    with TestClient(app) as client:
        whole = client.post("/v1/chat/completions", json=base).json()
        ledger = client.app.state.alchemist.training.ledger
        ledger.flush()
        (served,) = read_ledger(tmp_path / LEDGER_FILE)[0].choices
        text = whole["choices"][0]["message"]["content"]
        stops = ({"stop_token_ids": [served.token_ids[2]]}, {"stop": [text[len(text) // 2:]]})
        for stop in stops:
            r = client.post("/v1/chat/completions", json={**base, **stop}).json()
            assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] is not None
            assert client.post("/v1/feedback", json={"id": r["id"], "chosen": "Paris."}).status_code == 200
        assert client.post("/v1/feedback", json={"id": whole["id"], "chosen": "Paris."}).status_code == 200
        ledger.flush()
    rows = read_ledger(tmp_path / LEDGER_FILE)
    assert [(c.finish_reason, c.stop_reason) for row in rows for c in row.choices] == [
        ("length", None), ("stop", served.token_ids[2]), ("stop", stops[1]["stop"][0])]
    written, counts = export_rows(rows, "preference")
    assert len(written) == 3 and counts.truncated == 3  # the first cut by max_tokens, the others by the stops
    assert export_rows(rows, "preference", drop_truncated=True)[0] == []


def _ledger(root, requests: list[tuple[str, str, object, list[ChoiceRecord], LabelRecord | None]]) -> None:
    """(id, method, prompt, choices, label) each."""
    ledger = Ledger(root / LEDGER_FILE)
    for request_id, method, prompt, choices, label in requests:
        ledger.record_request(RequestRecord(request_id, time.time(), 0, method, [1, 2, 3], prompt))
        ledger.record_finished(request_id, choices, all(c.finish_reason == "abort" for c in choices))
        if label is not None:
            ledger.commit_label(request_id, label)
    ledger.close()


LABEL = LabelRecord("preference", chosen="Paris.", choice_index=0, chosen_token_ids=[5], rejected_token_ids=[10])


def test_an_answer_a_disconnect_cut_short_is_counted_as_cut_and_left_out_on_request(tmp_path):
    """A CPT answer a client stopped reading (finish reason `abort`) is no whole answer either."""
    _ledger(tmp_path, [("whole", "cpt", MESSAGES, [ChoiceRecord(0, [10], "Paris is the capital.", None, "stop")],
                        None),
                       ("gone", "cpt", MESSAGES, [ChoiceRecord(0, [10], "The ocean is a", None, "abort")], None)])
    rows = read_ledger(tmp_path / LEDGER_FILE)
    written, counts = export_rows(rows, "prompt-completion")
    assert len(written) == 2 and counts.truncated == 1
    kept, _ = export_rows(rows, "prompt-completion", drop_truncated=True)
    assert [row["completion"][0]["content"] for row in kept] == ["Paris is the capital."]
    # what a CPT server trains on: not a prompt its client left (a retry after a timeout sends it again)
    written, counts = export_rows(rows, "language-modeling")
    assert written == [{"messages": MESSAGES}] and counts.abandoned == 1


def test_a_groups_samples_with_equal_texts_make_no_preference_pair(tmp_path):
    """Samples of a group can say the same thing and still be rewarded differently (a noisy
    reward; an outside pass): a pair of equal texts teaches nothing, and is not written."""
    same = [ChoiceRecord(i, [10], text, [-0.5], "stop") for i, text in enumerate([" 4, 5,", " 4, 5,", " 6"])]
    _ledger(tmp_path, [("g", "grpo", MESSAGES, same, LabelRecord("rewards", "client", rewards=[1.0, 0.5, 0.0]))])
    rows, _ = export_rows(read_ledger(tmp_path / LEDGER_FILE), "preference")
    assert [(row["chosen"][0]["content"], row["rejected"][0]["content"]) for row in rows] == [(" 4, 5,", " 6")]


def test_the_style_is_that_of_the_requests_with_rows_and_a_prompt_the_ledger_lacks_is_counted_apart(tmp_path):
    """An unlabelled text completion (a probe, lm-eval's traffic) makes no preference row:
    it does not make the export's style ambiguous. A labelled request whose prompt
    `truncate_prompt_tokens` cut has no prompt to export: counted as such, not as another style."""
    served = [ChoiceRecord(0, [10], "Lyon.", None, "stop")]
    _ledger(tmp_path, [("chat", "dpo", MESSAGES, served, LABEL), ("probe", "dpo", "Once upon a time", served, None),
                       ("cut", "dpo", None, served, LABEL)])
    rows, counts = export_rows(read_ledger(tmp_path / LEDGER_FILE), "preference")
    assert [row["prompt"] for row in rows] == [MESSAGES]
    assert (counts.skipped, counts.without_prompt) == (0, 1)


def test_an_export_of_no_rows_leaves_the_file_there_and_a_path_it_cannot_write_is_said_plainly(tmp_path, capsys):
    _ledger(tmp_path, [("chat", "dpo", MESSAGES, [ChoiceRecord(0, [10], "Lyon.", None, "stop")], LABEL)])
    out = tmp_path / "prefs.jsonl"
    assert main(["feedback", "export", "--adapter-dir", str(tmp_path), "--out", str(out)]) == 0
    before = out.read_text()
    assert main(["feedback", "export", "--adapter-dir", str(tmp_path), "--out", str(out), "--since",
                 "2999-01-01"]) == 1
    assert out.read_text() == before and "not written" in capsys.readouterr().err
    assert main(["feedback", "export", "--adapter-dir", str(tmp_path), "--out",
                 str(tmp_path / "no-such-directory" / "x.jsonl")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_a_prompt_ending_with_an_assistant_message_is_left_out_and_counted(tmp_path):
    """TRL renders such a prompt as continued and the completion as a turn of its own:
    neither what `continue_final_message` served nor what a new turn after it served."""
    served = [ChoiceRecord(0, [10], " chicken cross the road?", None, "stop")]
    partial = [*MESSAGES, {"role": "assistant", "content": "Why did the"}]
    # and one that ends with a system message, which TRL's apply_chat_template refuses (a review)
    last_system = [*MESSAGES, {"role": "system", "content": "Answer in French."}]
    _ledger(tmp_path, [("cont", "dpo", partial, served, LABEL), ("chat", "dpo", MESSAGES, served, LABEL),
                       ("sys", "dpo", last_system, served, LABEL)])
    rows, counts = export_rows(read_ledger(tmp_path / LEDGER_FILE), "preference")
    assert [row["prompt"] for row in rows] == [MESSAGES] and counts.continuing == 2


def test_every_row_has_the_tools_column_once_one_has(tmp_path):
    """`datasets` infers a file's columns from its first 10 MB: a `tools` column that first
    appeared past it failed to load (a review)."""
    served = [ChoiceRecord(0, [10], "Lyon.", None, "stop")]
    ledger = Ledger(tmp_path / LEDGER_FILE)
    for request_id, tools in (("plain", None), ("tools", [WEATHER])):
        ledger.record_request(RequestRecord(request_id, time.time(), 0, "dpo", [1, 2, 3], MESSAGES, tools))
        ledger.record_finished(request_id, served, False)
        ledger.commit_label(request_id, LABEL)
    ledger.close()
    rows, _ = export_rows(read_ledger(tmp_path / LEDGER_FILE), "preference")
    assert [row["tools"] for row in rows] == [None, json.dumps([WEATHER])]


def test_a_completions_prompt_sent_as_token_ids_or_cut_is_no_prompt_as_written(tmp_path, capsys):
    """A review: /v1/completions handed the ledger the text its token ids decode to, and a
    prompt truncate_prompt_tokens cut as the decoded tail (which may begin inside a
    character); TRL would train on a re-tokenization of it, not on what was served."""
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        ids = {}
        for name, body in (("text", {"prompt": "The capital of France is"}),
                           ("token ids", {"prompt": tiny_tokenizer()("The capital of Italy is")["input_ids"]}),
                           ("cut", {"prompt": "The capital of Spain is", "truncate_prompt_tokens": 3})):
            r = client.post("/v1/completions", json={"model": TINY_NAME, "max_tokens": 3, **body})
            ids[name] = r.json()["id"]
            assert client.post("/v1/feedback", json={"id": ids[name], "chosen": " Paris."}).status_code == 200
        client.app.state.alchemist.training.ledger.flush()
    prompts = {row.request.id: row.request.prompt for row in read_ledger(tmp_path / LEDGER_FILE)}
    assert [prompts[ids[name]] for name in ("text", "token ids", "cut")] == ["The capital of France is", None, None]
    rows, counts = export_rows(read_ledger(tmp_path / LEDGER_FILE), "preference")
    assert [row["prompt"] for row in rows] == ["The capital of France is"] and counts.without_prompt == 2


def test_a_chat_served_without_the_assistants_turn_opened_is_left_out_and_said(tmp_path, capsys):
    """`add_generation_prompt: false` after a user's message served a prompt that TRL,
    which opens the assistant's turn after any prompt not ending with one, never renders:
    such a row would train on a prompt that was not served."""
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        for opened in (False, True):
            body = {"model": TINY_NAME, "messages": MESSAGES, "add_generation_prompt": opened}
            completion = client.post("/v1/chat/completions", json={**body, "max_tokens": 4}).json()["id"]
            assert client.post("/v1/feedback", json={"id": completion, "chosen": "Paris."}).status_code == 200
            served = client.post("/tokenize", json=body).json()["tokens"]
        client.app.state.alchemist.training.ledger.flush()
    assert [row.request.generation_prompt for row in read_ledger(tmp_path / LEDGER_FILE)] == [False, True]
    rows, counts = export_rows(read_ledger(tmp_path / LEDGER_FILE), "preference")
    assert len(rows) == 1 and (counts.without_generation_prompt, counts.continuing) == (1, 0)
    tokenizer = tiny_tokenizer()
    rendered = maybe_apply_chat_template({key: rows[0][key] for key in ("prompt", "chosen", "rejected")}, tokenizer)
    assert tokenizer(rendered["prompt"], add_special_tokens=False)["input_ids"] == served  # the one with the turn
    assert len(export(tmp_path, capsys, "--format", "unpaired")) == 2
    out = tmp_path / "prefs.jsonl"
    assert main(["feedback", "export", "--adapter-dir", str(tmp_path), "--out", str(out)]) == 0
    assert "1 requests left out served with add_generation_prompt: false" in capsys.readouterr().err


def test_a_cpt_prompt_served_without_the_assistants_turn_opened_is_a_language_modeling_row_as_served(tmp_path):
    """A language-modeling row is the prompt alone, which TRL renders without the turn
    opened: as a prompt served with `add_generation_prompt: false` was, token for token."""
    app = tiny_app(train=TrainConfig(mode="cpt", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        body = {"model": TINY_NAME, "messages": MESSAGES, "add_generation_prompt": False}
        assert client.post("/v1/chat/completions", json={**body, "max_tokens": 4}).status_code == 200
        served = client.post("/tokenize", json=body).json()["tokens"]
        client.app.state.alchemist.training.ledger.flush()
    rows, counts = export_rows(read_ledger(tmp_path / LEDGER_FILE), "language-modeling")
    assert rows == [{"messages": MESSAGES}] and counts.without_generation_prompt == 0
    tokenizer = tiny_tokenizer()
    assert tokenizer(maybe_apply_chat_template(rows[0], tokenizer)["text"], add_special_tokens=False)["input_ids"] \
        == served
    rows, counts = export_rows(read_ledger(tmp_path / LEDGER_FILE), "prompt-completion")
    assert rows == [] and counts.without_generation_prompt == 1
