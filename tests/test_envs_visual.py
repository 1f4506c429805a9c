"""The ``shapes`` environment: generated pictures whose counts are checked from the pixels themselves, exact
grading, determinism down to the PNG bytes, and the gymnasium path with the task's image."""

from __future__ import annotations

import json
import re
from collections import deque

import gymnasium
import numpy as np
import pytest

import envs  # noqa: F401  (registers the rl/NAME gymnasium ids)
from engines.model.images import image_parts
from envs.registry import BUILTINS, get
from envs.visual import ShapesEnv, extract_answer


def components(pixels: np.ndarray) -> list[tuple[str, str]]:
    """(colour, kind) of every blob of one colour in ``pixels`` (H x W x 3), found by an 8-connected flood fill.

    The colour is the strongest channel; the kind is read from how much of its bounding box the blob fills
    (a square all of it, a circle about pi/4, a triangle about a half)."""
    h, w, _ = pixels.shape
    ink = (pixels != 255).any(axis=-1)
    seen = np.zeros((h, w), dtype=bool)
    found = []
    for y in range(h):
        for x in range(w):
            if not ink[y, x] or seen[y, x]:
                continue
            colour = tuple(pixels[y, x])
            seen[y, x] = True
            queue, blob = deque([(y, x)]), []
            while queue:
                cy, cx = queue.popleft()
                blob.append((cy, cx))
                for dy in (-1, 0, 1):
                    for dx in (-1, 0, 1):
                        ny, nx = cy + dy, cx + dx
                        if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and tuple(pixels[ny, nx]) == colour:
                            seen[ny, nx] = True
                            queue.append((ny, nx))
            ys, xs = zip(*blob, strict=True)
            fill = len(blob) / ((max(ys) - min(ys) + 1) * (max(xs) - min(xs) + 1))
            kind = "square" if fill > 0.95 else "circle" if fill > 0.62 else "triangle"
            found.append((("red", "green", "blue")[int(np.argmax(colour))], kind))
    return found


def count_from_pixels(question: str, blobs: list[tuple[str, str]]) -> int:
    """The answer to ``question`` read off the blobs, from the question's own words."""
    if m := re.fullmatch(r"How many (red|green|blue) shapes are in the picture\?", question):
        return sum(colour == m.group(1) for colour, _ in blobs)
    if m := re.fullmatch(r"How many (circle|square|triangle)s are in the picture\?", question):
        return sum(kind == m.group(1) for _, kind in blobs)
    assert question == "How many shapes are in the picture?", question
    return len(blobs)


def test_same_seed_same_tasks_and_png_bytes():
    a, b = ShapesEnv.generate_tasks(12, seed=7), ShapesEnv.generate_tasks(12, seed=7)
    assert [(t.id, t.prompt, t.answer, t.meta, t.messages) for t in a] == \
        [(t.id, t.prompt, t.answer, t.meta, t.messages) for t in b]
    assert [t.images[0].data for t in a] == [t.images[0].data for t in b]  # identical pixels, identical PNG
    other = ShapesEnv.generate_tasks(12, seed=8)
    assert [t.images[0].data for t in other] != [t.images[0].data for t in a]
    assert len({t.images[0].data for t in a}) == len(a)  # the tasks of one seed differ from each other
    json.dumps(a[0].meta)  # the generation details travel in task files


@pytest.mark.parametrize("size,max_shapes,n", [((56, 56), 4, 120), ((72, 40), 3, 40)])
def test_the_answer_is_the_count_in_the_pixels(size, max_shapes, n):
    width, height = size
    tasks = ShapesEnv.generate_tasks(n, seed=11, width=width, height=height, max_shapes=max_shapes)
    kinds, answers = set(), []
    for task in tasks:
        pixels = np.asarray(task.images[0].load())
        assert pixels.shape == (height, width, 3)
        # no antialiasing: every pixel is the background or one of three saturated fills
        assert {tuple(p) for p in pixels.reshape(-1, 3)} <= {(255, 255, 255), (220, 40, 40), (30, 160, 60),
                                                             (40, 80, 220)}
        blobs = components(pixels)
        assert 1 <= len(blobs) <= max_shapes and len(blobs) == len(task.meta["shapes"])
        assert sorted(blobs) == sorted((s["colour"], s["kind"]) for s in task.meta["shapes"])
        question = task.meta["question"]
        assert task.prompt.startswith(question)
        assert task.answer == str(count_from_pixels(question, blobs))
        kinds.add(task.meta["question_kind"])
        answers.append(int(task.answer))
    assert kinds == {"kind", "colour", "total"}
    assert set(answers) <= set(range(max_shapes + 1)) and len(set(answers)) >= 3


