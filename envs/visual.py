"""Counting shapes in a generated picture: a vision-language task with an exact integer answer.

Each task is one small RGB image (56x56 by default, white background) holding 1..``max_shapes`` filled circles,
squares and triangles in red, green or blue, drawn without antialiasing at random non-overlapping places. The
question asks how many shapes of a kind (circles), of a colour (red) or in all there are; the answer is the count,
0..``max_shapes``. The reference solution (``meta["solution"]``, what a warm start learns) lists the shapes left to
right and then answers (``I see: red circle, blue square. The answer is 1.``): supervising what is in the picture,
not only the count, is what lets a tiny model learn to see (trained on the bare answer, ``meta["direct_solution"]``,
one stayed at chance for 1,600 steps). The grader reads the last ``The answer is N`` in a response (a response that
is only an integer counts too), so the reward is checked, not judged. Everything follows the seed: the same seed
gives the same pixels and the same PNG bytes.
"""

from __future__ import annotations

import random
import re
from typing import Any

from PIL import Image, ImageDraw

from engines.model.images import ImageRef
from envs.base import Env, Task
from envs.registry import register

KINDS = ("circle", "square", "triangle")
#: fill colours, far from each other and from the white background (the drawing uses them exactly)
COLOURS = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 80, 220)}
BACKGROUND = (255, 255, 255)
QUESTIONS = ("kind", "colour", "total")
INSTRUCTION = 'End your reply with "The answer is N." where N is the number.'
_ANSWER = re.compile(r"The answer is (\d+)")
_BARE = re.compile(r"\s*(\d+)\.?\s*")
_GAP = 2  # pixels of background kept between two shapes' boxes, so that no two shapes touch
_MARGIN = 1  # pixels of background kept at the image's border


def _check_options(width: int, height: int, max_shapes: int) -> None:
    if max_shapes < 1:
        raise ValueError(f"shapes: max_shapes must be at least 1 (got {max_shapes})")
    if min(width, height) < 16:
        raise ValueError(f"shapes: the image must be at least 16x16 pixels (got {width}x{height})")
    side = _side_range(width, height)[1] + _GAP
    if max_shapes * side * side > width * height // 2:
        raise ValueError(f"shapes: {max_shapes} shapes do not fit a {width}x{height} image; "
                         "give a larger image or fewer shapes")


