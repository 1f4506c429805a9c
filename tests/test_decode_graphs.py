"""Decode graphs keyed by batch size, captured as the engine starts, checked on a CPU where only a GPU can run them.

The capture sizes and the key are pure functions; which graphs an engine captures at start, in which order, with
which rows pointed at the scratch block, and that replaying them gives the eager engine's tokens are checked
through a stand-in for ``torch.cuda.CUDAGraph`` whose replay runs the captured step eagerly (reading the runner's
state as a replay reads its addresses), and so is the sampler inside the graph: its draw, taken where every row
samples plainly, is ``sample``'s bit for bit, and rows that filter their draw sample the replayed logits eagerly.
That the triton kernel gives the same logits at the table's full width as at the bucketed one runs for real, in
Triton's interpreter. The real graphs are tested on a GPU in
tests/test_triton_attention.py."""

import importlib.util
import itertools
import os
from types import SimpleNamespace

import pytest
import torch

from engines.inference import model_runner, native
from engines.inference.cuda_graphs import (
    MIN_WIDTH,
    DecodeGraphs,
    bucket,
    capture_size,
    capture_sizes,
    graph_key,
)
from engines.inference.kv_cache import decode_reads_in_place
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams, sample
from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model

# the triton kernel on CPU tensors: only in Triton's interpreter, which tests/conftest.py turns on where no GPU is
interpreted = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the triton kernel runs on CPU tensors only in Triton's interpreter")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def model_of(family="llama", **kw):
    torch.manual_seed(0)
    return build_model(make_config(family, **{**SMALL, **kw}), init=True, fused=True)


def new_engine(model, **kw):
    kw = dict(eos_id=None, max_seq_len=32, kv_cache_bytes=1 << 16, block_size=4, max_batch_tokens=64,
              max_num_seqs=12, attention="triton") | kw
    return InferenceEngine(model, **kw)


# --- the sizes and the key ------------------------------------------------------------

@pytest.mark.parametrize("max_batch,want", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (7, [1, 2, 4, 7]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12]),
    (64, [1, 2, 4, *range(8, 65, 8)]),
    (256, [1, 2, 4, *range(8, 257, 8)]),
    (300, [1, 2, 4, *range(8, 257, 8), 272, 288, 300]),
    (512, [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]),
])
def test_capture_sizes_step_as_vllms_and_end_at_max_batch(max_batch, want):
    assert capture_sizes(max_batch) == want


def test_capture_sizes_hold_for_every_max_batch():
    for m in range(1, 700):
        sizes = capture_sizes(m)
        assert sizes[-1] == m and sizes == sorted(set(sizes))
        for a, b in itertools.pairwise(sizes[:-1]):  # the steps before the last, which max_batch cuts
            assert b - a == (a if b <= 8 else 8 if b <= 256 else 16)
    with pytest.raises(ValueError, match="at least one row"):
        capture_sizes(0)


@pytest.mark.parametrize("max_batch", [1, 7, 12, 300, 512])
def test_a_batch_takes_the_smallest_capture_size_holding_it(max_batch):
    sizes = capture_sizes(max_batch)
    for n in range(1, max_batch + 1):
        s = capture_size(n, sizes)
        assert s in sizes and s >= n and all(x < n for x in sizes if x < s)
    with pytest.raises(ValueError, match="over the largest capture size"):
        capture_size(max_batch + 1, sizes)


def test_the_key_is_the_batch_size_alone_where_attention_reads_in_place():
    sizes, full = capture_sizes(40), 32 * 16
    for n in range(1, 41):
        for width in (1, 63, 64, 65, 200, full):
            assert graph_key(n, width, sizes, full, True) == (capture_size(n, sizes), full)
            # keyed by width, both stay power-of-two buckets: few pairs to capture lazily
            assert graph_key(n, width, sizes, full, False) == (bucket(n, 40), bucket(width, full, MIN_WIDTH))
    assert {graph_key(n, w, sizes, full, True) for n in (17, 20, 24) for w in (5, 300)} == {(24, full)}


