"""Multi-turn episodes: the environment between the model's turns, kept on the driver.

A multi-turn sample is an ordinary ``rl.sample.Sample`` whose turns are engine requests of the same rollout
(``rl.rollout.phase``): each turn is generated with the others of the iteration under its token budget, then its
environment steps (a sandbox command, a tool call) within its entry's ``timeout_s``, concurrently with the other
episodes; the observation is appended (loss mask 0, context only) and the next turn is generated, until the
episode ends. The trained sequence is the whole conversation after the first prompt: the model's tokens (loss
mask 1, with the sampler's log-probs) and the environment's observations. An environment that gives its
conversation as chat messages (``info["messages"]``, e.g. the tool-using SWE environment) is rendered with the
tokenizer's own chat template (``engines.model.text.conversation``: observations are the template's text between the
model's turns) and parses calls in the model family's format (``model.tool_format``, detected from the template);
a turn the template cannot render ends the episode there as truncated. An observation may show images: the
environment returns them in ``info["images"]`` (ImageRef, PIL image, path or bytes), one per ``{"type": "image"}``
part of its observation messages, in order; they join the sample's images (the rollout engine gets all of them with
each turn, the trainer expands their placeholders where they stand in the conversation), and the context counts
their tokens. An episode ends when the environment says
so, after ``rollout.max_turns`` turns (truncated: its task type's truncation penalty), or when the conversation no
longer fits the context; an environment error drops that sample and is counted. The environments live here, not
in the sample: a paused episode waits in the partial-rollout buffer with its environment kept here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.inference.sampling import SamplingParams
from engines.model.images import ImageError, ImageRef
from engines.model.text.chat_format import ChatFormatError, ToolFormat, detect_format
from engines.model.text.conversation import Conversation
from engines.model.text.tokenizer import TextTokenizer
from envs import Env, Task
from rl.config import EnvConfig
from rl.errors import UserError
from rl.rollout.episodes import EpisodeRunner
from rl.sample import Sample, image_positions
from rl.seeds import episode_seed, turn_seed


@dataclass
class Episode:
    """The driver's side of one multi-turn sample: its environment and, for chat environments, its conversation."""

    entry: EnvConfig
    task: Task
    env: Env
    conv: Conversation | None = None


