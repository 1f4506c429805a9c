"""Task sources as users bring them, without conversion: a ``datasets`` directory (``save_to_disk``), a hub dataset
``hf://org/name?split=..&config=..`` (loaded by ``datasets.load_dataset`` from a local stand-in of the hub, the
hub itself being out of reach here: tests/hub_standin.py), verl's Parquet layout, slime's JSONL and a column
mapping; a bad record is one line naming its file, row and column."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from engines.model.text.tokenizer import TextTokenizer
from envs.code import CodeEnv
from envs.tasks import TaskFileError, load_tasks
from tests.hub_standin import COMMIT, HubStandIn, serve
from tests.test_tokenizers import _transformers_ids, qwen_dir  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[1]
QA = [{"question": "What is 2 + 3?", "solution": "5", "level": 1},
      {"question": "What is 7 * 6?", "solution": "42", "level": 2}]


def verl_records() -> list[dict]:
    """Rows as verl's data preprocessing writes them (its gsm8k example's columns)."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "system", "content": "Think step by step."},
                        {"role": "user", "content": f"{q['question']} Let's think step by step."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": q["solution"]},
             "extra_info": {"split": "train", "index": i, "answer": q["solution"], "question": q["question"]}}
            for i, q in enumerate(QA)]


def test_a_save_to_disk_directory_loads_with_a_column_mapping(tmp_path):
    Dataset.from_list(QA).save_to_disk(tmp_path / "qa")
    with pytest.raises(TaskFileError, match="missing field 'prompt'"):
        load_tasks(tmp_path / "qa")
    tasks = load_tasks(tmp_path / "qa", columns={"prompt": "question", "answer": "solution"})
    assert [(t.id, t.prompt, t.answer, t.meta) for t in tasks] == [
        ("qa-1", "What is 2 + 3?", "5", {"level": 1}), ("qa-2", "What is 7 * 6?", "42", {"level": 2})]
    DatasetDict({"train": Dataset.from_list(QA), "test": Dataset.from_list(QA[:1])}).save_to_disk(tmp_path / "dd")
    with pytest.raises(TaskFileError, match=r"dd holds the splits train, test: give one as .*dd/train$"):
        load_tasks(tmp_path / "dd", columns={"prompt": "question", "answer": "solution"})
    test = load_tasks(tmp_path / "dd" / "test", columns={"prompt": "question", "answer": "solution"})
    assert [t.prompt for t in test] == ["What is 2 + 3?"]
    (tmp_path / "plain").mkdir()
    with pytest.raises(TaskFileError, match="not a datasets directory"):
        load_tasks(tmp_path / "plain")


def test_verl_parquet_loads_as_it_is(tmp_path, qwen_dir):  # noqa: F811 - the fixture
    path = tmp_path / "train.parquet"
    Dataset.from_list(verl_records()).to_parquet(path)  # as verl's preprocessing scripts write it
    tasks = load_tasks(path)
    first = tasks[0]
    assert first.messages == verl_records()[0]["prompt"]  # chat messages stay messages
    assert first.prompt == "What is 2 + 3? Let's think step by step." and first.answer == "5"
    assert first.meta["data_source"] == "openai/gsm8k" and first.meta["extra_info"]["index"] == 0
    assert first.meta["reward_model"] == {"style": "rule", "ground_truth": "5"} and first.meta["ability"] == "math"
    tok = TextTokenizer.load(qwen_dir)  # rendered with the model's own template when the prompt is made
    assert tok.prompt_ids(first) == _transformers_ids(qwen_dir, first.messages, add_generation_prompt=True)