@interpreted
def test_which_backends_read_the_cache_in_place():
    plain = make_config("llama", **SMALL)
    assert decode_reads_in_place("triton", plain, torch.float32, "cpu")
    for backend in ("torch", "flex", "paged"):
        assert not decode_reads_in_place(backend, plain, torch.float32, "cpu")
    # layers the kernel refuses go the torch way, which gathers by the width: their graphs keep it in the key
    wide = SimpleNamespace(is_mla=False, num_key_value_heads=1, num_attention_heads=2, head_dim=264)
    latent = SimpleNamespace(is_mla=True, num_attention_heads=4, kv_lora_rank=512, qk_rope_head_dim=64)
    for cfg in (wide, latent):
        assert not decode_reads_in_place("triton", cfg, torch.float32, "cpu")
    assert not decode_reads_in_place("triton", plain, torch.float64, "cpu")


# --- captures planned and made, through a stand-in for CUDA graphs --------------------

class FakeGraph:
    """A captured step on a CPU: its replay runs the step a graph captures (``DecodeGraphs._write``: the decode
    forward and the plain sampler into the shared buffers) at the captured rows and width, first checking that the
    rows past the live batch point at position 0 of the scratch block and that the live ones are as the step handed
    them to ``DecodeGraphs.logits``."""

    def __init__(self, rec, graphs, rows, width):
        self.rec, self.graphs, self.rows, self.width = rec, graphs, rows, width

    def replay(self):
        r, live = self.graphs.runner, self.graphs.live
        assert (r.block_table[live: self.rows] == r.scratch_block).all() and (r.pos[live: self.rows] == 0).all()
        # the live rows as the step handed them over, whatever was captured since
        tables, positions = self.graphs.entry
        assert torch.equal(r.block_table[:live], tables) and torch.equal(r.pos[:live], positions)
        self.rec.replays.append((live, self.rows, self.width))
        self.graphs._write(self.rows, self.width)


@pytest.fixture
def fake_graphs(monkeypatch):
    """Graphs on a CPU: ``graphs_supported`` as on a GPU, captures recorded (rows, width, each row's table and
    position as the capture saw them) and replayed eagerly."""
    rec = SimpleNamespace(captured=[], replays=[])
    real_logits = DecodeGraphs.logits

    def logits(self, n, width):
        self.live, self.entry = n, (self.runner.block_table[:n].clone(), self.runner.pos[:n].clone())
        return real_logits(self, n, width)

    def capture(self, rows, width):
        r = self.runner
        rec.captured.append((rows, width, r.block_table[:rows].clone(), r.pos[:rows].clone()))
        self._lay_out(self._step(rows, width))  # the warm-up a real capture runs, which lays out the buffers
        self.captures += 1
        return FakeGraph(rec, self, rows, width), self._out[0][:rows]

    monkeypatch.setattr(native, "graphs_supported", lambda device, cfg: True)
    monkeypatch.setattr(DecodeGraphs, "logits", logits)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    return rec


@interpreted
def test_an_engine_on_triton_plans_every_size_largest_first_and_captures_them_as_it_starts(fake_graphs):
    eng = new_engine(model_of())
    g, full = eng.runner.graphs, eng.max_blocks * eng.block_size
    assert g.in_place and g.at_start and g.sizes == [1, 2, 4, 8, 12]
    assert g.plan() == [(12, full), (8, full), (4, full), (2, full), (1, full)]
    assert [(rows, width) for rows, width, _, _ in fake_graphs.captured] == g.plan()
    assert g.captures == eng.stats()["cuda_graph_captures"] == 5 and set(g.graphs) == set(g.plan())
    for _, _, table, pos in fake_graphs.captured:  # every row wrote into the scratch block only
        assert (table == eng.scratch_block).all() and (pos == 0).all()
    assert (eng.runner.block_table == 0).all() and (eng.runner.pos == 0).all()  # and got its state back
    assert eng.capture_graphs() == 0  # nothing left to capture