class Episodes:
    """The multi-turn samples' environments, by sample key; ``start`` them, ``step`` them after each turn."""

    def __init__(self, runner: EpisodeRunner, tok: TextTokenizer, tool_format: str, max_turns: int, context: int,
                 run_seed: int) -> None:
        self.runner, self.tok, self.tool_format_name = runner, tok, tool_format
        self.max_turns, self.context, self.run_seed = max_turns, context, run_seed
        self.live: dict[int, Episode] = {}
        self._format: ToolFormat | None = None
        self.template_errors = 0  # episodes ended because the template could not render a turn

    def _tool_format(self) -> ToolFormat:
        if self._format is None:
            try:
                self._format = detect_format(self.tok, self.tool_format_name)
            except ChatFormatError as err:
                raise UserError(f"model.tool_format: {err}") from None
        return self._format

    def _image_tokens(self, s: Sample, more: list[int] | None = None, images: tuple = ()) -> int:
        """The tokens the sample's images (and ``images`` of the observation ``more``) add to its template ids: each
        placeholder becomes the tokens the model reads for its image."""
        vp = getattr(self.tok, "processor", None)
        pictures = (*s.images, *images)
        if not pictures or vp is None:
            return 0
        more = list(more or ())
        own = s.loss_mask.tolist() if s.loss_mask is not None else [1] * len(s.response_ids)
        ids = [*s.prompt_ids.tolist(), *s.response_ids.tolist(), *more]
        at = image_positions(vp.image_token_id, ids, len(s.prompt_ids), own + [0] * len(more))
        return vp.expanded_length([vp.image_token_id] * len(at), pictures, f"sample {s.key}") - len(at)

    def _params(self, s: Sample, image_tokens: int | None = None) -> SamplingParams:
        """The next turn's sampling: the sample's temperature, its task type's budget within what the context leaves
        (``image_tokens``: what its images add, counted here when not given), the turn's own seed (from the iteration
        it was drawn in)."""
        if image_tokens is None:
            image_tokens = self._image_tokens(s)
        room = self.context - len(s.prompt_ids) - len(s.response_ids) - image_tokens
        seed = turn_seed(episode_seed(self.run_seed, s.started), s.key, s.turns)
        return SamplingParams(s.temperature, max(min(s.task_type.max_tokens, room), 1), seed=seed)

    def start(self, samples: list[Sample], entries: list[EnvConfig], tasks: list[Task]) -> None:
        """Reset a fresh environment for each new sample (``entries[i]``, ``tasks[i]``): its first observation becomes
        the prompt; a reset that fails ends the sample with its error."""
        eps = [Episode(e, t, self.runner.make_env(e)) for e, t in zip(entries, tasks, strict=True)]
        fmt = self._tool_format() if any(ep.env.uses_tools for ep in eps) else None

        def reset(ep: Episode) -> tuple[str, dict]:
            if fmt is not None and ep.env.uses_tools:
                ep.env.set_tool_format(fmt)
            return ep.env.reset(options={"task": ep.task})

        firsts = self.runner.run_calls([(lambda ep=ep: reset(ep), ep.entry.timeout_s) for ep in eps])
        for s, ep, (out, err) in zip(samples, eps, firsts, strict=True):
            self.live[s.key] = ep
            if err is not None:
                s.status, s.error = "error", err
                continue
            obs, info = out
            if info.get("messages") and self.tok.has_chat_template:
                ep.conv = Conversation(self.tok, info["messages"], info.get("tools"), fmt)
                s.prompt_ids = ep.conv.prompt_ids
                images = info.get("images") or ()
            else:
                s.prompt_ids = self.tok.prompt_ids(ep.task) if ep.task.messages else self.tok.encode(obs)
                images = ep.task.images
            try:
                s.images = self._images(s, images, s.prompt_ids.tolist(), "first observation")
            except (ImageError, ValueError) as e:
                s.status, s.error = "error", str(e)
                continue
            s.params = self._params(s)
        self.close([s.key for s in samples if s.done])

    def step(self, samples: list[Sample]) -> None:
        """Step each sample's environment with the turn it just generated: the episode ends (its reward, or
        truncated), or the observation is appended and the sample runs again with its next turn's sampling."""
        def step(s: Sample) -> Any:
            return self.live[s.key].env.step(self.tok.decode(s.response_ids[s.turn_start:].tolist()))

        stepping = [s for s in samples if s.status != "error"]
        outs = dict(zip((s.key for s in stepping), self.runner.run_calls(
            [(lambda s=s: step(s), self.live[s.key].entry.timeout_s) for s in stepping]), strict=True))
        for s in samples:
            s.turns += 1
            if s.status == "error":
                s.error = f"the inference engine refused the request: {s.error}"
                continue
            result, err = outs[s.key]
            if err is not None:
                s.status, s.error = "error", err
                continue
            self._advance(s, *result)
        self.close([s.key for s in samples if s.done])

    def _advance(self, s: Sample, obs: str, reward: float, terminated: bool, truncated: bool, info: dict) -> None:
        ep, info = self.live[s.key], info or {}
        turn = s.response_ids[s.turn_start:].tolist()
        if terminated or truncated:
            s.reward, s.status = float(reward), "truncated" if truncated else "finished"
            if ep.conv is not None:
                ep.conv.finish(turn, info.get("calls"))
            return
        if s.turns >= self.max_turns:
            s.status = "truncated"  # out of turns
            return
        if ep.conv is not None:
            try:
                obs_ids = ep.conv.add_turn(turn, info.get("messages") or [{"role": "user", "content": obs}],
                                           info.get("calls"))
            except ChatFormatError:  # the template cannot go on: the episode ends at this turn
                s.status = "truncated"
                self.template_errors += 1
                return
        elif info.get("images"):
            s.status, s.error = "error", ("an observation with images needs chat messages: return them in "
                                          "info['messages'] from reset and step")
            return
        else:
            obs_ids = self.tok.encode(obs)
        try:
            images = self._images(s, info.get("images") or (), obs_ids, f"observation {s.turns}")
        except (ImageError, ValueError) as e:
            s.status, s.error = "error", str(e)
            return
        image_tokens = self._image_tokens(s, obs_ids, images[len(s.images):])  # with the observation's
        if len(s.prompt_ids) + len(s.response_ids) + len(obs_ids) + image_tokens + 1 >= self.context:
            s.status = "truncated"  # no room for another turn
            return
        s.observe(obs_ids)  # appended in place; the next turn starts after it
        s.images = images
        s.status = "running"
        s.params = self._params(s, image_tokens)

    def _images(self, s: Sample, given, ids: list[int], what: str) -> tuple:
        """The sample's images with those of ``what`` (template ids ``ids``) appended; ValueError (one line) when
        they do not match its image placeholders, or the model takes no images."""
        vp = getattr(self.tok, "processor", None)
        if vp is None:
            if given:
                raise ValueError(f"{what} has images, but {self.tok.source} is a text-only model's tokenizer")
            return s.images
        refs = tuple(ImageRef.of(im, f"sample {s.key} {what} image {j}") for j, im in enumerate(given))
        vp.check(ids, refs, f"sample {s.key} {what}")
        return (*s.images, *refs)

    def close(self, keys: list[int]) -> None:
        """Close the environments of the samples ``keys`` (ended or dropped); None of the others."""
        eps = [self.live.pop(k) for k in keys if k in self.live]
        if eps:
            self.runner.run_calls([(ep.env.close, 10.0) for ep in eps])

    def close_all(self) -> None:
        """Close every environment still open (the run, or the iteration's runner, ends)."""
        self.close(list(self.live))

    def take_template_errors(self) -> int:
        """Episodes ended since the last call because the chat template could not render a turn."""
        n, self.template_errors = self.template_errors, 0
        return n