def test_slime_jsonl_loads_as_it_is(tmp_path):
    path = tmp_path / "slime.jsonl"
    rows = [{"prompt": [{"content": "Find a + b + c.", "role": "user", "step_loss_mask": 1}], "label": "34",
             "metadata": {"source_name": "math"}},
            {"prompt": "Plain text prompt", "label": 7},
            {"prompt": "Accepted answers", "label": ["a", "b"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat, plain, many = load_tasks(path)
    assert chat.messages == rows[0]["prompt"] and chat.prompt == "Find a + b + c." and chat.answer == "34"
    assert chat.meta == {"metadata": {"source_name": "math"}} and "label" not in chat.meta
    assert (plain.prompt, plain.answer, plain.messages) == ("Plain text prompt", "7", None)
    assert json.loads(many.answer) == ["a", "b"]  # not a string: its JSON text


def test_columns_read_inside_struct_columns_and_are_checked(tmp_path):
    path = tmp_path / "train.parquet"
    Dataset.from_list(verl_records()).to_parquet(path)
    tasks = load_tasks(path, columns={"answer": "extra_info.answer", "id": "extra_info.question"})
    assert [(t.id, t.answer) for t in tasks] == [("What is 2 + 3?", "5"), ("What is 7 * 6?", "42")]
    with pytest.raises(TaskFileError, match="columns: 'solution' is not a task field"):
        load_tasks(path, columns={"solution": "x"})
    code = tmp_path / "code.jsonl"
    code.write_text(json.dumps({"instruction": "def add(a, b):\n", "tests": "assert add(1, 2) == 3",
                                "entry_point": "add"}) + "\n")
    (task,) = CodeEnv.load_tasks(code, columns={"prompt": "instruction"})  # an environment's own schema, mapped
    assert task.prompt == "def add(a, b):\n" and task.meta == {"tests": "assert add(1, 2) == 3", "entry_point": "add"}


@pytest.mark.parametrize(("row", "column", "message"), [
    ({"reward_model": {"style": "rule", "ground_truth": None}}, "reward_model.ground_truth", "missing column"),
    ({"prompt": [{"role": "user", "content": None}]}, "prompt", r"messages\[0\] must be an object"),
    ({"prompt": []}, "prompt", "must be a non-empty list of chat messages"),
])
def test_a_bad_record_names_its_file_row_and_column(tmp_path, row, column, message):
    records = [*verl_records(), {**verl_records()[0], **row}]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    with pytest.raises(TaskFileError) as err:
        load_tasks(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path} row 3: ") and repr(column) in text
    assert re.search(message, text), text
    mapped = tmp_path / "mapped.jsonl"
    mapped.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(TaskFileError, match=r"mapped.jsonl:1: missing column 'solution' \(answer\)$"):
        load_tasks(mapped, columns={"prompt": "question", "answer": "solution"})


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The hub stand-in serving one dataset repository with two configs, as the hub lays them out (data files,
    README.md with the configs in its YAML header)."""
    repo = tmp_path_factory.mktemp("hub") / "qa"
    for config, rows in (("easy", QA), ("chat", verl_records())):
        (repo / config).mkdir(parents=True)
        Dataset.from_list(rows[:1]).to_parquet(repo / config / "test.parquet")
        Dataset.from_list(rows).to_parquet(repo / config / "train.parquet")
    configs = "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.parquet\n"
                      f"  - split: test\n    path: {c}/test.parquet\n" for c in ("easy", "chat"))
    (repo / "README.md").write_text(f"---\nconfigs:\n{configs}---\n# A small QA dataset\n")
    server, url = serve({"org/qa": repo})
    yield url
    server.shutdown()


HUB_SOURCES = [("hf://org/qa?split=test&config=easy", {"prompt": "question", "answer": "solution"}),
               ("hf://org/qa?config=chat", {}),  # split defaults to train; verl's layout
               ("hf://org/missing?split=train", {}), ("hf://org/qa?config=hard", {}), ("hf://org/qa?splitt=train", {})]


@pytest.fixture(scope="module")
def hub_loads(hub, tmp_path_factory) -> list:
    """``load_tasks`` of each of HUB_SOURCES in one child process (huggingface_hub and datasets read HF_ENDPOINT
    once, when they are imported): the tasks as lists, or the error's text; and the stand-in's request log."""
    code = ("import json, sys\nfrom envs.tasks import load_tasks, TaskFileError\nout = []\n"
            "for source, columns in json.loads(sys.argv[1]):\n"
            "    try:\n        tasks = load_tasks(source, columns=columns)\n"
            "        out.append([[t.id, t.prompt, t.answer, t.messages] for t in tasks])\n"
            "    except TaskFileError as e:\n        out.append(str(e))\n"
            "print(json.dumps(out))\n")
    env = {**os.environ, "HF_ENDPOINT": hub, "HF_HOME": str(tmp_path_factory.mktemp("hf")), "PYTHONPATH": str(ROOT),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_TOKEN", None)
    HubStandIn.log.clear()
    run = subprocess.run([sys.executable, "-c", code, json.dumps(HUB_SOURCES)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), list(HubStandIn.log)


def test_a_hub_dataset_loads_by_split_and_config(hub_loads):
    (easy, chat, *_), log = hub_loads
    assert easy == [["qa-1", "What is 2 + 3?", "5", None]]
    fetched = [p for _, p in log if "/resolve/" in p]
    assert any(p.endswith(f"/datasets/org/qa/resolve/{COMMIT}/easy/test.parquet") for p in fetched), fetched
    assert [(i, a, m[-1]["role"]) for i, _, a, m in chat] == [("qa-1", "5", "user"), ("qa-2", "42", "user")]


def test_hub_errors_are_one_line(hub_loads):
    errors = hub_loads[0][2:]
    for text, message in zip(errors, [
            r"^hf://org/missing\?split=train: cannot load org/missing from http://127\.0\.0\.1:\d+: "
            r"DatasetNotFoundError",
            r"^hf://org/qa\?config=hard: cannot load org/qa .*'hard' not found",
            r"^hf://org/qa\?splitt=train: unknown option 'splitt'"], strict=True):
        assert isinstance(text, str) and "\n" not in text and re.search(message, text), text


def test_a_hub_source_survives_pathlib():
    # a config field typed Path turns hf://org/qa into hf:/org/qa
    from envs.task_sources import hub_source, parse_hub_source

    assert hub_source(Path("hf://org/qa?split=test&config=easy")) == "hf://org/qa?split=test&config=easy"
    assert parse_hub_source(hub_source("hf://qa")) == ("qa", {"split": "train"})
    assert hub_source("data/hf_tasks.jsonl") is None