@interpreted
def test_graphs_keyed_by_width_and_lazy_engines_capture_nothing_at_start(fake_graphs):
    model = model_of()
    for kw in (dict(attention="torch"), dict(capture_graphs_at_start=False)):
        eng = new_engine(model, **kw)
        assert eng.runner.graphs is not None and not eng.runner.graphs.at_start and eng.runner.graphs.plan() == []
        assert eng.stats()["cuda_graph_captures"] == 0 and eng.capture_graphs() == 0
    assert not new_engine(model, attention="torch").runner.graphs.in_place
    with pytest.raises(ValueError, match="captured at start only where decode attention reads the cache in place"):
        new_engine(model, attention="torch", capture_graphs_at_start=True)
    fake_graphs.captured.clear()
    lazy = new_engine(model, capture_graphs_at_start=False)
    lazy.generate([[3, 4, 5], [6, 7]], [SamplingParams(1.0, m, ignore_eos=True, seed=0) for m in (3, 5)])
    full = lazy.max_blocks * lazy.block_size
    assert [(r, w) for r, w, _, _ in fake_graphs.captured] == [(2, full), (1, full)]  # at first use, full width


PROMPTS = [[3 + i, 4, 5 + i, 6][: 1 + i % 4] + [9] * (i % 3) for i in range(10)]
PARAMS = [SamplingParams(1.0, 2 + (5 * i) % 9, ignore_eos=True, seed=i) for i in range(10)]


@pytest.fixture(scope="module")
def eager_run():
    """What an engine without graphs samples: the reference of the graphed runs."""
    model = model_of()
    return model, new_engine(model).generate(PROMPTS, PARAMS)


def same_completions(got, want):
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.logprobs, w.logprobs, atol=1e-5, rtol=0)


@interpreted
def test_start_captured_graphs_replay_the_eager_tokens_and_nothing_is_captured_while_decoding(fake_graphs, eager_run):
    """Ten requests of ragged lengths on 12 rows: the batch shrinks through the sizes 12, 8, 4, 2 and 1, each a
    graph captured at start, the padding rows at the scratch block on every replay."""
    model, want = eager_run
    eng = new_engine(model)
    assert eng.stats()["cuda_graph_captures"] == 5
    same_completions(eng.generate(PROMPTS, PARAMS), want)
    assert eng.stats()["cuda_graph_captures"] == 5 and len(fake_graphs.captured) == 5
    assert {rows for _, rows, _ in fake_graphs.replays} == {12, 8, 4, 2, 1}
    assert {width for _, _, width in fake_graphs.replays} == {eng.max_blocks * eng.block_size}
    assert any(rows > live for live, rows, _ in fake_graphs.replays)  # padding was checked


@interpreted
@pytest.mark.parametrize("how", ["an address moved", "cleared"])
def test_graphs_dropped_mid_run_are_all_captured_again_without_touching_live_rows(fake_graphs, eager_run, how):
    """Dropped while requests decode (an address that moved, or ``clear()`` as LoRA deltas do): the next decode step
    captures every size again before its replay, and live rows keep their blocks and positions."""
    model, want = eager_run
    eng = new_engine(model)
    for p, s in zip(PROMPTS, PARAMS, strict=True):
        eng.add_request(p, s)
    done = []
    while eng.waiting or len(fake_graphs.replays) < 3:
        done += eng.step()
    if how == "cleared":
        eng.runner.graphs.clear()
    else:
        eng.runner.graphs._where = ()  # as if the pool or a weight had moved since the captures
    replays = len(fake_graphs.replays)
    done += eng.step()
    assert eng.stats()["cuda_graph_captures"] == 10 and len(fake_graphs.replays) == replays + 1
    recaptured = fake_graphs.captured[5:]
    assert [(r, w) for r, w, _, _ in recaptured] == eng.runner.graphs.plan()
    for _, _, table, p in recaptured:
        assert (table == eng.scratch_block).all() and (p == 0).all()
    while eng.has_unfinished():
        done += eng.step()
    same_completions(sorted(done, key=lambda c: c.request_id), want)
    assert eng.stats()["cuda_graph_captures"] == 10