def _side_range(width: int, height: int) -> tuple[int, int]:
    """Smallest and largest side of a shape's box, from the image's smaller side."""
    m = min(width, height)
    return max(6, m // 5), max(6, m // 4)


def _place(rng: random.Random, n: int, width: int, height: int) -> list[list[int]]:
    """``n`` boxes ``[x0, y0, x1, y1]`` (inclusive) inside the image, ``_GAP`` pixels apart."""
    lo, hi = _side_range(width, height)
    for _ in range(100):  # a layout that paints itself into a corner starts over
        boxes: list[list[int]] = []
        for _ in range(200):
            side = rng.randint(lo, hi)
            x0 = rng.randint(_MARGIN, width - _MARGIN - side)
            y0 = rng.randint(_MARGIN, height - _MARGIN - side)
            box = [x0, y0, x0 + side - 1, y0 + side - 1]
            if all(box[0] > b[2] + _GAP or b[0] > box[2] + _GAP or box[1] > b[3] + _GAP or b[1] > box[3] + _GAP
                   for b in boxes):
                boxes.append(box)
                if len(boxes) == n:
                    return boxes
    raise ValueError(f"shapes: could not place {n} shapes in a {width}x{height} image")


def draw(shapes: list[dict[str, Any]], width: int, height: int) -> Image.Image:
    """The picture of ``shapes`` (dicts with ``kind``, ``colour`` and ``box``), RGB on white."""
    image = Image.new("RGB", (width, height), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for s in shapes:
        x0, y0, x1, y1 = s["box"]
        fill = COLOURS[s["colour"]]
        if s["kind"] == "circle":
            pen.ellipse([x0, y0, x1, y1], fill=fill)
        elif s["kind"] == "square":
            pen.rectangle([x0, y0, x1, y1], fill=fill)
        else:  # a triangle standing on the box's bottom edge, apex at the top centre
            pen.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)
    return image


def make_problem(rng: random.Random, width: int = 56, height: int = 56,
                 max_shapes: int = 4) -> tuple[Image.Image, str, int, dict[str, Any]]:
    """(image, question, answer, generation details) of one random picture.

    A question about a kind or a colour draws its answer first, uniformly in 0..max_shapes, and then a picture with
    that many such shapes among 1..max_shapes, so that no single count answers most questions."""
    question_kind = rng.choice(QUESTIONS)
    colours = tuple(sorted(COLOURS))
    if question_kind == "total":
        asked, n = "shape", rng.randint(1, max_shapes)
        answer = n
        shapes = [{"kind": rng.choice(KINDS), "colour": rng.choice(colours)} for _ in range(n)]
        question = "How many shapes are in the picture?"
    else:
        field, values = ("kind", KINDS) if question_kind == "kind" else ("colour", colours)
        asked = rng.choice(values)
        answer = rng.randint(0, max_shapes)
        n = rng.randint(max(answer, 1), max_shapes)
        chosen = set(rng.sample(range(n), answer))
        others = [v for v in values if v != asked]
        shapes = [{"kind": rng.choice(KINDS), "colour": rng.choice(colours)} for _ in range(n)]
        for i, s in enumerate(shapes):
            s[field] = asked if i in chosen else rng.choice(others)
        question = (f"How many {asked}s are in the picture?" if question_kind == "kind"
                    else f"How many {asked} shapes are in the picture?")
    for s, box in zip(shapes, _place(rng, n, width, height), strict=True):
        s["box"] = box
    details = {"shapes": shapes, "question": question, "question_kind": question_kind, "asked": asked,
               "width": width, "height": height}
    return draw(shapes, width, height), question, answer, details


def describe(shapes: list[dict[str, Any]]) -> str:
    """The shapes left to right (top to bottom where two start at one column), e.g. ``red circle, blue square``."""
    ordered = sorted(shapes, key=lambda s: (s["box"][0], s["box"][1]))
    return ", ".join(f"{s['colour']} {s['kind']}" for s in ordered)


def extract_answer(response: str) -> str | None:
    """The integer after the last ``The answer is`` in ``response``, else the response itself when it is only an
    integer (``3`` or ``3.``), else None."""
    found = _ANSWER.findall(response)
    if found:
        return found[-1]
    bare = _BARE.fullmatch(response)
    return bare.group(1) if bare else None


class ShapesEnv(Env):
    """Single-turn shape counting in a generated image: reward 1 for the exact count, else 0."""

    task_type = "shapes"

    def __init__(self, tasks: list[Task] | None = None, *, width: int = 56, height: int = 56,
                 max_shapes: int = 4) -> None:
        # as arithmetic's: the generation options shape only the tasks reset() generates, not the scoring
        _check_options(width, height, max_shapes)
        super().__init__(tasks)
        self.generate_options = {"width": width, "height": height, "max_shapes": max_shapes}

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        got = extract_answer(response)
        correct = got is not None and int(got) == int(task.answer)
        return (1.0 if correct else 0.0), {"extracted": got, "correct": correct}

    @classmethod
    def generate_tasks(cls, n: int, seed: int, width: int = 56, height: int = 56, max_shapes: int = 4) -> list[Task]:
        _check_options(width, height, max_shapes)
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            task_id = f"shapes-{seed}-{i}"
            image, question, answer, details = make_problem(rng, width, height, max_shapes)
            text = f"{question} {INSTRUCTION}"
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            meta = details | {"solution": f" I see: {describe(details['shapes'])}. The answer is {answer}.",
                              "direct_solution": f" The answer is {answer}."}
            tasks.append(Task(task_id, text, str(answer), meta, messages=messages,
                              images=(ImageRef.of(image, where=f"{task_id} image"),)))
        return tasks


register("shapes", ShapesEnv)
