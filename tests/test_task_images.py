"""Tasks with images, in each layout users bring them: JSONL with paths relative to the file or data URLs, content
parts with inline images (transformers', OpenAI's), verl's Parquet with ``<image>`` placeholders, slime's JSONL with
``multimodal_inputs``, a ``datasets`` directory with an ``Image`` column (TRL's convention: no placeholders); counts
that disagree and images that do not decode are one line naming the task and the column; save_tasks round-trips."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageFile

from engines.model.images import ImageRef
from envs.tasks import TaskFileError, load_tasks, save_tasks

IMAGE, TEXT = {"type": "image"}, "text"


def png(color: str, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def colour(image: ImageRef) -> tuple[int, int, int]:
    return image.load().getpixel((0, 0))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def text(t: str) -> dict:
    return {"type": TEXT, "text": t}


@pytest.fixture
def images_dir(tmp_path) -> Path:
    """``data/img/{red,blue}.png`` beside where the task files go (``data/``)."""
    folder = tmp_path / "data" / "img"
    folder.mkdir(parents=True)
    for name in ("red", "blue"):
        (folder / f"{name}.png").write_bytes(png(name))
    return tmp_path / "data"


def test_jsonl_with_paths_relative_to_the_file_data_urls_and_inline_parts(images_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative paths are the file's folder's, not the working directory's
    write_jsonl(images_dir / "train.jsonl", [
        {"messages": [{"role": "user", "content": [IMAGE, text("What colour?")]}], "images": ["img/red.png"],
         "answer": "red"},
        {"messages": [{"role": "user", "content": [IMAGE, text("Left: "), IMAGE, text(" which is red?")]}],
         "images": [data_url(png("blue")), {"path": "img/red.png"}], "answer": "right"},
        # inline images as transformers' processors and OpenAI take them; `images` fills the part without one
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "image", "path": "img/blue.png"},
                                                   {"type": "image_url", "image_url": {"url": data_url(png("red"))}},
                                                   {"type": "image"}, text("Count the red ones.")]}],
         "images": ["img/red.png"], "answer": "2"},
        {"prompt": "No images <image> here.", "answer": "x"},  # no images: the text stays as it is
        {"messages": [{"role": "system", "content": "Name the colour."},
                      {"role": "user", "content": [{"type": "image", "image": "img/blue.png"}]}], "answer": "blue"},
    ])
    red, right, mixed, plain, only = load_tasks("data/train.jsonl")
    assert red.prompt == "What colour?" and red.messages == [{"role": "user", "content": [IMAGE, text("What colour?")]}]
    assert red.images[0].path == str(images_dir / "img" / "red.png") and colour(red.images[0]) == (255, 0, 0)
    assert red.images[0].where == "data/train.jsonl:1: images[0]"
    assert right.prompt == "Left:  which is red?" and [colour(i) for i in right.images] == [(0, 0, 255), (255, 0, 0)]
    assert right.images[0].data == png("blue")
    assert mixed.messages[1]["content"] == [IMAGE, IMAGE, IMAGE, text("Count the red ones.")]
    assert [colour(i) for i in mixed.images] == [(0, 0, 255), (255, 0, 0), (255, 0, 0)]
    assert mixed.prompt == "Count the red ones." and mixed.meta == {}
    assert plain.images == () and plain.messages is None and plain.prompt == "No images <image> here."
    assert only.prompt == "<image>" and only.messages[1]["content"] == [IMAGE]  # no text: a placeholder as prompt
    assert only.images[0].where == "data/train.jsonl:5: messages[1].content[0]"


def verl_rows() -> list[dict]:
    """Rows as verl's multimodal preprocessing (geo3k) writes them: chat messages with ``<image>`` in the text and an
    ``images`` column of ``{bytes, path}`` structs."""
    return [{"data_source": "hiyouga/geometry3k", "ability": "math",
             "prompt": [{"role": "user", "content": "<image>Find x. Put the answer in \\boxed{}."}],
             "images": [{"bytes": png("red"), "path": None}],
             "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"split": "train", "index": 0}},
            {"data_source": "hiyouga/geometry3k", "ability": "math",
             "prompt": [{"role": "system", "content": "Think first."},
                        {"role": "user", "content": "Compare <image> with <image>. Which is larger?"}],
             "images": [{"bytes": png("red"), "path": None}, {"bytes": png("blue", 16), "path": None}],
             "reward_model": {"style": "rule", "ground_truth": "second"}, "extra_info": {"split": "train", "index": 1}}]


def test_verl_parquet_with_image_placeholders(tmp_path):
    path = tmp_path / "geo3k.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    one, two = load_tasks(path)
    assert one.messages == [{"role": "user", "content": [IMAGE, text("Find x. Put the answer in \\boxed{}.")]}]
    assert one.prompt == "Find x. Put the answer in \\boxed{}." and one.answer == "3"
    assert one.images[0].data == png("red") and one.images[0].where == f"{path} row 1: images[0]"
    assert two.messages[1]["content"] == [text("Compare "), IMAGE, text(" with "), IMAGE, text(". Which is larger?")]
    assert two.messages[0] == {"role": "system", "content": "Think first."}
    assert [i.load().size for i in two.images] == [(8, 8), (16, 16)]
    assert set(two.meta) == {"data_source", "ability", "reward_model", "extra_info"}  # no image bytes in meta

    rows = verl_rows()
    rows[1]["prompt"][1]["content"] = "Compare <image> with the other one."
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(TaskFileError) as err:
        load_tasks(path)
    assert str(err.value) == f"{path} row 2: column 'images' has 2 images but 'prompt' has 1 <image> placeholders"


def test_slime_jsonl_with_multimodal_inputs_and_a_text_prompt(tmp_path):
    path = write_jsonl(tmp_path / "slime.jsonl", [
        {"prompt": "<image>\nWhat colour is it?", "label": "red",
         "multimodal_inputs": {"images": [data_url(png("red"))]}, "metadata": {"src": "synthetic"}},
        {"prompt": [{"role": "user", "content": "Which is blue: <image> or <image>?"}], "label": "second",
         "multimodal_inputs": {"images": [data_url(png("red")), data_url(png("blue"))]}},
        {"prompt": "What colour?", "label": "blue", "images": [data_url(png("blue"))]},  # no placeholder: TRL's way
    ])
    one, two, three = load_tasks(path)
    assert one.messages == [{"role": "user", "content": [IMAGE, text("\nWhat colour is it?")]}]
    assert one.prompt == "\nWhat colour is it?" and one.answer == "red"
    assert one.meta == {"metadata": {"src": "synthetic"}}  # multimodal_inputs is not kept
    assert one.images[0].where == f"{path}:1: multimodal_inputs.images[0]"
    assert two.messages[0]["content"] == [text("Which is blue: "), IMAGE, text(" or "), IMAGE, text("?")]
    assert [colour(i) for i in two.images] == [(255, 0, 0), (0, 0, 255)]
    assert three.messages == [{"role": "user", "content": [IMAGE, text("What colour?")]}]
    assert three.prompt == "What colour?"
    write_jsonl(path, [{"prompt": "<image>", "label": "x",
                        "multimodal_inputs": {"images": [data_url(png("red"))], "videos": ["clip.mp4"]}}])
    with pytest.raises(TaskFileError, match=r"slime.jsonl:1: column 'multimodal_inputs' holds 'videos': only 'images'"):
        load_tasks(path)


def test_a_datasets_directory_with_image_columns_loads_without_decoding_pixels(tmp_path, monkeypatch):
    from datasets import Dataset, Sequence
    from datasets import Image as ImageFeature

    pictures = [Image.new("RGB", (8, 8), c) for c in ("red", "blue")]
    Dataset.from_dict({  # TRL's conversational layout: no placeholders, the images go before the first user text
        "prompt": [[{"role": "system", "content": "Name colours."}, {"role": "user", "content": "What colours?"}],
                   [{"role": "user", "content": "And this one?"}]],
        "images": [pictures, pictures[1:]], "answer": ["red, blue", "blue"],
    }).cast_column("images", Sequence(ImageFeature())).save_to_disk(tmp_path / "vqa")
    Dataset.from_dict({"question": ["Colour?"], "image": [pictures[0]], "answer": ["red"]}).cast_column(
        "image", ImageFeature()).save_to_disk(tmp_path / "single")

    def no_decoding(self, *args, **kwargs):
        raise AssertionError("loading tasks decoded an image's pixels")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    both, one = load_tasks(tmp_path / "vqa")
    (single,) = load_tasks(tmp_path / "single", columns={"prompt": "question"})  # TRL's `image` column
    monkeypatch.undo()
    assert both.messages[1] == {"role": "user", "content": [IMAGE, IMAGE, text("What colours?")]}
    assert both.messages[0] == {"role": "system", "content": "Name colours."} and both.prompt == "What colours?"
    assert all(i.data is not None for i in both.images)  # save_to_disk embeds the bytes
    assert [colour(i) for i in both.images] == [(255, 0, 0), (0, 0, 255)]
    assert one.messages == [{"role": "user", "content": [IMAGE, text("And this one?")]}] and len(one.images) == 1
    assert single.messages == [{"role": "user", "content": [IMAGE, text("Colour?")]}] and single.meta == {}
    assert single.images[0].where == f"{tmp_path / 'single'} row 1: image[0]"
    assert colour(single.images[0]) == (255, 0, 0)


@pytest.mark.parametrize(("record", "message"), [
    ({"messages": [{"role": "user", "content": [IMAGE, IMAGE, text("?")]}], "images": ["a.png"]},
     "column 'images' has 1 images but the messages have 2 image parts$"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"}, IMAGE, text("?")]}],
      "images": ["a.png", "a.png"]},
     "column 'images' has 2 images but the messages have 1 image parts without an inline image$"),
    ({"messages": [{"role": "user", "content": [IMAGE, text("?")]}]},
     "column 'images' has 0 images but the messages have 1 image parts$"),
    ({"messages": [{"role": "user", "content": "<image><image>?"}], "images": ["a.png"]},
     "column 'images' has 1 images but 'messages' has 2 <image> placeholders$"),
    ({"prompt": "<image> and <image>?", "images": ["a.png"]},
     "column 'images' has 1 images but 'prompt' has 2 <image> placeholders$"),
    ({"messages": [{"role": "user", "content": [IMAGE, "?"]}], "images": ["a.png"]},
     r"messages\[0\].content\[1\] must be an object with a string 'type'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text"}]}]},
     r"messages\[1\].content\[0\]: a text part needs a string 'text'"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "path": "a.mp4"}]}]},
     r"messages\[0\].content\[0\]: content part type 'video' is not read"),
    ({"messages": [{"role": "user", "content": []}]}, r"messages\[0\].content is an empty list of content parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     r"messages\[0\].content\[0\]: an 'image_url' part needs its 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "url": "https://example.com/a.png"}]}]},
     r"messages\[0\].content\[0\]: images are read from files or bytes, not URLs"),
    ({"messages": [{"role": "user", "content": [IMAGE, text("?")]}], "images": [None]}, r"images\[0\] is null$"),
])
def test_malformed_image_records_are_one_line_naming_the_line_and_column(tmp_path, record, message):
    (tmp_path / "a.png").write_bytes(png("red"))
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "answer": "1"}, {**record, "answer": "1"}])
    with pytest.raises(TaskFileError) as err:
        load_tasks(path)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{path}:2: "), err.value
    assert re.search(message, str(err.value)), err.value


def test_an_image_that_does_not_decode_fails_at_load_naming_the_task_and_column(tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    cases = [({"images": ["notes.png"]}, {}, f"{tmp_path / 'notes.png'}: not an image Pillow reads"),
             ({"images": ["missing.png"]}, {}, f"cannot read image file {tmp_path / 'missing.png'}"),
             ({"images": [data_url(b"GIF89a...")]}, {}, "9 bytes"),
             ({"pics": [data_url(png("red")[:-20])]}, {"images": "pics"}, "does not decode (55 bytes"),
             ({"messages": [{"role": "user", "content": [{"type": "image", "image": data_url(b"xx")}, text("?")]}]},
              {}, "2 bytes")]
    for record, columns, detail in cases:
        record = {"messages": [{"role": "user", "content": [IMAGE, text("?")]}], **record, "answer": "1"}
        path = write_jsonl(tmp_path / "bad.jsonl", [record])
        with pytest.raises(TaskFileError) as err:
            load_tasks(path, columns=columns)
        column = {"images": "images[0]", "pics": "pics[0]"}.get(next(iter({*record} & {"images", "pics"}), ""),
                                                                "messages[0].content[0]")
        assert str(err.value).startswith(f"{path}:1: {column}: "), err.value
        assert "\n" not in str(err.value) and detail in str(err.value), err.value
    rows = verl_rows()
    rows[1]["images"][1]["bytes"] = b"\x89PNG\r\n\x1a\n truncated"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "geo3k.parquet")
    with pytest.raises(TaskFileError, match=r"geo3k.parquet row 2: images\[1\]: the image does not decode"):
        load_tasks(tmp_path / "geo3k.parquet")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_tasks_with_images_round_trip_through_save_tasks(images_dir, tmp_path, suffix):
    source = write_jsonl(images_dir / "mixed.jsonl", [
        {"id": "paths", "messages": [{"role": "user", "content": [IMAGE, text("A "), IMAGE, text("B")]}],
         "images": ["img/red.png", data_url(png("blue"))], "answer": "1", "meta": {"k": 1}},
        {"id": "text", "prompt": "plain", "answer": "2"},
        {"id": "chat", "messages": [{"role": "user", "content": "no images"}], "answer": "3"}])
    tasks = load_tasks(source)
    out = tmp_path / "elsewhere" / f"again{suffix}"
    out.parent.mkdir()
    save_tasks(tasks, out)
    again = load_tasks(out)
    assert [(t.id, t.prompt, t.answer, t.meta, t.messages) for t in again] == [
        (t.id, t.prompt, t.answer, t.meta, t.messages) for t in tasks]
    def refs(ts):
        return [[(i.path, i.data) for i in t.images] for t in ts]

    assert refs(again) == refs(tasks)
    assert again[0].images[0].path == str(images_dir / "img" / "red.png") and again[0].images[1].data == png("blue")
    if suffix == ".parquet":
        assert pq.read_schema(out).field("images").type == pa.list_(
            pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    else:
        assert json.loads(out.read_text().splitlines()[0])["images"] == [
            {"path": str(images_dir / "img" / "red.png")}, {"bytes_b64": base64.b64encode(png("blue")).decode()}]