@interpreted
def test_capture_graphs_between_steps_leaves_the_rows_as_they_were(fake_graphs, eager_run):
    """An explicit ``capture_graphs()`` with requests decoding (rows due to move included) changes no token."""
    model, want = eager_run
    eng = new_engine(model)
    for p, s in zip(PROMPTS, PARAMS, strict=True):
        eng.add_request(p, s)
    done = []
    for _ in range(6):
        done += eng.step()
    eng.runner.graphs.clear()
    assert eng.capture_graphs() == 5
    while eng.has_unfinished():
        done += eng.step()
    same_completions(sorted(done, key=lambda c: c.request_id), want)


# --- the sampler inside the graph -------------------------------------------------------

class EvenTokens:
    """A grammar stand-in: only even token ids, never terminating."""

    def matcher(self):
        return self

    def allowed_mask(self):
        return torch.arange(SMALL["vocab_size"]) % 2 == 0

    def accept(self, token):
        return token % 2 == 0

    def is_terminated(self):
        return False


@pytest.fixture
def draws(fake_graphs, monkeypatch):
    """Per step, how its tokens were drawn: the rows (n), whether a graph replayed them, whether the replay's draw
    was taken (checked to be exactly what ``sample`` draws from the replayed logits with the rows' parameters and
    counters) and, where the step ran the eager sampler instead, the kinds it was given."""
    steps = []
    real_sampled, real_sample = DecodeGraphs.sampled, model_runner.sample

    def sampled(self, n):
        replayed = self._replayed == n
        got = real_sampled(self, n)
        if got is not None:
            r = self.runner
            want = sample(self._out[0][:n], r.rows[:n], r.gen[:n].clone(), [0] * n)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        steps.append(dict(n=n, replayed=replayed, offered=got is not None, eager=None))
        return got

    def eager(logits, rows, counters, kinds=None):
        steps[-1]["eager"] = tuple(kinds)
        return real_sample(logits, rows, counters, kinds)

    monkeypatch.setattr(DecodeGraphs, "sampled", sampled)
    monkeypatch.setattr(model_runner, "sample", eager)
    return steps


def exactly_the_same(got, want):
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]
    assert [c.top_logprobs for c in got] == [c.top_logprobs for c in want]


@interpreted
def test_a_replay_samples_plain_rows_in_the_graph_as_the_eager_sampler_does(draws, fake_graphs):
    """Temperatures from greedy to 1.7 and seeds of every size: every replay's draw is taken, equal bit for bit to
    ``sample`` on the replayed logits, no replayed step runs the eager sampler, and the engine's tokens and log-probs
    are those of an engine without graphs."""
    model = model_of()
    temps = [0.0, 0.3, 1.0, 1.7, 0.0, 0.8, 1.0, 1.2, 0.5, 1.0]
    params = [SamplingParams(t, 2 + (5 * i) % 9, ignore_eos=True, seed=(2**62 + 977 * i) if i % 2 else i)
              for i, t in enumerate(temps)]
    want = new_engine(model).generate(PROMPTS, params)
    exactly_the_same(new_engine(model).generate(PROMPTS, params), want)
    assert all(s["offered"] == s["replayed"] == (s["eager"] is None) for s in draws)
    assert sum(s["offered"] for s in draws) == len(fake_graphs.replays) >= 10
    assert {rows for _, rows, _ in fake_graphs.replays} == {12, 8, 4, 2, 1}