def test_task_layout():
    task = ShapesEnv.generate_tasks(1, seed=0, width=48, height=40)[0]
    assert task.id == "shapes-0-0" and task.messages[0]["role"] == "user"
    content = task.messages[0]["content"]
    assert content[0] == {"type": "image"} and content[1] == {"type": "text", "text": task.prompt}
    assert "The answer is N." in task.prompt
    assert image_parts(task.messages) == len(task.images) == 1
    image = task.images[0].load()
    assert image.size == (48, 40) and image.mode == "RGB" and task.images[0].where == "shapes-0-0 image"
    listed = ", ".join(f"{s['colour']} {s['kind']}" for s in sorted(task.meta["shapes"], key=lambda s: s["box"][:2]))
    assert task.meta["solution"] == f" I see: {listed}. The answer is {task.answer}."
    assert task.meta["direct_solution"] == f" The answer is {task.answer}."


def test_grading():
    env = ShapesEnv()
    task = next(t for t in ShapesEnv.generate_tasks(20, seed=3) if t.answer == "2")
    assert env.score(task, task.meta["solution"]) == (1.0, {"extracted": "2", "correct": True})
    assert env.score(task, "I count them. The answer is 2.")[0] == 1.0
    assert env.score(task, "The answer is 3. Looking again, The answer is 2.")[0] == 1.0  # the last one counts
    assert env.score(task, "The answer is 2. No: The answer is 3.")[0] == 0.0
    assert env.score(task, "The answer is 02")[0] == 1.0
    assert env.score(task, "2")[0] == 1.0 and env.score(task, " 2.\n")[0] == 1.0  # only a number
    assert env.score(task, "There are 2 shapes") == (0.0, {"extracted": None, "correct": False})  # no format
    assert env.score(task, "") == (0.0, {"extracted": None, "correct": False})
    assert env.score(task, "The answer is two.")[0] == 0.0
    assert extract_answer("The answer is 4 and 5") == "4" and extract_answer("-1") is None


def test_through_gymnasium():
    assert BUILTINS["shapes"] == "envs.visual:ShapesEnv" and get("shapes") is ShapesEnv
    env = gymnasium.make("rl/shapes", width=40, height=40, max_shapes=3)
    task = ShapesEnv.generate_tasks(1, seed=5)[0]
    obs, info = env.reset(options={"task": task})
    assert obs == task.prompt and info == {"task_id": task.id}
    end, reward, terminated, truncated, info = env.step(task.meta["solution"])
    assert (end, reward, terminated, truncated, info["correct"]) == ("", 1.0, True, False, True)
    env.reset(options={"task": task})
    wrong = str(int(task.answer) + 1)
    assert env.step(f"The answer is {wrong}.")[1] == 0.0
    obs, _ = env.reset(seed=0)  # no task: one is generated with the options given to make
    generated = env.unwrapped.task
    assert obs == generated.prompt and generated.images[0].load().size == (40, 40)
    assert len(generated.meta["shapes"]) <= 3
    env.close()


@pytest.mark.parametrize("kwargs", [{"max_shapes": 0}, {"width": 12}, {"max_shapes": 40}])
def test_bad_options_are_refused(kwargs):
    with pytest.raises(ValueError, match="shapes"):
        ShapesEnv(**kwargs)
    with pytest.raises(ValueError, match="shapes"):
        ShapesEnv.generate_tasks(1, 0, **kwargs)