@interpreted
def test_rows_that_filter_their_draw_sample_the_replayed_logits_eagerly(draws):
    """Top-k, top-p and a grammar make their steps sample the replayed logits eagerly, with the tokens of an engine
    without graphs; once those requests finish, the plain ones take the replay's draw, alternatives
    (``top_logprobs``) included: those come from the replayed logits."""
    model = model_of()
    short = dict(max_tokens=3, ignore_eos=True)
    params = [SamplingParams(1.0, **short, seed=1, top_k=5), SamplingParams(0.9, **short, seed=2, top_p=0.7),
              SamplingParams(1.0, **short, seed=3, grammar=EvenTokens()),
              *(SamplingParams(1.0, 12, ignore_eos=True, seed=4 + i, top_logprobs=3 * (i % 2)) for i in range(4))]
    prompts = PROMPTS[: len(params)]
    want = new_engine(model).generate(prompts, params)
    assert all(t % 2 == 0 for t in want[2].token_ids)
    exactly_the_same(new_engine(model).generate(prompts, params), want)
    replayed = [s for s in draws if s["replayed"]]
    assert all(s["offered"] for s in replayed)
    eager = [s for s in replayed if s["eager"] is not None]  # every row, the filtering ones too, sampled eagerly
    assert {s["n"] for s in eager} == {7} and all(sorted(s["eager"]) == [0] * 5 + [1, 2] for s in eager)
    assert {s["n"] for s in replayed if s["eager"] is None} == {4}  # the replay's draw taken


@interpreted
def test_a_capture_failing_at_start_leaves_the_engine_decoding_eagerly(monkeypatch, caplog, eager_run):
    def fail(self, rows, width):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(native, "graphs_supported", lambda device, cfg: True)
    monkeypatch.setattr(DecodeGraphs, "_capture", fail)
    model, want = eager_run
    with caplog.at_level("WARNING", logger="engines.inference.cuda_graphs"):
        eng = new_engine(model)
    assert eng.stats()["cuda_graphs_fallback"] == 1 and eng.stats()["cuda_graph_captures"] == 0
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    assert eng.capture_graphs() == 0
    same_completions(eng.generate(PROMPTS, PARAMS), want)


# --- the full width, for real in the interpreter ------------------------------------------

@interpreted
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_triton_decode_logits_at_the_full_width_equal_those_at_the_bucketed_width(family, monkeypatch):
    """The model runner's decode step over ragged rows (and, mistral, a sliding window): at the block table's full
    width, with the padding rows of a graph's batch at the scratch block, the logits of the bucketed width (and
    so the same tokens and log-probs within 1e-5)."""
    model = model_of(family, max_position_embeddings=256, **({"sliding_window": 5} if family == "mistral" else {}))
    monkeypatch.setattr(native, "graphs_supported", lambda device, cfg: True)  # a scratch block, as on a GPU
    eng = InferenceEngine(model, eos_id=None, max_seq_len=256, kv_cache_bytes=1 << 18, block_size=4,
                          max_batch_tokens=64, max_num_seqs=8, attention="triton", capture_graphs_at_start=False)
    r = eng.runner
    assert eng.scratch_block is not None
    r.graphs = None  # steps decode eagerly; the calls below are the ones a graph would capture
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20], [30, 31, 32, 33, 34], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                                  13, 14, 15, 16, 17, 18, 19]]
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(1.0, 40, ignore_eos=True, seed=i))
    while eng.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    n = len(eng.running)
    full = eng.max_blocks * eng.block_size
    width = max(q.context_len for q in eng.running)
    assert width < bucket(width, full, MIN_WIDTH) < full and n == 4
    want = r.decode_logits(n, bucket(width, full, MIN_WIDTH))  # what a graph keyed by width replayed
    torch.testing.assert_close(r.decode_logits(n, width), want, atol=1e-6, rtol=0)  # the eager step's own width
    for rows in (n, capture_size(n, capture_sizes(6)), 8):  # alone, then with two and four padding rows
        r.block_table[n:rows] = eng.scratch_block
        r.pos[n:rows] = 0
        got = r.decode_logits(rows, full)[:n]
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(torch.log_softmax(got.float(), -1), torch.log_softmax(want.float(), -1),
                                   atol=1e-5, rtol=0)
